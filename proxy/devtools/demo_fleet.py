"""The demo's simulated worker fleets: sequential workers, each with a 10/s client limit,
and the schedule an "autoscaler" grows them by.

A job refused with 429 is set aside and retried after the wait it was told, ahead of new
jobs, while the worker goes on with other jobs (Celery's ``retry(countdown=...)``): a vendor
429 waits ``Retry-After``, a proxy defer waits ``X-Quota-Retry-After-Ms`` plus a little jitter.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from dataclasses import dataclass
from typing import Final

import aiohttp

from proxy.tasks import spawn

__all__ = ["PER_WORKER_RATE", "Fleet", "FleetCounters", "workers_at"]

PER_WORKER_RATE: Final = 10.0
"""The old per-process client limit every worker keeps, requests per second."""
RAMP_START: Final = 0.10
RAMP_END: Final = 0.75
"""The fleets keep their first size for the first 10 % of the run, grow linearly until 75 %,
then keep their last size, so the steady state is visible however long the run is."""
_DEFER_JITTER: Final = 0.05
_TIMER_SLACK: Final = 0.01
_RETRY_JITTER: Final = 0.1


# -- the growth schedule ------------------------------------------------------------------


def workers_at(elapsed: float, duration: float, start: int, end: int) -> int:
    """The fleet size ``elapsed`` seconds into a run of ``duration`` seconds.

    ``start`` until ``RAMP_START`` of the run, then a linear ramp reaching ``end`` at
    ``RAMP_END``, then ``end``; rounded to whole workers, never outside [start, end].
    """
    if duration <= 0:
        return end
    ramp_from, ramp_to = RAMP_START * duration, RAMP_END * duration
    if elapsed <= ramp_from:
        return start
    if elapsed >= ramp_to:
        return end
    share = (elapsed - ramp_from) / (ramp_to - ramp_from)
    value = start + (end - start) * share
    low, high = min(start, end), max(start, end)
    return max(low, min(high, math.floor(value + 0.5)))


# -- the workers -------------------------------------------------------------------------


@dataclass(slots=True)
class FleetCounters:
    """What a fleet's workers saw, cumulative."""

    sent: int = 0
    retries: int = 0
    done: int = 0
    vendor_429: int = 0
    deferred: int = 0
    errors: int = 0


class Fleet:
    """Sequential workers with a 10/s client limit each, calling ``url`` (via ``proxy``)."""

    def __init__(self, name: str, session: aiohttp.ClientSession, url: str, proxy: str | None = None) -> None:
        self.name = name
        self.session = session
        self.url = url
        self.proxy = proxy
        self.counters = FleetCounters()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def size(self) -> int:
        return len(self._tasks)

    def scale(self, target: int) -> None:
        while len(self._tasks) < target:
            index = len(self._tasks)
            self._tasks.append(spawn(self._work(), name=f"demo-{self.name}-worker-{index}"))
        while len(self._tasks) > target:
            self._tasks.pop().cancel()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        interval = 1.0 / PER_WORKER_RATE
        counters = self.counters
        retry_at: list[float] = []  # due times of jobs set aside after a 429
        # A new worker starts at a random point of its interval, as real ones would.
        next_send = loop.time() + random.random() * interval
        while True:
            now = loop.time()
            if next_send > now:
                await asyncio.sleep(next_send - now)
                now = loop.time()
            # The client-side limiter: 10/s, burst 1 (GCRA); the small slack absorbs timer lateness
            # so a worker that is always ready really sends 10/s, not a little less.
            next_send = max(next_send, now - _TIMER_SLACK) + interval
            if retry_at and retry_at[0] <= now:
                heapq.heappop(retry_at)
                counters.retries += 1
            counters.sent += 1
            try:
                async with self.session.get(self.url, proxy=self.proxy) as response:
                    await response.read()
                    status, headers = response.status, response.headers
            except (aiohttp.ClientError, TimeoutError):
                counters.errors += 1
                continue
            if status != 429:
                counters.done += 1
                continue
            if headers.get("X-Quota-Action") == "defer":
                counters.deferred += 1
                wait = _float(headers.get("X-Quota-Retry-After-Ms"), 1000.0) / 1000.0
                wait += random.uniform(0, _DEFER_JITTER)
            else:
                counters.vendor_429 += 1
                wait = _float(headers.get("Retry-After"), 1.0) + random.uniform(0, _RETRY_JITTER)
            heapq.heappush(retry_at, loop.time() + wait)


def _float(text: str | None, default: float) -> float:
    try:
        value = float(text) if text is not None else default
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default
