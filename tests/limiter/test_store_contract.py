"""One contract, three stores: every assertion here holds for memory://, redis:// and
redis+cluster://, the Redis ones on each of RedisStore's acquire paths (the ``store``
fixture's params: "redis", the pipelined connection of redis:// and rediss://; "redis-py",
redis-py's client; "cluster", one pipelined connection per primary of a real three-node
Redis Cluster), so the paths cannot drift apart.

The memory store runs on a ManualClock; Redis runs on its own TIME, so time is
moved with real (short) sleeps there, and assertions allow for the few
milliseconds a real round trip takes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketSpec, BucketStore, Lesson

TOL = 0.05  # seconds of real time a Redis-backed assertion may drift


def bucket(key: str, rate: float, burst: float, scope: str = "global") -> BucketSpec:
    return BucketSpec(f"test:{{v}}:{key}", rate, burst, scope, key)  # type: ignore[arg-type]


async def advance(store: BucketStore, clock: ManualClock, seconds: float) -> None:
    if isinstance(store, MemoryStore):
        await clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


@pytest.fixture(params=["memory", "redis", "redis-py", "cluster"])
async def store(request: pytest.FixtureRequest, clock: ManualClock) -> AsyncIterator[BucketStore]:
    """The shared ``store`` fixture's stores, and redis+cluster:// on the session's cluster."""
    if request.param == "memory":
        s: BucketStore = MemoryStore(clock)
    elif request.param == "cluster":
        s = RedisStore(request.getfixturevalue("cluster_url"), timeout=1.0)
        # redis-py's cluster client (block, peek, learn...) learns the slots and connects to
        # every node on its first call: before the test, not inside its timed steps.
        await s.ping()
    else:
        s = RedisStore(request.getfixturevalue("redis_url"), timeout=1.0, pipelined=request.param == "redis")
    yield s
    await s.close()


@pytest.mark.parametrize(
    ("url", "pipelined"),
    [("redis_url", True), ("redis_url", False), ("cluster_url", True), ("cluster_url", False)],
    ids=["redis", "redis-py", "cluster", "cluster-redis-py"],
)
async def test_the_redis_params_take_different_acquire_paths(
    url: str, pipelined: bool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # What makes the fixture's Redis params different paths: only "redis-py" acquires with
    # redis-py's EVALSHA. Were they on one path, the suite would test it twice.
    store = RedisStore(request.getfixturevalue(url), timeout=1.0, pipelined=pipelined)
    through_redis_py: list[object] = []
    evalsha = store.client.evalsha

    def spy(*args: Any) -> Any:
        through_redis_py.append(args)
        return evalsha(*args)

    monkeypatch.setattr(store.client, "evalsha", spy)
    try:
        assert (await store.acquire((bucket("path", rate=1, burst=1),), 1, 0)).granted
    finally:
        await store.close()
    assert len(through_redis_py) == (0 if pipelined else 1)


async def test_fresh_bucket_grants_its_burst_then_refuses(store: BucketStore) -> None:
    b = (bucket("a", rate=1, burst=3),)
    grants = [await store.acquire(b, 1, 0) for _ in range(3)]
    assert all(r.granted and r.wait == 0 for r in grants)
    assert [round(r.levels[0]) for r in grants] == [2, 1, 0]
    refused = await store.acquire(b, 1, 0)
    assert not refused.granted
    assert refused.binding == 0
    assert refused.wait == pytest.approx(1.0, abs=TOL)


async def test_refusal_takes_nothing_from_any_bucket(store: BucketStore) -> None:
    tenant = bucket("t", rate=0.001, burst=5, scope="tenant")
    glob = bucket("g", rate=0.001, burst=2)
    both = (tenant, glob)
    assert (await store.acquire(both, 1, 0)).granted
    assert (await store.acquire(both, 1, 0)).granted
    for _ in range(20):
        r = await store.acquire(both, 1, 0)
        assert not r.granted
        assert r.binding == 1  # the global bucket refused
    levels = await store.peek(both)
    assert levels[0] == pytest.approx(3, abs=0.01)  # the tenant paid only for the two grants
    assert levels[1] == pytest.approx(0, abs=0.01)


async def test_holds_are_reservations_paced_one_interval_apart(store: BucketStore) -> None:
    b = (bucket("h", rate=10, burst=1),)
    waits = []
    for _ in range(4):
        r = await store.acquire(b, 1, 0.35)
        assert r.granted
        waits.append(r.wait)
    assert waits[0] == 0
    for expected, got in zip([0.1, 0.2, 0.3], waits[1:], strict=True):
        assert got == pytest.approx(expected, abs=TOL)
    refused = await store.acquire(b, 1, 0.35)
    assert not refused.granted
    assert refused.wait == pytest.approx(0.4, abs=TOL)


async def test_every_window_binds(store: BucketStore, clock: ManualClock) -> None:
    per_second = bucket("s", rate=10, burst=2)
    per_minute = bucket("m", rate=3 / 60, burst=3)
    both = (per_second, per_minute)
    assert (await store.acquire(both, 1, 0)).granted
    assert (await store.acquire(both, 1, 0)).granted
    r = await store.acquire(both, 1, 0)
    assert not r.granted and r.binding == 0  # the per-second bucket is empty first
    await advance(store, clock, 0.25)
    assert (await store.acquire(both, 1, 0)).granted  # per-second refilled; third of the minute
    await advance(store, clock, 0.25)
    r = await store.acquire(both, 1, 0)
    assert not r.granted and r.binding == 1  # now the per-minute bucket binds
    assert r.wait == pytest.approx((1 - 0.5 * 3 / 60) * 20, abs=0.05)  # 19.5 s


async def test_refill_is_linear_and_capped_at_burst(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("r", rate=20, burst=4),)
    for _ in range(4):
        assert (await store.acquire(b, 1, 0)).granted
    await advance(store, clock, 0.1)
    (level,) = await store.peek(b)
    assert level == pytest.approx(2, abs=20 * TOL)
    await advance(store, clock, 1.0)
    assert await store.peek(b) == (4,)


async def test_block_grants_nothing_then_refills_from_empty(store: BucketStore, clock: ManualClock) -> None:
    def now() -> float:  # (Redis: real time, which a loaded machine stretches past a sleep)
        return clock.monotonic() if isinstance(store, MemoryStore) else asyncio.get_running_loop().time()

    b = (bucket("blk", rate=20, burst=10),)
    began = now()
    result = await store.block(b, 0.3, "")
    assert result.until == pytest.approx(0.3, abs=0.001)
    r = await store.acquire(b, 1, 0)
    assert not r.granted
    assert r.wait == pytest.approx(0.3 + 1 / 20, abs=TOL)
    await advance(store, clock, 0.3)
    (level,) = await store.peek(b)
    # No burst at the edge: the bucket starts from empty when the block ends, and has
    # refilled since by no more than the time since then (10 at once with a burst).
    assert -0.5 <= level <= 20 * (max(now() - began - 0.3, 0.0) + TOL)
    await advance(store, clock, 0.2)
    (level,) = await store.peek(b)
    assert level == pytest.approx(min(20 * (now() - began - 0.3), 10), abs=20 * TOL)


async def test_block_keeps_reservations_already_made(store: BucketStore) -> None:
    b = (bucket("res", rate=10, burst=1),)
    for _ in range(6):
        assert (await store.acquire(b, 1, 1.0)).granted  # reserves up to 0.5 s ahead
    result = await store.block(b, 0.1, "")
    # The block lasts until the reservations have matured, not just 0.1 s.
    assert result.until == pytest.approx(0.5, abs=TOL)


async def test_drain_empties_but_refills_normally(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("dr", rate=10, burst=10),)
    assert (await store.drain(b)).levels == (0,)
    assert not (await store.acquire(b, 1, 0)).granted
    await advance(store, clock, 0.3)
    (level,) = await store.peek(b)
    assert level == pytest.approx(3, abs=10 * TOL)


async def test_drain_keeps_reservations(store: BucketStore) -> None:
    b = (bucket("drr", rate=10, burst=1),)
    for _ in range(3):
        assert (await store.acquire(b, 1, 1.0)).granted
    (level,) = (await store.drain(b)).levels
    assert level == pytest.approx(-2, abs=10 * TOL)


async def test_peek_takes_nothing(store: BucketStore) -> None:
    b = (bucket("p", rate=0.001, burst=2),)
    for _ in range(5):
        assert await store.peek(b) == (2,)
    assert (await store.acquire(b, 1, 0)).granted


async def test_keys_expire_once_refilled(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("ttl", rate=10, burst=2),)
    assert (await store.acquire(b, 1, 0)).granted
    if isinstance(store, MemoryStore):
        ttl = store.ttl(b[0].key)
        assert ttl == pytest.approx(0.1 + 1.0)
        await clock.advance(1.2)
        assert len(store) == 0
    else:
        assert isinstance(store, RedisStore)
        pttl = await store.client.pttl(b[0].key)
        assert 1000 < pttl <= 1100
        await asyncio.sleep(1.2)
        assert await store.client.exists(b[0].key) == 0


# -- learned limits (feedback.lua, mode "learn") ----------------------------------------------


def state_bucket(name: str, rate: float, burst: float) -> BucketSpec:
    """A global bucket as the limiter lays them out: fields of the vendor's state hash."""
    return BucketSpec("test:{v}:state", rate, burst, "global", name, field=f"g:{name}")


async def test_a_learned_rate_and_burst_apply_until_forgotten(store: BucketStore, clock: ManualClock) -> None:
    b = (state_bucket("l", rate=100, burst=10),)
    learned = await store.learn(b, (Lesson(rate=10, burst=2, window=1.0, ttl=60),))
    assert (learned.rates, learned.bursts) == ((10,), (2,))
    assert learned.levels[0] <= 2  # the burst shrank with it
    assert [(await store.acquire(b, 1, 0)).granted for _ in range(3)] == [True, True, False]
    refused = await store.acquire(b, 1, 0)
    assert refused.wait == pytest.approx(0.1, abs=TOL)  # refills at the learned 10/s, not 100/s
    forgot = await store.learn(b, (Lesson(forget=True),))
    assert (forgot.rates, forgot.bursts) == ((100,), (10,))
    assert forgot.levels[0] <= 0.5  # forgetting never raises the level ...
    await advance(store, clock, 0.05)
    (level,) = await store.peek(b)
    assert level == pytest.approx(5, abs=100 * TOL)  # ... it refills at the policy's rate again


async def test_a_learned_limit_never_loosens_the_policy(store: BucketStore) -> None:
    # A slow refill (one token per 100 s): on Redis' clock the eleven calls take time, and at
    # 100/s a loaded machine refilled a token between them.
    b = (state_bucket("loose", rate=0.01, burst=10),)
    learned = await store.learn(b, (Lesson(rate=0.05, burst=50, window=1.0),))
    assert (*learned.rates, *learned.bursts, *learned.levels) == pytest.approx((0.01, 10, 10), abs=1e-3)
    grants = [(await store.acquire(b, 1, 0)).granted for _ in range(11)]
    assert grants.count(True) == 10


async def test_remaining_lowers_the_level_and_never_raises_it(store: BucketStore) -> None:
    b = (state_bucket("rem", rate=0.001, burst=10),)
    # Redis' own clock moves between the calls: the level refills at 0.001/s meanwhile.
    assert (await store.learn(b, (Lesson(remaining=3),))).levels == pytest.approx((3,), abs=1e-3)
    assert (await store.learn(b, (Lesson(remaining=8),))).levels == pytest.approx((3,), abs=1e-3)
    grants = [(await store.acquire(b, 1, 0)).granted for _ in range(4)]
    assert grants == [True, True, True, False]


async def test_a_lower_rate_settles_for_one_vendor_window(store: BucketStore, clock: ManualClock) -> None:
    # Requests granted at the policy's 100/s stay in the vendor's count for its window: until
    # it has passed, the bucket grants only what the vendor says remains beyond what the
    # learned 10/s grants meanwhile (2 - 10 x 0.4 s).
    b = (state_bucket("set", rate=100, burst=10),)
    first = await store.learn(b, (Lesson(rate=10, burst=2, remaining=2, window=0.4),))
    assert first.settling[0] == pytest.approx(0.4, abs=TOL)
    assert first.levels[0] == pytest.approx(-2, abs=10 * TOL)
    await advance(store, clock, 0.2)
    again = await store.learn(b, (Lesson(rate=10, burst=2, remaining=1, window=0.4),))
    assert again.settling[0] == pytest.approx(0.2, abs=TOL)  # the same rate starts no new settling
    assert again.levels[0] == pytest.approx(-1, abs=10 * TOL)  # min(-2 + 2, 1 - 10 x 0.2)
    await advance(store, clock, 0.25)
    settled = await store.learn(b, (Lesson(rate=10, burst=2, remaining=1, window=0.4),))
    assert settled.settling == (0,)
    assert settled.levels[0] == pytest.approx(1, abs=10 * TOL)  # then only `remaining` caps


async def test_learned_limits_expire_unless_learned_again(store: BucketStore, clock: ManualClock) -> None:
    b = (state_bucket("exp", rate=100, burst=10),)
    await store.learn(b, (Lesson(rate=10, burst=2, window=0.1, ttl=0.2),))
    await advance(store, clock, 0.25)
    kept = await store.learn(b, (Lesson(),))  # nothing new: what is in force now
    assert (kept.rates, kept.bursts) == ((100,), (10,))
    assert kept.levels[0] == pytest.approx(10)


async def test_a_block_under_a_learned_rate_refills_at_it(store: BucketStore, clock: ManualClock) -> None:
    b = (state_bucket("blr", rate=100, burst=10),)
    await store.learn(b, (Lesson(rate=10, burst=2, window=1.0),))
    assert (await store.block(b, 0.1, "")).until == pytest.approx(0.1, abs=0.001)
    await advance(store, clock, 0.2)
    (level,) = await store.peek(b)
    assert level == pytest.approx(1, abs=10 * TOL)  # 0.1 s at 10/s after the block


async def test_reservations_keep_their_places_when_the_rate_rises(store: BucketStore) -> None:
    # Three grants at a learned 10/s burst 1: now, in 0.1 s and in 0.2 s. The vendor then
    # allows the policy's 100/s: new grants come after those reservations, not between them.
    b = (state_bucket("keep", rate=100, burst=10),)
    await store.learn(b, (Lesson(rate=10, burst=1, window=1.0),))
    waits = [(await store.acquire(b, 1, 1.0)).wait for _ in range(3)]
    assert waits == [0, pytest.approx(0.1, abs=TOL), pytest.approx(0.2, abs=TOL)]
    await store.learn(b, (Lesson(forget=True),))
    after = await store.acquire(b, 1, 1.0)
    assert after.wait == pytest.approx(0.21, abs=TOL)


async def test_the_state_outlives_what_it_learned(redis_url: str) -> None:
    store = RedisStore(redis_url, timeout=1.0)
    b = (state_bucket("ttl", rate=100, burst=10),)
    try:
        await store.learn(b, (Lesson(rate=10, burst=2, window=1.0, ttl=120),))
        assert (await store.acquire(b, 1, 0)).granted  # an acquire never shortens the hash's life
        assert 119_000 < await store.client.pttl(b[0].key) <= 121_000
    finally:
        await store.close()


# -- the replica set (presence.lua) ---------------------------------------------------------


async def test_replicas_announce_themselves_and_silent_ones_stop_counting(
    store: BucketStore, clock: ManualClock
) -> None:
    key, stale = "test:replicas", 0.3
    assert await store.announce(key, "a", stale) == 1
    assert await store.announce(key, "b", stale) == 2
    assert await store.announce(key, "a", stale) == 2  # again: still one member
    await advance(store, clock, 0.2)
    assert await store.announce(key, "a", stale) == 2
    await advance(store, clock, 0.2)  # b silent for 0.4 s > stale
    assert await store.announce(key, "a", stale) == 1
    assert await store.announce(key, "a", stale, leave=True) == 0


async def test_the_replica_set_expires_when_everyone_is_silent(redis_url: str) -> None:
    store = RedisStore(redis_url, timeout=1.0)
    try:
        assert await store.announce("test:replicas", "a", 0.5) == 1
        ttl = await store.client.pttl("test:replicas")
        assert 0 < ttl <= 500
    finally:
        await store.close()
