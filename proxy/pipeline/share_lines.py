"""Held requests of a vendor with ``share:`` wait for their turn in a line per tenant and
class on each replica (SPEC §13).

Under a share the store reserves a grant at most ``share.HORIZON`` ahead: a held request
refused with its turn asks again when the turn comes, so that a request of a higher class
or of a tenant further behind, arriving meanwhile, is served first. If every held request
of a tenant asked again at its turn, a tenant with forty waiting would send forty asks per
grant, all but one refused; so only the first of the tenant's line on this replica asks,
and the next one asks as soon as the one before it is granted (or gives up); a hold that
comes while its line holds anyone joins it without asking (``waiting``). The line is
FIFO (``asyncio.Lock`` wakes its waiters in order), one per (state, class, tenant),
forgotten when empty.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

from proxy.clock import Clock
from proxy.limiter.buckets import Buckets
from proxy.limiter.store import AcquireResult


def line_of(b: Buckets, tenant: str) -> Hashable | None:
    """The line the held requests of ``tenant`` with buckets ``b`` wait in: one per state
    (vendor and partition), class and tenant; None without a share."""
    return None if b.share is None else (b.state_key, b.share.klass, tenant)


class ShareLines:
    """The lines of one replica's held requests under a share, by (state key, class, tenant)."""

    def __init__(self) -> None:
        self._lines: dict[Hashable, _Line] = {}

    def __len__(self) -> int:
        return len(self._lines)

    def waiting(self, key: Hashable) -> AcquireResult | None:
        """The last answer the first of ``key``'s line had, while the line holds anyone:
        a new hold of the line joins it without asking the store (it would be refused, or
        served before those of its own tenant that came first); None: no line."""
        line = self._lines.get(key)
        return None if line is None or not line.lock.locked() else line.last

    async def turn(
        self,
        key: Hashable,
        clock: Clock,
        max_hold: float,
        result: AcquireResult,
        ask: Callable[[float], Awaitable[AcquireResult]],
    ) -> tuple[AcquireResult, float]:
        """A hold refused with its turn (``result``): first of ``key``'s line (waiting for
        those before it at most ``max_hold``), it asks again (``ask``, with the hold time
        left) on each turn it is told, until granted (or a concurrency cap is full) or
        ``max_hold`` is spent; returns the last answer and the seconds it waited."""
        start = clock.monotonic()
        deadline = start + max_hold
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = _Line(result)
        lock = line.lock
        line.users += 1
        try:
            wait = result.wait
            if lock.locked():
                try:
                    async with asyncio.timeout(max_hold):
                        await lock.acquire()
                except TimeoutError:
                    return result, clock.monotonic() - start
                wait = 0.0  # the one before it was served (or gave up): its turn may be now
            else:
                await lock.acquire()  # (free: at once)
            try:
                while True:
                    if wait > deadline - clock.monotonic():
                        return result, clock.monotonic() - start
                    if wait > 0:
                        await clock.sleep(wait)
                    result = await ask(max(deadline - clock.monotonic(), 0.0))
                    if result.granted or result.full >= 0:
                        # (not kept as the line's last answer: a hold joining the line
                        # would be let through on this request's tokens)
                        return result, clock.monotonic() - start
                    line.last = result
                    wait = result.retry_after
            finally:
                lock.release()
        finally:
            line.users -= 1
            if line.users == 0 and self._lines.get(key) is line:
                del self._lines[key]


class _Line:
    __slots__ = ("last", "lock", "users")

    def __init__(self, last: AcquireResult) -> None:
        self.lock = asyncio.Lock()
        self.users = 0
        self.last = last
        """The last refusal its first had (what a hold that joins it without asking is
        told, should its time run out in the line); never a grant, which was the first's
        own."""
