"""Why the proxy answers a request itself instead of forwarding it.

    Refusal
    ├── BadRequest            400  malformed target, tenant or X-Quota-* header
    ├── Denied                403  no vendor matches (the proxy is never an open proxy)
    ├── Limited               429 defer / 503 shed, the buckets are empty
    ├── StoreDown             429  store unavailable and on_failure: closed
    ├── UpstreamFailed        502 unreachable / 504 timed out
    └── InternalError         500  a bug in the proxy (logged with its traceback)

``responses.refusal_response`` turns each into the worker-facing answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.policy.model import Action


class Refusal(Exception):
    """A request the proxy answers itself."""


@dataclass
class BadRequest(Refusal):
    """The request cannot be understood: 400."""

    detail: str


@dataclass
class Denied(Refusal):
    """No vendor matches the target, or CONNECT is not allowed: 403."""

    detail: str
    host: str = ""


@dataclass
class Limited(Refusal):
    """The buckets refused: defer (429 + Retry-After) or shed (503)."""

    action: Action
    retry_after: float
    scope: str
    bucket: str


@dataclass
class StoreDown(Refusal):
    """The store is unavailable and the policy fails closed: 429, store-unavailable."""

    retry_after: float
    detail: str


@dataclass
class UpstreamFailed(Refusal):
    """The vendor could not be reached (502) or did not answer in time (504)."""

    status: int
    kind: str
    detail: str


@dataclass
class InternalError(Refusal):
    """The proxy itself failed: 500, never forwarded."""

    detail: str
