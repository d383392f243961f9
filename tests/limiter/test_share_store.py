"""The schedule of a vendor with ``share:`` in the store (SPEC §13; acquire.lua "Share",
share_memory.py), on memory:// and both Redis acquire paths: who is granted when several
tenants and classes wait on one quota. Each figure here fails on a first-come limiter
(``share=None`` gives every busy tenant the same part, and a flooding class as much as
the urgent one).

The pollers ask as a hold's turn or a precise retrier does: each asks again when told.
On memory:// the clock is stepped; on Redis the pollers run in real time for a short spell.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.share import SLACK, share_ask
from proxy.limiter.store import BucketSpec, BucketStore, ShareAsk
from proxy.policy.model import Share

STATE = "test:{v}:state"


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, clock: ManualClock) -> AsyncIterator[BucketStore]:
    """memory:// and Redis (its pipelined acquire: redis-py's sends the same script, and
    test_store_contract.py holds the two Redis paths to one behaviour)."""
    if request.param == "memory":
        s: BucketStore = MemoryStore(clock)
    else:
        s = RedisStore(request.getfixturevalue("redis_url"), timeout=1.0)
    yield s
    await s.close()


RATE = 400.0  # tokens/s: enough grants in a short real-time spell on Redis
BURST = 4.0


def quota(rate: float = RATE, burst: float = BURST) -> tuple[BucketSpec, ...]:
    return (BucketSpec(STATE, rate, burst, "global", "global", field="g:q"),)


def asks(share: Share, tenants: dict[str, int]) -> dict[str, ShareAsk]:
    return {t: share_ask(share, STATE, t, klass, 0) for t, klass in tenants.items()}


async def run(
    store: BucketStore,
    clock: ManualClock,
    who: dict[str, ShareAsk | None],
    seconds: float,
    buckets: tuple[BucketSpec, ...] | dict[str, tuple[BucketSpec, ...]] | None = None,
    hold: float = 0.0,
    costs: dict[str, tuple[float, ...]] | None = None,
) -> Counter[str]:
    """Every tenant of ``who`` asks without pause (its next ask when its answer says), for
    ``seconds``; returns the grants per tenant. ``hold``: as held requests do, each may wait
    that long and asks without a deferral slot (a hold's line asks again on its turn);
    else as precise retriers of defers do. ``costs``: each tenant's cost in each of its
    buckets (a metered call's, SPEC §14)."""
    of = buckets if isinstance(buckets, dict) else dict.fromkeys(who, quota() if buckets is None else buckets)
    hold_or_queue = hold > 0
    granted: Counter[str] = Counter()
    if isinstance(store, MemoryStore):
        due = dict.fromkeys(who, clock.monotonic())
        end = clock.monotonic() + seconds
        step = 0.0005
        turn = 0
        while clock.monotonic() < end:
            names = list(who)
            turn += 1
            names = names[turn % len(names) :] + names[: turn % len(names)]  # no tenant always first
            for t in names:
                if due[t] <= clock.monotonic():
                    queue = None if hold_or_queue else f"test:{{v}}:q:{t}"
                    r = await store.acquire(
                        of[t], 1.0, hold, queue, None, None, None, who[t], costs[t] if costs else None
                    )
                    if r.granted:
                        granted[t] += 1
                        due[t] = clock.monotonic() + r.wait
                    else:
                        due[t] = clock.monotonic() + r.retry_after
            await clock.advance(step)
        return granted

    stop = asyncio.get_running_loop().time() + seconds

    async def poll(t: str) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < stop:
            queue = None if hold_or_queue else f"test:{{v}}:q:{t}"
            r = await store.acquire(of[t], 1.0, hold, queue, None, None, None, who[t], costs[t] if costs else None)
            if r.granted:
                granted[t] += 1
                await asyncio.sleep(r.wait)
            else:
                await asyncio.sleep(min(r.retry_after, max(stop - loop.time(), 0)))

    # Several pollers per tenant, as several workers: each tenant always has one asking.
    await asyncio.gather(*(poll(t) for t in who for _ in range(3)))
    return granted


def parts(granted: Counter[str]) -> dict[str, float]:
    total = sum(granted.values())
    return {t: n / total for t, n in granted.items()}


WEIGHTED = (("t1", 1 / 8), ("t2", 2 / 8), ("t5", 5 / 8))
"""Each tenant's part of the quota under weights 1:2:5."""


async def test_weights_divide_a_busy_quota(store: BucketStore, clock: ManualClock) -> None:
    share = Share(weights=(("t2", 2.0), ("t5", 5.0)))
    who: dict[str, ShareAsk | None] = dict(asks(share, {"t1": 0, "t2": 0, "t5": 0}))
    granted = await run(store, clock, who, 1.5)
    total = sum(granted.values())
    assert total >= 0.9 * RATE * 1.5, granted  # the whole quota is used
    got = parts(granted)
    for t, want in WEIGHTED:
        assert got[t] == pytest.approx(want, abs=0.05), granted


async def test_weights_divide_a_meter_that_binds(store: BucketStore, clock: ManualClock) -> None:
    """SPEC §13/§14: weights divide each meter. The vendor's request bucket has room to
    spare and its token meter binds; the tenants' calls cost 8, 4 and 10 tokens: each
    receives tokens by its weight (1:2:5), not calls (first come gave them tokens by their
    calls' costs, about 8:4:10)."""
    share = Share(weights=(("t2", 2.0), ("t5", 5.0)))
    who: dict[str, ShareAsk | None] = {t: share_ask(share, STATE, t, 0, 0, metered=1) for t in ("t1", "t2", "t5")}
    meter = BucketSpec(STATE, 2400.0, 40.0, "global", "tokens", field="m:tokens")
    buckets = (*quota(rate=4000.0, burst=40.0), meter)
    cost = {"t1": 8.0, "t2": 4.0, "t5": 10.0}
    granted = await run(store, clock, who, 1.5, buckets, costs={t: (1.0, c) for t, c in cost.items()})
    tokens = Counter({t: n * cost[t] for t, n in granted.items()})
    assert sum(tokens.values()) >= 0.9 * 2400 * 1.5, granted  # the whole meter is used
    got = parts(tokens)
    for t, want in WEIGHTED:
        assert got[t] == pytest.approx(want, abs=0.05), (granted, got)


async def test_first_come_is_not_weighted(store: BucketStore, clock: ManualClock) -> None:
    """The same load without a share: the test above's check fails on a plain limiter. How
    first come divides it is chance (a third each, or on Redis now and then 72 % to one
    tenant whose retriers happen to ask first), never the weights."""
    granted = await run(store, clock, {"t1": None, "t2": None, "t5": None}, 1.0)
    got = parts(granted)
    assert max(abs(got.get(t, 0.0) - want) for t, want in WEIGHTED) > 0.05, granted


async def test_a_tenant_alone_takes_the_whole_quota(store: BucketStore, clock: ManualClock) -> None:
    share = Share(weights=(("t5", 5.0),))
    who: dict[str, ShareAsk | None] = dict(asks(share, {"t1": 0}))
    granted = await run(store, clock, who, 1.0)
    assert granted["t1"] >= 0.9 * RATE, granted


async def test_a_higher_class_goes_first_and_a_lower_one_keeps_min_share(
    store: BucketStore, clock: ManualClock
) -> None:
    share = Share(classes=("checkout", "batch"), default_class="batch", min_share=0.1)
    who: dict[str, ShareAsk | None] = dict(asks(share, {"shop": 0, "nightly": 1}))
    granted = await run(store, clock, who, 1.5, hold=0.5)
    got = parts(granted)
    assert sum(granted.values()) >= 0.9 * RATE * 1.5, granted
    assert got["nightly"] == pytest.approx(0.1, abs=0.05), granted  # min_share, not half
    assert got["shop"] >= 0.85, granted


async def test_a_refusal_by_the_schedule_takes_nothing_and_says_its_turn(
    store: BucketStore, clock: ManualClock
) -> None:
    share = Share(weights=(("big", 9.0),))
    a = asks(share, {"small": 0, "big": 0})
    b = quota(rate=100.0, burst=1.0)
    assert (await store.acquire(b, 1.0, 0.0, "test:{v}:q:big", None, None, None, a["big"])).granted
    for t in ("small", "big"):  # both wait: the bucket is empty
        assert not (await store.acquire(b, 1.0, 0.0, f"test:{{v}}:q:{t}", None, None, None, a[t])).granted
    # "small" may go while its tag is at most SLACK of the quota past "big"'s: then it is
    # refused with a token in the bucket, told to come back once "big" had nine.
    grants = 0
    for _ in range(5):
        await advance(store, clock, 0.011)
        r = await store.acquire(b, 1.0, 0.0, None, None, None, None, a["small"])
        if not r.granted:
            break
        grants += 1
    assert grants <= 1 + 100.0 * SLACK  # one of its own, or SLACK of the quota, past "big"'s tag
    assert not r.granted and r.levels[0] >= 0.99  # a token there, not taken
    assert r.retry_after >= 0.05  # "big"'s nine at 100/s, less what the slack allows
    assert (await store.peek(b))[0] >= 0.99


async def advance(store: BucketStore, clock: ManualClock, seconds: float) -> None:
    if isinstance(store, MemoryStore):
        await clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


async def test_a_tenant_held_by_its_own_limit_holds_no_one_back(store: BucketStore, clock: ManualClock) -> None:
    """tenant_limits stay hard caps, and a tenant refused by its own cap is not waiting on the
    quota: the others take what it cannot (work-conserving)."""
    share = Share(weights=(("capped", 5.0),))
    capped = (BucketSpec("test:{v}:t:capped", RATE / 10, 1.0, "tenant", "tenant capped"), *quota())
    who: dict[str, ShareAsk | None] = {
        "capped": share_ask(share, STATE, "capped", 0, 1),
        "other": share_ask(share, STATE, "other", 0, 0),
    }
    granted = await run(store, clock, who, 1.5, buckets={"capped": capped, "other": quota()}, hold=0.5)
    assert granted["capped"] <= RATE / 10 * 1.5 + 2, granted
    assert granted["capped"] + granted["other"] >= 0.9 * RATE * 1.5, granted
