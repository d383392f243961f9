"""Concurrency leases (SPEC §10): taken with the tokens in one step, given back, expiring.

Same contract for memory:// (ManualClock) and Redis (its own TIME, real short sleeps).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketSpec, BucketStore, Leases, LeaseSet

TOL = 0.05


def bucket(key: str, rate: float = 1000, burst: float = 1000) -> BucketSpec:
    return BucketSpec(f"test:{{v}}:{key}", rate, burst, "global", key)


def leases(lease_id: str, *sets: LeaseSet, life: float = 30.0) -> Leases:
    return Leases(lease_id, life, sets)


VENDOR = LeaseSet("test:{v}:c", 2, "concurrency 2")
SEARCH = LeaseSet("test:{v}:c:search", 1, "endpoint search concurrency 1")


async def advance(store: BucketStore, clock: ManualClock, seconds: float) -> None:
    if isinstance(store, MemoryStore):
        await clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


async def test_a_full_lease_set_refuses_and_takes_nothing(store: BucketStore) -> None:
    b = (bucket("lt", rate=0.001, burst=10),)
    first = await store.acquire(b, 1, 0, leases=leases("r1", VENDOR))
    second = await store.acquire(b, 1, 0, leases=leases("r2", VENDOR))
    assert first.granted and second.granted
    assert (first.inflight, second.inflight) == ((1,), (2,))
    third = await store.acquire(b, 1, 0, leases=leases("r3", VENDOR))
    assert not third.granted
    assert third.full == 0 and third.inflight == (2,)
    (level,) = await store.peek(b)
    assert level == pytest.approx(8, abs=0.01)  # the refused request took no token


async def test_a_release_frees_the_slot(store: BucketStore) -> None:
    b = (bucket("lr"),)
    for i in range(2):
        assert (await store.acquire(b, 1, 0, leases=leases(f"r{i}", VENDOR))).granted
    assert await store.release((VENDOR,), ("r0",), "") == (1,)
    assert (await store.acquire(b, 1, 0, leases=leases("r2", VENDOR))).granted
    assert await store.inflight((VENDOR,)) == (2,)
    assert await store.release((VENDOR,), ("nobody",), "") == (2,)  # unknown ids change nothing
    # Several at once (a loop turn's releases on one set): each given back, once.
    assert await store.release((VENDOR,), ("r1", "nobody", "r2"), "") == (0,)
    assert (await store.acquire(b, 1, 0, leases=leases("r3", VENDOR))).granted
    assert (await store.acquire(b, 1, 0, leases=leases("r4", VENDOR))).granted


async def test_every_set_must_have_room(store: BucketStore) -> None:
    b = (bucket("le"),)
    assert (await store.acquire(b, 1, 0, leases=leases("s1", SEARCH, VENDOR))).granted
    refused = await store.acquire(b, 1, 0, leases=leases("s2", SEARCH, VENDOR))
    assert not refused.granted and refused.full == 0  # the endpoint class is full...
    other = await store.acquire(b, 1, 0, leases=leases("o1", VENDOR))
    assert other.granted and other.inflight == (2,)  # ...the vendor's set still had room for one
    assert (await store.acquire(b, 1, 0, leases=leases("o2", VENDOR))).full == 0


async def test_leases_of_a_replica_that_died_expire(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("ld"),)
    for i in range(2):
        assert (await store.acquire(b, 1, 0, leases=leases(f"dead{i}", VENDOR, life=0.2))).granted
    assert (await store.acquire(b, 1, 0, leases=leases("x", VENDOR))).full == 0
    await advance(store, clock, 0.3)  # nobody released: the leases ran out
    assert (await store.acquire(b, 1, 0, leases=leases("alive", VENDOR))).granted
    assert await store.inflight((VENDOR,)) == (1,)


async def test_a_renewed_lease_outlives_its_first_life(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("ln"),)
    assert (await store.acquire(b, 1, 0, leases=leases("long", VENDOR, life=0.2))).granted
    await advance(store, clock, 0.1)
    assert await store.renew(((VENDOR, "long"), (VENDOR, "gone")), 0.5) == 1
    await advance(store, clock, 0.2)
    assert await store.inflight((VENDOR,)) == (1,)  # would have expired without the renewal


async def test_a_lease_lives_through_its_hold(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("lh", rate=5, burst=1),)
    assert (await store.acquire(b, 1, 0)).granted
    held = await store.acquire(b, 1, 1.0, leases=leases("held", VENDOR, life=0.1))
    assert held.granted and held.wait == pytest.approx(0.2, abs=TOL)
    await advance(store, clock, 0.25)  # past life, not past the reservation's maturity + life
    assert await store.inflight((VENDOR,)) == (1,)


async def test_releases_are_announced_to_other_replicas(redis_url: str) -> None:
    a, b = RedisStore(redis_url, 1.0), RedisStore(redis_url, 1.0)
    heard: asyncio.Queue[tuple[str, ...]] = asyncio.Queue()
    watch = asyncio.ensure_future(
        b.watch("test:{v}:released*", lambda _channel, data: heard.put_nowait(tuple(data.split())))
    )
    try:
        # The subscription is in place once a probe announcement gets through.
        while True:
            await a.client.publish("test:{v}:released", "probe")
            try:
                assert await asyncio.wait_for(heard.get(), 0.2) == ("probe",)
                break
            except TimeoutError:
                continue
        # Only a set that was full can have requests waiting for it: the class (cap 1) is
        # announced, the vendor's set (1 of 2) is not.
        assert (await a.acquire((bucket("la"),), 1, 0, leases=leases("r", VENDOR, SEARCH))).granted
        await a.release((VENDOR, SEARCH), ("r",), "test:{v}:released")
        assert await asyncio.wait_for(heard.get(), 5.0) == (SEARCH.key,)
        # A release that leaves no set with room it lacked says nothing at all: the next
        # message heard is the probe published after it.
        assert (await a.acquire((bucket("la"),), 1, 0, leases=leases("s", VENDOR))).granted
        await a.release((VENDOR,), ("s",), "test:{v}:released")
        await a.client.publish("test:{v}:released", "after")
        assert await asyncio.wait_for(heard.get(), 5.0) == ("after",)
        # Both of the vendor's slots taken, one given back: announced.
        for lease in ("t1", "t2"):
            assert (await a.acquire((bucket("la"),), 1, 0, leases=leases(lease, VENDOR))).granted
        await a.release((VENDOR,), ("t1",), "test:{v}:released")
        assert await asyncio.wait_for(heard.get(), 5.0) == (VENDOR.key,)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await a.close()
        await b.close()


async def test_a_lease_set_keeps_whole_ms_and_outlives_its_last_lease(redis_url: str) -> None:
    # Whole ms: a small sorted set keeps fractional scores as text in a listpack, parsed
    # again at every comparison (ZADD several times slower). The set's TTL is only
    # extended: a lease granted later with a shorter life never shortens it.
    store = RedisStore(redis_url, 1.0)
    try:
        b = (bucket("lw"),)
        lease_set = LeaseSet("test:{v}:c:whole", 5, "concurrency 5")
        assert (await store.acquire(b, 1, 0, leases=leases("long", lease_set, life=20.0))).granted
        assert (await store.acquire(b, 1, 0, leases=leases("short", lease_set, life=0.5))).granted
        scores: Any = await store.client.zrange(lease_set.key, 0, -1, withscores=True)
        assert [name for name, _ in scores] == [b"short", b"long"]
        assert all(score == int(score) for _, score in scores)
        assert await store.client.object("encoding", lease_set.key) == b"listpack"
        assert await store.client.pttl(lease_set.key) > 20_000
        assert await store.release((lease_set,), ("long",), "") == (1,)
        assert await store.renew(((lease_set, "short"),), 0.2) == 0  # GT: never shortened
        assert await store.client.pttl(lease_set.key) > 19_000
    finally:
        await store.close()
