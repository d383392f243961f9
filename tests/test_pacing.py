"""Held requests leave evenly paced, even after the event loop stalled (SPEC §6)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable

import pytest

from proxy.clock import ManualClock
from proxy.pacing import Pacer
from tests.conftest import client_session, vendor_policy


async def test_on_time_leavers_wait_nothing() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    for _ in range(5):
        assert await pacer.leave("v", clock.monotonic(), window=1.0) == 0
        await clock.advance(0.1)


async def test_late_leavers_keep_the_spacing_they_were_due_at() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    left: list[float] = []

    async def leave(due: float) -> None:
        await pacer.leave("v", due, window=1.0)
        left.append(clock.monotonic())

    await clock.advance(0.5)  # a stall: all four were due during it, 0.1 s apart
    tasks = [asyncio.ensure_future(leave(start + 0.1 * i)) for i in range(4)]
    for _ in range(10):
        await asyncio.sleep(0)
        await clock.advance(0.05)
    await asyncio.gather(*tasks)
    assert [round(t - start, 2) for t in left] == [0.5, 0.6, 0.7, 0.8]


async def test_a_long_gap_in_the_schedule_is_not_carried_over() -> None:
    """Pacing keeps the store's spacing, never more: one held request an hour is not
    made to wait an hour more."""
    clock = ManualClock()
    pacer = Pacer(clock)
    assert await pacer.leave("v", clock.monotonic(), window=1.0) == 0
    await clock.advance(3600)
    assert await pacer.leave("v", clock.monotonic(), window=1.0) == 0


async def _waited(clock: ManualClock, leaving: Awaitable[float]) -> float:
    """Run one ``leave`` to its end, moving the manual clock until it returns."""
    task = asyncio.ensure_future(leaving)
    await asyncio.sleep(0)
    while not task.done():
        await clock.advance(0.05)
    return round(task.result(), 3)


async def test_a_stall_is_forgotten_once_no_window_holds_its_late_leavers() -> None:
    """The lag a stall left (0.3 s here) shifts the leavers of that busy spell only: a
    held request due after a quiet spell longer than the vendor's longest window cannot
    share a window with the late ones, so it leaves when due. It used to keep the largest
    stall ever seen as an offset: every later hold of the vendor waited 0.3 s more."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.3)  # a stall: the first held request leaves 0.3 s late
    assert await _waited(clock, pacer.leave("v", start, window=1.0)) == 0
    await clock.advance(0.1)  # the next one, on time 0.4 s after the first, shifts with it
    assert await _waited(clock, pacer.leave("v", start + 0.4, window=1.0)) == 0.3
    await clock.advance(5.0)  # a quiet spell of 5 s, longer than the 1 s window
    due = clock.monotonic()
    assert await _waited(clock, pacer.leave("v", due, window=1.0)) == 0
    await clock.advance(0.1)
    assert await _waited(clock, pacer.leave("v", due + 0.1, window=1.0)) == 0


async def test_within_the_window_the_shift_is_kept() -> None:
    """A quiet spell shorter than the window keeps the shift: an on-time leaver right after
    late ones would share a window with them and overrun it."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.3)
    assert await _waited(clock, pacer.leave("v", start, window=1.0)) == 0
    await clock.advance(0.4)  # due 0.7 s after the first, which left 0.3 s late
    assert await _waited(clock, pacer.leave("v", start + 0.7, window=1.0)) == 0.3


async def test_vendors_are_paced_apart() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    assert await pacer.leave("a", clock.monotonic(), window=1.0) == 0
    assert await pacer.leave("b", clock.monotonic(), window=1.0) == 0


@pytest.mark.slow
async def test_a_stalled_event_loop_does_not_release_the_held_requests_together(vendor, start_proxy):
    """Five held requests whose times came during a 0.3 s stall used to reach the vendor
    within a few milliseconds of each other; now they keep the vendor's interval."""
    policy = vendor_policy(
        vendor.url, limits="[{rate: 20, per: 1s, burst: 1}]", on_limit="{action: hold, max_hold: 2s}"
    )
    proxy = await start_proxy(policy)
    async with client_session() as s:

        async def call(i: int) -> int:
            async with s.get(f"http://api.payments.example/h{i}", proxy=proxy.url) as r:
                await r.read()
                return r.status

        calls = [asyncio.ensure_future(call(i)) for i in range(10)]
        while proxy.runtime.deps.held.get("payments", 0) < 9:  # one token, nine held 50 ms apart
            await asyncio.sleep(0.01)
        time.sleep(0.3)  # the whole process stalls, as in a long garbage collection
        assert await asyncio.gather(*calls) == [200] * 10
    arrivals = sorted(vendor.mock.arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:])]  # between held requests
    assert min(gaps) >= 0.04, [round(g, 3) for g in gaps]
