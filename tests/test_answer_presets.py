"""Answer presets (SPEC §9, policy/presets.py): the built-in ones written byte for byte as
the dialects they replace wrote them, and each kind of answer as its SDK reads it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.pipeline.responses import refusal_response
from proxy.policy.presets import BUILT_IN
from proxy.wire.refusals import Limited, StoreDown, UpstreamFailed
from tests.test_answers import QUOTA, REFUSALS, VENDOR

GOLDEN = json.loads((Path(__file__).parent / "golden" / "answers.json").read_text())
"""Every refusal in the generic, stripe and openai dialects as they were written before
presets (status, reason, headers in order, body bytes)."""

CASES = {
    **REFUSALS,
    "long-defer": Limited("defer", 90.0, "global", "global 100/1s burst 10", hint=95.0),
    "long-store-down": StoreDown(120.0, "store unavailable: circuit breaker open", QUOTA),
    "idempotent-timeout": UpstreamFailed(
        504, "upstream-timeout", "payments did not answer in time", reached=True, idempotent=True
    ),
}


def written(refusal: Any, vendor: Any) -> dict[str, Any]:
    r = refusal_response(refusal, vendor)
    assert isinstance(r.body, bytes)
    return {
        "status": r.status,
        "reason": r.reason,
        "headers": [list(kv) for kv in r.headers.items()],
        "body": r.body.decode(),
    }


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_the_dialects_presets_replace_are_written_byte_for_byte(key: str) -> None:
    dialect, case, *rest = key.split("/")
    vendor = None if rest else replace(VENDOR, answers=BUILT_IN[dialect])
    assert written(CASES[case], vendor) == GOLDEN[key]


SHED = CASES["shed"]
DEFER = CASES["defer"]
LONG = CASES["long-defer"]


def body_of(refusal: Any, preset: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    r = refusal_response(refusal, replace(VENDOR, answers=BUILT_IN[preset]))
    assert isinstance(r.body, bytes)
    return r.status, dict(r.headers), json.loads(r.body)


def test_github_a_defer_is_githubs_own_rate_limit_a_shed_and_a_long_defer_are_not_retried() -> None:
    # PyGithub's GithubRetry retries 5xx always, 403 with Retry-After or a rate-limit message,
    # and 413/429/503 with Retry-After: a shed (never with Retry-After) is a 429, a long
    # defer (with it) a 409; a defer is GitHub's own 403 "API rate limit exceeded".
    status, headers, body = body_of(DEFER, "github")
    assert status == 403 and headers["Retry-After"] == "1"
    assert body["message"].startswith("API rate limit exceeded (payments is over its quota")
    status, headers, body = body_of(SHED, "github")
    assert status == 429 and "Retry-After" not in headers and body["action"] == "shed"
    status, headers, body = body_of(LONG, "github")
    assert status == 409 and headers["Retry-After"] == "95" and body["retry_after"] == 95
    status, _, body = body_of(CASES["deny"], "github")
    assert status == 403 and not body["message"].startswith("API rate limit")


def test_slack_errors_are_strings_and_only_a_defer_is_a_429() -> None:
    for refusal, expected in ((DEFER, 429), (SHED, 409), (LONG, 409)):
        status, _, body = body_of(refusal, "slack")
        assert (status, body["ok"], body["error"]) == (expected, False, "ratelimited")
    status, _, body = body_of(CASES["timeout"], "slack")
    assert (status, body["error"]) == (504, "upstream_timeout")


def test_anthropic_speaks_its_own_error_body() -> None:
    for refusal, kind in ((DEFER, "rate_limit_error"), (SHED, "rate_limit_error"), (CASES["deny"], "permission_error")):
        _, headers, body = body_of(refusal, "anthropic")
        assert body["type"] == "error" and body["error"]["type"] == kind
        assert "Stripe-Should-Retry" not in headers
    assert body_of(SHED, "anthropic")[1]["x-should-retry"] == "false"
