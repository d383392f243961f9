"""Learned limits in the limiter (learning.py, Limiter.learn) on the memory store and a
ManualClock: which bucket a report is about, what it teaches, and that the store is
called only when a lesson changes something."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy.clock import ManualClock
from proxy.limiter import Breaker, Limiter, global_buckets
from proxy.limiter.learning import ARRIVAL_SPREAD, bucket_for, learned_values, plan
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.quota_headers import QuotaReport
from proxy.limiter.store import BucketSpec, LearnResult, Lesson
from proxy.pipeline.feedback import apply_feedback
from proxy.policy.model import Endpoint, EndpointMatch, Feedback, Limit, Vendor
from proxy.telemetry.metrics import Metrics
from tests.helpers.stores import FlakyStore

PREFIX = "qp-test"
LEARNED_70 = 68.99 / 1.01  # per second: what a vendor allowing 70 in any second teaches


def report(
    limit: float | None = None, remaining: float | None = None, reset: float | None = None, window: float | None = None
) -> QuotaReport:
    return QuotaReport("X-RateLimit", limit=limit, remaining=remaining, reset=reset, window=window)


@pytest.mark.parametrize(
    ("r", "expected"),
    [
        (report(window=60), 1),  # the vendor names its window: the bucket with that per
        (report(window=3600), None),  # a window no bucket has: not ours to guess
        (report(reset=0.4), 0),  # the shortest bucket whose per covers the reset
        (report(reset=30), 1),
        (report(reset=873), 2),
        (report(reset=90_000), 2),  # longer than any: the longest
        (report(), 0),  # neither: the shortest (only its level)
    ],
)
def test_the_bucket_a_report_is_about(r: QuotaReport, expected: int | None) -> None:
    assert bucket_for(r, [1.0, 60.0, 86_400.0]) == expected


@pytest.mark.parametrize(
    ("limit", "window", "rate", "burst"),
    [
        (70, 1, 68.99 / 1.01, 2),  # 68.31/s: 68.99/s left 0.15 ms of arrival spread
        (100, 1, 98.99 / 1.01, 2),
        (5000, 3600, 4900.99 / 3600.01, 100),
        (60, 60, 58.99 / 60.01, 2),
        (5, 1, 4.99 / 1.01, 1),  # 4/s before: 80 % of a vendor allowing 5
        (2, 1, 1.99 / 1.01, 1),
        (1, 1, 0.99 / 1.01, 1),
    ],
)
def test_a_learned_bucket_never_exceeds_the_vendors_window(
    limit: float, window: float, rate: float, burst: float
) -> None:
    assert learned_values(limit, window) == (pytest.approx(rate), burst)
    # A bucket grants at most burst + rate x window requests in any window, a whole number:
    # under limit + 1 is at most the limit (and as close to it as that allows), in a window
    # as long as the vendor's and the few ms by which arrivals may come closer than grants.
    assert limit + 0.98 < rate * (window + ARRIVAL_SPREAD) + burst < limit + 1
    assert rate * window + burst < limit + 1 - rate * ARRIVAL_SPREAD


def test_plan_only_ever_tightens_and_forgets_at_the_policys_limit() -> None:
    limits = [Limit(100, 1, 10), Limit(4000, 60, 4000)]
    lower = plan([report(limit=70, remaining=12, window=1)], limits)
    lower_rate: Any = pytest.approx(LEARNED_70)
    assert lower[0].lesson == Lesson(rate=lower_rate, burst=2, remaining=12.99, window=1, ttl=60)
    wide = plan([report(limit=3000, remaining=5, reset=40)], limits)
    wide_rate: Any = pytest.approx(2940.99 / 60.01)
    assert wide[1].lesson == Lesson(rate=wide_rate, burst=60, remaining=5.99, window=60, ttl=600)
    burst_capped = plan([report(limit=99, window=1)], [Limit(100, 1, 1)])
    assert (burst_capped[0].lesson.rate, burst_capped[0].lesson.burst) == (pytest.approx(97.99 / 1.01), 1)
    # At the policy's rate the policy's burst could still overrun the vendor's window: learned.
    at_policy = plan([report(limit=100, remaining=3, window=1)], limits)[0].lesson
    assert (at_policy.rate, at_policy.burst, at_policy.forget) == (pytest.approx(98.99 / 1.01), 2, False)
    # What the policy can grant in a window (100 + burst 10) or more: the policy applies.
    assert plan([report(limit=110, remaining=3, window=1)], limits)[0].lesson.forget
    assert plan([report(limit=150, window=1)], limits)[0].lesson.forget


def test_a_capacity_without_a_window_only_lowers_the_level() -> None:
    # Shopify's 32/40 is a leaky bucket's capacity, not a count per window.
    shopify = QuotaReport("X-Shopify-Shop-Api-Call-Limit", limit=40, remaining=8)
    (t,) = plan([shopify], [Limit(2, 1, 40)]).values()
    assert t.lesson == Lesson(remaining=8.99, window=1, ttl=60)  # (a level under 9: 8 whole requests)


def test_several_reports_on_one_bucket_keep_the_tightest() -> None:
    reports = [report(limit=80, remaining=30, window=1), report(limit=70, remaining=50, window=1)]
    (t,) = plan(reports, [Limit(100, 1, 10)]).values()
    assert (t.lesson.rate, t.lesson.remaining, t.vendor_limit) == (pytest.approx(LEARNED_70), 30.99, 70)


def vendor(limits: tuple[Limit, ...] = (Limit(100, 1, 10),)) -> Vendor:
    return Vendor("v", hosts=("v.example",), limits=limits, feedback=Feedback(headers="auto"))


class CountingStore(FlakyStore):
    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.learns = 0

    async def learn(self, buckets: tuple[BucketSpec, ...], lessons: tuple[Lesson, ...]) -> LearnResult:
        self.learns += 1
        return await super().learn(buckets, lessons)


@pytest.fixture
def store(clock: ManualClock) -> CountingStore:  # overrides the parametrised conftest fixture here
    return CountingStore(clock)


@pytest.fixture
def limiter(store: CountingStore, clock: ManualClock) -> Limiter:
    return Limiter(store, clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))


async def test_a_steady_vendor_costs_no_store_call_per_request(
    limiter: Limiter, store: CountingStore, clock: ManualClock
) -> None:
    v = vendor()
    steady = [report(limit=70, remaining=40, window=1)]
    assert await limiter.learn(v, steady)
    assert store.learns == 1
    for _ in range(200):  # a request every 15 ms at the learned rate, the vendor saying the same
        assert (await limiter.acquire(v, "t", 1.0)).granted
        assert not await limiter.learn(v, steady)
        await clock.advance(1 / LEARNED_70)
    assert store.learns == 1
    assert limiter.learned_rate(v) == pytest.approx(LEARNED_70)


async def test_learned_values_are_refreshed_before_they_expire(
    limiter: Limiter, store: CountingStore, clock: ManualClock
) -> None:
    v = vendor()
    steady = [report(limit=70, window=1)]
    await limiter.learn(v, steady)
    await clock.advance(29)
    assert not await limiter.learn(v, steady)
    await clock.advance(2)  # past half the 60-s expiry
    assert await limiter.learn(v, steady)
    assert store.learns == 2
    await clock.advance(61)  # the vendor went quiet: the policy applies again
    assert limiter.learned_rate(v) is None
    b = global_buckets(PREFIX, v)
    assert await store.peek(b) == (10,)


async def test_a_remaining_below_the_level_is_worth_a_call(
    limiter: Limiter, store: CountingStore, clock: ManualClock
) -> None:
    v = vendor()
    await limiter.learn(v, [report(limit=70, window=1)])
    await clock.advance(2)  # settled, the bucket full again at its learned burst 2
    assert (await limiter.acquire(v, "t", 0)).granted  # level 1
    assert not await limiter.learn(v, [report(limit=70, remaining=1, window=1)])
    assert not await limiter.learn(v, [report(limit=70, remaining=0.5, window=1)])  # within one request
    assert not await limiter.learn(v, [report(limit=70, remaining=0, window=1)])  # 0 is not below 1 - 1
    assert store.learns == 1
    assert (await limiter.acquire(v, "t", 0)).granted
    await clock.advance(1.0)  # refilled to 2; other clients of the vendor took its quota meanwhile
    assert await limiter.learn(v, [report(limit=70, remaining=0, window=1)])
    assert not (await limiter.acquire(v, "t", 0)).granted


async def test_learning_and_clearing_are_logged_once(
    limiter: Limiter, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quota_proxy.limiter")
    v = vendor()
    for _ in range(3):
        await limiter.learn(v, [report(limit=70, window=1)])
    for _ in range(3):
        await limiter.learn(v, [report(limit=110, window=1)])
    assert [r.getMessage() for r in caplog.records] == [
        "vendor v says X-RateLimit allows 70 per 1s: global 100/1s burst 10 now refills at 68.31/s, burst 2 "
        "(policy 100/s)",
        "vendor v's learned limit on global 100/1s burst 10 is cleared: the policy's 100/s applies",
    ]


async def test_apply_feedback_learns_only_with_auto_and_a_429_still_blocks(clock: ManualClock) -> None:
    from prometheus_client import CollectorRegistry

    limiter = Limiter(MemoryStore(clock), clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))
    metrics = Metrics(CollectorRegistry())
    headers = CIMultiDict({"X-RateLimit-Limit": "70", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "1"})
    off = Vendor("off", hosts=("off.example",), limits=(Limit(100, 1, 10),))
    await apply_feedback(limiter, off, 200, headers, metrics=metrics)
    assert limiter.learned_rate(off) is None
    on = vendor()
    applied = await apply_feedback(limiter, on, 429, headers, metrics=metrics)
    assert applied.blocked_for == pytest.approx(10.0)  # no Retry-After: retry_after_default
    assert limiter.learned_rate(on) == pytest.approx(LEARNED_70)
    assert metrics.registry.get_sample_value("ratelimit_learned_rate", {"limiter": "v"}) == pytest.approx(LEARNED_70)
    assert metrics.registry.get_sample_value("ratelimit_learned_rate", {"limiter": "off"}) is None
    cleared = CIMultiDict({"X-RateLimit-Limit": "110", "X-RateLimit-Remaining": "99", "X-RateLimit-Reset": "1"})
    await apply_feedback(limiter, on, 200, cleared, metrics=metrics)
    assert metrics.registry.get_sample_value("ratelimit_learned_rate", {"limiter": "v"}) is None


async def test_a_request_of_an_endpoint_class_teaches_that_class_not_the_vendor(clock: ManualClock) -> None:
    """A vendor's headers describe the bucket the request counted against: for a class with
    limits of its own (GitHub's search, 30/min beside 5,000/h) that is the class's, so
    "30 left" must not clamp every other request of the vendor to 30."""
    limiter = Limiter(MemoryStore(clock), clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))
    search = Endpoint("search", EndpointMatch(path="/search/*"), (Limit(60, 60, 60),))
    plain = Endpoint("files", EndpointMatch(path="/files/*"), cost=5)  # no limits of its own
    v = Vendor(
        "v",
        hosts=("v.example",),
        limits=(Limit(100, 1, 100),),
        feedback=Feedback(headers="auto"),
        endpoints=(search, plain),
    )
    said = CIMultiDict({"X-RateLimit-Limit": "30", "X-RateLimit-Remaining": "30", "X-RateLimit-Reset": "60"})
    await apply_feedback(limiter, v, 200, said, endpoint=search)
    assert limiter.learned_rate(v) is None  # the vendor's global buckets learned nothing
    learned = limiter.learned_status(v)["buckets"]
    assert isinstance(learned, list)
    assert [(b["bucket"], b["rate_per_second"]) for b in learned] == [
        ("endpoint search 60/1m burst 60", round(29.99 / 60.01, 6))
    ]  # one spare
    # The class is held to 30 in any minute (burst 1, 29/min); the vendor's other requests are not.
    assert (await limiter.acquire(v, "t", 0, endpoint=search)).granted
    assert not (await limiter.acquire(v, "t", 0, endpoint=search)).granted
    assert all([(await limiter.acquire(v, "t", 0)).granted for _ in range(50)])
    await clock.advance(60 / 29)
    assert (await limiter.acquire(v, "t", 0, endpoint=search)).granted
    # A class without limits of its own: the headers are about the vendor's buckets.
    await apply_feedback(
        limiter,
        v,
        200,
        CIMultiDict({"X-RateLimit-Limit": "70", "X-RateLimit-Remaining": "70", "X-RateLimit-Reset": "1"}),
        endpoint=plain,
    )
    assert limiter.learned_rate(v) == pytest.approx(LEARNED_70)
