"""Worker-side helper: what did the quota-proxy (or the vendor behind it) just say?

``classify(response)`` turns a ``requests`` response that came through the proxy into an
:class:`Outcome`:

========================  ===========================================================
kind                      when
========================  ===========================================================
``ok``                    any status below 400
``deferred``              429 **with** ``X-Quota-Action`` (``defer``): the proxy kept the
                          request to stay inside the quota; nothing reached the vendor.
                          ``retry_after`` comes from ``X-Quota-Retry-After-Ms`` when
                          present (the real wait), else from ``Retry-After``.
                          ``reason`` is ``store-unavailable`` when the proxy's Redis is
                          down and it fails closed.
``shed``                  503 with ``X-Quota-Action: shed``: the proxy refused outright;
                          retrying soon is pointless, the job should be dead-lettered.
``vendor_throttled``      429 **without** ``X-Quota-Action``: the vendor itself refused.
                          ``retry_after`` is the vendor's ``Retry-After`` (seconds or an
                          HTTP-date, read against the vendor's ``Date``).
``error``                 anything else, or no response at all (``classify_exception``);
                          ``transient`` says whether a retry with backoff may help
                          (5xx, 408, timeouts, connection errors) or not (4xx).
========================  ===========================================================

:func:`retry_delay` gives the advised wait: the hint plus a small random jitter, so
workers refused at the same instant do not all come back at the same instant.
:func:`backoff` is exponential backoff with jitter for transient errors.
"""

from __future__ import annotations

import email.utils
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

import requests

__all__ = [
    "DEFAULT_DEFER_RETRY_AFTER",
    "DEFAULT_VENDOR_RETRY_AFTER",
    "Kind",
    "Outcome",
    "backoff",
    "classify",
    "classify_exception",
    "jitter",
    "parse_retry_after",
    "proxy_settings",
    "quota_headers",
    "retry_delay",
    "send",
]

ACTION: Final = "X-Quota-Action"
RETRY_AFTER_MS: Final = "X-Quota-Retry-After-Ms"
REASON: Final = "X-Quota-Reason"
LIMITER: Final = "X-Quota-Limiter"
ERROR: Final = "X-Quota-Error"
ON_LIMIT: Final = "X-Quota-On-Limit"
MAX_HOLD: Final = "X-Quota-Max-Hold"
DEFAULT_TENANT_HEADER: Final = "X-Tenant-Id"

DEFAULT_DEFER_RETRY_AFTER: Final = 1.0
"""Wait for a proxy defer without a usable hint (the proxy always sends one)."""
DEFAULT_VENDOR_RETRY_AFTER: Final = 10.0
"""Wait for a vendor 429 without a usable ``Retry-After`` (the proxy's own default)."""

JITTER_FRACTION: Final = 0.2
MIN_JITTER: Final = 0.1
MAX_JITTER: Final = 5.0

TRANSIENT_STATUSES: Final = frozenset({408, 425, 500, 502, 503, 504})
ON_LIMIT_CHOICES: Final = frozenset({"hold", "defer", "shed"})


class Kind(StrEnum):
    OK = "ok"
    DEFERRED = "deferred"
    SHED = "shed"
    VENDOR_THROTTLED = "vendor_throttled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One answer, classified. Times are seconds."""

    kind: Kind
    status: int | None = None
    """HTTP status; ``None`` when no response arrived (connection error, timeout)."""
    retry_after: float | None = None
    """The wait hint: for ``deferred`` the precise one (``X-Quota-Retry-After-Ms``, else
    ``Retry-After``); for ``vendor_throttled`` the vendor's ``Retry-After``."""
    retry_after_header: float | None = None
    """``Retry-After`` as sent (whole seconds from the proxy), ``None`` if absent or unusable."""
    limiter: str | None = None
    reason: str | None = None
    """``X-Quota-Reason`` (``store-unavailable``), ``X-Quota-Error``, or the exception's name."""
    transient: bool = False
    """For ``error``: worth a retry with backoff."""

    @property
    def ok(self) -> bool:
        return self.kind is Kind.OK

    @property
    def retryable(self) -> bool:
        return self.kind in (Kind.DEFERRED, Kind.VENDOR_THROTTLED) or (self.kind is Kind.ERROR and self.transient)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe, for task results, logs and dead-letter records."""
        return {
            "kind": str(self.kind),
            "status": self.status,
            "retry_after": self.retry_after,
            "retry_after_header": self.retry_after_header,
            "limiter": self.limiter,
            "reason": self.reason,
            "transient": self.transient,
        }


def parse_retry_after(value: str | None, date: str | None = None, now: datetime | None = None) -> float | None:
    """``Retry-After`` in seconds (RFC 9110 §10.2.3): delay-seconds or an HTTP-date.

    An HTTP-date is measured against ``date`` (the response's own ``Date``, so a skewed
    clock on either side does not matter) or else ``now``. Unusable values give ``None``;
    a date in the past gives 0.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    reference = None
    if date:
        try:
            reference = email.utils.parsedate_to_datetime(date)
        except (TypeError, ValueError, IndexError):
            reference = None
    if reference is None:
        reference = now or datetime.now(UTC)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if reference.tzinfo is None:
        reference = reference.replace(tzinfo=UTC)
    return max(0.0, (when - reference).total_seconds())


def _retry_after_ms(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        ms = int(value.strip())
    except ValueError:
        return None
    return ms / 1000 if ms >= 0 else None


def classify(response: requests.Response) -> Outcome:
    """Classify a response that came through quota-proxy (see the module docstring)."""
    status = response.status_code
    headers = response.headers
    action = headers.get(ACTION, "").strip().lower()
    limiter = headers.get(LIMITER) or None
    if status < 400:
        return Outcome(Kind.OK, status, limiter=limiter)
    retry_after_header = parse_retry_after(headers.get("Retry-After"), headers.get("Date"))
    if status == 429 and action:
        # The proxy's own refusal: only the proxy may send X-Quota-* (it strips them from
        # vendor responses), and a 429 from it always means "come back later".
        retry_after = _retry_after_ms(headers.get(RETRY_AFTER_MS))
        if retry_after is None:
            retry_after = retry_after_header if retry_after_header is not None else DEFAULT_DEFER_RETRY_AFTER
        return Outcome(Kind.DEFERRED, status, retry_after, retry_after_header, limiter, headers.get(REASON) or None)
    if status == 503 and action == "shed":
        return Outcome(Kind.SHED, status, limiter=limiter)
    if status == 429:
        retry_after = retry_after_header if retry_after_header is not None else DEFAULT_VENDOR_RETRY_AFTER
        return Outcome(Kind.VENDOR_THROTTLED, status, retry_after, retry_after_header, limiter)
    return Outcome(
        Kind.ERROR,
        status,
        limiter=limiter,
        reason=headers.get(ERROR) or action or None,
        transient=status in TRANSIENT_STATUSES,
    )


def classify_exception(exc: BaseException) -> Outcome:
    """No response: timeouts and connection failures are transient, the rest (a bad URL,
    an invalid header) are not."""
    transient = isinstance(exc, requests.Timeout | requests.ConnectionError)
    return Outcome(Kind.ERROR, None, reason=type(exc).__name__, transient=transient)


def jitter(delay: float, rng: random.Random | None = None) -> float:
    """``delay`` plus a random jitter in ``[0, spread)``, spread = 20 % of the delay,
    at least 100 ms and at most 5 s."""
    spread = min(MAX_JITTER, max(MIN_JITTER, JITTER_FRACTION * delay))
    return delay + (rng or random).uniform(0.0, spread)


def retry_delay(outcome: Outcome, *, precise: bool = False, rng: random.Random | None = None) -> float:
    """How long to wait before retrying a ``deferred`` or ``vendor_throttled`` outcome.

    Deferred, by default: at least ``Retry-After`` (whole seconds, ≥ the real wait) plus
    jitter; that is what a job queue should use as its countdown. ``precise=True`` uses the
    real wait (``X-Quota-Retry-After-Ms``) plus jitter instead, for a caller that retries
    in-process and wants the token the moment it is free. Vendor throttled: the vendor's
    ``Retry-After`` plus jitter (the proxy blocks the whole fleet for that long anyway).
    """
    if outcome.retry_after is None or outcome.kind not in (Kind.DEFERRED, Kind.VENDOR_THROTTLED):
        raise ValueError(f"no retry hint in a {outcome.kind} outcome")
    base = outcome.retry_after
    if outcome.kind is Kind.DEFERRED and not precise and outcome.retry_after_header is not None:
        base = max(base, outcome.retry_after_header)
    return jitter(base, rng)


def backoff(attempt: int, *, base: float = 1.0, cap: float = 300.0, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter for transient errors: ``d = min(cap, base * 2**attempt)``,
    a wait in ``[d/2, d]`` (attempt 0 is the first retry)."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(cap, base * 2.0 ** min(attempt, 62))
    return ceiling / 2 + (rng or random).uniform(0.0, ceiling / 2)


def quota_headers(
    *,
    tenant: str | None = None,
    on_limit: str | None = None,
    max_hold: float | str | None = None,
    tenant_header: str = DEFAULT_TENANT_HEADER,
) -> dict[str, str]:
    """Request headers for the proxy: the tenant, and this request's choice when the quota
    binds (``hold``/``defer``/``shed``) and longest hold (seconds or ``"250ms"``; the
    vendor's ``max_hold`` caps it). The proxy strips them all before forwarding."""
    headers: dict[str, str] = {}
    if tenant is not None:
        headers[tenant_header] = tenant
    if on_limit is not None:
        if on_limit not in ON_LIMIT_CHOICES:
            raise ValueError(f"on_limit must be one of {sorted(ON_LIMIT_CHOICES)}, not {on_limit!r}")
        headers[ON_LIMIT] = on_limit
    if max_hold is not None:
        if isinstance(max_hold, str):
            headers[MAX_HOLD] = max_hold
        else:
            if not math.isfinite(max_hold) or max_hold < 0:
                raise ValueError(f"max_hold must be a non-negative number of seconds, not {max_hold!r}")
            headers[MAX_HOLD] = f"{round(max_hold * 1000)}ms"
    return headers


def proxy_settings(explicit: str | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """``proxies=`` for requests: ``explicit``, else ``$QUOTA_PROXY_URL``, else ``None``
    (requests then uses ``HTTP_PROXY``/``HTTPS_PROXY`` from the environment, which is
    how most workers reach the proxy without any code change)."""
    url = explicit or (os.environ if environ is None else environ).get("QUOTA_PROXY_URL")
    return {"http": url, "https": url} if url else None


def send(session: requests.Session, method: str, url: str, **kwargs: Any) -> tuple[Outcome, requests.Response | None]:
    """``session.request(...)`` classified; a request that raised gives ``(outcome, None)``."""
    try:
        response = session.request(method, url, **kwargs)
    except requests.RequestException as exc:
        return classify_exception(exc), None
    return classify(response), response
