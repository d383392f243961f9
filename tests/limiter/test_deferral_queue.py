"""The deferral queue: callers refused together are told to come back one refill apart.

Same contract for memory:// (ManualClock) and redis:// (its own TIME, so the
assertions allow a few milliseconds of real time).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.store import BucketSpec, BucketStore

TOL = 0.05  # seconds of real time a Redis-backed assertion may drift
QUEUE = "test:{v}:q:default"


def bucket(key: str, rate: float, burst: float, scope: str = "global") -> BucketSpec:
    return BucketSpec(f"test:{{v}}:{key}", rate, burst, scope, key)  # type: ignore[arg-type]


async def test_callers_refused_together_get_slots_one_refill_apart(store: BucketStore) -> None:
    b = (bucket("g", rate=10, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE)).granted
    refused = [await store.acquire(b, 1, 0, QUEUE) for _ in range(5)]
    assert not any(r.granted for r in refused)
    # Every bucket could grant again after ~0.1 s: that is the real wait, for all of them.
    assert all(r.wait == pytest.approx(0.1, abs=TOL) for r in refused)
    # The hints are the queue's slots: the first at the real wait, then one refill (0.1 s) apart.
    hints = [r.hint for r in refused]
    assert hints[0] == pytest.approx(0.1, abs=TOL)
    for earlier, later in itertools.pairwise(hints):
        assert later - earlier == pytest.approx(0.1, abs=TOL)
    assert all(r.retry_after >= r.wait for r in refused)


async def test_callers_of_different_costs_are_each_told_when_their_own_cost_is_there(store: BucketStore) -> None:
    """A metered call's cost is its estimate, call by call (SPEC §14): a caller is told when
    the bucket will have refilled what the callers told before it take, and its own cost on
    top. Before, it was told when the one before it could go (its own cost left out): a
    caller costing more than the one before came back to a bucket short of it, was refused
    again, and lost its place (a metered defer used 83 % of the vendor's tokens)."""
    requests, tokens = bucket("r", rate=1000, burst=1000), bucket("m", rate=100, burst=100)
    assert (await store.acquire((requests, tokens), 1, 0, QUEUE, costs=(1, 100))).granted  # the meter: empty
    small = await store.acquire((requests, tokens), 1, 0, QUEUE, costs=(1, 50))
    large = await store.acquire((requests, tokens), 1, 0, QUEUE, costs=(1, 100))
    assert not small.granted and not large.granted
    assert small.hint == pytest.approx(0.5, abs=TOL)  # 50 tokens at 100/s
    assert large.hint == pytest.approx(1.5, abs=TOL)  # the 50 taken at 0.5 s, then its own 100


async def test_a_refusal_without_a_queue_is_told_the_real_wait(store: BucketStore) -> None:
    b = (bucket("s", rate=10, burst=1),)
    assert (await store.acquire(b, 1, 0)).granted
    for _ in range(3):
        r = await store.acquire(b, 1, 0)  # shed: no retry expected, so no slot taken
        assert not r.granted
        assert r.retry_after == pytest.approx(r.wait, abs=1e-6)
    # ...and taking no slot leaves the queue empty for the next deferred caller.
    assert (await store.acquire(b, 1, 0, QUEUE)).hint == pytest.approx(0.1, abs=TOL)


async def test_the_queue_takes_nothing_from_the_buckets(store: BucketStore) -> None:
    b = (bucket("n", rate=10, burst=2),)
    for _ in range(2):
        assert (await store.acquire(b, 1, 0, QUEUE)).granted
    for _ in range(20):
        assert not (await store.acquire(b, 1, 0, QUEUE)).granted
    (level,) = await store.peek(b)
    assert level == pytest.approx(0, abs=TOL * 10)  # refilled a little, never pushed below zero


async def test_slots_are_as_long_as_the_binding_bucket_refills(store: BucketStore) -> None:
    tenant = bucket("t", rate=2, burst=1, scope="tenant")  # 0.5 s a token: binds
    glob = bucket("g2", rate=100, burst=100)
    assert (await store.acquire((tenant, glob), 1, 0, QUEUE)).granted
    a, b = [await store.acquire((tenant, glob), 1, 0, QUEUE) for _ in range(2)]
    assert a.binding == b.binding == 0
    assert b.hint - a.hint == pytest.approx(0.5, abs=TOL)


async def test_a_flooding_tenant_pushes_only_its_own_queue(store: BucketStore) -> None:
    glob = bucket("gf", rate=10, burst=1)
    flood_t, quiet_t = (
        bucket("tf", rate=100, burst=100, scope="tenant"),
        bucket("tq", rate=100, burst=100, scope="tenant"),
    )
    assert (await store.acquire((flood_t, glob), 1, 0, "test:{v}:q:flood")).granted
    for _ in range(50):  # a flood of refusals: slots far into the future for the flooder...
        flood = await store.acquire((flood_t, glob), 1, 0, "test:{v}:q:flood")
    assert flood.hint > 4.0
    quiet = await store.acquire((quiet_t, glob), 1, 0, "test:{v}:q:quiet")
    assert not quiet.granted
    assert quiet.hint == pytest.approx(quiet.wait, abs=TOL)  # ...none for the other tenant


async def test_the_queue_forgets_itself_once_its_slots_have_passed(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("f", rate=20, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE)).granted
    for _ in range(4):
        await store.acquire(b, 1, 0, QUEUE)  # slots up to ~0.25 s out
    if isinstance(store, MemoryStore):
        await clock.advance(0.4)
    else:
        await asyncio.sleep(0.4)
    assert (await store.acquire(b, 1, 0, QUEUE)).granted  # the bucket refilled meanwhile
    r = await store.acquire(b, 1, 0, QUEUE)
    assert r.hint == pytest.approx(0.05, abs=TOL)  # a fresh queue: the first slot is the real wait


async def test_a_grant_that_finds_the_bucket_overflowed_starts_the_queue_again(
    store: BucketStore, clock: ManualClock
) -> None:
    """The queue's hints are a schedule nobody keeps to the letter: a settlement gives back
    what a metered call did not use, a caller takes tokens between two told ones. When the
    bucket fills and overflows while every caller told a slot sleeps, those tokens are lost
    (a metered defer used 89 % of the vendor's tokens, 7 % overflowing). A grant that finds
    the bucket overflowed starts the queue again: the next caller refused is told the real
    wait, not a slot behind callers the bucket has already outrun."""
    b = (bucket("o", rate=10, burst=2),)
    for _ in range(2):
        assert (await store.acquire(b, 1, 0, QUEUE)).granted
    told = [await store.acquire(b, 1, 0, QUEUE) for _ in range(20)]
    assert told[-1].hint > 1.5  # slots two seconds out
    if isinstance(store, MemoryStore):
        await clock.advance(0.5)
    else:
        await asyncio.sleep(0.5)
    # Full after 0.2 s, then overflowing: whoever asks now is granted, and finds it so.
    assert (await store.acquire(b, 1, 0, QUEUE)).granted
    assert (await store.acquire(b, 1, 0, QUEUE)).granted
    r = await store.acquire(b, 1, 0, QUEUE)
    assert not r.granted
    assert r.hint == pytest.approx(0.1, abs=TOL)  # the real wait: one token at 10/s


async def test_a_grant_below_a_full_bucket_keeps_the_queue(store: BucketStore, clock: ManualClock) -> None:
    """...and only then: a bucket granting before it fills has lost nothing, and the callers
    told before are still ahead of the next one."""
    b = (bucket("k", rate=10, burst=2),)
    for _ in range(2):
        assert (await store.acquire(b, 1, 0, QUEUE)).granted
    told = [await store.acquire(b, 1, 0, QUEUE) for _ in range(20)]
    if isinstance(store, MemoryStore):
        await clock.advance(0.12)
    else:
        await asyncio.sleep(0.12)
    assert (await store.acquire(b, 1, 0, QUEUE)).granted  # one token back, not yet full
    r = await store.acquire(b, 1, 0, QUEUE)
    assert not r.granted
    assert r.hint == pytest.approx(told[-1].hint - 0.12 + 0.1, abs=TOL)  # behind the last told
