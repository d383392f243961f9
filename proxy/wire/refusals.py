"""Why the proxy answers a request itself instead of forwarding it.

    Refusal             status   outcome          error type       retry?
    ├── BadRequest      400      denied           bad_request      no: malformed target, tenant or X-Quota-* header
    │   └── UnknownTenant                                          no: a tenant the policy does not name (known_only)
    ├── BodyTimeout     408      error            bad_request      yes: the worker sent no byte of its body for
    │                                                              connections.idle_timeout (never whole at the vendor)
    ├── ProxyAuthRequired 407    denied           forbidden        no: missing or wrong proxy credentials (proxy_auth)
    ├── Denied          403      denied           forbidden        no: no vendor matches (never an open proxy)
    ├── Limited         429/503  deferred/shed    rate_limited     defer yes, shed no: the buckets are empty
    ├── StoreDown       429      deferred         rate_limited     yes: store unavailable and on_failure: closed
    ├── UpstreamFailed  502/504  error            upstream_error   only if it cannot have reached the vendor,
    │                                                              or is idempotent
    └── InternalError   500      error            proxy_error      only if idempotent: a bug in the proxy (logged)

Each refusal carries what the rest of the proxy needs to know about it, so nothing
else has to ask which kind it is: ``status``, the ``outcome`` it is counted and
logged as (SPEC §7), the ``error`` type and ``code`` its answer names (SPEC §5),
whether a client may ``retry`` it (SPEC §9), and ``detail``, the sentence for the
access log (None for Limited, whose answer names its bucket instead). A deferral or a
shed also says its ``reason`` (``REASONS``: which limit said no), by which the live page
counts them. ``pipeline.responses.refusal_response`` renders the answer;
``pipeline.ledger.Ledger.refuse`` does the accounting.

This is the refusal vocabulary every layer above the wire uses (quota raises ``Limited``
and the tenancy refusals, the wire answers a turned-away connection): it lives here, at the
bottom of the request path, so that none of them imports upward (ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from proxy.policy.model import Action
from proxy.policy.presets import OWN_STATUS
from proxy.wire.ratelimit_item import QuotaItem

Outcome = Literal["deferred", "shed", "denied", "error"]
"""How a refused request is counted: ``ratelimit_requests_total{outcome}`` and the access log."""

ErrorType = Literal["rate_limited", "forbidden", "bad_request", "upstream_error", "proxy_error"]
"""The ``error.type`` of an answer the proxy writes itself (SPEC §5)."""

REASONS: Final = ("tenant", "global", "endpoint", "concurrency", "vendor_block", "drain", "store_unavailable")
"""Why a request was deferred or shed (/status ``refusals``): its tenant's limits (or no free
``tenant.max_active`` seat), the vendor's global limits, its endpoint class's limits, a
concurrency cap (or ``max_tunnels``), a block after a vendor 429, the global buckets
refilling after a drain (the vendor's remaining quota fell below ``low_watermark``), the
store unavailable with ``on_failure: closed``."""
_BY_SCOPE: Final = {"tenants": "tenant", "tunnels": "concurrency"}


class Refusal(Exception):
    """A request the proxy answers itself."""

    status: int
    """The answer's HTTP status."""
    outcome: Outcome
    error: ErrorType
    """The answer's ``error.type``."""
    code: str
    """The answer's ``error.code``: which refusal of its type, for programs."""
    retry: bool
    """Whether a client may send the request again (``x-should-retry``; a long defer is
    turned into "do not retry" where it is written, per vendor)."""
    detail: str | None
    tls_error: str | None = None
    """The ``ratelimit_tls_errors_total`` reason this refusal counts as, if it is a TLS failure."""
    reason_phrase: str | None = None
    """The status line's reason, when the standard one says too little: a refused CONNECT,
    whose body HTTP clients do not show (``Tunnel connection failed: 403 ...``)."""
    reason: str = ""
    """Of a deferral or a shed: one of ``REASONS``."""


@dataclass
class BadRequest(Refusal):
    """The request cannot be understood: 400."""

    detail: str
    status = 400
    outcome = "denied"
    error = "bad_request"
    code = "bad_request"
    retry = False


@dataclass
class BodyTimeout(Refusal):
    """The worker sent no byte of its request body for ``connections.idle_timeout``: 408.
    The vendor never got the request whole, so it cannot have acted on it: a retry is safe."""

    detail: str
    status = 408
    error = "bad_request"
    outcome = "error"
    code = "request_timeout"
    retry = True


@dataclass
class UnknownTenant(BadRequest):
    """``tenant.known_only``: the request names a tenant the policy does not: 400."""

    code = "unknown_tenant"


@dataclass
class ProxyAuthRequired(Refusal):
    """``tenant.from: proxy_auth``: no usable proxy credentials: 407 and a Basic challenge.

    ``detail`` never holds the secret nor the user name: which users exist is not told."""

    detail: str
    status = 407
    outcome = "denied"
    error = "forbidden"
    code = "proxy_auth_required"
    retry = False


@dataclass
class Denied(Refusal):
    """No vendor matches the target, or CONNECT is not allowed: 403."""

    detail: str
    host: str = ""
    status = 403
    outcome = "denied"
    error = "forbidden"
    code = "denied"
    retry = False


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
    quota: QuotaItem | None = None
    """The refusing bucket as the RateLimit fields describe it, if it is a bucket."""
    reason: str = ""
    """One of ``REASONS``; by default the ``scope``'s (a global bucket's refusal may be a
    vendor block's or a drain's: the caller says so)."""
    error = "rate_limited"
    detail = None

    def __post_init__(self) -> None:
        shed = self.action == "shed"
        self.status, self.outcome, self.code, self.retry = (
            (OWN_STATUS["shed"], "shed", "shed", False) if shed else (OWN_STATUS["defer"], "deferred", "deferred", True)
        )
        if not self.reason:
            self.reason = _BY_SCOPE.get(self.scope, self.scope)
        if self.hint is None or self.hint < self.retry_after:
            self.hint = self.retry_after


@dataclass
class StoreDown(Refusal):
    """The store is unavailable and the policy fails closed: 429, store-unavailable."""

    retry_after: float
    detail: str
    quota: QuotaItem | None = None
    """The vendor's quota as the RateLimit fields describe it while nothing is granted."""
    status = 429
    outcome = "deferred"
    error = "rate_limited"
    code = "store_unavailable"
    retry = True
    reason = "store_unavailable"


@dataclass
class UpstreamFailed(Refusal):
    """The vendor could not be reached (502) or did not answer in time (504)."""

    status: int
    kind: str
    """upstream-unreachable, upstream-timeout or upstream-tls (the X-Quota-Error header)."""
    detail: str
    reached: bool
    """The request may have reached the vendor (it was being written, or was written):
    resending it could repeat it. False only when it certainly did not (no connection)."""
    idempotent: bool = False
    """The request is safe to repeat (headers.idempotent)."""
    outcome = "error"
    error = "upstream_error"

    def __post_init__(self) -> None:
        self.code = self.kind.replace("-", "_")
        self.retry = not self.reached or self.idempotent
        if self.kind == "upstream-tls":
            self.tls_error = "upstream_verify"


@dataclass
class InternalError(Refusal):
    """The proxy itself failed: 500. The request may have gone out before the failure."""

    detail: str
    idempotent: bool = False
    status = 500
    outcome = "error"
    error = "proxy_error"
    code = "internal_error"

    def __post_init__(self) -> None:
        self.retry = self.idempotent
