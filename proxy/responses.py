"""Every answer the proxy gives in its own name: one place for bodies and headers.

The refusal says what the answer is (its status, error type and detail: refusals.py);
this module says how it is written. A vendor's own 429 never carries X-Quota-Action,
so a worker can tell the two apart.
"""

from __future__ import annotations

import json
import math

from aiohttp import web

from proxy import headers as h
from proxy.refusals import BadRequest, Denied, InternalError, Limited, Refusal, StoreDown, UpstreamFailed


def retry_after_seconds(wait: float) -> int:
    """Whole seconds, at least 1 and at least the real wait."""
    return max(1, math.ceil(wait - 1e-9))


def _json(refusal: Refusal, body: dict[str, object], headers: dict[str, str]) -> web.Response:
    return web.Response(
        status=refusal.status,
        body=json.dumps({"error": refusal.error, **body}, separators=(",", ":")).encode(),
        content_type="application/json",
        headers=headers,
    )


def refusal_response(refusal: Refusal, limiter: str | None) -> web.Response:
    match refusal:
        case Limited(action="shed"):
            return _json(
                refusal,
                {"action": "shed", "limiter": limiter, "scope": refusal.scope, "bucket": refusal.bucket},
                {h.ACTION: "shed", h.LIMITER: limiter or "", h.SCOPE: refusal.scope},
            )
        case Limited():
            return _defer(
                refusal, limiter, {"scope": refusal.scope, "bucket": refusal.bucket}, {h.SCOPE: refusal.scope}
            )
        case StoreDown():
            return _defer(refusal, limiter, {"reason": "store-unavailable"}, {h.REASON: "store-unavailable"})
        case Denied():
            return _json(refusal, {"action": "deny", "detail": refusal.detail}, {h.ACTION: "deny"})
        case BadRequest():
            return _json(refusal, {"detail": refusal.detail}, {})
        case UpstreamFailed():
            extra = {h.LIMITER: limiter} if limiter else {}
            return _json(refusal, {"limiter": limiter, "detail": refusal.detail}, {h.ERROR: refusal.kind, **extra})
        case InternalError():
            return _json(refusal, {"limiter": limiter, "detail": refusal.detail}, {h.ERROR: "proxy-error"})
    raise TypeError(f"unknown refusal {refusal!r}")


def _defer(
    refusal: Limited | StoreDown, limiter: str | None, extra: dict[str, object], headers: dict[str, str]
) -> web.Response:
    wait = refusal.retry_after
    hint = refusal.hint if isinstance(refusal, Limited) and refusal.hint is not None else wait
    seconds = retry_after_seconds(hint)
    hint_ms = max(1, math.ceil(hint * 1000))
    return _json(
        refusal,
        {"action": "defer", "limiter": limiter, "retry_after": seconds, "retry_after_ms": hint_ms, **extra},
        {
            h.RETRY_AFTER: str(seconds),
            h.HINT_MS: str(hint_ms),
            h.ACTION: "defer",
            h.RETRY_AFTER_MS: str(max(1, math.ceil(wait * 1000))),
            h.LIMITER: limiter or "",
            **headers,
        },
    )
