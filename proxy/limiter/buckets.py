"""Which buckets a request draws from, and what their store keys are.

Keys share the hash tag ``{vendor}`` so one vendor's buckets live in one Redis
Cluster slot (a script may only touch keys of one slot). The limit itself is
part of the key: a changed limit starts a fresh bucket, an unchanged one keeps
its state across reloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.limiter.store import BucketSpec, LeaseSet
from proxy.policy.model import Endpoint, Limit, Vendor


@dataclass(frozen=True, slots=True)
class Buckets:
    """Every bucket of one (vendor, tenant): tenant buckets first, then global."""

    all: tuple[BucketSpec, ...]
    tenant_count: int
    queue: str | None = None
    """The deferral queue key of this bucket set (acquire.lua): refused callers' retry slots."""

    @property
    def global_part(self) -> tuple[BucketSpec, ...]:
        return self.all[self.tenant_count :]


def vendor_namespace(prefix: str, vendor: str) -> str:
    return f"{prefix}:{{{vendor}}}"


def block_channel(prefix: str, vendor: str) -> str:
    return f"{vendor_namespace(prefix, vendor)}:block"


def block_channel_pattern(prefix: str) -> str:
    return f"{prefix}:{{*}}:block"


def vendor_of_channel(channel: str) -> str | None:
    start, end = channel.find("{"), channel.rfind("}")
    return channel[start + 1 : end] if 0 <= start < end else None


def state_key(prefix: str, vendor: str) -> str:
    """The vendor's state hash: its global buckets, and the counter and loss time that
    tell a store that lost its keys (acquire.lua, "Lost state")."""
    return f"{vendor_namespace(prefix, vendor)}:state"


def probe_key(prefix: str, vendor: str) -> str:
    """A key of the vendor's slot that readiness writes to (probe.lua)."""
    return f"{vendor_namespace(prefix, vendor)}:probe"


def replicas_key(prefix: str) -> str:
    """The set of replicas alive (presence.lua): every replica announces itself there, so
    that each knows its share of the limits should the store fail (degraded.py)."""
    return f"{prefix}:replicas"


def global_buckets(prefix: str, vendor: Vendor) -> tuple[BucketSpec, ...]:
    state = state_key(prefix, vendor.name)
    return tuple(
        BucketSpec(state, lim.per_second, lim.burst, "global", f"global {lim.label}", field=f"g:{lim.key}")
        for lim in vendor.limits
    )


def tenant_buckets(prefix: str, vendor: Vendor, tenant: str) -> tuple[BucketSpec, ...]:
    ns = vendor_namespace(prefix, vendor.name)
    limits: tuple[Limit, ...] = vendor.tenant_limits.for_tenant(tenant)
    return tuple(
        BucketSpec(f"{ns}:t:{tenant}:{lim.key}", lim.per_second, lim.burst, "tenant", f"tenant {tenant} {lim.label}")
        for lim in limits
    )


def buckets_for(prefix: str, vendor: Vendor, tenant: str) -> Buckets:
    tenant_part = tenant_buckets(prefix, vendor, tenant)
    queue = f"{vendor_namespace(prefix, vendor.name)}:q:{tenant}"
    return Buckets(tenant_part + global_buckets(prefix, vendor), len(tenant_part), queue)


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
