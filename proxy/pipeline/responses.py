"""Every answer the proxy gives in its own name: one place for what each one says.

The refusal says what the answer is (its status, error type, code, whether to retry:
wire/refusals.py); this module turns it into an ``Answer`` (the sentence for a person, the
generic body keys, the X-Quota-* and retry headers) and the vendor's dialect writes it
(wire/answers.py). A vendor's own 429 never carries X-Quota-Action, so a worker can tell
the two apart.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from aiohttp import web

from proxy.policy.model import Vendor
from proxy.policy.presets import GENERIC, AnswerKind
from proxy.wire import headers as h
from proxy.wire.answers import Answer, render
from proxy.wire.refusals import (
    BadRequest,
    BodyTimeout,
    Denied,
    InternalError,
    Limited,
    ProxyAuthRequired,
    Refusal,
    StoreDown,
    UpstreamFailed,
)

if TYPE_CHECKING:
    from proxy.wire.responder import Responder

_NO_VENDOR: Final = Vendor(name="")
PROXY_CHALLENGE: Final = 'Basic realm="quota-proxy"'
"""What a 407 asks for (RFC 9110 §11.7.1): Basic credentials, as HTTP_PROXY=http://user:secret@... sends them."""


def retry_after_seconds(wait: float) -> int:
    """Whole seconds, at least 1 and at least the real wait."""
    return max(1, math.ceil(wait - 1e-9))


def _ms(seconds: float) -> int:
    """Milliseconds, at least 1 and at least ``seconds``."""
    return max(1, math.ceil(seconds * 1000 - 1e-6))


def refusal_response(refusal: Refusal, vendor: Vendor | None) -> web.Response:
    """The answer to a refused request, in ``vendor``'s dialect (generic without a vendor)."""
    answer = _answer(refusal, vendor)
    response = render(answer, vendor.answers if vendor is not None else GENERIC)
    if refusal.reason_phrase:
        response.set_status(response.status, refusal.reason_phrase)
    return response


def _answer(refusal: Refusal, vendor: Vendor | None) -> Answer:
    limiter = vendor.name if vendor is not None else None
    match refusal:
        case Limited(action="shed"):
            over = _over_quota(limiter, refusal.scope, refusal.bucket)
            message = f"{over}: the request was shed (not sent); do not retry it now"
            return _plain(
                refusal,
                message,
                {"action": "shed", "limiter": limiter, "scope": refusal.scope, "bucket": refusal.bucket},
                {h.ACTION: "shed", h.LIMITER: limiter or "", h.SCOPE: refusal.scope},
                vendor,
            )
        case Limited():
            return _defer(
                refusal,
                vendor or _NO_VENDOR,
                _over_quota(limiter, refusal.scope, refusal.bucket),
                {"scope": refusal.scope, "bucket": refusal.bucket},
                {h.SCOPE: refusal.scope},
            )
        case StoreDown():
            why = f"{limiter}: the quota store is unavailable and the policy fails closed, so nothing is sent"
            return _defer(
                refusal, vendor or _NO_VENDOR, why, {"reason": "store-unavailable"}, {h.REASON: "store-unavailable"}
            )
        case Denied():
            message = f"{refusal.detail} (the proxy sends only what its policy allows)"
            return _plain(refusal, message, {"action": "deny", "detail": refusal.detail}, {h.ACTION: "deny"}, vendor)
        case ProxyAuthRequired():
            message = (
                f"{refusal.detail}: this proxy takes the tenant from proxy credentials "
                "(HTTP_PROXY=http://TENANT:SECRET@proxy:port)"
            )
            return _plain(
                refusal,
                message,
                {"action": "deny", "detail": refusal.detail},
                {h.ACTION: "deny", h.PROXY_AUTHENTICATE: PROXY_CHALLENGE},
                vendor,
            )
        case BadRequest():
            return _plain(refusal, f"bad request: {refusal.detail}", {"detail": refusal.detail}, {}, vendor)
        case BodyTimeout():
            message = f"{refusal.detail}: the vendor never got the request whole; send it again"
            return _plain(refusal, message, {"detail": refusal.detail}, {h.REASON: "request-timeout"}, vendor)
        case UpstreamFailed():
            if not refusal.reached:
                advice = "the request was not sent (safe to retry)"
            elif refusal.retry:
                advice = "the vendor may have processed the request (idempotent: safe to retry)"
            else:
                advice = "the vendor may have processed the request: do not resend it without an Idempotency-Key"
            return _plain(
                refusal,
                f"{refusal.detail}: {advice}",
                {"limiter": limiter, "detail": refusal.detail},
                {h.ERROR: refusal.kind, **({h.LIMITER: limiter} if limiter else {})},
                vendor,
            )
        case InternalError():
            return _plain(
                refusal,
                f"{refusal.detail} (see the proxy's log); the request may have been sent",
                {"limiter": limiter, "detail": refusal.detail},
                {h.ERROR: "proxy-error"},
                vendor,
            )
    raise TypeError(f"unknown refusal {refusal!r}")


def _kind(refusal: Refusal) -> AnswerKind:
    """The preset template a refusal that is not a defer is written with."""
    if isinstance(refusal, Limited):
        return "shed"
    if isinstance(refusal, Denied | ProxyAuthRequired):
        return "deny"
    if isinstance(refusal, UpstreamFailed | InternalError):
        return "upstream_error"
    return "bad_request"


def _over_quota(limiter: str | None, scope: str, bucket: str) -> str:
    if scope == "tunnels":
        return f"{limiter or 'the vendor'} has no free tunnel ({bucket})"
    if scope == "tenants":
        return f"{limiter or 'the vendor'} has no room for another tenant ({bucket})"
    if scope == "concurrency":
        return f"{limiter or 'the vendor'} has as many requests in flight as it allows ({bucket})"
    return f"{limiter or 'the vendor'} is over its quota ({bucket})"


def _plain(
    refusal: Refusal, message: str, fields: dict[str, object], headers: dict[str, str], vendor: Vendor | None
) -> Answer:
    return Answer(
        refusal.status,
        refusal.error,
        refusal.code,
        message,
        refusal.retry,
        fields,
        headers,
        _kind(refusal),
        (vendor.name or None) if vendor is not None else None,
    )


def _defer(
    refusal: Limited | StoreDown, vendor: Vendor, why: str, extra: dict[str, object], headers: dict[str, str]
) -> Answer:
    """A 429 that says when to come back: ``retry-after-ms`` the caller's slot (the hint),
    ``Retry-After`` whole seconds at least that, ``X-Quota-Retry-After-Ms`` the real wait.
    A hint beyond the vendor's ``answers_max_wait`` says "do not retry" (re-enqueue)."""
    wait = refusal.retry_after
    hint = refusal.hint if isinstance(refusal, Limited) and refusal.hint is not None else wait
    seconds, hint_ms = retry_after_seconds(hint), _ms(hint)
    retry = hint <= vendor.answers_max_wait
    message = f"{why}; retry in {math.ceil(hint_ms / 10) / 100:.2f} s"  # never before the hint
    if not retry:
        message += " (longer than one call should wait: re-enqueue the job)"
    limiter = vendor.name or None
    quota = refusal.quota.fields() if refusal.quota is not None else {}
    return Answer(
        refusal.status,
        refusal.error,
        refusal.code,
        message,
        retry,
        {"action": "defer", "limiter": limiter, "retry_after": seconds, "retry_after_ms": hint_ms, **extra},
        {
            h.RETRY_AFTER: str(seconds),
            h.HINT_MS: str(hint_ms),
            h.ACTION: "defer",
            h.RETRY_AFTER_MS: str(_ms(wait)),
            h.LIMITER: limiter or "",
            **headers,
            **quota,
        },
        "defer" if retry else "long_defer",
        limiter,
    )


async def write_answer(responder: Responder, answer: web.Response) -> None:
    """One of the proxy's own answers (``refusal_response``), written whole."""
    body = answer.body if isinstance(answer.body, bytes) else b""
    await responder.send(answer.status, answer.reason, answer.headers.items(), body)
