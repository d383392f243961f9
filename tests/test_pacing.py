"""Held requests leave evenly paced, even after the event loop stalled (SPEC §6)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from proxy import forward
from proxy.clock import ManualClock
from proxy.dataplane.upstream import Pool
from proxy.limiter.store import BucketSpec
from proxy.pacing import _MAX_TRACKED, MAX_WAIT, Pacer
from tests.conftest import client_session, eventually, vendor_policy


def spec(rate: float, burst: float, key: str = "v") -> BucketSpec:
    return BucketSpec(key, rate, burst, "global", f"{key} {rate}/1s burst {burst}")


async def test_on_time_writes_wait_nothing() -> None:
    """Writes on their grants' schedule (a burst, then one per interval) fit the mirror."""
    clock = ManualClock()
    pacer = Pacer(clock)
    bucket = [spec(10, 3)]
    assert [pacer.reserve(bucket)[0] for _ in range(3)] == [0.0, 0.0, 0.0]
    for _ in range(20):
        await clock.advance(0.1)
        assert pacer.reserve(bucket)[0] == 0.0


async def test_writes_bunched_by_a_delay_leave_a_burst_then_at_the_rate() -> None:
    """Eight requests granted over 0.5 s and all delayed to its end (a connection opening,
    a stall): a burst of them goes, the rest one interval apart, as the vendor's bucket
    would have let them."""
    clock = ManualClock()
    pacer = Pacer(clock)
    bucket = [spec(10, 3)]
    for _ in range(3):
        pacer.reserve(bucket)
    await clock.advance(0.5)
    waits = [round(pacer.reserve(bucket)[0], 3) for _ in range(8)]
    assert waits == [0.0, 0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5]


async def test_a_lag_is_spent_from_the_slack_not_carried_on() -> None:
    """Steady traffic at half the rate, one request written 0.15 s late: the next waits
    only for the tokens the late one took early, later ones nothing. (The earlier pacer
    kept every lag as an offset while traffic went on: under steady load each stall
    delayed all later requests more.)"""
    clock = ManualClock()
    pacer = Pacer(clock)
    bucket = [spec(10, 1)]
    assert pacer.reserve(bucket)[0] == 0.0
    await clock.advance(0.35)  # due at 0.2, written at 0.35
    assert pacer.reserve(bucket)[0] == 0.0
    await clock.advance(0.05)  # due at 0.4: the late one's token is back at 0.45
    assert round(pacer.reserve(bucket)[0], 3) == 0.05
    for _ in range(5):
        await clock.advance(0.2)
        assert pacer.reserve(bucket)[0] == 0.0


async def test_the_tightest_bucket_binds_and_cost_counts() -> None:
    """A request waiting for its endpoint class's bucket takes the vendor's global one only
    when it goes: the class's waiters do not hold back the vendor's other requests."""
    clock = ManualClock()
    pacer = Pacer(clock)
    loose, tight = spec(100, 10, "global"), spec(4, 2, "search")
    assert pacer.reserve([tight, loose], cost=2) == (0.0, ())  # the class's burst of 2, at once
    wait, rest = pacer.reserve([tight, loose], cost=2)
    assert (round(wait, 3), rest) == (0.5, [loose])  # 2 more tokens at 4/s; the global one later
    assert [pacer.reserve([loose])[0] for _ in range(7)] == [0.0] * 7  # the global bucket has room
    await clock.advance(0.5)
    assert pacer.reserve(rest, cost=2) == (0.0, ())  # the waiter goes: its 2 global tokens are back
    assert [pacer.reserve([loose])[0] > 0 for _ in range(9)] == [False] * 8 + [True]  # it took 2 of 10
    assert round(pacer.reserve([tight, loose], cost=2)[0], 3) == 0.5


async def test_buckets_and_vendors_are_paced_apart() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    assert pacer.reserve([spec(1, 1, "a")])[0] == 0.0
    assert pacer.reserve([spec(1, 1, "b")])[0] == 0.0
    assert pacer.reserve([spec(1, 1, "a")])[0] == 1.0


async def test_a_mirror_out_of_step_with_the_store_does_not_hold_requests() -> None:
    """5 a minute: the mirror's burst is spent, so the next token is 12 s away. A request
    the store grants now (it restarted empty of history, or requests went out failing
    open) is not held 12 s: no stall is that long, the store is trusted, and the mirror
    restarts from its answer. (The fault tests' store restart held each request 12 s.)"""
    clock = ManualClock()
    pacer = Pacer(clock)
    bucket = [spec(5 / 60, 5)]
    assert [pacer.reserve(bucket)[0] for _ in range(5)] == [0.0] * 5
    assert pacer.reserve(bucket) == (0.0, ())  # 12 s away: the store is trusted
    assert pacer._tat["v"] == clock.monotonic() + 12  # a full mirror, less this request
    assert [pacer.reserve(bucket)[0] for _ in range(4)] == [0.0] * 4
    fast = [spec(10, 1, "fast")]
    assert pacer.reserve(fast)[0] == 0.0
    assert round(pacer.reserve(fast)[0], 3) == 0.1 < MAX_WAIT  # a wait within the bound is kept


async def test_what_it_remembers_is_bounded() -> None:
    """One mirror per partition's bucket: many credentials must not grow it without end."""
    clock = ManualClock()
    pacer = Pacer(clock)
    for i in range(3 * _MAX_TRACKED):
        pacer.reserve([spec(10, 1, f"p{i}")])
        if i % 1000 == 0:
            await clock.advance(0.05)
    assert len(pacer._tat) <= _MAX_TRACKED


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


async def test_a_paced_write_given_up_puts_its_connection_back_unused(raw_vendor) -> None:
    """A worker that goes away while its request waits for the pacer: nothing was written
    on the pooled connection it held, so the connection goes back to the pool."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(100))

    raw = await raw_vendor(serve)
    origin = forward.origin_of(raw.url)
    pool = Pool(False)
    conn = await pool.open(origin, 1.0)
    clock = ManualClock()
    waiting = asyncio.ensure_future(forward._paced(pool, conn, Pacer(clock), 0.5, (), 1.0, 1.0))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.idle(origin) is conn
    assert received == []
    await pool.close()


async def test_a_connection_the_vendor_closed_during_the_wait_is_replaced(raw_vendor) -> None:
    closing = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if raw.connections == 1:
            await closing.wait()
            return  # the vendor drops its idle connection (its keep-alive timeout)
        await reader.read(100)

    raw = await raw_vendor(serve)
    origin = forward.origin_of(raw.url)
    pool = Pool(False)
    conn = await pool.open(origin, 1.0)
    clock = ManualClock()
    waiting = asyncio.ensure_future(forward._paced(pool, conn, Pacer(clock), 0.5, (), 1.0, 1.0))
    closing.set()
    await eventually(lambda: conn.closed, "the vendor's close seen")
    await clock.advance(0.5)
    fresh = await waiting
    assert fresh is not conn and not fresh.closed
    assert raw.connections == 2
    await pool.close()
