"""Held requests leave evenly paced, even after the event loop stalled (SPEC §6)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
import pytest

from proxy.clock import ManualClock
from proxy.limiter.buckets import Buckets
from proxy.limiter.store import BucketSpec
from proxy.pipeline import forward
from proxy.pipeline.pacing import _MAX_TRACKED, MAX_WAIT, Paced, Pacer, vendor_room
from proxy.wire.pool import Pool
from tests.conftest import client_session, eventually, vendor_policy


def spec(rate: float, burst: float, key: str = "v") -> BucketSpec:
    return BucketSpec(key, rate, burst, "global", f"{key} {rate}/1s burst {burst}")


BUCKET = [spec(10, 5)]
W = 1.0  # the vendor's longest window


async def test_on_time_writes_wait_nothing() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    for _ in range(20):
        assert pacer.reserve(BUCKET, clock.monotonic(), W) == 0.0
        await clock.advance(0.1)


async def test_requests_delayed_together_keep_the_spacing_of_their_grants() -> None:
    """A replica's requests granted 0.2 s apart (the other replica has the rest of the
    fleet's 10/s) are all delayed to 0.5 s: they go as far apart as they were granted,
    shifted, never together. (A mirror of the bucket kept by the replica alone, which saw
    only half the grants, let them go at once: 102 in a window of 100 at the vendor.)"""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.5)
    waits = [round(pacer.reserve(BUCKET, start + 0.2 * i, W), 3) for i in range(3)]
    assert waits == [0.0, 0.2, 0.4]


async def test_a_lag_is_kept_while_requests_keep_coming_and_forgotten_after_a_quiet_window() -> None:
    """A 0.3 s stall shifts the requests after it by 0.3 s while they keep coming (any
    one less late would be early against the shifted stream); once the last write is
    older than the vendor's window, the next request goes when granted."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.3)
    assert pacer.reserve(BUCKET, start, W) == 0.0  # written 0.3 s after its grant
    for _ in range(5):
        await clock.advance(0.5)  # within the window of the last write
        assert round(pacer.reserve(BUCKET, clock.monotonic(), W), 3) == 0.3
    await clock.advance(0.3 + W)  # a quiet spell longer than the window
    assert pacer.reserve(BUCKET, clock.monotonic(), W) == 0.0
    assert pacer.reserve(BUCKET, clock.monotonic(), W) == 0.0


async def test_a_bucket_with_room_for_the_lag_carries_none() -> None:
    """A lag of 0.3 s at 10/s makes at most 3 requests early when it ends: a request
    granted with 4 tokens still in the bucket (3 + its own) drops it; with 3.5 it does not.
    A vendor whose limit does not bind thus never keeps its requests late."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.3)
    assert pacer.reserve(BUCKET, start, W, [0.0]) == 0.0  # written 0.3 s late
    now = clock.monotonic()
    assert pacer.reserve(BUCKET, now, W, [4.0]) == 0.0  # room: the lag ends here
    assert pacer.reserve(BUCKET, now, W, [0.0]) == 0.0  # and is not carried on
    huge = [spec(1e9, 1e9, "huge")]
    assert pacer.reserve(huge, start, W, [1e9]) == 0.0
    assert pacer.reserve(huge, clock.monotonic(), W, [1e9 - 1]) == 0.0


async def test_a_room_for_part_of_the_lag_drops_that_part_once_per_window() -> None:
    """A lag of 0.3 s at 10/s, and a request granted with 3.5 tokens left (2.5 besides its
    own): 0.25 s of the lag can end (2.5 requests early at most), not all of it. The next
    requests, granted with the same room within the window, drop no more: one room pays
    for one drop. A window after the lag's peak, the room drops the rest."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.3)
    assert pacer.reserve(BUCKET, start, W, [0.0]) == 0.0  # written 0.3 s late
    now = clock.monotonic()
    assert round(pacer.reserve(BUCKET, now, W, [3.5]), 3) == 0.05
    for _ in range(4):
        await clock.advance(0.2)
        assert round(pacer.reserve(BUCKET, clock.monotonic(), W, [3.5]), 3) == 0.05
    await clock.advance(0.2)  # a window after the peak's write
    assert pacer.reserve(BUCKET, clock.monotonic(), W, [3.5]) == 0.0


async def test_a_long_lag_on_a_bucket_below_its_rate_ends_while_requests_keep_coming() -> None:
    """A replica's loop stalled 0.9 s; its vendor bucket (30/s, burst 10) then grants 20/s,
    each request with ~9 tokens to spare besides its own, and each wakes 5 ms late (a busy
    loop). Room for the whole lag (27 tokens) never comes with a burst of 10: the lag used
    to stay (and grow by the late wake-ups, up to MAX_WAIT), every request written ~1 s
    late for as long as traffic went on. Now each window drops 0.3 s of it."""
    clock = ManualClock()
    pacer = Pacer(clock)
    bucket = [spec(30, 10)]
    start = clock.monotonic()
    await clock.advance(0.9)
    assert pacer.reserve(bucket, start, W, [0.0]) == 0.0  # written 0.9 s late
    waits = []
    for _ in range(100):  # 5 s at 20/s
        granted = clock.monotonic()
        await clock.advance(0.005)  # woken late
        wait = pacer.reserve(bucket, granted, W, [9.0])
        waits.append(wait)
        await clock.advance(wait)
        await clock.advance(0.05 - 0.005 - wait if wait < 0.045 else 0.0)
    assert waits[0] > 0.5  # a lag is not dropped at once without room for all of it
    assert max(waits[-20:]) < 0.01, waits[-20:]


async def test_a_metered_request_is_paced_on_its_meters_own_buckets_at_its_estimate() -> None:
    """SPEC §14: the vendor counts a meter's tokens as it counts requests, so a stall that
    bunches grants bunches tokens: a meter's own bucket (not its tenant's) keeps a lag like
    a request bucket, its room weighed against the call's estimate (2,000 tokens), not 1.
    (Before, only request buckets were paced: a vendor with meters alone, none.)"""
    clock = ManualClock()
    pacer = Pacer(clock)
    tenant, requests = spec(10, 10, "t"), spec(100, 100, "v")
    tenant_tokens = BucketSpec("t-m", 100, 4000, "tenant", "tenant tokens")
    tokens = BucketSpec("v", 1000, 4000, "global", "tokens 1000/1s burst 4000", field="m:tokens:0")
    b = Buckets((tenant, requests, tenant_tokens, tokens), tenant_count=1, meters=(0, 0))
    specs, room = vendor_room(b, (5.0, 0.0, 900.0, 0.0), 0.0, 1.0, (2000.0,))
    assert specs == (requests, tokens)
    assert room == (0.0, 0.0 - 2000.0 + 1.0)
    start = clock.monotonic()
    await clock.advance(0.3)
    assert pacer.reserve(specs, start, W, room) == 0.0  # a stall: written 0.3 s late
    now = clock.monotonic()
    # Room for the request (100 left) but not for the tokens (2,000: the call's own): the
    # meter keeps the lag.
    specs, room = vendor_room(b, (5.0, 100.0, 900.0, 2000.0), 0.0, 1.0, (2000.0,))
    assert round(pacer.reserve(specs, now, W, room), 3) == 0.3
    # 4,000 left is room for 0.3 s at 1,000/s (300) besides the call's own 2,000: none kept.
    specs, room = vendor_room(b, (5.0, 100.0, 900.0, 4000.0), 0.0, 1.0, (2000.0,))
    assert pacer.reserve(specs, now, W, room) == 0.0


async def test_a_lag_is_the_longest_stall_not_the_sum_of_them() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.2)
    assert pacer.reserve(BUCKET, start, W) == 0.0  # a 0.2 s stall
    for _ in range(5):  # later requests, each delayed 0.1 s on its own: kept at 0.2 s late
        granted = clock.monotonic()
        await clock.advance(0.1)
        assert round(pacer.reserve(BUCKET, granted, W), 3) == 0.1
        await clock.advance(0.1)


async def test_the_latest_bucket_binds_and_buckets_are_apart() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    search, global_ = spec(2, 1, "search"), spec(100, 10, "global")
    await clock.advance(0.3)
    assert pacer.reserve([search], start, W) == 0.0  # 0.3 s late on the class's bucket
    now = clock.monotonic()
    assert pacer.reserve([global_], now, W) == 0.0  # the global bucket had no late write
    assert pacer.reserve([spec(10, 1, "other")], now, W) == 0.0  # nor another vendor's
    assert round(pacer.reserve([search, global_], now, W), 3) == 0.3  # the class binds
    assert round(pacer.reserve([global_], now, W), 3) == 0.3  # and now the global one is late too


async def test_a_growing_lag_is_told_once_per_stall_and_an_adopted_one_is_kept() -> None:
    clock = ManualClock()
    told: list[tuple[tuple[str, ...], float]] = []
    a, b = Pacer(clock), Pacer(clock)
    a.on_grown = lambda idents, lag: told.append((idents, round(lag, 3)))
    start = clock.monotonic()
    assert a.reserve(BUCKET, start, W) == 0.0  # on time: nothing to tell
    await clock.advance(0.2)
    a.reserve(BUCKET, start + 0.05, W)  # a stall: written 0.15 s late
    for _ in range(5):  # the requests after it keep the lag: nothing new to tell
        await clock.advance(0.01)
        a.reserve(BUCKET, clock.monotonic() - 0.15, W)
    assert told == [(("v",), 0.15)]
    b.adopt(["v"], 0.15)  # what the other replica does with the message
    b.adopt(["v"], 0.05)  # a smaller lag heard later does not shorten it
    assert round(b.reserve(BUCKET, clock.monotonic(), W), 3) == 0.15


async def test_a_bucket_that_does_not_bind_keeps_and_tells_nothing() -> None:
    """Huge limits (room for any lag): a request's own delay on a busy loop is no lag to
    keep or tell; telling it cost a PUBLISH every few requests under load."""
    clock = ManualClock()
    told: list[float] = []
    pacer = Pacer(clock)
    pacer.on_grown = lambda idents, lag: told.append(lag)
    huge = [spec(1e9, 1e9, "huge")]
    for k in range(20):
        granted = clock.monotonic()
        await clock.advance(0.001 * (k % 7))  # each its own delay, up to 6 ms
        assert pacer.reserve(huge, granted, W, [1e9 - k]) == 0.0
    assert told == []
    assert pacer._lag.get("huge", (0.0, 0.0))[0] == 0.0  # no lag kept (no record at all, on the short cut)


async def test_a_ledger_out_of_step_with_the_store_does_not_hold_requests() -> None:
    """A wait over MAX_WAIT is no stall to carry on: the store granted the request, it
    goes, and the lag restarts from it."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    await clock.advance(0.4)
    assert pacer.reserve(BUCKET, start - 5.0, W) == 0.0  # 5 s late (a clock jump, a lost state)
    assert pacer.reserve(BUCKET, clock.monotonic(), W) == 0.0
    assert pacer.reserve(BUCKET, clock.monotonic(), W) == 0.0
    assert MAX_WAIT < 5.0


async def test_what_it_remembers_is_bounded() -> None:
    """One lag per partition's bucket: many credentials must not grow it without end."""
    clock = ManualClock()
    pacer = Pacer(clock)
    for i in range(3 * _MAX_TRACKED):
        pacer.reserve([spec(10, 1, f"p{i}")], clock.monotonic(), W)
    assert len(pacer._lag) <= _MAX_TRACKED


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


async def paced_on_a_pooled_connection(
    raw_vendor: Any, serve: Any
) -> tuple[Any, Pool, Any, ManualClock, asyncio.Future[Any]]:
    """A vendor running ``serve``, a pooled connection to it, and a write waiting 0.5 s of a
    manual clock for the pacer on it (forward.paced)."""
    raw = await raw_vendor(serve)
    origin = forward.origin_of(raw.url)
    pool = Pool(False)
    conn = await pool.open(origin, 1.0)
    clock = ManualClock()
    waiting = asyncio.ensure_future(forward.paced(pool, conn, Pacer(clock), 0.5, 1.0))
    return raw, pool, conn, clock, waiting


async def test_a_paced_write_given_up_puts_its_connection_back_unused(raw_vendor) -> None:
    """A worker that goes away while its request waits for the pacer: nothing was written
    on the pooled connection it held, so the connection goes back to the pool."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(100))

    _, pool, conn, _, waiting = await paced_on_a_pooled_connection(raw_vendor, serve)
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.idle(conn.origin) is conn
    assert received == []
    await pool.close()


async def test_a_connection_the_vendor_closed_during_the_wait_is_replaced(raw_vendor) -> None:
    closing = asyncio.Event()
    served: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(1)
        if len(served) == 1:
            await closing.wait()
            return  # the vendor drops its idle connection (its keep-alive timeout)
        await reader.read(100)

    raw, pool, conn, clock, waiting = await paced_on_a_pooled_connection(raw_vendor, serve)
    closing.set()
    await eventually(lambda: conn.closed, "the vendor's close seen")
    await clock.advance(0.5)
    fresh = await waiting
    assert fresh is not conn and not fresh.closed
    assert raw.connections == 2
    await pool.close()


@pytest.mark.slow
async def test_a_stall_on_one_replica_shifts_the_other_replicas_writes(vendor, start_proxy, redis_url) -> None:
    """Two replicas on one Redis. One of them writes 0.3 s late (a stall): the other hears
    it through the store and its next request, granted at once, is written 0.3 s late too,
    rather than into the windows that already hold the stalled replica's late ones."""
    # (Burst 1: no room besides the request's own, which would end part of the lag.)
    policy = vendor_policy(vendor.url, store=redis_url, limits="[{rate: 100, per: 1s, burst: 1}]")
    a = await start_proxy(policy)
    b = await start_proxy(policy)
    deps_a, deps_b = a.runtime.deps, b.runtime.deps
    pace = deps_b.limiter.buckets(deps_b.policy.vendors[0], "t").vendor_side
    idents = tuple(spec.ident for spec in pace)

    async def heard() -> bool:
        a.runtime._tell_lag(idents, 0.3)  # as its pacer does when a write's lag grows
        await asyncio.sleep(0.05)
        return all(deps_b.pacer._lag.get(i, (0.0, 0.0))[0] == 0.3 for i in idents)

    await eventually(heard, "the other replica heard the lag")
    assert deps_a.pacer._lag == {}  # a replica ignores its own message
    async with client_session() as s:
        started = time.monotonic()
        async with s.get("http://api.payments.example/late", proxy=b.url) as r:
            assert r.status == 200
    assert vendor.mock.arrivals[-1] - started >= 0.28, vendor.mock.arrivals[-1] - started


async def test_a_request_granted_later_waits_for_an_earlier_one_still_connecting() -> None:
    """The burst that must connect first is written before the grants after it that found
    an idle connection (whose lag they could not know yet: they went first and bunched
    with it at the vendor); one granted with room to be early by MAX_WAIT does not wait."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    ticket = pacer.connecting(BUCKET, start)
    assert pacer.still_connecting == 1
    assert not pacer.earlier(BUCKET, start)  # itself
    assert pacer.earlier(BUCKET, start + 0.1, [0.0])
    assert not pacer.earlier(BUCKET, start + 0.1, [10 * MAX_WAIT + 1.0])  # room for it
    assert not pacer.earlier([spec(10, 5, key="other")], start + 0.1)  # another bucket
    later = asyncio.ensure_future(pacer.after_earlier(BUCKET, start + 0.1, [0.0]))
    await asyncio.sleep(0)
    assert not later.done()
    pacer.written(ticket)
    await asyncio.wait_for(later, 1.0)
    assert pacer.still_connecting == 0 and not pacer.earlier(BUCKET, start + 0.1)


async def test_an_earlier_request_that_never_connects_holds_the_later_ones_up_max_wait_at_most() -> None:
    clock = ManualClock()
    pacer = Pacer(clock)
    pacer.connecting(BUCKET, clock.monotonic())
    later = asyncio.ensure_future(pacer.after_earlier(BUCKET, clock.monotonic() + 0.1))
    await eventually(lambda: bool(clock._sleepers), "the wait begun")
    await clock.advance(MAX_WAIT / 2)
    assert not later.done()
    await clock.advance(MAX_WAIT / 2)
    await asyncio.wait_for(later, 1.0)


async def test_a_connection_found_idle_is_not_written_on_before_an_earlier_grant_connects(raw_vendor) -> None:
    """forward.ready: A (granted first) opens its connection, slowly; B (granted after)
    finds one idle. B is let go only once A is (its lag then known: B's wait follows it)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)

    raw = await raw_vendor(serve)
    pool = Pool(keepalive=30.0)
    origin = forward.origin_of(raw.url)
    idle = await pool.open(origin, 1.0)
    clock = ManualClock()
    pacer = Pacer(clock)
    opening = asyncio.Event()
    real_open = Pool.open

    async def slow_open(self: Pool, where: Any, timeout: float | None) -> Any:
        await opening.wait()
        return await real_open(self, where, timeout)

    granted = clock.monotonic()
    a_pace = Paced(tuple(BUCKET), granted, W, (0.0,), 1.0)
    b_pace = Paced(tuple(BUCKET), granted + 0.1, W, (0.0,), 1.0)
    order: list[str] = []

    async def go(name: str, pace: Paced, conn: Any) -> None:
        await forward.ready(pool, origin, 1.0, pacer, pace, conn)
        order.append(name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Pool, "open", slow_open)
        a = asyncio.ensure_future(go("a", a_pace, None))
        await eventually(lambda: pacer.still_connecting == 1, "A connecting")
        b = asyncio.ensure_future(go("b", b_pace, idle))
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == [] and not b.done()
        opening.set()
        await asyncio.wait_for(a, 2.0)
        await clock.advance(0.2)  # B's wait: the lag A was written with
        await asyncio.wait_for(b, 2.0)
    assert order == ["a", "b"]
    await pool.close()


async def test_the_short_cut_is_taken_only_while_no_lag_can_be_live() -> None:
    """reserve's short cut (no lookups while no bucket carries a live lag) gives what the
    full reckoning gives: on time while nothing lags; once a stall left a lag, the shifted
    stream keeps it for the window (and another replica's adopted lag is kept too)."""
    clock = ManualClock()
    pacer = Pacer(clock)
    start = clock.monotonic()
    assert pacer.reserve(BUCKET, start, W, [0.0]) == 0.0  # nothing lags: on time
    await clock.advance(0.3)
    assert pacer.reserve(BUCKET, start + 0.05, W, [0.0]) == 0.0  # written 0.25 s late: a lag
    now = clock.monotonic()
    assert round(pacer.reserve(BUCKET, now, W, [0.0]), 3) == 0.25  # kept: not the short cut
    await clock.advance(W + 0.3)  # a quiet window: the lag is no longer live
    assert pacer.reserve(BUCKET, clock.monotonic(), W, [0.0]) == 0.0
    pacer.adopt([BUCKET[0].ident], 0.1)  # another replica's stall
    now = clock.monotonic()
    assert round(pacer.reserve(BUCKET, now, W, [0.0]), 3) == 0.1


async def test_a_late_slot_taken_shifts_the_writes_after_it_half_an_interval_at_most(vendor, start_proxy):
    """A slot nobody claimed, taken late (acquire.lua, "Late slots"), is a move the store
    fitted beside the schedule. Paced as granted when the slot matured, it gave the replica a
    lag of the whole move: every later write of that bucket went out that much late
    (bench/quota.py giveup-fresh, 2/s burst 1: requests written up to 1 s after their grants,
    and the vendor's strict window overrun). Now half the schedule's interval at most."""
    policy = vendor_policy(vendor.url, limits="[{rate: 1, per: 1s, burst: 1}]", on_limit="{action: defer}")
    proxy = await start_proxy(policy)
    host = "http://api.payments.example"

    async def fresh(path: str) -> aiohttp.ClientResponse:
        async with client_session() as s, s.get(f"{host}{path}", proxy=proxy.url) as r:
            await r.read()
            return r

    began = time.monotonic()
    assert (await fresh("/a")).status == 200
    left = await fresh("/b")  # deferred, its slot at 1 s; its connection gone: nobody's
    assert left.status == 429 and left.headers["X-Quota-Action"] == "defer"
    async with client_session() as mine:
        async with mine.get(f"{host}/e", proxy=proxy.url) as r:  # its slot at 2 s
            await r.read()
            assert r.status == 429
            back = time.monotonic() + int(r.headers["retry-after-ms"]) / 1000 + 0.01
        await asyncio.sleep(max(began + 1.95 - time.monotonic(), 0))
        assert (await fresh("/c")).status == 200  # takes the 1 s slot, 0.95 s late
        await asyncio.sleep(max(back - time.monotonic(), 0))
        sent = time.monotonic()
        async with mine.get(f"{host}/e", proxy=proxy.url) as r:  # its own slot, on time
            await r.read()
            assert r.status == 200, dict(r.headers)
    written = vendor.mock.arrivals[-1] - sent
    assert written < 0.75, f"written {written * 1000:.0f} ms after it was sent"  # (0.5 s: half the interval)
