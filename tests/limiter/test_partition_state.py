"""Partitions in the limiter (SPEC §10): per-partition state hashes, blocks told apart on
the block channel, lost-state detection per partition, bounded per-state memories, and
local shares per partition; the default partition keeps the keys of a vendor without one."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

import proxy.limiter.limiter as limiter_module
from proxy.clock import ManualClock, SystemClock
from proxy.limiter import Breaker, Limiter
from proxy.limiter.buckets import (
    block_channel,
    block_channel_pattern,
    global_buckets,
    partition_of_channel,
    state_key,
    vendor_of_channel,
)
from proxy.limiter.degraded import LocalShares, grace_for
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.partitions import RecentPartitions, partition_hash
from proxy.limiter.presence import Presence
from proxy.limiter.redis_store import RedisStore
from proxy.policy.model import Endpoint, EndpointMatch, Limit, OnLimit, Partition, TenantLimits, Vendor
from tests.helpers.stores import FlakyStore

PREFIX = "qp-parts"
A = partition_hash("Bearer sk_live_A")
B = partition_hash("Bearer sk_live_B")
SEARCH = Endpoint("search", EndpointMatch(), (Limit(5, 3600, 5),))


def payments(rate: float = 3, per: float = 3600, burst: float = 3, max_hold: float = 0.5) -> Vendor:
    return Vendor(
        name="payments",
        limits=(Limit(rate, per, burst),),
        tenant_limits=TenantLimits(default=(Limit(1000, 1, 1000),)),
        on_limit=OnLimit("hold", max_hold),
        partition=Partition("Authorization"),
        endpoints=(SEARCH,),
    )


@pytest.fixture
async def stores() -> AsyncIterator[Callable[[str], RedisStore]]:
    made: list[RedisStore] = []

    def make(url: str) -> RedisStore:
        made.append(RedisStore(url, timeout=5.0))
        return made[-1]

    yield make
    for s in made:
        await s.close()


def on(store: Any, clock: Any = None) -> Limiter:
    clock = clock or SystemClock()
    return Limiter(store, clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))


async def wait_for(condition: Callable[[], Any], what: str, deadline: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while True:
        ok = condition()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        if loop.time() > end:
            raise AssertionError(f"not within {deadline}s: {what}")
        await asyncio.sleep(0.01)


def test_the_hash_is_sha256_hex_16_and_keys_name_only_it() -> None:
    assert hashlib.sha256(b"Bearer sk_live_A").hexdigest()[:16] == A
    assert state_key(PREFIX, "payments", A) == f"{PREFIX}:{{payments}}:p:{A}:state"
    assert state_key(PREFIX, "payments", "") == f"{PREFIX}:{{payments}}:state"  # the default: as always
    channel = block_channel(PREFIX, "payments", A)
    assert channel == f"{PREFIX}:{{payments}}:block:{A}"
    assert (vendor_of_channel(channel), partition_of_channel(channel)) == ("payments", A)
    default = block_channel(PREFIX, "payments")
    assert (vendor_of_channel(default), partition_of_channel(default)) == ("payments", "")
    assert block_channel_pattern(PREFIX) == f"{PREFIX}:{{*}}:block*"


def test_a_request_of_the_default_partition_uses_the_keys_of_a_vendor_without_partitions() -> None:
    clock = ManualClock()
    limiter = on(MemoryStore(clock), clock)
    plain = Vendor(name="payments", limits=(Limit(3, 3600, 3),), tenant_limits=payments().tenant_limits)
    b = limiter.buckets(payments(), "acme")
    assert b == limiter.buckets(plain, "acme")  # the same buckets, keys, queue and state
    assert b.state_key == state_key(PREFIX, "payments")
    assert b.queue == f"{PREFIX}:{{payments}}:q:acme"
    part = limiter.buckets(payments(), "acme", SEARCH, A)
    assert part.all[0] == b.all[0]  # the tenant's bucket is per tenant, not per partition
    assert {x.key for x in part.all[1:]} == {state_key(PREFIX, "payments", A)}
    assert part.queue == f"{PREFIX}:{{payments}}:q:acme/p/{A}/e/search"


async def test_each_partition_has_the_whole_quota_on_redis(redis_url: str, stores) -> None:
    limiter = on(stores(redis_url))
    v = payments()
    for part in (A, B, ""):
        granted = [(await limiter.acquire(v, "acme", 0, partition=part)).granted for _ in range(4)]
        assert granted == [True, True, True, False], part
    raw = aioredis.from_url(redis_url)
    try:
        keys = {k.decode() async for k in raw.scan_iter(f"{PREFIX}:*")}
    finally:
        await raw.aclose()
    assert {state_key(PREFIX, "payments", p) for p in (A, B, "")} <= keys
    assert not [k for k in keys if "sk_live" in k]


async def test_a_block_is_one_partitions_and_announced_as_such(redis_url: str, stores) -> None:
    a, b = on(stores(redis_url)), on(stores(redis_url))
    raw = aioredis.from_url(redis_url)
    watcher = asyncio.ensure_future(b.watch_blocks())
    try:
        await wait_for(lambda: raw.pubsub_numpat(), "the replica's block subscription")
        v = payments(rate=100, per=1)
        mark_a, mark_default = b.mark("payments", A), b.mark("payments")
        assert await a.block(v, 3.0, partition=A) == pytest.approx(3.0, abs=0.01)
        await wait_for(lambda: b.blocked_for("payments", A) > 0, "the block announcement")
        assert 2.0 < b.blocked_for("payments", A) <= 3.0
        assert b.blocked_since("payments", mark_a, A) > 2.0  # A's held requests stay in
        assert b.blocked_for("payments") == b.blocked_for("payments", B) == 0
        assert b.blocked_since("payments", mark_default) == 0  # the default partition's go out
        assert not (await b.acquire(v, "acme", 0, partition=A)).granted
        assert (await b.acquire(v, "acme", 0, partition=B)).granted
        assert (await b.acquire(v, "acme", 0)).granted
        assert b.partitions_blocked("payments") == 1
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
        await raw.aclose()


async def test_a_drain_empties_one_partition(redis_url: str, stores) -> None:
    limiter = on(stores(redis_url))
    v = payments()
    await limiter.drain(v, partition=A)
    assert not (await limiter.acquire(v, "acme", 0, partition=A)).granted
    assert (await limiter.acquire(v, "acme", 0, partition=B)).granted


async def test_a_lost_partition_state_is_noticed_for_that_partition(redis_url: str, stores) -> None:
    store = stores(redis_url)
    limiter = on(store)
    v = payments(rate=50, per=1, burst=5, max_hold=1.0)
    for part in (A, ""):
        while (await limiter.acquire(v, "acme", 1.0, partition=part)).granted:
            pass  # the burst and a second of reservations
    assert await store.client.delete(state_key(PREFIX, "payments", A)) == 1  # e.g. evicted
    after = await limiter.acquire(v, "acme", 0, partition=A)
    assert after.lost and not after.granted  # read full, it would have granted
    assert not (await limiter.acquire(v, "acme", 0)).lost  # the default partition's state is whole


async def test_per_state_memories_stay_bounded_with_many_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limiter_module, "_STATES_MAX", 20)
    clock = ManualClock()
    limiter = on(MemoryStore(clock), clock)
    v = payments(rate=1000, per=1, burst=1000)
    for i in range(200):
        part = partition_hash(f"token {i}")
        assert (await limiter.acquire(v, "acme", 0, partition=part)).granted
        await limiter.block(v, 0.05, partition=part)
        await clock.advance(0.01)
    assert len(limiter._seen) <= 20
    assert len(limiter._observed_parts) <= 20
    # Blocks that ended are forgotten; running ones are kept (each is a vendor 429 within
    # its Retry-After, at most feedback.max_retry_after ago).
    assert len(limiter._blocked_until) <= 21 and len(limiter._block_generation) <= 21
    assert limiter.blocked_for("payments", part) > 0  # the latest block is kept


async def test_memory_store_forgets_the_counters_of_idle_partitions() -> None:
    """memory:// kept one grant counter per state key forever: one per partition ever
    seen. Like the state hash on Redis, a counter now goes when its buckets have refilled."""
    clock = ManualClock()
    store = MemoryStore(clock)
    limiter = on(store, clock)
    v = payments(rate=100, per=1, burst=100)
    for i in range(300):
        assert (await limiter.acquire(v, "acme", 0, partition=partition_hash(f"token {i}"))).granted
    assert len(store._seq) == 300
    await clock.advance(60.0)  # every bucket refilled long ago: the states expired
    assert len(store) == 0
    assert len(store._seq) == 0
    assert (await limiter.acquire(v, "acme", 0, partition=partition_hash("token 0"))).granted


async def test_recent_partitions_count_saturates_and_forgets() -> None:
    clock = ManualClock()
    recent = RecentPartitions(clock, limit=3)
    for p in ("", A, B, "x", "y"):
        recent.note("payments", p)
    assert recent.count("payments") == 3  # at least 3: saturated, memory bounded
    assert recent.count("crm") == 0
    await clock.advance(recent.window + 1)
    recent.note("payments", A)
    assert recent.count("payments") == 1


async def test_local_shares_are_kept_and_charged_per_partition() -> None:
    """store.on_failure: local: each partition's global share decides its requests alone, a
    block of one partition stays there, and each partition's shared buckets are charged."""
    clock = ManualClock()
    shared = FlakyStore(clock)
    local = LocalShares(clock, Presence(clock), grace_for(1.0, 0.05))
    limiter = Limiter(shared, clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0), local=local)
    announcing = asyncio.ensure_future(limiter.announce())
    try:
        await clock.advance(0)
        for _ in range(5):
            await asyncio.sleep(0)
        v = payments(rate=10, per=1, burst=10)
        await clock.advance(2.0)
        shared.fail = True
        for part in (A, B):  # a partition's share starts empty when first asked for
            assert not (await limiter.acquire(v, "acme", 0, endpoint=SEARCH, partition=part)).granted
        await clock.advance(0.5)  # each share (one replica: the whole) refills 5
        for part in (A, B):
            granted = [(await limiter.acquire(v, "acme", 0, partition=part)).granted for _ in range(6)]
            assert granted == [True] * 5 + [False], part
        await clock.advance(0.3)
        await limiter.block(v, 5.0, partition=A)
        assert not (await limiter.acquire(v, "acme", 0, partition=A)).granted
        assert (await limiter.acquire(v, "acme", 0, partition=B)).granted
        assert {p for _, p in local.owing()} == {A, B}
        shared.fail = False
        await clock.advance(1.0)
        assert (await limiter.acquire(v, "acme", 0, partition=B)).granted  # the charge, then both grant
        assert local.current() == "recovering" and local.owing() == []
        (a_level,) = await shared.peek(global_buckets(PREFIX, v, A))
        (b_level,) = await shared.peek(global_buckets(PREFIX, v, B))
        # Each partition's shared buckets are charged with what its own share still owes:
        # A's (blocked, never refilled) the 5 it granted alone; B's share had refilled
        # (nothing owed), so B's bucket has only this last grant taken.
        assert (a_level, b_level) == (pytest.approx(5.0, abs=1e-6), pytest.approx(9.0, abs=1e-6))
    finally:
        announcing.cancel()
        await asyncio.gather(announcing, return_exceptions=True)
