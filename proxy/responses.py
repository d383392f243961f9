"""Every answer the proxy gives in its own name: one place for bodies and headers.

A vendor's own 429 never carries X-Quota-Action, so a worker can tell the two apart.
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


def _json(status: int, body: dict[str, object], headers: dict[str, str]) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body, separators=(",", ":")).encode(),
        content_type="application/json",
        headers=headers,
    )


def refusal_response(refusal: Refusal, limiter: str | None) -> web.Response:
    if isinstance(refusal, Limited):
        if refusal.action == "shed":
            return _json(
                503,
                {"error": "rate_limited", "action": "shed", "limiter": limiter, "scope": refusal.scope,
                 "bucket": refusal.bucket},
                {h.ACTION: "shed", h.LIMITER: limiter or "", h.SCOPE: refusal.scope},
            )
        return _defer(limiter, refusal.retry_after, {"scope": refusal.scope, "bucket": refusal.bucket},
                      {h.SCOPE: refusal.scope})
    if isinstance(refusal, StoreDown):
        return _defer(limiter, refusal.retry_after, {"reason": "store-unavailable"},
                      {h.REASON: "store-unavailable"})
    if isinstance(refusal, Denied):
        return _json(403, {"error": "forbidden", "action": "deny", "detail": refusal.detail}, {h.ACTION: "deny"})
    if isinstance(refusal, BadRequest):
        return _json(400, {"error": "bad_request", "detail": refusal.detail}, {})
    if isinstance(refusal, UpstreamFailed):
        extra = {h.LIMITER: limiter} if limiter else {}
        return _json(
            refusal.status,
            {"error": refusal.kind.replace("-", "_"), "limiter": limiter, "detail": refusal.detail},
            {h.ERROR: refusal.kind, **extra},
        )
    if isinstance(refusal, InternalError):
        return _json(500, {"error": "proxy_error", "limiter": limiter, "detail": refusal.detail},
                     {h.ERROR: "proxy-error"})
    raise TypeError(f"unknown refusal {refusal!r}")


def _defer(limiter: str | None, wait: float, extra: dict[str, object], headers: dict[str, str]) -> web.Response:
    seconds = retry_after_seconds(wait)
    return _json(
        429,
        {"error": "rate_limited", "action": "defer", "limiter": limiter, "retry_after": seconds, **extra},
        {
            h.RETRY_AFTER: str(seconds),
            h.ACTION: "defer",
            h.RETRY_AFTER_MS: str(max(1, math.ceil(wait * 1000))),
            h.LIMITER: limiter or "",
            **headers,
        },
    )
