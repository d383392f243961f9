"""Which buckets a request draws from, and what their store keys are.

Keys share the hash tag ``{vendor}`` so one vendor's buckets live in one Redis
Cluster slot (a script may only touch keys of one slot). The limit itself is
part of the key: a changed limit starts a fresh bucket, an unchanged one keeps
its state across reloads.

A vendor's meters (SPEC §14) add buckets of their own at the end: the tenant's and the
vendor's for each meter, in the policy's order, taken at the request's estimate of that
meter's currency (``Buckets.costs``) in the same store call.

A vendor's global and endpoint buckets are fields of its state hash (acquire.lua,
"Lost state"); with ``partition:`` each partition has a state hash of its own,
``…:p:<hash>:state``, and the default partition (no header) keeps the vendor's
``…:state``: a policy without partitions or endpoints uses the keys it always did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from proxy.limiter.share import share_ask
from proxy.limiter.store import BucketSpec, LeaseSet, ShareAsk
from proxy.policy.model import Endpoint, Limit, Meter, Share, Vendor


@dataclass(frozen=True, slots=True)
class Buckets:
    """Every bucket of one (vendor, tenant, endpoint, partition), in the store's order:
    tenant buckets, then the endpoint's, then the vendor's global ones."""

    all: tuple[BucketSpec, ...]
    tenant_count: int
    queue: str | None = None
    """The deferral queue key of this bucket set (acquire.lua): refused callers' retry slots."""
    kept: str | None = None
    """The key of the slots kept for this bucket set's deferred callers (acquire.lua, "Kept slots")."""
    endpoint_count: int = 0
    state_key: str = ""
    """The state hash holding the endpoint and global buckets (of the partition)."""
    partition: str = ""
    """The partition's hash; "" = the default partition."""
    endpoint: str | None = None
    """The endpoint class's name, None for a request of none."""
    share: ShareAsk | None = None
    """Its place in the vendor's schedule (``share:``, SPEC §13; share.py); None: first come."""
    meters: tuple[int, ...] = ()
    """The meter (an index of ``vendor.meters``) of each of the last ``len(meters)`` buckets:
    its meters' buckets, after the request buckets (SPEC §14); () without meters."""
    settles: bool = False
    """Whether a meter of these buckets settles from the answer (its estimate is not its cost)."""
    vendor_side: tuple[BucketSpec, ...] = field(init=False, repr=False, compare=False)
    """The request buckets the vendor counts itself: the endpoint class's and the global ones
    (the pacer keeps a lag per bucket: pacing.py)."""

    paced_meters: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The indexes in ``all`` of the meters' own buckets (not their tenants'): the vendor
    counts those too, so the pacer keeps their lag as well (each at its meter's estimate)."""
    paced_meter_part: tuple[BucketSpec, ...] = field(init=False, repr=False, compare=False)
    """The buckets ``paced_meters`` names."""
    request_count: int = field(init=False, repr=False, compare=False)
    """How many of ``all`` count requests (the first): the rest are meters'."""
    meter_part: tuple[BucketSpec, ...] = field(init=False, repr=False, compare=False)
    """The meters' buckets (``all`` after the request buckets): what a settlement moves."""
    meter_bursts: tuple[tuple[int, float], ...] = field(init=False, repr=False, compare=False)
    """Per meter with buckets here (its index of ``vendor.meters``), the smallest burst of
    them: the most an estimate of that meter may be (metering.estimates)."""

    def __post_init__(self) -> None:
        first_meter = len(self.all) - len(self.meters)
        object.__setattr__(self, "request_count", first_meter)
        object.__setattr__(self, "meter_part", self.all[first_meter:])
        object.__setattr__(self, "vendor_side", self.all[self.tenant_count : first_meter])
        paced = tuple(i for i in range(first_meter, len(self.all)) if self.all[i].scope == "global")
        object.__setattr__(self, "paced_meters", paced)
        object.__setattr__(self, "paced_meter_part", tuple(self.all[i] for i in paced))
        bursts: dict[int, float] = {}
        for spec, k in zip(self.meter_part, self.meters, strict=True):
            bursts[k] = min(bursts.get(k, spec.burst), spec.burst)
        object.__setattr__(self, "meter_bursts", tuple(sorted(bursts.items())))

    @property
    def global_part(self) -> tuple[BucketSpec, ...]:
        return self.all[self.tenant_count + self.endpoint_count : len(self.all) - len(self.meters)]

    @property
    def fleet_indexes(self) -> tuple[int, ...]:
        """The indexes in ``all`` of the vendor's own buckets, the requests' then the meters'
        (not the tenants' nor an endpoint's): what local shares start from the levels last
        seen and charge back (degraded.py)."""
        return (*range(self.tenant_count + self.endpoint_count, self.request_count), *self.paced_meters)

    def costs(self, cost: float, estimates: tuple[float, ...]) -> tuple[float, ...]:
        """What each bucket takes: ``cost`` from a request bucket, its meter's estimate
        (``estimates``, one per meter of the vendor) from a meter's."""
        return (cost,) * self.request_count + tuple(estimates[k] for k in self.meters)

    @property
    def endpoint_part(self) -> tuple[BucketSpec, ...]:
        return self.all[self.tenant_count : self.tenant_count + self.endpoint_count]


def vendor_namespace(prefix: str, vendor: str) -> str:
    return f"{prefix}:{{{vendor}}}"


def block_channel(prefix: str, vendor: str, partition: str = "") -> str:
    """Where a block of the vendor's (partition's) global buckets is announced."""
    channel = f"{vendor_namespace(prefix, vendor)}:block"
    return f"{channel}:{partition}" if partition else channel


def block_seconds(data: str) -> float:
    """A block announcement's length: feedback.lua publishes milliseconds (ValueError if not a number)."""
    return float(data) / 1000.0


def lag_channel(prefix: str) -> str:
    """Where replicas tell each other their write lags (pacing.py): one channel, rarely used."""
    return f"{prefix}:lag"


def block_channel_pattern(prefix: str) -> str:
    return f"{prefix}:{{*}}:block*"


def vendor_of_channel(channel: str) -> str | None:
    start, end = channel.find("{"), channel.rfind("}")
    return channel[start + 1 : end] if 0 <= start < end else None


def partition_of_channel(channel: str) -> str:
    """The partition a block channel names ("" = the default partition)."""
    _, _, partition = channel[channel.rfind("}") + 1 :].partition(":block:")
    return partition


def state_key(prefix: str, vendor: str, partition: str = "") -> str:
    """The vendor's (partition's) state hash: its global and endpoint buckets, and the
    counter and loss time that tell a store that lost its keys (acquire.lua, "Lost state")."""
    if partition:
        return f"{vendor_namespace(prefix, vendor)}:p:{partition}:state"
    return f"{vendor_namespace(prefix, vendor)}:state"


def probe_key(prefix: str, vendor: str) -> str:
    """A key of the vendor's slot that readiness writes to (probe.lua)."""
    return f"{vendor_namespace(prefix, vendor)}:probe"


def replicas_key(prefix: str) -> str:
    """The set of replicas alive (presence.lua): every replica announces itself there, so
    that each knows its share of the limits should the store fail (degraded.py)."""
    return f"{prefix}:replicas"


def global_buckets(prefix: str, vendor: Vendor, partition: str = "") -> tuple[BucketSpec, ...]:
    state = state_key(prefix, vendor.name, partition)
    return tuple(
        BucketSpec(state, lim.per_second, lim.burst, "global", f"global {lim.label}", field=f"g:{lim.key}")
        for lim in vendor.limits
    )


def endpoint_buckets(prefix: str, vendor: Vendor, endpoint: Endpoint, partition: str = "") -> tuple[BucketSpec, ...]:
    """An endpoint class's buckets: fields ``e:<name>:<limit>`` of the (partition's) state
    hash, so a lost state is noticed for them as for the global ones."""
    state = state_key(prefix, vendor.name, partition)
    return tuple(
        BucketSpec(
            state,
            lim.per_second,
            lim.burst,
            "endpoint",
            f"endpoint {endpoint.name} {lim.label}",
            field=f"e:{endpoint.name}:{lim.key}",
        )
        for lim in endpoint.limits
    )


def tenant_buckets(prefix: str, vendor: Vendor, tenant: str) -> tuple[BucketSpec, ...]:
    ns = vendor_namespace(prefix, vendor.name)
    limits: tuple[Limit, ...] = vendor.tenant_limits.for_tenant(tenant)
    return tuple(
        BucketSpec(f"{ns}:t:{tenant}:{lim.key}", lim.per_second, lim.burst, "tenant", f"tenant {tenant} {lim.label}")
        for lim in limits
    )


def meter_buckets(prefix: str, vendor: Vendor, tenant: str, partition: str = "") -> tuple[tuple[BucketSpec, int], ...]:
    """Each meter's buckets with its index: the tenant's (keys of their own, as its request
    buckets), then the vendor's (fields ``m:<meter>:<limit>`` of the partition's state hash:
    a lost state is noticed for them too)."""
    ns = vendor_namespace(prefix, vendor.name)
    out: list[tuple[BucketSpec, int]] = []
    for k, meter in enumerate(vendor.meters):
        out += (
            (BucketSpec(f"{ns}:t:{tenant}:m:{meter.name}:{lim.key}", lim.per_second, lim.burst, "tenant",
                        f"tenant {tenant} {meter.name} {lim.label}"), k)
            for lim in meter.tenant_limits.for_tenant(tenant)
        )  # fmt: skip
        out += ((spec, k) for spec in meter_vendor_buckets(prefix, vendor, meter, partition))
    return tuple(out)


def meter_vendor_buckets(prefix: str, vendor: Vendor, meter: Meter, partition: str = "") -> tuple[BucketSpec, ...]:
    """A meter's own buckets (not its tenants'), one per limit in order: what a vendor 429
    blocks, its token headers teach and /status shows."""
    state = state_key(prefix, vendor.name, partition)
    return tuple(
        BucketSpec(
            state, lim.per_second, lim.burst, "global", f"{meter.name} {lim.label}", field=f"m:{meter.name}:{lim.key}"
        )
        for lim in meter.limits
    )


def queue_key(prefix: str, vendor: str, tenant: str, endpoint: Endpoint | None = None, partition: str = "") -> str:
    """The deferral queue of a bucket set. A tenant name never holds ``/``, so the
    partition and endpoint parts cannot run into another tenant's key; an endpoint
    without limits of its own shares the vendor's bucket set, hence its queue."""
    key = f"{vendor_namespace(prefix, vendor)}:q:{tenant}"
    if partition:
        key += f"/p/{partition}"
    if endpoint is not None and endpoint.limits:
        key += f"/e/{endpoint.name}"
    return key


def kept_key(queue: str) -> str:
    """The slots kept for a bucket set's deferred callers, beside its deferral queue ``queue``."""
    return queue.replace("}:q:", "}:r:", 1)  # (the first: the vendor's namespace ends there)


FIRST_COME: Final = Share()
"""The schedule of a metered vendor without ``share:`` (``buckets_for``): every tenant one
member ``METERED_MEMBER`` of its one class, so first come as before, but its holds reserve
at most ``share.HORIZON`` ahead and ask again at their turn, as under a share."""
METERED_MEMBER: Final = "*"


def buckets_for(
    prefix: str,
    vendor: Vendor,
    tenant: str,
    endpoint: Endpoint | None = None,
    partition: str = "",
    klass: int | None = None,
) -> Buckets:
    """``klass``: the request's class (an index of ``vendor.share.classes``; None: the
    tenant's own)."""
    tenant_part = tenant_buckets(prefix, vendor, tenant)
    endpoint_part = endpoint_buckets(prefix, vendor, endpoint, partition) if endpoint is not None else ()
    queue = queue_key(prefix, vendor.name, tenant, endpoint, partition)
    state = state_key(prefix, vendor.name, partition)
    share = vendor.share
    ask = None
    if share is not None:
        index = share.class_of(tenant) if klass is None else klass
        ask = share_ask(share, state, tenant, index or 0, len(tenant_part) + len(endpoint_part))
    metered = meter_buckets(prefix, vendor, tenant, partition)
    settles = bool(metered) and any(vendor.meters[k].settle.kind != "none" for _, k in metered)
    if ask is None and settles:
        # A settlement gives back what a call did not use; given to a hold reserved far ahead
        # (a queue of them), those tokens would move later calls into vendor windows that
        # do not hold the call that left them: so a metered hold reserves no further ahead
        # than a shared one (bench/meters.py part a: a vendor 429 in every run, none since).
        ask = share_ask(FIRST_COME, state, METERED_MEMBER, 0, len(tenant_part) + len(endpoint_part))
    if ask is not None and metered:
        ask = ask._replace(metered=len(metered))
    return Buckets(
        tenant_part + endpoint_part + global_buckets(prefix, vendor, partition) + tuple(b for b, _ in metered),
        len(tenant_part),
        queue,
        kept_key(queue),
        len(endpoint_part),
        state,
        partition,
        None if endpoint is None else endpoint.name,
        ask,
        tuple(k for _, k in metered),
        settles,
    )


def lease_sets(prefix: str, vendor: Vendor, endpoint: Endpoint | None) -> tuple[LeaseSet, ...]:
    """The concurrency lease sets a request of ``vendor`` (of class ``endpoint``, if any)
    takes a lease in (SPEC §10): the endpoint class's, then the vendor's; none without caps.

    Vendor-wide, never per partition: a cap then never lets the vendor see more
    requests in flight than it, however the vendor counts (per account, per key)."""
    ns = vendor_namespace(prefix, vendor.name)
    sets: tuple[LeaseSet, ...] = ()
    if endpoint is not None and endpoint.concurrency is not None:
        cap = endpoint.concurrency
        sets = (LeaseSet(f"{ns}:c:e:{endpoint.name}", cap, f"endpoint {endpoint.name} concurrency {cap}"),)
    if vendor.concurrency is not None:
        sets += (LeaseSet(f"{ns}:c", vendor.concurrency, f"concurrency {vendor.concurrency}"),)
    return sets


def release_channel(prefix: str, vendor: str) -> str:
    """Where release.lua announces a vendor's released leases, waking held requests fleet-wide."""
    return f"{vendor_namespace(prefix, vendor)}:released"


def release_channel_pattern(prefix: str) -> str:
    return f"{prefix}:{{*}}:released"
