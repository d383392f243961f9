"""A vendor's token quota headers teach its meters (SPEC §14: ``feedback.headers: auto`` also
reads OpenAI's ``x-ratelimit-*-tokens`` and Anthropic's ``anthropic-ratelimit-*-tokens-*``),
only ever tightening; the request buckets are taught by the request headers as before."""

from __future__ import annotations

import datetime
import json

import pytest

from proxy.clock import ManualClock
from proxy.limiter import Breaker, Limiter
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.quota_headers import SHOPIFY, read_body_quota, read_meter_quota
from proxy.limiter.teaching import currency_of
from proxy.pipeline.feedback import apply_feedback
from proxy.policy.model import Feedback, Limit, Meter, MeterEstimate, MeterSettle, Vendor
from tests.helpers.meter_samples import SHOPIFY_JSON

NOW = 1_800_000_000.0


def test_openai_and_anthropic_token_headers_are_read_by_currency() -> None:
    reset = datetime.datetime.fromtimestamp(NOW + 12, datetime.UTC).isoformat().replace("+00:00", "Z")
    said = {
        "x-ratelimit-limit-tokens": "30000",
        "x-ratelimit-remaining-tokens": "29000",
        "x-ratelimit-reset-tokens": "2s",
        "anthropic-ratelimit-input-tokens-limit": "40000",
        "anthropic-ratelimit-input-tokens-remaining": "39000",
        "anthropic-ratelimit-input-tokens-reset": reset,
        "anthropic-ratelimit-output-tokens-limit": "8000",
        "anthropic-ratelimit-output-tokens-remaining": "7000",
    }
    reports = read_meter_quota(said, NOW)
    assert set(reports) == {"openai", "anthropic_input", "anthropic_output"}
    assert (reports["openai"].limit, reports["openai"].remaining, reports["openai"].reset) == (30000, 29000, 2.0)
    assert reports["openai"].window == 60
    assert reports["anthropic_input"].reset == pytest.approx(12)
    assert (reports["anthropic_output"].limit, reports["anthropic_output"].reset) == (8000, None)
    assert read_meter_quota({"x-ratelimit-remaining-requests": "5"}, NOW) == {}


def llm(kind: str = "openai") -> Vendor:
    tokens = Meter("tokens", (Limit(rate=100_000, per=60, burst=100_000),), MeterEstimate(kind))  # type: ignore[arg-type]
    return Vendor(
        name="llm",
        hosts=("api.llm.example",),
        limits=(Limit(rate=500, per=60, burst=500),),
        feedback=Feedback(headers="auto"),
        meters=(tokens,),
    )


async def test_a_vendors_lower_token_limit_is_learned_by_its_meter() -> None:
    clock = ManualClock()
    limiter = Limiter(MemoryStore(clock), clock, key_prefix="qp-test", breaker=Breaker(clock, 3, 1.0))
    v = llm()
    said = {
        "x-ratelimit-limit-tokens": "30000",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "2s",
    }
    await apply_feedback(limiter, v, 200, said)
    b, levels = await limiter.peek(v, "t")
    # Never more than the vendor says remain (less while its window still counts what the
    # policy's faster rate granted before), refilling at the vendor's 30000 per minute.
    assert levels[b.request_count] <= 1000.99
    memo = limiter.learned.memos[b.all[b.request_count].ident]
    assert memo.learned_rate(clock.monotonic()) == pytest.approx(29_400.99 / 60.01)
    refused = await limiter.acquire(v, "t", 0.0, estimates=(2000.0,))
    assert not refused.granted and refused.binding == b.request_count
    # A request bucket is not what the token headers teach.
    assert levels[b.request_count - 1] == pytest.approx(500)


async def test_headers_of_another_currency_teach_a_meter_nothing() -> None:
    clock = ManualClock()
    limiter = Limiter(MemoryStore(clock), clock, key_prefix="qp-test", breaker=Breaker(clock, 3, 1.0))
    v = llm("anthropic_input")
    said = {"x-ratelimit-limit-tokens": "30000", "x-ratelimit-remaining-tokens": "1000"}
    await apply_feedback(limiter, v, 200, said)
    b, levels = await limiter.peek(v, "t")
    assert levels[b.request_count] == pytest.approx(100_000)


def test_shopifys_throttle_status_is_read_from_the_answers_body() -> None:
    document = json.loads(SHOPIFY_JSON)
    (report,) = read_body_quota(document).values()
    assert (report.size, report.available, report.restore) == (2000.0, 1997.0, 100.0)
    assert set(read_body_quota(document)) == {SHOPIFY}
    status = document["extensions"]["cost"]["throttleStatus"]
    for broken in ({**status, "restoreRate": "50"}, {**status, "maximumAvailable": -1}, {**status, "restoreRate": 0}):
        assert read_body_quota({"extensions": {"cost": {"throttleStatus": broken}}}) == {}
    not_them: tuple[object, ...] = (None, [], {"data": {}}, {"extensions": {"cost": 5}}, {"extensions": []})
    for not_it in not_them:
        assert read_body_quota(not_it) == {}


def shopify(settle: str = "/extensions/cost/actualQueryCost") -> Vendor:
    points = Meter(
        "points",
        (Limit(rate=100, per=1, burst=2000),),
        MeterEstimate("fixed", 100.0),
        MeterSettle("json", pointer=settle),
    )
    return Vendor(
        name="shopify",
        hosts=("shop.myshopify.com",),
        limits=(Limit(rate=100, per=1, burst=100),),
        feedback=Feedback(headers="auto"),
        meters=(points,),
    )


async def test_a_shopify_meter_learns_the_bucket_its_answers_state() -> None:
    """SPEC §14: ``feedback.headers: auto`` reads Shopify's throttleStatus in the body: the
    points meter holds no more than the vendor says are available, refills at its restore
    rate and never above its size (a shop on a smaller plan than the policy says)."""
    clock = ManualClock()
    limiter = Limiter(MemoryStore(clock), clock, key_prefix="qp-test", breaker=Breaker(clock, 3, 1.0))
    v = shopify()
    said = {
        "extensions": {
            "cost": {"throttleStatus": {"maximumAvailable": 1000.0, "currentlyAvailable": 300, "restoreRate": 50.0}}
        }
    }
    assert await limiter.learn_meters(v, read_body_quota(said))
    b, levels = await limiter.peek(v, "t")
    assert levels[b.request_count] <= 300
    memo = limiter.learned.memos[b.all[b.request_count].ident]
    assert memo.learned_rate(clock.monotonic()) == pytest.approx(50.0)
    await clock.advance(30.0)
    _, levels = await limiter.peek(v, "t")
    assert levels[b.request_count] == pytest.approx(1000.0)  # its size, not the policy's 2000
    # A meter that does not count Shopify's points learns nothing from them.
    other = shopify(settle="/usage/total")
    assert currency_of(other.meters[0]) is None
    assert not await limiter.learn_meters(other, read_body_quota(said))
