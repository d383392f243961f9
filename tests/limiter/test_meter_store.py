"""Meters in the store (SPEC §14): a metered request takes its estimate from its meter's
buckets with its other buckets in the one atomic call (``acquire(costs=...)``), and the
answer's actual amount settles it (``settle``): the difference given back, or owed.

The same contract for memory:// (ManualClock) and redis:// (its own TIME, so the
assertions allow some milliseconds of real time).
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketSpec, BucketStore, Reserve, StateGuard

TOL = 0.03  # seconds of real time a Redis-backed assertion may drift
STATE = "test:{m}:state"
QUEUE = "test:{m}:q:default"


def requests(name: str, rate: float = 10, burst: float = 10) -> BucketSpec:
    return BucketSpec(STATE, rate, burst, "global", f"requests {name}", field=f"g:{name}")


def tokens(name: str, rate: float = 1000, burst: float = 5000) -> BucketSpec:
    return BucketSpec(STATE, rate, burst, "global", f"tokens {name}", field=f"m:{name}")


def guard() -> StateGuard:
    return StateGuard(STATE, 0, 0.0)


async def later(store: BucketStore, clock: ManualClock, seconds: float) -> None:
    if isinstance(store, MemoryStore):
        await clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


async def test_each_bucket_takes_its_own_cost_in_one_call(store: BucketStore) -> None:
    b = (requests("a"), tokens("a"))
    first = await store.acquire(b, 1, 0, QUEUE, guard(), costs=(1, 3000))
    assert first.granted and first.levels == (pytest.approx(9, abs=0.5), pytest.approx(2000, abs=50))
    # The meter has 2000 of the 3000 asked: refused on it (the request bucket has room), a
    # wait of the 1000 tokens it lacks at 1000/s, and nothing taken from either.
    second = await store.acquire(b, 1, 0, QUEUE, guard(), costs=(1, 3000))
    assert not second.granted and second.binding == 1
    assert second.wait == pytest.approx(1.0, abs=TOL * 2)
    assert second.levels[0] == pytest.approx(9, abs=0.5) and second.levels[1] < 2100


async def test_a_metered_hold_waits_for_its_slowest_bucket(store: BucketStore) -> None:
    b = (requests("h", rate=1, burst=1), tokens("h"))
    assert (await store.acquire(b, 1, 0, None, guard(), costs=(1, 4000))).granted
    held = await store.acquire(b, 1, 2.0, None, guard(), costs=(1, 2000))
    # The request bucket refills in 1 s, the meter's 1000 missing tokens in 1 s: the slower.
    assert held.granted and held.wait == pytest.approx(1.0, abs=TOL * 2)
    assert held.levels[1] == pytest.approx(-1000, abs=50)  # reserved: below empty


async def test_the_queue_spaces_refusals_by_the_binding_buckets_own_cost(store: BucketStore) -> None:
    b = (requests("q", rate=100, burst=100), tokens("q"))
    assert (await store.acquire(b, 1, 0, QUEUE + "q", guard(), costs=(1, 5000))).granted
    one = await store.acquire(b, 1, 0, QUEUE + "q", guard(), costs=(1, 500))
    two = await store.acquire(b, 1, 0, QUEUE + "q", guard(), costs=(1, 500))
    assert not one.granted and not two.granted and one.binding == two.binding == 1
    # Each refusal a slot of 500 tokens at 1000/s: half a second apart, not 1/100 s.
    assert two.hint - one.hint == pytest.approx(0.5, abs=TOL)


async def test_settling_gives_the_difference_back(store: BucketStore) -> None:
    b = (tokens("r"),)
    await store.acquire(b, 1, 0, None, guard(), costs=(3000,))
    levels = await store.settle(b, (3000 - 1200,))  # the answer said 1200
    assert levels[0] == pytest.approx(3800, abs=50)
    # Never above the burst.
    assert (await store.settle(b, (4000,)))[0] == pytest.approx(5000)


async def test_settling_without_a_coroutine_settles_as_settle_does(
    store: BucketStore, request: pytest.FixtureRequest
) -> None:
    """``settle_then`` (the straight path's, one per metered answer, no task): the levels the
    coroutine would give, told to ``then``; or, a store without such a call (redis-py's
    clients), False and nothing done, the coroutine being the caller's."""
    b = (tokens("t"),)
    await store.acquire(b, 1, 0, None, guard(), costs=(3000,))
    told: asyncio.Future[tuple[float, ...] | None] = asyncio.get_running_loop().create_future()

    def then(levels: tuple[float, ...] | None, exc: BaseException | None) -> None:
        told.set_result(levels) if exc is None else told.set_exception(exc)

    sent = store.settle_then(b, (3000 - 1200,), 0.0, then)
    if request.node.callspec.params["store"] == "redis-py":
        assert not sent and not told.done()
        assert (await store.peek(b))[0] == pytest.approx(2000, abs=50)  # nothing given back
        return
    assert sent
    levels = await asyncio.wait_for(told, 5)
    assert levels is not None and levels[0] == pytest.approx(3800, abs=50)
    assert (await store.peek(b))[0] == pytest.approx(3800, abs=50)


async def test_settling_without_a_coroutine_after_redis_forgot_its_scripts(redis_url: str) -> None:
    """A Redis restarted (or SCRIPT FLUSHed) answers NOSCRIPT: the settlement goes the
    coroutine's way, which loads the script, and ``then`` hears its levels."""
    store = RedisStore(redis_url, timeout=1.0)
    try:
        b = (tokens("n"),)
        await store.acquire(b, 1, 0, None, guard(), costs=(3000,))
        with redis.Redis.from_url(redis_url) as raw:
            raw.script_flush()
        told: asyncio.Future[tuple[float, ...] | None] = asyncio.get_running_loop().create_future()
        assert store.settle_then(b, (1000,), 0.0, lambda levels, exc: told.set_result(levels))
        levels = await asyncio.wait_for(told, 5)
        assert levels is not None and levels[0] == pytest.approx(3000, abs=50)
    finally:
        await store.close()


async def test_settling_above_the_estimate_is_a_debt_the_next_requests_wait_out(
    store: BucketStore, clock: ManualClock
) -> None:
    b = (tokens("d"),)
    await store.acquire(b, 1, 0, None, guard(), costs=(5000,))
    levels = await store.settle(b, (5000 - 6500,))  # it took 6500
    assert levels[0] == pytest.approx(-1500, abs=50)
    refused = await store.acquire(b, 1, 0, None, guard(), costs=(100,))
    assert not refused.granted and refused.wait == pytest.approx(1.6, abs=TOL * 2)
    await later(store, clock, 1.65)
    assert (await store.acquire(b, 1, 0, None, guard(), costs=(100,))).granted


async def test_a_full_bucket_is_left_alone_by_a_refund_and_owes_a_debt_from_its_burst(store: BucketStore) -> None:
    fresh = (tokens("f1"), tokens("f2"))
    levels = await store.settle(fresh, (300, -700))
    assert levels == (pytest.approx(5000), pytest.approx(4300, abs=5))
    assert (await store.peek(fresh)) == (pytest.approx(5000), pytest.approx(4300, abs=5))


async def test_a_refund_still_gives_one_cost_to_every_bucket(store: BucketStore) -> None:
    b = (requests("x"), tokens("x"))
    await store.acquire(b, 1, 0, None, guard(), costs=(1, 1000))
    levels = await store.refund(b, 1)
    assert levels == (pytest.approx(10, abs=0.5), pytest.approx(4001, abs=50))


KEPT = Reserve("test:{m}:r:default", "", horizon=5.0, owner=0.0, life=2.0)


async def test_a_metered_refusal_keeps_its_slot_with_its_estimate_taken(store: BucketStore, clock: ManualClock) -> None:
    b = (requests("k"), tokens("k", rate=1000, burst=5000))
    owned = KEPT._replace(owner=0.2)  # its owner's alone for 0.2 s after it matures
    assert (await store.acquire(b, 1, 0, QUEUE + "k", guard(), None, owned, costs=(1, 5000))).granted
    kept = await store.acquire(b, 1, 0, QUEUE + "k", guard(), None, owned, costs=(1, 500))
    assert not kept.granted and kept.reserved and kept.wait == pytest.approx(0.5, abs=TOL)
    assert kept.levels[1] == pytest.approx(-500, abs=50)  # taken as a hold's
    await later(store, clock, kept.wait + 0.05)
    other = await store.acquire(b, 1, 0, QUEUE + "k", guard(), None, owned, costs=(1, 10))
    assert not other.claimed  # within its owner's head start
    # Its owner claims it, with another estimate (its retry's body): the difference is taken.
    claimed = await store.acquire(
        b, 1, 0, QUEUE + "k", guard(), None, owned._replace(claim=kept.reserved), costs=(1, 800)
    )
    assert claimed.granted and claimed.claimed
    assert claimed.levels[1] == pytest.approx(other.levels[1] - 300, abs=60)


async def test_a_metered_slot_nobody_claims_serves_the_next_metered_calls(
    store: BucketStore, clock: ManualClock
) -> None:
    """Issue 34 with meters (SPEC §6, §14): a deferred LLM call's slot holds its estimate of
    tokens; its owner gone, the tokens serve the next metered calls, as many as they need (a
    costly slot serves several cheaper calls), instead of standing idle until the slot is
    dropped (before, a metered slot was its owner's alone)."""
    b = (requests("n"), tokens("n", rate=1000, burst=5000))
    assert (await store.acquire(b, 1, 0, QUEUE + "n", guard(), None, KEPT, costs=(1, 5000))).granted
    kept = await store.acquire(b, 1, 0, QUEUE + "n", guard(), None, KEPT, costs=(1, 500))
    assert kept.reserved and kept.wait == pytest.approx(0.5, abs=TOL)
    await later(store, clock, kept.wait + 0.05)  # matured, nobody claimed it: 50 tokens refilled since
    first = await store.acquire(b, 1, 0, QUEUE + "n", guard(), None, KEPT, costs=(1, 200))
    assert first.granted and first.claimed
    assert first.levels[1] == pytest.approx(50, abs=40)  # its 200 tokens were the slot's
    second = await store.acquire(b, 1, 0, QUEUE + "n", guard(), None, KEPT, costs=(1, 300))
    assert second.granted and second.claimed
    assert second.levels[1] == pytest.approx(50, abs=40)  # and these 300, the slot's rest
    third = await store.acquire(b, 1, 0, QUEUE + "n", guard(), None, KEPT, costs=(1, 100))
    assert not third.claimed  # the slot's tokens are spent: these must come from the bucket


async def test_a_metered_slot_nobody_claims_gives_its_tenant_bucket_its_own_estimate_back(
    store: BucketStore, clock: ManualClock
) -> None:
    mine = BucketSpec("test:{m}:t:acme:m", 1000, 5000, "tenant", "tenant acme tokens")
    b = (mine, tokens("s", rate=1, burst=5000))
    kept = KEPT._replace(tenants=1, life=0.2)
    assert (await store.acquire(b, 1, 0, QUEUE + "s", guard(), None, kept, costs=(5000, 100))).granted
    slot = await store.acquire(b, 1, 0, QUEUE + "s", guard(), None, kept, costs=(700, 100))
    assert slot.reserved and slot.levels[0] == pytest.approx(-700, abs=30)
    await later(store, clock, slot.wait + 0.3)  # past its life: -700 + 1000 refilled
    after = await store.acquire(b, 1, 0, QUEUE + "s", guard(), None, kept, costs=(1, 1))
    assert after.levels[0] == pytest.approx(300 + 700 - 1, abs=40)  # its own 700 back (not the request's 1)


async def test_a_refund_gives_back_only_what_the_bucket_would_have_held(store: BucketStore, clock: ManualClock) -> None:
    """Tokens a call did not use were not spent; but given back now, to a bucket that stood
    above half its burst since the call went, they land on top of what it granted meanwhile
    (tokens the bucket would have overflowed): the vendor's window, counting actual usage, saw
    a fleet whose refunds had come in after a full bucket overrun it (bench/meters.py)."""
    below = (tokens("rb", rate=100, burst=1000),)
    assert (await store.acquire(below, 1, 0, None, guard(), costs=(1000,))).granted
    assert (await store.acquire(below, 1, 10.0, None, guard(), costs=(500,))).granted  # held: below empty
    await later(store, clock, 0.1)
    levels = await store.settle(below, (400,), 0.05)  # below empty all along: all of it back
    assert levels[0] == pytest.approx(-500 + 10 + 400, abs=10)

    full = (tokens("rf", rate=100, burst=1000),)
    assert (await store.acquire(full, 1, 0, None, guard(), costs=(300,))).granted
    await later(store, clock, 0.1)
    assert (await store.acquire(full, 1, 0, None, guard(), costs=(10,))).granted  # above half since
    await later(store, clock, 0.05)
    levels = await store.settle(full, (250,), 0.1)  # nothing back: it would have overflowed
    assert levels[0] == pytest.approx(700 + 15 - 10, abs=10)
