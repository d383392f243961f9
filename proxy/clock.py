"""Time as the proxy sees it, injectable so tests and benches can move it by hand.

The limiter's clock in production is the store's (Redis ``TIME``); this clock
paces holds, drives the in-process store and times the circuit breaker.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""

    async def sleep(self, seconds: float) -> None:
        """Wait until ``monotonic()`` has advanced by ``seconds``."""


class SystemClock:
    __slots__ = ()

    # The builtin itself, no Python frame around it: the request path reads the clock
    # about ten times per request.
    monotonic = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)


class ManualClock:
    """A clock that only moves when ``advance`` is called; sleepers wake in deadline order."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), fut))
        await fut

    async def advance(self, seconds: float) -> None:
        """Move time forward, waking every sleeper whose deadline has come, in order."""
        target = self._now + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._sleepers)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
                # Let the woken task run before time moves on.
                for _ in range(5):
                    await asyncio.sleep(0)
        self._now = target
