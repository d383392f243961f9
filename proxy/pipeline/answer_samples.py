"""``quota-proxy check --answers``: each kind of the proxy's own answers for a vendor, as
its workers will see it (status line, headers, body), written by the same code that
writes them when it runs, for a sample refusal of that kind."""

from __future__ import annotations

from aiohttp import web

from proxy.limiter.buckets import buckets_for
from proxy.limiter.store import AcquireResult
from proxy.pipeline.decide import Defer, Shed, decide, refusal
from proxy.pipeline.ratelimit_fields import request_limits
from proxy.pipeline.responses import refusal_response
from proxy.policy.durations import format_duration
from proxy.policy.model import Action, Vendor, Wish
from proxy.policy.presets import KINDS, AnswerKind
from proxy.wire.refusals import BadRequest, Denied, Refusal, UpstreamFailed

_KIND_NAMES: dict[AnswerKind, str] = {
    "defer": "defer",
    "long_defer": "long defer",
    "shed": "shed",
    "deny": "deny",
    "bad_request": "bad request",
    "upstream_error": "upstream error",
}


SAMPLE_TENANT = "default"
"""The tenant of the samples: whose buckets a refusal names when its own bucket refused."""


def sample(vendor: Vendor, kind: AnswerKind) -> tuple[str, Refusal]:
    """A refusal of ``kind`` for ``vendor``, and when it happens."""
    if kind == "defer":
        return "the buckets are empty, the wait is short", _limited(vendor, "defer", 0.25)
    if kind == "long_defer":
        return (
            f"a wait beyond answers_max_wait ({format_duration(vendor.answers_max_wait)})",
            _limited(vendor, "defer", vendor.answers_max_wait * 2),
        )
    if kind == "shed":
        return "the buckets are empty and the action is shed", _limited(vendor, "shed", 0.25)
    if kind == "deny":
        return "no vendor matches", Denied("no vendor in the policy matches 'other.example'", "other.example")
    if kind == "bad_request":
        return "a malformed request", BadRequest("bad X-Quota-On-Limit 'soon': expected hold, defer or shed")
    return "the vendor did not answer in time (a POST)", UpstreamFailed(
        504, "upstream-timeout", f"{vendor.name} did not answer in time", reached=True
    )


def _limited(vendor: Vendor, action: Action, wait: float) -> Refusal:
    """What the request path makes of a store that refused ``wait`` seconds on the vendor's
    first global bucket (the others, and the tenant's, have room): the same buckets, decision
    and refusal as a real one (handler.py), so the labels and RateLimit fields are the real ones."""
    buckets = buckets_for("", vendor, SAMPLE_TENANT)
    limits = request_limits(vendor, SAMPLE_TENANT)
    binding = buckets.tenant_count  # the first global bucket
    levels = [float(limit.burst) - 1 for limit, _ in limits]
    # Refused with this wait for one token: the level reservations took it down to.
    levels[binding] = 1 - wait * limits[binding][0].per_second
    result = AcquireResult(False, wait, binding, tuple(levels), hint=wait)
    decision = decide(result, Wish(action, 0.0))
    assert isinstance(decision, Defer | Shed)  # refused: never a grant
    return refusal(decision, result, buckets, limits)


def describe(vendor: Vendor) -> str:
    """Every kind of answer for ``vendor``, as its workers will see it."""
    lines = [f"vendor {vendor.name}: answers {vendor.answers.name}"]
    for kind in KINDS:
        when, refusal = sample(vendor, kind)
        answer = refusal_response(refusal, vendor)
        lines.append(f"  {_KIND_NAMES[kind]} ({when}):")
        lines += [f"    {line}" for line in _wire(answer)]
    return "\n".join(lines)


def _wire(answer: web.Response) -> list[str]:
    body = answer.body if isinstance(answer.body, bytes) else b""
    head = [f"HTTP/1.1 {answer.status} {answer.reason}"]
    head += [f"{name}: {value}" for name, value in answer.headers.items()]
    return [*head, "", body.decode()]
