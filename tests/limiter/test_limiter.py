"""The Limiter on the memory store and a ManualClock: breaker gating, local record
of vendor blocks, the tokens gauge's extrapolation and the bucket cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import proxy.limiter.limiter as limiter_module
from proxy.clock import ManualClock
from proxy.limiter import Breaker, Limiter, StoreUnavailable
from proxy.policy.model import Limit, TenantLimits, Vendor
from tests.helpers.stores import FlakyStore

FAILURES = 3
COOLOFF = 1.0
PREFIX = "qp-test"


def make_vendor(
    name: str = "payments",
    limits: tuple[Limit, ...] = (Limit(10, 1, 5),),
    tenant: tuple[Limit, ...] = (Limit(2, 1, 2),),
) -> Vendor:
    return Vendor(name=name, hosts=(f"api.{name}.example",), limits=limits, tenant_limits=TenantLimits(default=tenant))


@pytest.fixture
def store(clock: ManualClock) -> FlakyStore:  # overrides the parametrised conftest fixture here
    return FlakyStore(clock)


@pytest.fixture
def errors() -> list[StoreUnavailable]:
    return []


@pytest.fixture
def limiter(store: FlakyStore, clock: ManualClock, errors: list[StoreUnavailable]) -> Limiter:
    return Limiter(
        store, clock, key_prefix=PREFIX, breaker=Breaker(clock, FAILURES, COOLOFF), on_store_error=errors.append
    )


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the event loop run until ``condition`` holds (no clock involved)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


# -- breaker gating ------------------------------------------------------------------


async def test_open_breaker_fails_fast_without_calling_the_store(
    limiter: Limiter, store: FlakyStore, clock: ManualClock, errors: list[StoreUnavailable]
) -> None:
    v = make_vendor()
    store.fail = True
    for i in range(FAILURES):
        with pytest.raises(StoreUnavailable, match="injected"):
            await limiter.acquire(v, "acme", 0)
        assert store.calls == i + 1
    assert limiter.breaker.state == "open"
    assert len(errors) == FAILURES and all("injected" in str(e) for e in errors)

    # From now on a call would hang forever if it reached the store: the breaker must answer alone.
    store.gate = asyncio.Event()
    for _ in range(20):
        with pytest.raises(StoreUnavailable, match="breaker"):
            await asyncio.wait_for(limiter.acquire(v, "acme", 0), timeout=1.0)
    assert store.calls == FAILURES
    assert len(errors) == FAILURES  # refusals by the breaker are not store errors

    # After the cool-off one probe reaches the (recovered) store and closes the breaker.
    store.gate, store.fail = None, False
    await clock.advance(COOLOFF)
    result = await limiter.acquire(v, "acme", 0)
    assert result.granted
    assert store.calls == FAILURES + 1
    assert limiter.breaker.state == "closed"
    assert (await limiter.acquire(v, "acme", 0)).granted
    assert store.calls == FAILURES + 2


async def test_failed_probe_reopens_and_keeps_the_store_quiet(
    limiter: Limiter, store: FlakyStore, clock: ManualClock, errors: list[StoreUnavailable]
) -> None:
    v = make_vendor()
    store.fail = True
    for _ in range(FAILURES):
        with pytest.raises(StoreUnavailable):
            await limiter.acquire(v, "acme", 0)
    await clock.advance(COOLOFF)
    with pytest.raises(StoreUnavailable, match="injected"):
        await limiter.acquire(v, "acme", 0)  # the probe
    assert store.calls == FAILURES + 1
    assert limiter.breaker.state == "open"
    for _ in range(10):
        with pytest.raises(StoreUnavailable, match="breaker"):
            await limiter.acquire(v, "acme", 0)
    assert store.calls == FAILURES + 1
    assert len(errors) == FAILURES + 1


async def test_one_probe_at_a_time_and_a_cancelled_probe_frees_the_slot(
    limiter: Limiter, store: FlakyStore, clock: ManualClock
) -> None:
    v = make_vendor()
    store.fail = True
    for _ in range(FAILURES):
        with pytest.raises(StoreUnavailable):
            await limiter.acquire(v, "acme", 0)
    store.fail = False
    store.gate = asyncio.Event()  # the store answers slowly
    await clock.advance(COOLOFF)
    probe = asyncio.ensure_future(limiter.acquire(v, "acme", 0))
    await until(lambda: store.calls == FAILURES + 1, "the probe reached the store")
    for _ in range(5):
        with pytest.raises(StoreUnavailable, match="breaker"):  # a probe is in flight: nobody else goes
            await asyncio.wait_for(limiter.acquire(v, "acme", 0), timeout=1.0)
    assert store.calls == FAILURES + 1

    probe.cancel()  # the worker went away mid-probe
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert limiter.breaker.state == "half-open"
    store.gate = None
    assert (await limiter.acquire(v, "acme", 0)).granted  # the next request may probe
    assert store.calls == FAILURES + 2
    assert limiter.breaker.state == "closed"


# -- vendor blocks -------------------------------------------------------------------


async def test_block_is_recorded_locally_even_when_the_store_fails(
    limiter: Limiter, store: FlakyStore, clock: ManualClock, errors: list[StoreUnavailable]
) -> None:
    v = make_vendor()
    store.fail = True
    until_s = await limiter.block(v, 5.0)  # never raises
    assert until_s == 5.0
    assert limiter.blocked_for("payments") == pytest.approx(5.0)
    assert len(errors) == 1  # the failed feedback call still counts
    await clock.advance(2.0)
    assert limiter.blocked_for("payments") == pytest.approx(3.0)
    await clock.advance(3.0)
    assert limiter.blocked_for("payments") == 0
    assert limiter.blocked_for("other") == 0


async def test_block_reaches_the_store_and_reports_its_length(
    limiter: Limiter, store: FlakyStore, clock: ManualClock
) -> None:
    v = make_vendor(limits=(Limit(10, 1, 1),), tenant=())
    assert (await limiter.acquire(v, "acme", 1.0)).granted
    held = await limiter.acquire(v, "acme", 1.0)  # a reservation 0.1 s ahead
    assert held.granted and held.wait == pytest.approx(0.1)
    assert await limiter.block(v, 2.0) == pytest.approx(2.0)
    assert limiter.blocked_for("payments") == pytest.approx(2.0)
    refused = await limiter.acquire(v, "acme", 0)
    assert not refused.granted
    assert refused.wait == pytest.approx(2.0 + 0.1)  # from empty after the block: one refill interval
    assert limiter.tokens_available(v) == pytest.approx(-20.0)  # 2 s of refill owed, as the store said


async def test_feedback_bypasses_an_open_breaker(limiter: Limiter, store: FlakyStore, clock: ManualClock) -> None:
    v = make_vendor()
    store.fail = True
    for _ in range(FAILURES):
        with pytest.raises(StoreUnavailable):
            await limiter.acquire(v, "acme", 0)
    assert limiter.breaker.state == "open"
    store.fail = False
    calls = store.calls
    assert await limiter.block(v, 1.5) == pytest.approx(1.5)
    assert store.calls == calls + 1  # the vendor's 429 was recorded fleet-wide, not lost to the breaker
    (level,) = await store.peek((limiter.buckets(v, "acme").global_part[0],))
    assert level == pytest.approx(-15.0)


async def test_blocked_since_only_sees_blocks_that_began_after_the_mark(limiter: Limiter, clock: ManualClock) -> None:
    before = limiter.mark("payments")
    assert limiter.blocked_since("payments", before) == 0
    limiter.note_block("payments", 3.0)
    after = limiter.mark("payments")
    assert limiter.blocked_since("payments", before) == pytest.approx(3.0)  # a hold that predates the block
    assert limiter.blocked_since("payments", after) == 0  # reserved knowing of the block: the store accounted it
    assert limiter.blocked_since("other", limiter.mark("other")) == 0
    await clock.advance(1.0)
    assert limiter.blocked_since("payments", before) == pytest.approx(2.0)
    # A shorter block later neither shortens the known one nor hides it from older marks.
    limiter.note_block("payments", 0.5)
    assert limiter.blocked_for("payments") == pytest.approx(2.0)
    assert limiter.blocked_since("payments", after) == pytest.approx(2.0)
    await clock.advance(2.0)
    assert limiter.blocked_since("payments", before) == 0
    assert limiter.blocked_for("payments") == 0


# -- the tokens gauge ----------------------------------------------------------------


async def test_tokens_available_extrapolates_the_last_answer(limiter: Limiter, clock: ManualClock) -> None:
    per_second, per_minute = Limit(10, 1, 8), Limit(60, 60, 30)
    v = make_vendor(limits=(per_second, per_minute), tenant=(Limit(1, 1, 1),))
    assert limiter.tokens_available(v) is None  # nothing known yet
    for _ in range(4):
        assert (await limiter.acquire(v, f"t{_}", 0)).granted
    # The scarcest global bucket is the per-second one (8 - 4); tenant buckets do not count.
    assert limiter.tokens_available(v) == pytest.approx(4.0)
    await clock.advance(0.2)
    assert limiter.tokens_available(v) == pytest.approx(6.0)  # +10/s on the per-second bucket
    await clock.advance(10.0)
    # The per-second bucket is full again (8); the per-minute one refilled 10 of its 4 taken, capped at 30.
    assert limiter.tokens_available(v) == pytest.approx(8.0)
    for i in range(8):
        assert (await limiter.acquire(v, f"u{i}", 0)).granted
    assert limiter.tokens_available(v) == pytest.approx(0.0)
    await clock.advance(60.0)
    assert limiter.tokens_available(v) == pytest.approx(8.0)
    # No extra store call: the gauge is computed from what the limiter already knows.
    assert limiter.tokens_available(make_vendor("never-called")) is None


async def test_tokens_available_follows_a_drain(limiter: Limiter, clock: ManualClock) -> None:
    v = make_vendor(limits=(Limit(10, 1, 5),))
    assert (await limiter.acquire(v, "acme", 0)).granted
    await limiter.drain(v)
    assert limiter.tokens_available(v) == pytest.approx(0.0)
    await clock.advance(0.3)
    assert limiter.tokens_available(v) == pytest.approx(3.0)


# -- the bucket cache ----------------------------------------------------------------


def test_buckets_are_cached_per_vendor_and_tenant(limiter: Limiter) -> None:
    v = make_vendor()
    b = limiter.buckets(v, "acme")
    assert limiter.buckets(v, "acme") is b
    assert b.tenant_count == 1
    assert [x.scope for x in b.all] == ["tenant", "global"]
    assert b.global_part == b.all[1:]
    assert all(x.key.startswith(f"{PREFIX}:{{payments}}:") for x in b.all)
    assert "acme" in b.all[0].key and "acme" not in b.all[1].key
    other = limiter.buckets(v, "globex")
    assert other is not b
    assert other.all[0].key != b.all[0].key
    assert other.all[1] == b.all[1]  # the same global bucket for every tenant


def test_a_reloaded_vendor_gets_fresh_buckets(limiter: Limiter) -> None:
    old = make_vendor(limits=(Limit(10, 1, 5),))
    b_old = limiter.buckets(old, "acme")
    new = make_vendor(limits=(Limit(20, 1, 5),))
    b_new = limiter.buckets(new, "acme")
    assert b_new is not b_old
    assert b_new.all[1].rate == 20
    assert b_new.all[1].ident != b_old.all[1].ident  # a changed limit is a new bucket
    assert b_new.all[0].ident == b_old.all[0].ident  # the unchanged tenant limit keeps its state
    assert limiter.buckets(new, "acme") is b_new


def test_bucket_cache_is_bounded(limiter: Limiter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limiter_module, "_CACHE_MAX", 8)
    v = make_vendor()
    first = limiter.buckets(v, "t0")
    for i in range(1, 50):
        b = limiter.buckets(v, f"t{i}")
        assert b.all[0].key.endswith(f":t:t{i}:2/1/2")
        assert len(limiter._cache) <= 8  # tenants come from headers: memory must not grow with them
    again = limiter.buckets(v, "t0")
    assert again == first  # rebuilt after eviction, with the same keys
