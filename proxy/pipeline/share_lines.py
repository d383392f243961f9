"""Held requests of a vendor with ``share:`` wait for their turn in a line per tenant and
class on each replica (SPEC §13).

Under a share the store reserves a grant at most ``share.HORIZON`` ahead: a held request
refused with its turn asks again when the turn comes, so that a request of a higher class
or of a tenant further behind, arriving meanwhile, is served first. If every held request
of a tenant asked again at its turn, a tenant with forty waiting would send forty asks per
grant, all but one refused; so only the first of the tenant's line on this replica asks,
and the next one asks as soon as the one before it is granted (or gives up). The line is
FIFO (``asyncio.Lock`` wakes its waiters in order), one per (state, class, tenant),
forgotten when empty.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager

from proxy.clock import Clock
from proxy.limiter.store import AcquireResult


class ShareLines:
    """The lines of one replica's held requests under a share, by (state key, class, tenant)."""

    def __init__(self) -> None:
        self._lines: dict[Hashable, tuple[asyncio.Lock, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._lines)

    @asynccontextmanager
    async def first(self, key: Hashable, within: float) -> AsyncIterator[bool]:
        """Wait to be the first of ``key``'s line for at most ``within`` seconds: yields
        whether it is (False: the time ran out in the line, nothing to ask)."""
        entry = self._lines.get(key)
        if entry is None:
            entry = self._lines[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        first = False
        try:
            try:
                async with asyncio.timeout(within):
                    await lock.acquire()
                first = True
            except TimeoutError:
                pass
            try:
                yield first
            finally:
                if first:
                    lock.release()
        finally:
            users[0] -= 1
            if users[0] == 0 and self._lines.get(key) is entry:
                del self._lines[key]

    async def turn(
        self,
        key: Hashable,
        clock: Clock,
        max_hold: float,
        result: AcquireResult,
        ask: Callable[[float], Awaitable[AcquireResult]],
    ) -> tuple[AcquireResult, float]:
        """A hold refused with its turn (``result``): first of ``key``'s line, it asks again
        (``ask``, with the hold time left) on each turn it is told, until granted (or a
        concurrency cap is full) or ``max_hold`` is spent; returns the last answer and the
        seconds it waited."""
        start = clock.monotonic()
        deadline = start + max_hold
        async with self.first(key, max_hold) as first:
            if not first:
                return result, clock.monotonic() - start
            wait = result.wait if clock.monotonic() - start < 0.001 else 0.0  # (a turn just freed: ask now)
            while True:
                if wait > deadline - clock.monotonic():
                    return result, clock.monotonic() - start
                if wait > 0:
                    await clock.sleep(wait)
                result = await ask(max(deadline - clock.monotonic(), 0.0))
                if result.granted or result.full >= 0:
                    return result, clock.monotonic() - start
                wait = result.retry_after
