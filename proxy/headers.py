"""Header names the proxy reads or writes, the hop-by-hop set (RFC 9110 §7.6.1), and
whether a request is safe to send twice."""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

ON_LIMIT = "X-Quota-On-Limit"
MAX_HOLD = "X-Quota-Max-Hold"
QUOTA_PREFIX = "x-quota-"

ACTION = "X-Quota-Action"
LIMITER = "X-Quota-Limiter"
REASON = "X-Quota-Reason"
RETRY_AFTER_MS = "X-Quota-Retry-After-Ms"
SCOPE = "X-Quota-Scope"
ERROR = "X-Quota-Error"
RETRY_AFTER = "Retry-After"
HINT_MS = "retry-after-ms"  # the retry hint in ms, read first by OpenAI's and Stainless-generated SDKs
SHOULD_RETRY = "x-should-retry"  # obeyed by OpenAI's and Stainless-generated SDKs (Anthropic's, ...)
STRIPE_SHOULD_RETRY = "Stripe-Should-Retry"  # obeyed by Stripe's SDKs, which otherwise retry every 5xx
IDEMPOTENCY_KEY = "Idempotency-Key"
PROXY_AUTHORIZATION = "Proxy-Authorization"  # hop-by-hop: read by the proxy, never forwarded
PROXY_AUTHENTICATE = "Proxy-Authenticate"

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})

# Connection-specific: meaningful for one hop only, never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)

# Request headers the proxy consumes or recomputes itself.
_REQUEST_DROP = HOP_BY_HOP | {"host", "expect"}


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    tokens: set[str] = set()
    for value in headers.getall("Connection", ()):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def upstream_request_headers(headers: CIMultiDictProxy[str], tenant_header: str) -> CIMultiDict[str]:
    """The worker's headers minus hop-by-hop ones, ``Host`` (set from the upstream URL),
    the tenant header and every ``X-Quota-*`` header."""
    return _without(headers, _REQUEST_DROP | {tenant_header.lower()})


def downstream_response_headers(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The vendor's headers minus hop-by-hop ones and any ``X-Quota-*`` header, for the worker.

    ``X-Quota-*`` is the proxy's namespace: a worker must be able to trust that
    ``X-Quota-Action`` came from the proxy, so a vendor's 429 never carries it (SPEC §5)."""
    return _without(headers, HOP_BY_HOP)


def _without(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` minus the names in ``drop``, those its ``Connection`` field names and
    every ``X-Quota-*`` header, in their order."""
    dropped = drop | _connection_tokens(headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        low = name.lower()
        if low in dropped or low.startswith(QUOTA_PREFIX):
            continue
        out.add(name, value)
    return out


def idempotent(method: str, headers: Mapping[str, str]) -> bool:
    """Whether sending the request twice does no more than sending it once: an idempotent
    method (RFC 9110 §9.2.2, TRACE aside), or a request carrying an ``Idempotency-Key``
    (the vendor deduplicates it)."""
    return method.upper() in IDEMPOTENT_METHODS or IDEMPOTENCY_KEY in headers
