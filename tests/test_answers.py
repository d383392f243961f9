"""The proxy's own answers in each dialect (SPEC §5, §9): status, headers and body for
every refusal kind, as ``responses.refusal_response`` writes them."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from proxy.pipeline.responses import refusal_response
from proxy.policy.model import Vendor
from proxy.policy.presets import BUILT_IN
from proxy.wire.ratelimit_item import QuotaItem
from proxy.wire.refusals import (
    BadRequest,
    Denied,
    InternalError,
    Limited,
    ProxyAuthRequired,
    Refusal,
    StoreDown,
    UnknownTenant,
    UpstreamFailed,
)

AnswerDialect = str

VENDOR = Vendor(name="payments", hosts=("api.payments.example",))
QUOTA = QuotaItem("quota-proxy-global-100-1s", 100, 1, 0, 1)

REFUSALS: dict[str, Refusal] = {
    "defer": Limited("defer", 0.3, "global", "global 100/1s burst 10", hint=0.42, quota=QUOTA),
    "shed": Limited("shed", 0.3, "global", "global 100/1s burst 10", quota=QUOTA),
    "store-down": StoreDown(1.0, "store unavailable: circuit breaker open", QUOTA),
    "deny": Denied("no vendor in the policy matches 'other.example'", "other.example"),
    "bad-request": BadRequest("bad X-Quota-On-Limit 'soon': expected hold, defer or shed"),
    "refused": UpstreamFailed(502, "upstream-unreachable", "payments: cannot connect: refused", reached=False),
    "timeout": UpstreamFailed(504, "upstream-timeout", "payments did not answer in time", reached=True),
    "bug": InternalError("internal proxy error"),
    "proxy-auth": ProxyAuthRequired("proxy credentials required"),
    "unknown-tenant": UnknownTenant("unknown tenant 'x' in X-Tenant-Id"),
    "no-seat": Limited("defer", 30.0, "tenants", "tenant.max_active 10000 reached"),
}

STATUS = {
    "defer": 429,
    "shed": 503,
    "store-down": 429,
    "deny": 403,
    "bad-request": 400,
    "refused": 502,
    "timeout": 504,
    "bug": 500,
    "proxy-auth": 407,
    "unknown-tenant": 400,
    "no-seat": 429,
}
RETRY = {
    "defer": "true",
    "shed": "false",  # shedding must not be undone by SDK retries
    "store-down": "true",
    "deny": "false",
    "bad-request": "false",
    "refused": "true",  # never reached the vendor
    "timeout": "false",  # a POST the vendor may have processed
    "bug": "false",
    "proxy-auth": "false",
    "unknown-tenant": "false",
    "no-seat": "true",
}
MESSAGES = {
    "defer": "payments is over its quota (global 100/1s burst 10); retry in 0.42 s",
    "shed": "payments is over its quota (global 100/1s burst 10): the request was shed (not sent); do not retry it now",
    "store-down": (
        "payments: the quota store is unavailable and the policy fails closed, so nothing is sent; retry in 1.00 s"
    ),
    "deny": "no vendor in the policy matches 'other.example' (the proxy sends only what its policy allows)",
    "bad-request": "bad request: bad X-Quota-On-Limit 'soon': expected hold, defer or shed",
    "refused": "payments: cannot connect: refused: the request was not sent (safe to retry)",
    "timeout": (
        "payments did not answer in time: the vendor may have processed the request: "
        "do not resend it without an Idempotency-Key"
    ),
    "bug": "internal proxy error (see the proxy's log); the request may have been sent",
    "proxy-auth": (
        "proxy credentials required: this proxy takes the tenant from proxy credentials "
        "(HTTP_PROXY=http://TENANT:SECRET@proxy:port)"
    ),
    "unknown-tenant": "bad request: unknown tenant 'x' in X-Tenant-Id",
    "no-seat": "payments has no room for another tenant (tenant.max_active 10000 reached); retry in 30.00 s",
}
# (error.type, error.code) per dialect: what each SDK reads to pick its error class.
ERRORS: dict[AnswerDialect, dict[str, tuple[str, str]]] = {
    "generic": {
        "defer": ("rate_limited", "deferred"),
        "shed": ("rate_limited", "shed"),
        "store-down": ("rate_limited", "store_unavailable"),
        "deny": ("forbidden", "denied"),
        "bad-request": ("bad_request", "bad_request"),
        "refused": ("upstream_error", "upstream_unreachable"),
        "timeout": ("upstream_error", "upstream_timeout"),
        "bug": ("proxy_error", "internal_error"),
        "proxy-auth": ("forbidden", "proxy_auth_required"),
        "unknown-tenant": ("bad_request", "unknown_tenant"),
        "no-seat": ("rate_limited", "deferred"),
    },
    "stripe": {
        "defer": ("invalid_request_error", "rate_limit"),
        "shed": ("api_error", "rate_limit"),
        "store-down": ("invalid_request_error", "rate_limit"),
        "deny": ("invalid_request_error", "denied"),
        "bad-request": ("invalid_request_error", "bad_request"),
        "refused": ("api_error", "upstream_unreachable"),
        "timeout": ("api_error", "upstream_timeout"),
        "bug": ("api_error", "internal_error"),
        "proxy-auth": ("invalid_request_error", "proxy_auth_required"),
        "unknown-tenant": ("invalid_request_error", "unknown_tenant"),
        "no-seat": ("invalid_request_error", "rate_limit"),
    },
    "openai": {
        "defer": ("requests", "rate_limit_exceeded"),
        "shed": ("requests", "rate_limit_exceeded"),
        "store-down": ("requests", "rate_limit_exceeded"),
        "deny": ("invalid_request_error", "denied"),
        "bad-request": ("invalid_request_error", "bad_request"),
        "refused": ("server_error", "upstream_unreachable"),
        "timeout": ("server_error", "upstream_timeout"),
        "bug": ("server_error", "internal_error"),
        "proxy-auth": ("invalid_request_error", "proxy_auth_required"),
        "unknown-tenant": ("invalid_request_error", "unknown_tenant"),
        "no-seat": ("requests", "rate_limit_exceeded"),
    },
}
# The generic top-level keys, kept in every dialect.
FIELDS: dict[str, dict[str, object]] = {
    "defer": {
        "action": "defer",
        "limiter": "payments",
        "retry_after": 1,
        "retry_after_ms": 420,
        "scope": "global",
        "bucket": "global 100/1s burst 10",
    },
    "shed": {"action": "shed", "limiter": "payments", "scope": "global", "bucket": "global 100/1s burst 10"},
    "store-down": {
        "action": "defer",
        "limiter": "payments",
        "retry_after": 1,
        "retry_after_ms": 1000,
        "reason": "store-unavailable",
    },
    "deny": {"action": "deny", "detail": "no vendor in the policy matches 'other.example'"},
    "bad-request": {"detail": "bad X-Quota-On-Limit 'soon': expected hold, defer or shed"},
    "refused": {"limiter": "payments", "detail": "payments: cannot connect: refused"},
    "timeout": {"limiter": "payments", "detail": "payments did not answer in time"},
    "bug": {"limiter": "payments", "detail": "internal proxy error"},
    "proxy-auth": {"action": "deny", "detail": "proxy credentials required"},
    "unknown-tenant": {"detail": "unknown tenant 'x' in X-Tenant-Id"},
    "no-seat": {
        "action": "defer",
        "limiter": "payments",
        "retry_after": 30,
        "retry_after_ms": 30000,
        "scope": "tenants",
        "bucket": "tenant.max_active 10000 reached",
    },
}

DIALECTS: tuple[AnswerDialect, ...] = ("generic", "stripe", "openai")


def rendered(refusal: Refusal, vendor: Vendor | None) -> tuple[web.Response, dict[str, Any]]:
    resp = refusal_response(refusal, vendor)
    assert resp.content_type == "application/json"
    assert isinstance(resp.body, bytes)
    return resp, json.loads(resp.body)


def error_object(dialect: AnswerDialect, kind: str) -> dict[str, object]:
    type_, code = ERRORS[dialect][kind]
    message = MESSAGES[kind]
    if dialect == "openai":
        return {"message": message, "type": type_, "param": None, "code": code}
    return {"type": type_, "code": code, "message": message}


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_every_refusal_in_every_dialect(dialect: AnswerDialect, kind: str) -> None:
    resp, body = rendered(REFUSALS[kind], replace(VENDOR, answers=BUILT_IN[dialect]))
    assert resp.status == STATUS[kind]
    assert body == {"error": error_object(dialect, kind), "message": MESSAGES[kind], **FIELDS[kind]}
    assert resp.headers["x-should-retry"] == RETRY[kind]
    if dialect == "openai":
        assert "Stripe-Should-Retry" not in resp.headers
    else:  # generic speaks Stripe's too: its SDK retries every 5xx it is not told otherwise
        assert resp.headers["Stripe-Should-Retry"] == RETRY[kind]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_defer_says_when_to_come_back(dialect: AnswerDialect) -> None:
    resp, _ = rendered(REFUSALS["defer"], replace(VENDOR, answers=BUILT_IN[dialect]))
    assert resp.headers["Retry-After"] == "1"  # whole seconds, at least the hint
    assert resp.headers["retry-after-ms"] == "420"  # the hint: this caller's slot
    assert resp.headers["X-Quota-Retry-After-Ms"] == "300"  # the real wait
    assert resp.headers["X-Quota-Action"] == "defer"
    assert resp.headers["X-Quota-Limiter"] == "payments"
    assert resp.headers["X-Quota-Scope"] == "global"
    assert resp.headers["RateLimit-Policy"] == '"quota-proxy-global-100-1s";q=100;w=1'
    assert resp.headers["RateLimit"] == '"quota-proxy-global-100-1s";r=0;t=1'


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_shed_never_invites_a_retry(dialect: AnswerDialect) -> None:
    resp, _ = rendered(REFUSALS["shed"], replace(VENDOR, answers=BUILT_IN[dialect]))
    # urllib3 and other generic stacks retry a 503 that carries Retry-After.
    for name in ("Retry-After", "retry-after-ms", "X-Quota-Retry-After-Ms", "RateLimit", "RateLimit-Policy"):
        assert name not in resp.headers
    assert resp.headers["X-Quota-Action"] == "shed"


@pytest.mark.parametrize("dialect", DIALECTS)
def test_store_down_is_a_defer_with_its_reason(dialect: AnswerDialect) -> None:
    resp, _ = rendered(REFUSALS["store-down"], replace(VENDOR, answers=BUILT_IN[dialect]))
    assert resp.headers["X-Quota-Reason"] == "store-unavailable"
    assert resp.headers["X-Quota-Action"] == "defer"
    assert (resp.headers["Retry-After"], resp.headers["retry-after-ms"]) == ("1", "1000")
    assert "RateLimit" in resp.headers


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("kind", ["deny", "bad-request", "refused", "timeout", "bug"])
def test_answers_that_are_not_waits_carry_no_wait(dialect: AnswerDialect, kind: str) -> None:
    resp, _ = rendered(REFUSALS[kind], replace(VENDOR, answers=BUILT_IN[dialect]))
    for name in ("Retry-After", "retry-after-ms", "X-Quota-Retry-After-Ms", "RateLimit"):
        assert name not in resp.headers
    assert (resp.headers.get("X-Quota-Action") == "deny") == (kind == "deny")


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("kind", ["defer", "store-down"])
def test_a_wait_beyond_answers_max_wait_says_do_not_retry_but_keeps_the_wait(dialect: AnswerDialect, kind: str) -> None:
    vendor = replace(VENDOR, answers=BUILT_IN[dialect], answers_max_wait=0.4)  # shorter than either wait
    resp, body = rendered(REFUSALS[kind], vendor)
    assert resp.status == 429
    assert resp.headers["x-should-retry"] == "false"
    assert resp.headers.get("Stripe-Should-Retry", "false") == "false"
    assert resp.headers["Retry-After"] == "1" and body["retry_after"] == 1
    assert body["retry_after_ms"] == int(resp.headers["retry-after-ms"])
    assert body["message"].endswith("(longer than one call should wait: re-enqueue the job)")
    assert body["error"]["message"] == body["message"]


def test_a_wait_equal_to_answers_max_wait_is_still_retried() -> None:
    resp, _ = rendered(REFUSALS["defer"], replace(VENDOR, answers_max_wait=0.42))
    assert resp.headers["x-should-retry"] == "true"


def test_idempotent_requests_that_may_have_reached_the_vendor_are_retried() -> None:
    timeout = UpstreamFailed(504, "upstream-timeout", "payments did not answer in time", True, idempotent=True)
    resp, body = rendered(timeout, VENDOR)
    assert resp.headers["x-should-retry"] == "true"
    assert body["message"].endswith("the vendor may have processed the request (idempotent: safe to retry)")
    resp, _ = rendered(InternalError("internal proxy error", idempotent=True), VENDOR)
    assert resp.headers["x-should-retry"] == "true"


def test_without_a_vendor_the_answer_is_generic() -> None:
    resp, body = rendered(REFUSALS["deny"], None)
    assert resp.status == 403
    assert body["error"] == error_object("generic", "deny")
    assert resp.headers["Stripe-Should-Retry"] == "false"


def test_a_long_hint_is_shown_in_the_message_rounded_up() -> None:
    refusal = Limited("defer", 1.0, "tenant", "tenant acme 20/1s burst 20", hint=312.0041)
    _, body = rendered(refusal, VENDOR)
    assert body["retry_after"] == 313 and body["retry_after_ms"] == 312005
    assert body["message"] == (
        "payments is over its quota (tenant acme 20/1s burst 20); retry in 312.01 s"
        " (longer than one call should wait: re-enqueue the job)"
    )


def test_the_sentence_names_what_refused() -> None:
    tunnels = Limited("defer", 1.0, "tunnels", "max_tunnels 2 reached")
    assert (
        rendered(tunnels, VENDOR)[1]["message"]
        == "payments has no free tunnel (max_tunnels 2 reached); retry in 1.00 s"
    )
    blocked = Limited("defer", 2.5, "global", "vendor block: the vendor answered 429")
    assert rendered(blocked, VENDOR)[1]["message"] == (
        "payments is over its quota (vendor block: the vendor answered 429); retry in 2.50 s"
    )


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_407_challenges_for_basic_proxy_credentials(dialect: AnswerDialect) -> None:
    resp, _ = rendered(REFUSALS["proxy-auth"], replace(VENDOR, answers=BUILT_IN[dialect]))
    assert resp.headers["Proxy-Authenticate"] == 'Basic realm="quota-proxy"'
    assert resp.headers["X-Quota-Action"] == "deny"
