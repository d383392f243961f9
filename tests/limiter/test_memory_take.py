"""memory://'s one-pass ``take`` (no leases, nothing learned: every straight-path request)
against its general arithmetic, which the store contract checks against Redis's scripts:
the same answers and the same state, step for step, over random demand."""

from __future__ import annotations

import random

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.store import AcquireResult, BucketSpec, Leases, StateGuard


def _buckets() -> tuple[BucketSpec, ...]:
    return (
        BucketSpec("t:{v}:tenant:a", 3.0, 2.0, "tenant", "tenant a"),
        BucketSpec("t:{v}:state", 5.0, 4.0, "global", "5/1s", field="g0"),
        BucketSpec("t:{v}:state", 50.0 / 60.0, 30.0, "global", "50/1m", field="g1"),
    )


def _general(store: MemoryStore, buckets: tuple[BucketSpec, ...], cost: float, wait: float, guard: StateGuard):
    # Leases with no set: the general branch's arithmetic with nothing to count.
    return store.take(buckets, cost, wait, "t:{v}:q", guard, Leases("x", 1.0, ()))


def _rounded(r: AcquireResult) -> tuple[object, ...]:
    return (r.granted, round(r.wait, 9), r.binding, tuple(round(x, 9) for x in r.levels), round(r.hint, 9), r.seq)


async def test_the_one_pass_take_answers_and_stores_what_the_general_one_does() -> None:
    rng = random.Random(11)
    buckets = _buckets()
    plain_clock, general_clock = ManualClock(), ManualClock()
    plain, general = MemoryStore(plain_clock), MemoryStore(general_clock)
    granted = refused = 0
    for step in range(3000):
        cost = rng.choice((1.0, 1.0, 1.0, 2.0))
        max_wait = rng.choice((0.0, 0.0, 0.2, 1.0))
        # the guard as the limiter makes it: the counter it last saw
        guard_p = StateGuard("t:{v}:state", plain._seq.get("t:{v}:state", (0, 0.0))[0], 0.5)
        guard_g = StateGuard("t:{v}:state", general._seq.get("t:{v}:state", (0, 0.0))[0], 0.5)
        a = plain.take(buckets, cost, max_wait, "t:{v}:q", guard_p)
        b = _general(general, buckets, cost, max_wait, guard_g)
        assert _rounded(a) == _rounded(b), step
        assert a.inflight == b.inflight == () and a.full == b.full == -1
        granted += a.granted
        refused += not a.granted
        assert plain._state.keys() == general._state.keys()
        for key, st in plain._state.items():
            assert [round(x, 9) for x in st] == [round(x, 9) for x in general._state[key]], (step, key)
        assert plain._queues == general._queues and plain._seq == general._seq
        dt = rng.choice((0.0, 0.0, 0.01, 0.05, 0.3, 2.0, 40.0))
        await plain_clock.advance(dt)
        await general_clock.advance(dt)
    assert granted > 300 and refused > 300  # both branches were exercised


async def test_a_learned_limit_takes_the_general_arithmetic() -> None:
    """While a vendor's headers have taught a lower rate, the one pass is not taken: the
    learned limit applies."""
    from proxy.limiter.store import Lesson

    clock = ManualClock()
    store = MemoryStore(clock)
    b = (BucketSpec("t:{v}:state", 100.0, 100.0, "global", "100/1s", field="g0"),)
    await store.learn(b, (Lesson(rate=1.0, burst=1.0, remaining=None, ttl=60.0, window=1.0),))
    assert store.take(b, 1.0, 0.0).granted
    refused = store.take(b, 1.0, 0.0)
    assert not refused.granted and refused.wait == 1.0
