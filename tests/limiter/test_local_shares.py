"""store.on_failure: local on a ManualClock: replicas sharing one store that goes away.

Two (or three) Limiters share one memory:// store that can be taken down and brought
back, with or without its state, and a ManualClock: each replica's local share, where
the shares start, what the shared buckets are charged on return, the grace, and a whole
fleet's output measured in every 1-second window across an outage.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from proxy.clock import ManualClock
from proxy.limiter import Breaker, Limiter, StoreUnavailable
from proxy.limiter.buckets import global_buckets, lease_sets, meter_vendor_buckets, replicas_key
from proxy.limiter.degraded import LocalShares, grace_for, share
from proxy.limiter.presence import Presence
from proxy.limiter.quota_headers import read_quota
from proxy.limiter.store import AcquireResult, BucketSpec, Leases
from proxy.policy.model import Feedback, Limit, Meter, MeterEstimate, OnLimit, TenantLimits, Vendor, Wish
from proxy.quota.concurrency import Concurrency, Slot
from proxy.quota.sizing import Sizing
from tests.helpers.stores import FlakyStore

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

PREFIX = "qp-degraded"
COOLOFF = 1.0
TIMEOUT = 0.05
GRACE = grace_for(COOLOFF, TIMEOUT)
RATE, BURST = 50.0, 10.0


def payments(rate: float = RATE, burst: float = BURST, tenant: tuple[Limit, ...] = (), max_hold: float = 0.5) -> Vendor:
    return Vendor(
        name="payments",
        hosts=("api.payments.example",),
        limits=(Limit(rate, 1.0, burst),),
        tenant_limits=TenantLimits(default=tenant),
        on_limit=OnLimit("hold", max_hold),
    )


@dataclass
class Replica:
    limiter: Limiter
    local: LocalShares
    grants_alone: list[str] = field(default_factory=list)


@pytest.fixture
def shared(clock: ManualClock) -> FlakyStore:
    return FlakyStore(clock)


@pytest.fixture
async def fleet(shared: FlakyStore, clock: ManualClock) -> AsyncIterator[Callable[[int], list[Replica]]]:
    """``fleet(n)``: n replicas on the shared store, each announcing itself every second."""
    tasks: list[asyncio.Task[None]] = []

    def make(n: int) -> list[Replica]:
        replicas = []
        for _ in range(n):
            local = LocalShares(clock, Presence(clock), GRACE)
            grants: list[str] = []
            limiter = Limiter(
                shared,
                clock,
                key_prefix=PREFIX,
                breaker=Breaker(clock, 3, COOLOFF),
                local=local,
                on_local_grant=grants.append,
            )
            replicas.append(Replica(limiter, local, grants))
        for r in replicas:
            tasks.append(asyncio.ensure_future(r.limiter.announce()))
        return replicas

    yield make
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def settle(clock: ManualClock) -> None:
    """Let every replica announce itself (and learn the count) once."""
    await clock.advance(0)
    for _ in range(5):
        await asyncio.sleep(0)
    await clock.advance(1.0)


async def go_local(shared: FlakyStore, limiter: Limiter, v: Vendor) -> None:
    """Take the store down; the replica notices on its next request (its share starts empty)."""
    shared.fail = True
    assert not (await limiter.acquire(v, "default", 0)).granted


async def take_all(limiter: Limiter, v: Vendor, max_wait: float = 0.0) -> list[AcquireResult]:
    """Acquire until refused; the grants and the refusal."""
    out = []
    while True:
        r = await limiter.acquire(v, "default", max_wait)
        out.append(r)
        if not r.granted:
            return out


# -- the share --------------------------------------------------------------------------


def test_a_share_divides_rate_and_burst_but_never_below_one_request() -> None:
    b = BucketSpec("k", 50, 10, "global", "global 50/1s burst 10")
    assert (share(b, 2).rate, share(b, 2).burst) == (25, 5)
    assert (share(b, 20).rate, share(b, 20).burst) == (2.5, 1.0)  # 0.5 could never grant
    tiny = BucketSpec("k", 1, 0.5, "global", "odd")
    assert share(tiny, 2).burst == 0.5  # never above the bucket itself


async def test_presence_counts_the_largest_recent_answer_and_an_outage_does_not_age_it(clock: ManualClock) -> None:
    p = Presence(clock, every=1.0, stale=5.0)
    assert p.replicas() == 0
    for count in (3, 1, 2):  # e.g. a store that restarted empty re-learning the fleet
        p.record(count)
        await clock.advance(1.0)
    assert p.replicas() == 3
    await clock.advance(60.0)  # no answers for a minute: the store is out
    assert p.replicas() == 3  # still the count from just before
    for _ in range(8):  # the fleet shrank: believed once the larger answers are old
        p.record(2)
        await clock.advance(1.0)
    assert p.replicas() == 2


async def test_replicas_count_each_other_through_the_store(fleet, shared: FlakyStore, clock: ManualClock) -> None:
    a, b, c = fleet(3)
    await settle(clock)
    assert [r.local.presence.replicas() for r in (a, b, c)] == [3, 3, 3]
    assert await shared.announce(replicas_key(PREFIX), "probe", 5.0) == 4
    await c.limiter.leave()
    assert await shared.announce(replicas_key(PREFIX), "probe", 5.0) == 3


# -- entering local mode ----------------------------------------------------------------


async def test_the_store_down_each_replica_enforces_its_share_with_the_same_semantics(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    a, b = fleet(2)
    await settle(clock)
    v = payments(max_hold=0.5)
    await clock.advance(1.0)  # idle: the shared bucket is full (10)
    assert (await a.limiter.acquire(v, "default", 0)).granted
    shared.fail = True

    # Holds: reservations on a 25/s share are paced 40 ms apart, up to max_hold.
    held = [await a.limiter.acquire(v, "default", 0.5) for _ in range(14)]
    assert all(r.granted for r in held[:12]), [(r.granted, r.wait) for r in held]
    waits = [r.wait for r in held if r.granted]
    assert waits[:3] == pytest.approx([0.04, 0.08, 0.12], abs=1e-6)  # from empty: the share never starts above it
    assert max(waits) <= 0.5
    assert not held[-1].granted
    # Defers get spread hints from the share's own deferral queue.
    refused = [await a.limiter.acquire(v, "default", 0) for _ in range(3)]
    assert not any(r.granted for r in refused)
    hints = [r.retry_after for r in refused]
    assert hints == sorted(hints) and hints[2] - hints[0] == pytest.approx(2 / 25, abs=1e-6)
    assert a.local.current() == "local" and a.local.replicas == 2
    assert len(a.grants_alone) == len([r for r in held if r.granted])
    assert b.local.current() == "shared"  # b has not needed the store yet


async def test_shares_start_from_the_level_last_seen_divided_never_above_empty(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    (a,) = fleet(1)
    await settle(clock)
    v = payments(rate=10, burst=10, max_hold=2.0)
    # Reserve 1 s ahead: the shared bucket owes 10 tokens.
    grants = [r for r in await take_all(a.limiter, v, max_wait=1.0) if r.granted]
    assert len(grants) == 20
    shared.fail = True
    r = await a.limiter.acquire(v, "default", 2.0)
    assert r.granted and r.wait == pytest.approx(1.1, abs=1e-6)  # still owing what was reserved


async def test_a_replica_that_never_saw_the_count_fails_closed(shared: FlakyStore, clock: ManualClock) -> None:
    local = LocalShares(clock, Presence(clock), GRACE)
    limiter = Limiter(shared, clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, COOLOFF), local=local)
    shared.fail = True  # down since before the first announcement
    with pytest.raises(StoreUnavailable):
        await limiter.acquire(payments(), "default", 0)
    assert local.current() == "shared" and not limiter.serves_without_store()


async def test_the_open_breaker_spares_the_store_while_the_shares_decide(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    (a,) = fleet(1)
    await settle(clock)
    v = payments()
    shared.fail = True
    for _ in range(20):
        await a.limiter.acquire(v, "default", 0.5)
    assert a.limiter.breaker.state == "open"
    calls = shared.acquires
    for _ in range(20):
        await a.limiter.acquire(v, "default", 0.5)
    assert shared.acquires == calls  # nothing reached the store: not even attempts (they would raise first)


async def test_tenant_limits_are_shared_too(fleet, shared: FlakyStore, clock: ManualClock) -> None:
    a, _ = fleet(2)
    await settle(clock)
    v = payments(rate=1000, burst=1000, tenant=(Limit(4, 1.0, 4),))
    shared.fail = True
    assert not (await a.limiter.acquire(v, "default", 0)).granted  # the global share starts empty
    await clock.advance(0.1)  # 50 global tokens later
    results = await take_all(a.limiter, v)
    assert len(results) - 1 == 2  # a tenant burst of 4, halved
    assert results[-1].binding == 0  # the tenant bucket refused


async def test_a_vendor_block_applies_to_the_local_shares(fleet, shared: FlakyStore, clock: ManualClock) -> None:
    (a,) = fleet(1)
    await settle(clock)
    v = payments()
    await a.limiter.acquire(v, "default", 0)
    shared.fail = True
    assert not (await a.limiter.acquire(v, "default", 0)).granted  # the share starts empty
    await clock.advance(2.0)
    assert (await a.limiter.acquire(v, "default", 0)).granted
    assert await a.limiter.block(v, 3.0) == 3.0  # the vendor answered 429 during the outage
    r = await a.limiter.acquire(v, "default", 0)
    assert not r.granted and r.wait == pytest.approx(3.0 + 1 / RATE, abs=1e-6)


async def test_a_block_running_when_the_store_fails_goes_on(fleet, shared: FlakyStore, clock: ManualClock) -> None:
    (a,) = fleet(1)
    await settle(clock)
    v = payments()
    await a.limiter.block(v, 4.0)
    await clock.advance(1.0)
    shared.fail = True
    r = await a.limiter.acquire(v, "default", 0)
    assert not r.granted and r.wait == pytest.approx(3.0 + 1 / RATE, abs=1e-6)


# -- coming back --------------------------------------------------------------------------


async def test_coming_back_charges_what_was_granted_alone_then_needs_both_for_the_grace(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    a, _ = fleet(2)
    await settle(clock)
    v = payments(rate=2, burst=10)  # a's share: 1/s, burst 5
    shared.fail = True
    assert not (await a.limiter.acquire(v, "default", 0)).granted  # the share starts empty
    await clock.advance(5.0)
    alone = [r for r in await take_all(a.limiter, v) if r.granted]
    assert len(alone) == 5
    assert a.limiter.breaker.state == "open"
    shared.forget()  # back, and empty: its buckets read full
    shared.fail = False
    await clock.advance(COOLOFF)  # the share refilled 1 of its 5
    r = await a.limiter.acquire(v, "default", 0)  # the probe: the charge, then this request
    assert r.granted and a.local.current() == "recovering"
    # Full (10) less the 4 of the 5 granted alone that the share has not refilled, less this
    # request: what the two shares hold together (a: 0, b untouched: 5).
    assert (await shared.peek(global_buckets(PREFIX, v)))[0] == pytest.approx(10 - 4 - 1, abs=1e-6)
    # During the grace the share binds as well: the shared bucket has 5, a's share none.
    refused = await a.limiter.acquire(v, "default", 0)
    assert not refused.granted and refused.wait == pytest.approx(1.0, abs=1e-6)
    await clock.advance(GRACE)
    assert a.local.current() == "shared" and a.local.replicas == 0
    assert [r.granted for r in await take_all(a.limiter, v)][:5] == [True] * 5  # the shared bucket alone


async def test_a_failure_during_the_grace_goes_back_to_the_shares_and_owes_again(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    (a,) = fleet(1)
    await settle(clock)
    v = payments(rate=10, burst=10)
    await go_local(shared, a.limiter, v)
    await clock.advance(3.0)
    assert (await a.limiter.acquire(v, "default", 0)).granted
    shared.fail = False
    await clock.advance(COOLOFF)
    assert (await a.limiter.acquire(v, "default", 0)).granted
    assert a.local.current() == "recovering"
    shared.fail = True
    r = await a.limiter.acquire(v, "default", 0)
    assert r.granted and a.local.current() == "local"  # decided by the share, owed to the store
    assert a.local.owed() == [v]


async def test_a_short_outage_charges_only_what_was_granted_alone(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    """The shortfall bound alone would charge the share's whole burst after a blip."""
    a, _ = fleet(2)
    await settle(clock)
    v = payments(rate=100, burst=20)
    await clock.advance(1.0)
    await go_local(shared, a.limiter, v)
    await clock.advance(0.1)  # the share (50/s, burst 10) refills 5 tokens from empty
    assert (await a.limiter.acquire(v, "default", 0)).granted
    shared.fail = False
    await clock.advance(0.05)  # the share is 3.5 short of full; the breaker never opened
    await a.limiter.acquire(v, "default", 0)
    assert a.local.current() == "recovering"
    level = (await shared.peek(global_buckets(PREFIX, v)))[0]
    assert level == pytest.approx(20 - 1 - 1, abs=1e-6)  # full, less the one granted alone, less this one


# -- a fleet across an outage ---------------------------------------------------------


def max_in_any_window(times: list[float], window: float) -> int:
    times = sorted(times)
    return max((bisect.bisect_right(times, t + window - 1e-9) - i for i, t in enumerate(times)), default=0)


@pytest.mark.parametrize("comeback", ["state kept", "restarted empty"])
@pytest.mark.parametrize("max_wait", [0.0, 0.5], ids=["defer", "hold"])
async def test_a_fleet_stays_within_every_window_across_an_outage_and_keeps_serving(
    fleet, shared: FlakyStore, clock: ManualClock, comeback: str, max_wait: float
) -> None:
    replicas = fleet(2)
    await settle(clock)
    v = payments()
    sent: list[float] = []
    demand, step = 80.0, 0.005  # per replica, per second: 160/s against a quota of 50/s

    async def run(seconds: float, b_idle: float = 0.0) -> None:
        owed = [0.0, 0.0]
        start, end = clock.monotonic(), clock.monotonic() + seconds
        while clock.monotonic() < end:
            for i, r in enumerate(replicas):
                if i == 1 and clock.monotonic() < start + b_idle:
                    continue  # b notices the outage later: the replicas come back at different times
                owed[i] += demand * step
                while owed[i] >= 1:
                    owed[i] -= 1
                    try:
                        result = await r.limiter.acquire(v, "default", max_wait)
                    except StoreUnavailable:
                        continue
                    if result.granted:
                        sent.append(clock.monotonic() + result.wait)
            await clock.advance(step)

    start = clock.monotonic()
    await run(3.0)
    shared.fail = True
    down = clock.monotonic()
    await run(10.0, b_idle=0.6)
    if comeback == "restarted empty":
        shared.forget()
    shared.fail = False
    up = clock.monotonic()
    await run(GRACE + 4.0)

    worst = max_in_any_window(sent, 1.0)
    assert worst <= RATE + BURST, worst
    during = [t for t in sent if down + 1.0 <= t < up]
    assert len(during) >= 0.4 * RATE * (up - down - 1.0), len(during)
    assert all(r.local.current() == "shared" for r in replicas)
    end = clock.monotonic()
    tail = [t for t in sent if up + GRACE + 1.0 <= t < end]  # held ones may still be due after the end
    assert len(tail) == pytest.approx(RATE * (end - up - GRACE - 1.0), rel=0.1)
    assert all(r.grants_alone for r in replicas)
    print(
        f"{comeback}, max_wait {max_wait}: {len(sent)} sent over {clock.monotonic() - start:.1f}s, "
        f"{len(during) / (up - down - 1.0):.1f}/s during the outage, at most {worst} in any 1 s window"
    )


async def test_the_first_shared_grants_after_an_outage_keep_every_window_within_the_limit(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    """A bucket whose refill outlasts the grace (10/s, burst 50: 5 s): the share spends its
    whole burst just before the store returns empty. Uncharged, the shared bucket would
    read full and hand out a second burst once the grace is over."""
    (a,) = fleet(1)
    await settle(clock)
    rate, burst = 10.0, 50.0
    v = payments(rate=rate, burst=burst)
    await go_local(shared, a.limiter, v)
    await clock.advance(10.0)  # idle: the share refills to its burst
    sent = [clock.monotonic() for r in await take_all(a.limiter, v) if r.granted]
    assert len(sent) == burst
    shared.forget()  # back, and empty
    shared.fail = False
    await clock.advance(COOLOFF)
    end = clock.monotonic() + GRACE + 8.0
    while clock.monotonic() < end:  # a saturating demand from the return on
        for _ in range(2):
            r = await a.limiter.acquire(v, "default", 0)
            if r.granted:
                sent.append(clock.monotonic())
        await clock.advance(0.01)
    assert a.local.current() == "shared"
    for window in (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0):
        worst = max_in_any_window(sent, window)
        assert worst <= rate * window + burst, (window, worst)


async def test_a_reload_during_the_outage_keeps_the_shares_and_what_is_owed(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    (a,) = fleet(1)
    await settle(clock)
    v = payments(rate=2, burst=10)
    await go_local(shared, a.limiter, v)
    await clock.advance(5.0)
    assert len([r for r in await take_all(a.limiter, v) if r.granted]) == 10
    reloaded = payments(rate=2, burst=10)  # the same limits in a new policy generation
    assert reloaded is not v and not (await a.limiter.acquire(reloaded, "default", 0)).granted  # still spent
    assert a.local.owed() == [reloaded]
    changed = payments(rate=4, burst=10)  # new limits: fresh shares, the debt still owed
    await a.limiter.acquire(changed, "default", 0)
    assert [(b.rate, d) for b, d in await a.local.debts(changed)] == [(4.0, 10.0)]


async def test_a_meter_is_shared_like_the_requests_and_charged_back_in_its_own_units(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    """SPEC §12/§14: a meter's local shares start from its level last seen, divided, never
    above empty (before: full, half its burst granted alone at once on top of a window the
    fleet had just spent), and what they granted alone is charged back to the shared meter in
    tokens (before: in requests, 1 per call)."""
    a, _ = fleet(2)
    await settle(clock)
    tokens = Meter("tokens", (Limit(100, 1.0, 1000),), MeterEstimate("fixed", 100.0))
    v = dataclasses.replace(payments(rate=100, burst=100), meters=(tokens,))
    assert (await a.limiter.acquire(v, "default", 0, estimates=(1000.0,))).granted  # the meter: empty
    shared.fail = True
    r = await a.limiter.acquire(v, "default", 0, estimates=(100.0,))
    assert not r.granted and r.wait == pytest.approx(2.0, abs=1e-6)  # a's share: 50/s from empty
    await clock.advance(4.0)  # 200 tokens in a's share
    alone = [await a.limiter.acquire(v, "default", 0, estimates=(100.0,)) for _ in range(3)]
    assert [r.granted for r in alone] == [True, True, False]
    shared.forget()  # back, and empty: its buckets read full
    shared.fail = False
    await clock.advance(COOLOFF)
    r = await a.limiter.acquire(v, "default", 0, estimates=(10.0,))
    assert r.granted and a.local.current() == "recovering"
    # Full, less the 200 tokens granted alone (a's share is 450 short of full: all of them
    # count), less this call's 10.
    assert (await shared.peek(meter_vendor_buckets(PREFIX, v, tokens)))[0] == pytest.approx(1000 - 200 - 10, abs=1e-6)


# -- concurrency caps --------------------------------------------------------------------


async def test_the_store_down_each_replica_keeps_its_share_of_a_concurrency_cap(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    """A cap of 4 over 2 replicas is 2 each while the store is out: the leases a local share
    grants are counted and given back locally (they used to be granted with no lease at all,
    so the vendor could see any number in flight)."""
    a, _ = fleet(2)
    await settle(clock)
    v = dataclasses.replace(payments(rate=1000, burst=1000), concurrency=4)
    (cap,) = lease_sets(PREFIX, v, None)
    await go_local(shared, a.limiter, v)
    await clock.advance(0.1)  # the share (500/s) starts empty: 50 tokens, plenty

    def leases(n: int) -> Leases:
        return Leases(f"r{n}", 30.0, (cap,))

    results = [await a.limiter.acquire(v, "default", 0, leases=leases(i)) for i in range(3)]
    assert [r.granted for r in results] == [True, True, False]
    assert results[-1].full == 0  # the cap's share is full, the buckets would grant
    assert await a.limiter.release_local(leases(0)) == (1,)  # one left in flight here
    assert (await a.limiter.acquire(v, "default", 0, leases=leases(3))).granted
    assert await a.limiter.release_local(leases(99)) is None  # not a local lease: nothing known
    # A local lease runs out by itself like a shared one (a request that never released).
    await clock.advance(31.0)
    assert (await a.limiter.acquire(v, "default", 0, leases=leases(4))).granted


async def test_a_request_held_for_a_local_cap_share_gets_the_slot_when_one_is_given_back(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    """Through Concurrency (what the handler uses): with the store out, a hold waits for
    this replica's share of the cap without spinning, and is woken by a local release."""
    a, _ = fleet(2)
    await settle(clock)
    v = dataclasses.replace(payments(rate=1000, burst=1000), concurrency=2)  # 1 per replica
    await go_local(shared, a.limiter, v)
    await clock.advance(0.1)
    concurrency = Concurrency(a.limiter, clock, Sizing())
    wish = Wish("hold", 5.0)

    def attempt_for(slot: Slot) -> Callable[[float], Awaitable[AcquireResult]]:
        return lambda left: a.limiter.acquire(v, "default", left, leases=slot.leases)

    first = concurrency.slot(v, None)
    assert (await concurrency.acquire(first, wish, attempt_for(first))).granted
    second = concurrency.slot(v, None)
    waiting = asyncio.ensure_future(concurrency.acquire(second, wish, attempt_for(second)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done() and concurrency.held_for_slot("payments") == 1
    first.close()  # given back locally: the waiter is woken, not polled
    assert (await asyncio.wait_for(waiting, 1.0)).granted
    second.close()
    await concurrency.close()


async def test_the_shares_start_from_what_the_vendor_taught_not_the_policy(
    fleet, shared: FlakyStore, clock: ManualClock
) -> None:
    """A vendor that said it allows 70/s (policy 100/s burst 10): the learned bucket is
    68.31/s burst 2, so each of 2 replicas' shares is 34.15/s burst 1, not 50/s burst 5."""
    a, _ = fleet(2)
    await settle(clock)
    v = dataclasses.replace(payments(rate=100, burst=10), feedback=Feedback(headers="auto"))
    said = {"X-RateLimit-Limit": "70", "X-RateLimit-Remaining": "70", "X-RateLimit-Reset": "1"}
    assert await a.limiter.learn(v, read_quota(said, 0.0))
    assert a.limiter.learned_rate(v) == pytest.approx(68.99 / 1.01)
    await go_local(shared, a.limiter, v)
    await clock.advance(1.0)  # the share refills to its burst
    assert sum(r.granted for r in await take_all(a.limiter, v)) == 1
    await clock.advance(0.5)  # 17.1 tokens at 34.15/s: again only the burst of 1 is there at once
    assert sum(r.granted for r in await take_all(a.limiter, v, max_wait=0.5)) == 1 + 17
