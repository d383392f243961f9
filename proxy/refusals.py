"""Why the proxy answers a request itself instead of forwarding it.

    Refusal             status   outcome          error
    ├── BadRequest      400      denied           bad_request     malformed target, tenant or X-Quota-* header
    ├── Denied          403      denied           forbidden       no vendor matches (never an open proxy)
    ├── Limited         429/503  deferred/shed    rate_limited    the buckets are empty: defer or shed
    ├── StoreDown       429      deferred         rate_limited    store unavailable and on_failure: closed
    ├── UpstreamFailed  502/504  error            upstream_*      the vendor unreachable, timed out, bad TLS
    └── InternalError   500      error            proxy_error     a bug in the proxy (logged with its traceback)

Each refusal carries what the rest of the proxy needs to know about it, so nothing
else has to ask which kind it is: ``status``, the ``outcome`` it is counted and
logged as (SPEC §7), the ``error`` type its answer names, and ``detail``, the
sentence for a person (in the answer and the access log; None for Limited, whose
answer names its bucket instead). ``responses.refusal_response`` renders the answer;
``ledger.Ledger.refuse`` does the accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.policy.model import Action

Outcome = Literal["deferred", "shed", "denied", "error"]
"""How a refused request is counted: ``ratelimit_requests_total{outcome}`` and the access log."""


class Refusal(Exception):
    """A request the proxy answers itself."""

    status: int
    """The answer's HTTP status."""
    outcome: Outcome
    error: str
    """The answer's error type (rate_limited, forbidden, bad_request, upstream_..., proxy_error)."""
    detail: str | None
    tls_error: str | None = None
    """The ``ratelimit_tls_errors_total`` reason this refusal counts as, if it is a TLS failure."""


@dataclass
class BadRequest(Refusal):
    """The request cannot be understood: 400."""

    detail: str
    status = 400
    outcome = "denied"
    error = "bad_request"


@dataclass
class Denied(Refusal):
    """No vendor matches the target, or CONNECT is not allowed: 403."""

    detail: str
    host: str = ""
    status = 403
    outcome = "denied"
    error = "forbidden"


@dataclass
class Limited(Refusal):
    """The buckets refused: defer (429 + Retry-After) or shed (503)."""

    action: Action
    retry_after: float
    """Seconds until every bucket could grant (the real wait)."""
    scope: str
    bucket: str
    hint: float | None = None
    """Seconds until this caller's slot in the deferral queue, when it has one: when to
    retry (never before ``retry_after``). None: the real wait is the hint."""
    error = "rate_limited"
    detail = None

    def __post_init__(self) -> None:
        self.status, self.outcome = (503, "shed") if self.action == "shed" else (429, "deferred")
        if self.hint is None or self.hint < self.retry_after:
            self.hint = self.retry_after


@dataclass
class StoreDown(Refusal):
    """The store is unavailable and the policy fails closed: 429, store-unavailable."""

    retry_after: float
    detail: str
    status = 429
    outcome = "deferred"
    error = "rate_limited"


@dataclass
class UpstreamFailed(Refusal):
    """The vendor could not be reached (502) or did not answer in time (504)."""

    status: int
    kind: str
    """upstream-unreachable, upstream-timeout or upstream-tls (the X-Quota-Error header)."""
    detail: str
    outcome = "error"

    def __post_init__(self) -> None:
        self.error = self.kind.replace("-", "_")
        if self.kind == "upstream-tls":
            self.tls_error = "upstream_verify"


@dataclass
class InternalError(Refusal):
    """The proxy itself failed: 500, never forwarded."""

    detail: str
    status = 500
    outcome = "error"
    error = "proxy_error"
