"""Vendors' own quota headers, read from samples of what each really sends (SPEC §10)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.limiter.quota_headers import QuotaReport, read_quota

NOW = 1_372_700_000.0  # wall clock for resets sent as instants


def read(*pairs: tuple[str, str]) -> tuple[QuotaReport, ...]:
    return read_quota(CIMultiDict(pairs), NOW)


def test_github_epoch_reset() -> None:
    (r,) = read(
        ("x-ratelimit-limit", "5000"),
        ("x-ratelimit-remaining", "4999"),
        ("x-ratelimit-reset", "1372700873"),
        ("x-ratelimit-used", "1"),
        ("x-ratelimit-resource", "core"),
    )
    assert (r.source, r.limit, r.remaining, r.reset, r.window) == ("X-RateLimit", 5000, 4999, 873, None)


def test_x_ratelimit_delta_and_millisecond_epoch_resets() -> None:
    (delta,) = read(("X-RateLimit-Limit", "70"), ("X-RateLimit-Remaining", "12"), ("X-RateLimit-Reset", "1"))
    assert (delta.limit, delta.remaining, delta.reset) == (70, 12, 1)
    (millis,) = read(("X-RateLimit-Remaining", "3"), ("X-RateLimit-Reset", str(int((NOW + 2.5) * 1000))))
    assert millis.reset == pytest.approx(2.5)
    assert millis.limit is None


def test_x_ratelimit_limit_with_a_window() -> None:
    (r,) = read(("X-RateLimit-Limit", "100, 100;w=60"), ("X-RateLimit-Remaining", "99"))
    assert (r.limit, r.window) == (100, 60)


def test_openai_requests_per_minute() -> None:
    (r,) = read(
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-limit-tokens", "150000"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-remaining-tokens", "149984"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-reset-tokens", "6m0s"),
    )
    assert (r.limit, r.remaining, r.reset, r.window) == (60, 59, 1, 60)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("6m0s", 360), ("1s", 1), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("2.5", 2.5), ("17ms", 0.017)],
)
def test_openai_reset_durations(text: str, seconds: float) -> None:
    (r,) = read(("x-ratelimit-remaining-requests", "1"), ("x-ratelimit-reset-requests", text))
    assert r.reset == pytest.approx(seconds)


def test_shopify_leaky_bucket() -> None:
    (r,) = read(("X-Shopify-Shop-Api-Call-Limit", "32/40"))
    assert (r.limit, r.remaining, r.reset, r.window) == (40, 8, None, None)


def test_ietf_current_form_with_two_policies() -> None:
    reports = read(
        ("RateLimit-Policy", '"burst";q=100;w=1, "daily";q=1000;w=86400'),
        ("RateLimit", '"burst";r=42;t=1, "daily";r=500;t=3600'),
    )
    assert [(r.name, r.limit, r.window, r.remaining, r.reset) for r in reports] == [
        ("burst", 100, 1, 42, 1),
        ("daily", 1000, 86400, 500, 3600),
    ]


def test_ietf_fields_split_over_lines_and_quoted_names() -> None:
    reports = read(
        ("RateLimit-Policy", '"a, b;c";q=10;w=1'),
        ("RateLimit", '"a, b;c";r=3;t=1'),
        ("RateLimit", '"other";r=9;t=2'),
    )
    assert [(r.name, r.remaining, r.limit) for r in reports] == [("a, b;c", 3, 10), ("other", 9, None)]


def test_ietf_draft_07_dictionary() -> None:
    (r,) = read(("RateLimit", "limit=100, remaining=50, reset=5"), ("RateLimit-Policy", "100;w=60"))
    assert (r.limit, r.remaining, r.reset, r.window) == (100, 50, 5, 60)


def test_ietf_draft_06_fields() -> None:
    (r,) = read(
        ("RateLimit-Limit", "10, 10;w=1, 50;w=60"),
        ("RateLimit-Remaining", "9"),
        ("RateLimit-Reset", "1"),
    )
    assert (r.source, r.limit, r.remaining, r.reset, r.window) == ("RateLimit-Remaining", 10, 9, 1, 1)


def test_the_most_specific_family_wins() -> None:
    reports = read(
        ("RateLimit-Policy", '"p";q=100;w=1'),
        ("RateLimit", '"p";r=7;t=1'),
        ("X-RateLimit-Remaining", "99"),
    )
    assert [r.remaining for r in reports] == [7]


@pytest.mark.parametrize(
    "pairs",
    [
        (),
        (("X-RateLimit-Remaining", "lots"),),
        (("X-RateLimit-Remaining", "-3"),),
        (("X-RateLimit-Remaining", "inf"),),
        (("RateLimit", '"p";t=1'),),
        (("X-Shopify-Shop-Api-Call-Limit", "32"),),
        (("X-Shopify-Shop-Api-Call-Limit", "32/0"),),
        (("x-ratelimit-remaining-requests", ""),),
    ],
)
def test_what_cannot_be_read_is_ignored(pairs: tuple[tuple[str, str], ...]) -> None:
    assert read(*pairs) == ()


def test_an_unreadable_reset_leaves_the_rest() -> None:
    (r,) = read(("X-RateLimit-Remaining", "5"), ("X-RateLimit-Reset", "soon"))
    assert (r.remaining, r.reset) == (5, None)


def test_discord_fractional_epoch_reset() -> None:
    # Discord: X-RateLimit-Reset is an epoch with milliseconds as a fraction.
    (r,) = read(
        ("X-RateLimit-Limit", "5"),
        ("X-RateLimit-Remaining", "1"),
        ("X-RateLimit-Reset", f"{NOW + 1.25:.3f}"),
        ("X-RateLimit-Reset-After", "1.25"),
        ("X-RateLimit-Bucket", "abcd1234"),
    )
    assert (r.limit, r.remaining, r.window) == (5, 1, None)
    assert r.reset == pytest.approx(1.25, abs=0.001)


def test_reddit_fractional_remaining_and_delta_reset() -> None:
    (r,) = read(("x-ratelimit-used", "4"), ("x-ratelimit-remaining", "596.0"), ("x-ratelimit-reset", "204"))
    assert (r.limit, r.remaining, r.reset) == (None, 596, 204)


def test_openai_headers_as_sent_with_a_millisecond_reset() -> None:
    (r,) = read(
        ("x-ratelimit-limit-requests", "10000"),
        ("x-ratelimit-limit-tokens", "2000000"),
        ("x-ratelimit-remaining-requests", "9999"),
        ("x-ratelimit-remaining-tokens", "1999456"),
        ("x-ratelimit-reset-requests", "6ms"),
        ("x-ratelimit-reset-tokens", "16ms"),
    )
    assert (r.source, r.limit, r.remaining, r.window) == ("x-ratelimit-*-requests", 10000, 9999, 60)
    assert r.reset == pytest.approx(0.006)


def test_shopify_full_bucket() -> None:
    (r,) = read(("X-Shopify-Shop-Api-Call-Limit", "40/40"), ("Retry-After", "2.0"))
    assert (r.limit, r.remaining) == (40, 0)
