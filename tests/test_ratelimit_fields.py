"""The IETF RateLimit fields the proxy writes (SPEC §9): one item per bucket, the request's
tightest bucket, and only ever tighter than what the vendor said."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.limiter.buckets import buckets_for
from proxy.pipeline.ratelimit_fields import (
    blocked_item,
    bucket_item,
    fields_for_forwarded,
    request_limits,
    tightest,
    vendor_remaining,
)
from proxy.policy.model import Limit, TenantLimits, Vendor
from proxy.wire.ratelimit_item import QuotaItem

VENDOR = Vendor(
    name="payments",
    hosts=("api.payments.example",),
    limits=(Limit(100, 1, 10), Limit(4000, 60, 4000)),
    tenant_limits=TenantLimits(default=(Limit(20, 1, 20),), overrides=(("exempt", ()),)),
)


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def test_an_item_is_quota_per_window_whole_tokens_left_and_seconds_to_full() -> None:
    item = bucket_item(Limit(100, 1, 10), "global", 7.6)
    assert item == QuotaItem("quota-proxy-global-100-1s", 100, 1, 7, 1)
    assert item.fields() == {
        "RateLimit-Policy": '"quota-proxy-global-100-1s";q=100;w=1',
        "RateLimit": '"quota-proxy-global-100-1s";r=7;t=1',
    }
    # 4000/1m with 3990 left: 10 tokens short of full, at 66.7/s: 0.15 s, rounded up.
    assert bucket_item(Limit(4000, 60, 4000), "global", 3990) == QuotaItem(
        "quota-proxy-global-4000-60s", 4000, 60, 3990, 1
    )


@pytest.mark.parametrize(
    ("limit", "q", "w"),
    [
        (Limit(0.5, 1, 1), 1, 2),  # one token every two seconds
        (Limit(2.5, 1, 3), 2, 1),  # never promises more than the bucket grants
        (Limit(10, 0.25, 10), 40, 1),
        (Limit(1, 3600, 1), 1, 3600),
    ],
)
def test_quota_and_window_are_whole_numbers(limit: Limit, q: int, w: int) -> None:
    item = bucket_item(limit, "tenant", 0)
    assert (item.quota, item.window) == (q, w)


def test_reservations_leave_nothing_and_a_longer_refill() -> None:
    # A held request's reservation drives the level below zero: 12 tokens short of 10.
    assert bucket_item(Limit(100, 1, 10), "global", -2) == QuotaItem("quota-proxy-global-100-1s", 100, 1, 0, 1)
    assert bucket_item(Limit(2, 1, 10), "global", -2).reset == 6


def test_the_levels_line_up_with_the_buckets_the_limiter_takes_from() -> None:
    for tenant in ("acme", "exempt"):
        limits = request_limits(VENDOR, tenant)
        buckets = buckets_for("p", VENDOR, tenant).all
        assert [f"{scope} {limit.label}" for limit, scope in limits] == [
            b.label.replace(f"tenant {tenant} ", "tenant ") for b in buckets
        ]


def test_the_tightest_bucket_has_the_fewest_tokens_then_the_longest_refill() -> None:
    limits = request_limits(VENDOR, "acme")  # tenant 20/1s, global 100/1s burst 10, global 4000/1m
    assert tightest(limits, (15.0, 9.0, 3000.0)) == bucket_item(Limit(100, 1, 10), "global", 9.0)
    assert tightest(limits, (3.0, 9.0, 3000.0)) == bucket_item(Limit(20, 1, 20), "tenant", 3.0)
    # Both empty: the one that takes longer to fill up describes the request.
    assert tightest(limits, (0.5, 9.0, 0.2)) == bucket_item(Limit(4000, 60, 4000), "global", 0.2)
    # A refusal names its binding bucket, whatever the others say.
    assert tightest(limits, (0.0, 9.0, 3000.0), index=1) == bucket_item(Limit(100, 1, 10), "global", 9.0)
    assert tightest(limits, (1.0, 2.0)) is None  # levels that do not line up describe nothing


def test_while_nothing_is_granted_the_narrowest_global_limit_is_empty_until_the_wait_ends() -> None:
    # 4000/1m is the narrower sustained rate (66.7/s against 100/s).
    assert blocked_item(VENDOR, 2.2) == QuotaItem("quota-proxy-global-4000-60s", 4000, 60, 0, 3)
    assert blocked_item(Vendor(name="x"), 1.0) is None


@pytest.mark.parametrize(
    ("pairs", "remaining"),
    [
        ((), None),
        ((("RateLimit", '"default";r=50;t=30'),), 50),
        ((("RateLimit", '"burst";r=5;t=1, "daily";r=900;t=86400'),), 5),
        ((("RateLimit", "burst;t=1;r=5"), ("ratelimit", '"day";r=3')), 3),  # split over field lines
        ((("RateLimit", '"a,b;r=1";r=40;t=1'),), 40),  # commas and semicolons inside a name
        ((("RateLimit", "garbage"),), None),
        ((("X-RateLimit-Remaining", "1"),), None),  # legacy fields are not RateLimit
    ],
)
def test_what_the_vendor_says_remains(pairs: tuple[tuple[str, str], ...], remaining: int | None) -> None:
    assert vendor_remaining(headers(*pairs)) == remaining


def test_the_proxy_adds_its_item_only_where_it_is_tighter_than_the_vendor() -> None:
    ours = QuotaItem("quota-proxy-global-100-1s", 100, 1, 7, 1)
    assert fields_for_forwarded(headers(), ours) == ours.fields()
    assert fields_for_forwarded(headers(("RateLimit", '"v";r=50;t=1')), ours) == ours.fields()
    assert fields_for_forwarded(headers(("RateLimit", '"v";r=7;t=1')), ours) == {}
    assert fields_for_forwarded(headers(("RateLimit", '"v";r=2;t=1')), ours) == {}
