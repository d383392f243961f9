"""memory://'s one-pass ``take`` (no leases, nothing learned: every straight-path request)
against its general arithmetic, which the store contract checks against Redis's scripts:
the same answers and the same state, step for step, over random demand."""

from __future__ import annotations

import random

import pytest

from proxy.clock import ManualClock
from proxy.limiter.buckets import FIRST_COME, METERED_MEMBER
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.share import share_ask
from proxy.limiter.store import AcquireResult, BucketSpec, Leases, Reserve, StateGuard
from proxy.policy.model import Share


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


def _schedules(store: MemoryStore) -> dict[str, tuple[object, ...]]:
    """The store's schedules as what they decide by (not when last touched); an empty one
    is none (``Schedules.of`` makes an empty one where none is)."""
    out: dict[str, tuple[object, ...]] = {}
    for key, s in store._schedules._all.items():
        seen = (s.waiting, s.tags, s.weights, s.busy, s.credit, s.credited, s.ends)
        if any(any(x) for x in seen[:5]) or s.ends or any(c is not None for c in s.credited):
            out[key] = tuple(repr(x) for x in seen)
    return out


@pytest.mark.parametrize("weighted", [False, True], ids=["first-come", "weighted"])
async def test_a_grant_at_once_under_a_schedule_and_kept_slots_is_the_general_ones(weighted: bool) -> None:
    """A deferring (kept slots) metered call under its vendor's schedule (first come, or a
    weighted share with two classes) is granted in one pass when nothing is kept, no one
    waits and it need not wait: the same answers and the same state, step for step, as the
    general arithmetic (holds, kept slots, claims and turns taken there) over random demand."""
    rng = random.Random(5)
    share = Share(weights=(("a", 1.0), ("b", 3.0)), classes=("high", "low")) if weighted else FIRST_COME
    tenants = ("a", "b") if weighted else (METERED_MEMBER,)
    buckets = {
        t: (
            BucketSpec(f"t:{{v}}:tenant:{t}", 4.0, 3.0, "tenant", f"tenant {t}"),
            BucketSpec("t:{v}:state", 5.0, 4.0, "global", "5/1s", field="g0"),
            BucketSpec("t:{v}:state", 400.0, 800.0, "global", "400/1s", field="m0"),
        )
        for t in tenants
    }
    one_clock, general_clock = ManualClock(), ManualClock()
    one, general = MemoryStore(one_clock), MemoryStore(general_clock)
    claims: dict[str, str] = {}
    at_once = granted = refused = kept = 0
    for step in range(3000):
        tenant = rng.choice(tenants)
        klass = rng.choice((0, 1)) if weighted else 0
        ask = share_ask(share, "t:{v}:state", tenant, klass, 1, metered=1)
        costs = (1.0, 1.0, float(rng.choice((10, 50, 200))))
        max_wait = rng.choice((0.0, 0.0, 0.2, 1.0))
        claim = claims.pop(tenant, "") if rng.random() < 0.7 else ""
        reserve = Reserve(f"t:{{v}}:r:{tenant}", claim, 0.5, tenants=1)
        queue = f"t:{{v}}:q:{tenant}"
        quiet = not claim and not one._kept.get(reserve.key) and one._schedules.quiet(ask, one_clock.monotonic())
        guard_o = StateGuard("t:{v}:state", one._seq.get("t:{v}:state", (0, 0.0))[0], 0.5)
        guard_g = StateGuard("t:{v}:state", general._seq.get("t:{v}:state", (0, 0.0))[0], 0.5)
        a = one.take(buckets[tenant], 1.0, max_wait, queue, guard_o, None, reserve, ask, costs)
        b = general.take(buckets[tenant], 1.0, max_wait, queue, guard_g, Leases("x", 1.0, ()), reserve, ask, costs)
        assert _rounded(a) == _rounded(b) and a.reserved == b.reserved and a.claimed == b.claimed, step
        at_once += quiet and a.granted and a.wait == 0
        granted += a.granted
        refused += not a.granted
        kept += bool(a.reserved)
        if a.reserved:
            claims[tenant] = a.reserved
        assert one._state.keys() == general._state.keys()
        for key, st in one._state.items():
            assert [round(x, 9) for x in st] == [round(x, 9) for x in general._state[key]], (step, key)
        assert one._queues == general._queues and one._seq == general._seq
        assert {k: v for k, v in one._kept.items() if v} == {k: v for k, v in general._kept.items() if v}, step
        assert _schedules(one) == _schedules(general), step
        dt = rng.choice((0.0, 0.0, 0.01, 0.05, 0.3, 2.0, 40.0))
        await one_clock.advance(dt)
        await general_clock.advance(dt)
    assert at_once > 300 and granted - at_once > 100 and refused > 300 and kept > 100  # every branch
