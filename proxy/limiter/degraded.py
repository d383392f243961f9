"""``store.on_failure: local`` (SPEC §12, degraded mode): this replica's share of every
limit, enforced in-process while the store is unavailable.

Modes, one per limiter (one store):

- ``shared``: the store decides; nothing here is used.
- ``local``: a store call failed (an error, a timeout, the breaker open). Every bucket a
  request touches, global and tenant, is enforced on an in-process memory:// store with
  its rate and burst divided by the replicas seen alive in the store just before it
  failed (presence.py): the same holds, defers and spread retry hints as the store's.
  Each replica of the fleet does the same, so together they stay within every limit.
  Tenant limits are shared like the global ones (a tenant's workers spread over the
  replicas keep their whole rate; applied in full, a tenant could take N times its
  limit out of the shrunken global shares).
- ``recovering``: the store answered again. First the shared buckets are charged with
  what this replica granted alone (see ``debts``), then for ``grace`` seconds a request
  needs both its local share and the shared buckets: replicas come back one breaker
  probe at a time, and until the last one has, the ones back must not spend the whole
  quota while the others still spend their shares. Then back to ``shared``.

Where the shares start: a global share starts from what this replica last saw of the
shared bucket, divided, and never above empty. A share that started full would hand out
a whole burst again on top of the one the fleet may have just spent; one that owes (the
store's level was negative: holds outstanding) keeps owing. Only the burst is given up.

What the shared buckets are charged, per global bucket: the tokens this replica granted
alone since the last charge, but no more than its share's shortfall from full (what of
them has not refilled yet). The store reads a bucket that refilled during the outage, or
restarted empty, as full; after every replica's charge it holds at most what the local
shares held together, so the first shared grants cannot push any window over the quota.

A replica that never saw the replica count (the store was down since it started) has no
share to enforce and fails closed.

Learned limits (SPEC §10): a bucket whose vendor said it allows less than the policy is
divided at the learned rate and burst, as this replica last knew them.

Concurrency caps (SPEC §10) are shared too: while the store is out a request granted here
takes a lease in this replica's share of each cap (the cap divided by the replicas, at
least one), counted and given back in-process; a lease that is never given back runs out
after its life, as in the store. Requests granted locally that are still in flight when the
store returns are not counted there: for one request's length the fleet may briefly exceed a
cap by what the shares had in flight.

Endpoint classes and partitions (SPEC §10): every bucket a request touches is shared, so
an endpoint's buckets are divided like the rest. Global shares start, block, drain and
are charged per partition (each partition is a quota of its own). Endpoint shares start
full (their global shares, nested around them, start no fuller than empty) and are not
charged back: after the outage an endpoint bucket may read fuller than it would have,
by at most its burst, while the charged global buckets still bind the whole vendor.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from proxy.clock import Clock
from proxy.limiter.buckets import Buckets
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.presence import Presence
from proxy.limiter.store import AcquireResult, BucketSpec, Leases, LeaseSet
from proxy.policy.model import Vendor

log = logging.getLogger("quota_proxy.store")

Mode = Literal["shared", "local", "recovering"]

_SPECS_MAX = 10_000  # (vendor, tenant, endpoint, partition) share lists kept; tenants are unbounded
_WARN_EVERY = 1.0  # seconds between repeats of the "no replica count" error


def grace_for(cooloff: float, timeout: float) -> float:
    """How long a replica back from an outage keeps its local share as well: until every
    replica's breaker has probed the store again (a probe that found it still out re-opens
    the breaker for a whole cool-off, so two of them), plus a second."""
    return 2 * cooloff + timeout + 1.0


def cap_share(leases: Leases, replicas: int) -> Leases:
    """One replica's share of the caps a request's leases are in: each divided by ``replicas``,
    never below one request in flight."""
    sets = tuple(dataclasses.replace(ls, cap=max(ls.cap // replicas, 1)) for ls in leases.sets)
    return leases._replace(sets=sets)


def share(spec: BucketSpec, replicas: int) -> BucketSpec:
    """One replica's share of a bucket: rate and burst divided by ``replicas``, the burst
    never below one request (a smaller bucket could never grant)."""
    return dataclasses.replace(spec, rate=spec.rate / replicas, burst=max(spec.burst / replicas, min(spec.burst, 1.0)))


@dataclass(slots=True)
class _Spent:
    """A vendor's (partition's) own buckets, the requests' then the meters' (``Buckets.
    fleet_indexes``), as this replica keeps them while degraded."""

    vendor: Vendor
    partition: str
    shared: tuple[BucketSpec, ...]
    local: tuple[BucketSpec, ...]
    alone: list[float]
    """Per bucket: what the local shares granted alone (the store took none of it) since the
    shared buckets were last charged, in its own units (requests, or a meter's tokens)."""


class LocalShares:
    def __init__(self, clock: Clock, presence: Presence, grace: float) -> None:
        self.clock = clock
        self.presence = presence
        self.grace = grace
        """Seconds after the store returns during which both local and shared must grant."""
        self.mode: Mode = "shared"
        self.replicas = 0
        """The share in use: every limit is divided by this (0 while shared)."""
        self.since = clock.monotonic()
        """When (local clock) the current mode began."""
        self.until = 0.0
        """Recovering: when the grace ends."""
        self._store = MemoryStore(clock)
        self._specs: dict[tuple[str, str, str | None, str], tuple[Vendor, tuple[BucketSpec, ...]]] = {}
        self._vendors: dict[tuple[str, str], _Spent] = {}
        """Per (vendor, partition): its global shares; partitions seen during the outage only."""
        self.tighten: Callable[[BucketSpec], BucketSpec] = lambda spec: spec
        """A bucket as the vendor's headers taught it (the Limiter's learned limits): the
        shares divide what the vendor allows, not the policy's limit, when that is lower."""
        self._leased: set[str] = set()
        """Ids of the leases taken in the local shares of caps (and not yet given back)."""
        self._warned = -math.inf

    # -- modes -------------------------------------------------------------------------

    def current(self) -> Mode:
        """The mode now (a grace that ran out ends here)."""
        if self.mode == "recovering" and self.clock.monotonic() >= self.until:
            log.warning(
                "back on the shared buckets: the grace after the store outage is over, local shares (1/%d) dropped",
                self.replicas,
            )
            self._reset()
        return self.mode

    @property
    def active(self) -> bool:
        """Local shares are enforced (the store is out, or just back)."""
        return self.current() != "shared"

    def engage(self, why: object) -> bool:
        """The store failed: enforce the local shares from now on (True), or say that this
        replica cannot (False: it never saw how many replicas there are)."""
        now = self.clock.monotonic()
        mode = self.current()
        if mode == "local":
            return True
        if mode == "recovering":
            self.mode, self.since = "local", now
            log.error(
                "store unavailable again (%s) right after it returned: enforcing 1/%d of every limit IN-PROCESS again",
                why,
                self.replicas,
            )
            return True
        n = self.presence.replicas()
        if n <= 0:
            if now - self._warned >= _WARN_EVERY:
                self._warned = now
                log.error(
                    "store unavailable (%s) and on_failure is local, but this replica never learnt from the store "
                    "how many replicas share the limits: deferring every request (failing closed) until it returns",
                    why,
                )
            return False
        self.mode, self.replicas, self.since = "local", n, now
        log.error(
            "STORE UNAVAILABLE (%s): on_failure is local, so this replica now enforces 1/%d of every limit "
            "IN-PROCESS (%d replicas were alive in the store) until the store returns",
            why,
            n,
            n,
        )
        return True

    def recovered(self) -> None:
        """The store answers again and this replica's local spending is charged to it."""
        now = self.clock.monotonic()
        log.warning(
            "store back after %.1fs on local shares: the shared buckets were charged for what this replica "
            "granted alone; requests need both the local share and the shared buckets for %.1fs more",
            now - self.since,
            self.grace,
        )
        self.mode, self.since, self.until = "recovering", now, now + self.grace

    def _reset(self) -> None:
        self.mode, self.replicas, self.since = "shared", 0, self.clock.monotonic()
        self._store = MemoryStore(self.clock)
        self._specs.clear()
        self._vendors.clear()
        self._leased.clear()

    # -- buckets -----------------------------------------------------------------------

    def knows(self, vendor: Vendor, partition: str = "") -> bool:
        """Whether the vendor's (partition's) global shares have started (``begin``) in this outage."""
        spent = self._vendors.get((vendor.name, partition))
        return spent is not None and spent.vendor is vendor

    async def begin(
        self,
        vendor: Vendor,
        shared: tuple[BucketSpec, ...],
        levels: tuple[float, ...] | None,
        blocked_for: float,
        partition: str = "",
    ) -> None:
        """Start the vendor's global shares from ``levels`` (the shared buckets' levels now,
        as this replica last saw them; None: never seen), divided, never above empty; a
        vendor block still running goes on. After a reload that kept the vendor's limits the
        shares go on as they were; either way what was granted alone stays owed."""
        before = self._vendors.get((vendor.name, partition))
        if before is not None and [b.ident for b in before.shared] == [b.ident for b in shared]:
            before.vendor = vendor
            return
        local = tuple(share(self.tighten(b), self.replicas) for b in shared)
        now = self.clock.monotonic()
        for i, b in enumerate(local):
            level = levels[i] / self.replicas if levels is not None and i < len(levels) else 0.0
            self._store.set_level(b, min(level, 0.0), now)
        if blocked_for > 0:
            await self._store.block(local, blocked_for, "")
        owed = {} if before is None else dict(zip((x.ident for x in before.shared), before.alone, strict=True))
        alone = [owed.get(x.ident, 0.0) for x in shared]
        if before is not None:  # new limits: a request bucket owes what the old ones did (requests)
            old = max(
                (a for x, a in zip(before.shared, before.alone, strict=True) if x.field.startswith("g:")), default=0.0
            )
            alone = [max(a, old) if x.field.startswith("g:") else a for x, a in zip(shared, alone, strict=True)]
        self._vendors[(vendor.name, partition)] = _Spent(vendor, partition, shared, local, alone)

    def _shares(self, vendor: Vendor, tenant: str, b: Buckets) -> tuple[BucketSpec, ...]:
        key = (vendor.name, tenant, b.endpoint, b.partition)
        hit = self._specs.get(key)
        if hit is not None and hit[0] is vendor:
            return hit[1]
        if len(self._specs) >= _SPECS_MAX:
            self._specs.clear()
        specs = tuple(share(self.tighten(spec), self.replicas) for spec in b.all)
        self._specs[key] = (vendor, specs)
        return specs

    async def acquire(
        self,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        alone: bool,
        leases: Leases | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        """The store's acquire on this replica's shares. ``alone``: the shared buckets will
        not take it (the store is out), so it is owed to them when it returns. ``leases``:
        a lease in this replica's share of each cap, or nothing (``full``)."""
        mine = None if leases is None or not leases.sets else cap_share(leases, self.replicas)
        if len(self._leased) >= _SPECS_MAX:  # ids whose requests never gave them back: long expired
            self._leased.clear()
        shares = self._shares(vendor, tenant, b)
        result = await self._store.acquire(shares, cost, max_wait, queue, leases=mine, costs=costs)
        if result.granted and mine is not None:
            self._leased.add(mine.id)
        if result.granted and alone:
            self.spent_alone(vendor, b, cost, costs)
        return result

    async def release(self, leases: Leases) -> tuple[int, ...] | None:
        """Give back a lease taken in the local shares of caps: the requests still in flight
        here per set. None: not a local lease (the store's, or from before a recovery)."""
        if leases.id not in self._leased:
            return None
        self._leased.discard(leases.id)
        return await self._store.release(leases.sets, (leases.id,), "")

    async def renew(self, leases: tuple[tuple[LeaseSet, str], ...], life: float) -> None:
        """Keep the local leases among ``leases`` alive (a long download while the store is out)."""
        mine = tuple(pair for pair in leases if pair[1] in self._leased)
        if mine:
            await self._store.renew(mine, life)

    def spent_alone(self, vendor: Vendor, b: Buckets, cost: float, costs: tuple[float, ...] | None = None) -> None:
        """A grant of ``cost`` (``costs``: per bucket of ``b``) that the store did not take."""
        alone = self._vendors[(vendor.name, b.partition)].alone
        for j, i in enumerate(b.fleet_indexes):
            alone[j] += cost if costs is None else costs[i]

    async def refund(
        self, vendor: Vendor, tenant: str, b: Buckets, cost: float, costs: tuple[float, ...] | None = None
    ) -> None:
        shares = self._shares(vendor, tenant, b)
        await self._store.settle(shares, costs if costs is not None else (cost,) * len(shares))

    async def block(self, vendor: Vendor, seconds: float, partition: str = "") -> None:
        """A vendor 429 while degraded: the (partition's) global shares grant nothing for ``seconds``."""
        spent = self._vendors.get((vendor.name, partition))
        if spent is not None:
            await self._store.block(spent.local, seconds, "")

    async def drain(self, vendor: Vendor, partition: str = "") -> None:
        spent = self._vendors.get((vendor.name, partition))
        if spent is not None:
            await self._store.drain(spent.local)

    # -- coming back ---------------------------------------------------------------------

    def owed(self) -> list[Vendor]:
        """Vendors whose local spending the shared buckets have not been charged with."""
        return list({id(vendor): vendor for vendor, _ in self.owing()}.values())

    def owing(self) -> list[tuple[Vendor, str]]:
        """(vendor, partition) whose local spending the shared buckets have not been charged with."""
        return [(s.vendor, s.partition) for s in self._vendors.values() if max(s.alone, default=0.0) > 0]

    async def debts(self, vendor: Vendor, partition: str = "") -> list[tuple[BucketSpec, float]]:
        """(shared bucket, tokens to take from it) for each global bucket of ``vendor``'s
        ``partition``: what this replica granted alone, but no more than its share is short of full."""
        spent = self._vendors.get((vendor.name, partition))
        if spent is None or max(spent.alone, default=0.0) <= 0:
            return []
        levels = await self._store.peek(spent.local)
        out = []
        for shared, local, level, alone in zip(spent.shared, spent.local, levels, spent.alone, strict=True):
            debt = min(local.burst - level, alone)
            if debt > 0:
                out.append((shared, debt))
        return out

    def settled(self, vendor: Vendor, partition: str = "") -> None:
        spent = self._vendors.get((vendor.name, partition))
        if spent is not None:
            spent.alone = [0.0] * len(spent.shared)

    # -- what people read --------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        mode = self.current()
        now = self.clock.monotonic()
        seen = self.presence.last_seen
        return {
            "mode": mode,
            "replicas_seen": self.presence.replicas(),
            "replicas_seen_seconds_ago": None if seen is None else round(now - seen, 3),
            "share": round(1.0 / self.replicas, 6) if mode != "shared" else None,
            "mode_for_seconds": round(now - self.since, 3),
            "grace_left_seconds": round(self.until - now, 3) if mode == "recovering" else None,
        }

    async def levels(self, vendor: Vendor) -> list[dict[str, Any]] | None:
        """The vendor's (default partition's) global shares now, for /status; None when it has none."""
        spent = self._vendors.get((vendor.name, "")) if self.active else None
        if spent is None:
            return None
        levels = await self._store.peek(spent.local)
        return [
            {"bucket": b.label, "rate_per_second": b.rate, "burst": b.burst, "tokens": round(level, 3)}
            for b, level in zip(spent.local, levels, strict=True)
        ]
