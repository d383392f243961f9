"""A memory:// store that fails, hangs or forgets on demand, for limiter tests on a ManualClock."""

from __future__ import annotations

import asyncio

from proxy.clock import ManualClock
from proxy.limiter import StoreUnavailable
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.store import AcquireResult, BlockResult, BucketSpec, Leases, StateGuard


class FlakyStore(MemoryStore):
    """A memory store that counts its calls and can be told to fail, to hang, or to lose
    every key (a Redis restarted without persistence). Several limiters may share one: a
    fleet's store."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls = 0
        self.acquires = 0
        """Acquires that reached the store (and did not fail)."""
        self.fail = False
        self.gate: asyncio.Event | None = None  # set: every call waits for it

    async def _enter(self) -> None:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise StoreUnavailable("ConnectionError: injected")

    def forget(self) -> None:
        """Lose every key, as a Redis restarted without persistence."""
        fresh = MemoryStore(self._clock)
        self._state, self._queues, self._seq = fresh._state, fresh._queues, fresh._seq
        self._leases, self._replicas = fresh._leases, fresh._replicas
        self._learned = fresh._learned  # learned limits live in the state hash: lost with it

    async def acquire(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None = None,
        guard: StateGuard | None = None,
        leases: Leases | None = None,
    ) -> AcquireResult:
        await self._enter()
        self.acquires += 1
        return await super().acquire(buckets, cost, max_wait, queue, guard, leases)

    async def block(self, buckets: tuple[BucketSpec, ...], seconds: float, channel: str) -> BlockResult:
        await self._enter()
        return await super().block(buckets, seconds, channel)

    async def drain(self, buckets: tuple[BucketSpec, ...]) -> BlockResult:
        await self._enter()
        return await super().drain(buckets)

    async def refund(self, buckets: tuple[BucketSpec, ...], cost: float) -> tuple[float, ...]:
        await self._enter()
        return await super().refund(buckets, cost)

    async def announce(self, key: str, member: str, stale: float, leave: bool = False) -> int:
        await self._enter()
        return await super().announce(key, member, stale, leave)
