"""Acquiring with local shares to fall back on (``store.on_failure: local``, degraded.py): the
shared buckets while the store answers, this replica's share alone while it cannot, and,
once the shared buckets were charged with what the share granted alone, both at once until
the grace ends."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.limiter.blocks import Blocks
from proxy.limiter.breaker import Breaker
from proxy.limiter.buckets import Buckets, global_buckets, state_key
from proxy.limiter.degraded import LocalShares
from proxy.limiter.observations import Observations
from proxy.limiter.store import AcquireResult, BucketStore, Leases, Reserve, StoreUnavailable
from proxy.policy.model import Vendor

_CHARGE_WAIT = 10 * 365 * 86400.0  # seconds: a charge is an acquire that is never refused

Shared = Callable[
    [Vendor, Buckets, float, float, str | None, Leases | None, Reserve | None, tuple[float, ...] | None],
    Awaitable[AcquireResult],
]
"""An acquire of the shared buckets, behind the breaker (``Limiter._acquire_shared``)."""


class Fallback:
    """A limiter's acquires when it has local shares."""

    def __init__(
        self,
        local: LocalShares,
        store: BucketStore,
        breaker: Breaker,
        key_prefix: str,
        *,
        shared: Shared,
        failed: Callable[[StoreUnavailable], None],
        observations: Observations,
        blocks: Blocks,
        on_grant: Callable[[str], None] | None = None,
    ) -> None:
        self.local = local
        self.store = store
        self.breaker = breaker
        self.key_prefix = key_prefix
        self._shared = shared
        self._failed = failed  # a store call failed (Limiter.store_failed)
        self._observations = observations
        self._blocks = blocks
        self._on_grant = on_grant
        self._settling = False  # a charge of the shared buckets is on its way (_come_back)

    async def acquire(
        self,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        leases: Leases | None,
        reserve: Reserve | None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        """``Limiter.acquire`` with local shares to fall back on. A share keeps no slot: a
        claim is the store's to honour. ``costs``: each bucket's own (a metered request)."""
        local = self.local
        mode = local.current()
        if mode == "shared":
            try:
                return await self._shared(vendor, b, cost, max_wait, queue, leases, reserve, costs)
            except StoreUnavailable as exc:
                if not local.engage(exc):
                    raise
                return await self._acquire_local(vendor, tenant, b, cost, max_wait, queue, leases, costs)
        if mode == "local" and not await self._come_back(vendor):
            return await self._acquire_local(vendor, tenant, b, cost, max_wait, queue, leases, costs)
        return await self._acquire_both(vendor, tenant, b, cost, queue, leases, costs)

    async def _local_shares(self, vendor: Vendor, b: Buckets) -> None:
        local = self.local
        part = b.partition
        if not local.knows(vendor, part):
            fleet = tuple(b.all[i] for i in b.fleet_indexes)
            levels = self._observations.fleet_levels_now(vendor, b)
            await local.begin(vendor, fleet, levels, self._blocks.left(vendor.name, part), part)

    async def _acquire_local(
        self,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        leases: Leases | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        """The store is out: this replica's share decides alone (of the caps too)."""
        await self._local_shares(vendor, b)
        result = await self.local.acquire(vendor, tenant, b, cost, max_wait, queue, True, leases, costs)
        if result.granted and self._on_grant is not None:
            self._on_grant(vendor.name)
        return result

    async def _come_back(self, vendor: Vendor) -> bool:
        """Is the store back? When the breaker lets a call through, charge the shared
        buckets with what this replica granted alone (those calls are the probe; with
        nothing to charge, a charge of nothing is). True: the store took every charge."""
        if self._settling or not self.breaker.allow():
            return False
        self._settling = True
        try:
            for owing, partition in self.local.owing() or [(vendor, "")]:
                await self._charge(owing, partition)
        except StoreUnavailable as exc:
            self._failed(exc)
            return False
        except BaseException:
            self.breaker.release()
            raise
        finally:
            self._settling = False
        self.breaker.success()
        self.local.recovered()
        return True

    async def _charge(self, vendor: Vendor, partition: str) -> None:
        """Take the vendor's (partition's) debts (degraded.py) from its shared buckets: an
        acquire that cannot be refused, under the state guard, so a store that came back
        empty is noticed as well."""
        local = self.local
        observations = self._observations
        globals_ = global_buckets(self.key_prefix, vendor, partition)
        key = state_key(self.key_prefix, vendor.name, partition)
        debts = await local.debts(vendor, partition) or [(bucket, 0.0) for bucket in globals_[:1]]
        for bucket, debt in debts:
            result = await self.store.acquire((bucket,), debt, _CHARGE_WAIT, None, observations.guard(vendor, key))
            observations.answered(vendor, key, result)
        if not globals_:
            await self.store.ping()
        local.settled(vendor, partition)

    async def _acquire_both(
        self,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        queue: str | None,
        leases: Leases | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        """Just back from an outage: the local share and the shared buckets must both grant,
        and at once. A hold would be booked on two buckets at two different times and leave
        at the later one, later than the shared bucket booked it: when the grace ends, the
        shared bucket's next grants would bunch with it. So during the grace a request is
        forwarded now or deferred (with the hint of whichever refused)."""
        local = self.local
        await self._local_shares(vendor, b)
        mine = await local.acquire(vendor, tenant, b, cost, 0.0, queue, False, None, costs)
        if not mine.granted:
            return mine  # this replica's share refuses: nothing was taken anywhere
        try:
            result = await self._shared(vendor, b, cost, 0.0, queue, leases, None, costs)
        except StoreUnavailable as exc:
            local.engage(exc)  # out again: the local grant stands, owed to the store
            local.spent_alone(vendor, b, cost, costs)
            return mine
        if not result.granted:
            await local.refund(vendor, tenant, b, cost, costs)
        return result
