"""``quota-proxy check --answers``: each kind of the proxy's own answers for a vendor, as
its workers will see it (status line, headers, body), written by the same code that
writes them when it runs, for a sample refusal of that kind."""

from __future__ import annotations

from aiohttp import web

from proxy.pipeline.refusals import BadRequest, Denied, Limited, Refusal, UpstreamFailed
from proxy.pipeline.responses import refusal_response
from proxy.policy.durations import format_duration
from proxy.policy.model import Vendor
from proxy.policy.presets import KINDS, AnswerKind

_KIND_NAMES: dict[AnswerKind, str] = {
    "defer": "defer",
    "long_defer": "long defer",
    "shed": "shed",
    "deny": "deny",
    "bad_request": "bad request",
    "upstream_error": "upstream error",
}


def sample(vendor: Vendor, kind: AnswerKind) -> tuple[str, Refusal]:
    """A refusal of ``kind`` for ``vendor``, and when it happens."""
    bucket = f"global {vendor.limits[0].rate:g}/{format_duration(vendor.limits[0].per)}" if vendor.limits else "global"
    if kind == "defer":
        return "the buckets are empty, the wait is short", Limited("defer", 0.25, "global", bucket, hint=0.25)
    if kind == "long_defer":
        wait = vendor.answers_max_wait * 2
        return (
            f"a wait beyond answers_max_wait ({format_duration(vendor.answers_max_wait)})",
            Limited("defer", wait, "global", bucket, hint=wait),
        )
    if kind == "shed":
        return "the buckets are empty and the action is shed", Limited("shed", 0.25, "global", bucket)
    if kind == "deny":
        return "no vendor matches", Denied("no vendor in the policy matches 'other.example'", "other.example")
    if kind == "bad_request":
        return "a malformed request", BadRequest("bad X-Quota-On-Limit 'soon': expected hold, defer or shed")
    return "the vendor did not answer in time (a POST)", UpstreamFailed(
        504, "upstream-timeout", f"{vendor.name} did not answer in time", reached=True
    )


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
