"""Who may use the admin listener (SPEC §12), checked before any admin endpoint runs.

- **Token.** With ``admin_token`` set (``QUOTA_PROXY_ADMIN_TOKEN`` wins over the file),
  ``GET /status``, ``GET /status/history`` and ``POST /reload`` need ``Authorization:
  Bearer <token>``, compared in constant time; else 401 with ``WWW-Authenticate: Bearer``.
  ``/metrics``, ``/healthz`` and ``/readyz`` stay open for scrapers and probes.
- **Host.** Every endpoint but ``/healthz`` and ``/readyz`` answers only a request whose
  ``Host`` names this listener: any IP address, ``localhost``, its own listen name, or one of
  ``admin_hosts``; else 421. A page a browser loaded from another name cannot read
  ``/status`` by rebinding that name to the proxy's address (DNS rebinding): its requests
  carry that name. Probes that send an IP address as ``Host`` are served.
- **Origin.** A request other than GET or HEAD that carries an ``Origin`` not naming this
  listener is refused (403): a web page cannot make a browser reload the policy, not even
  through an IP address.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.names import ip_or_none, parse_authority
from proxy.policy.model import Policy
from proxy.wire.answers import Answer, render

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS: Final = frozenset({"/healthz", "/readyz"})
"""Served whatever the Host: probes read nothing there."""
TOKEN_PATHS: Final = frozenset({"/status", "/status/history", "/reload"})
"""Guarded by the admin token when one is set."""
_REALM: Final = 'Bearer realm="quota-proxy admin"'
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


def admin_access(policy: Callable[[], Policy]) -> Middleware:
    """The admin application's middleware; ``policy`` is the live policy (a reload may
    change the token and the names)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        current = policy()
        if request.path not in OPEN_PATHS:
            refusal = _misdirected(request, current) or _cross_origin(request, current)
            if refusal is not None:
                return refusal
        if request.path in TOKEN_PATHS and current.admin_token is not None:
            refusal = _unauthorized(request, current.admin_token)
            if refusal is not None:
                return refusal
        return await handler(request)

    return check


def names_this_listener(authority: str, policy: Policy) -> bool:
    """Does ``host[:port]`` name the admin listener: an IP address, or one of its names?"""
    try:
        host, _ = parse_authority(authority)
    except ValueError:
        return False
    return ip_or_none(host) is not None or host in policy.admin_names


def _misdirected(request: web.Request, policy: Policy) -> web.Response | None:
    host = request.headers.get("Host")
    if host is None or names_this_listener(host, policy):
        return None  # no Host at all is no browser's request (HTTP/1.0 tools)
    names = ", ".join(policy.admin_names)
    message = (
        f"this admin listener answers to IP addresses and {names}, not to the Host {host[:100]!r}; "
        "list the name in admin_hosts to use it"
    )
    return _refusal(421, "misdirected", message)


def _cross_origin(request: web.Request, policy: Policy) -> web.Response | None:
    origin = request.headers.get("Origin")
    if request.method in _SAFE_METHODS or origin is None:
        return None
    try:
        authority = urlsplit(origin).netloc
    except ValueError:
        authority = ""
    if authority and names_this_listener(authority, policy):
        return None
    return _refusal(403, "cross_origin", f"a {request.method} from the web page of origin {origin[:100]!r} is refused")


def _unauthorized(request: web.Request, token: str) -> web.Response | None:
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and _same(given.strip(), token):
        return None
    challenge = _REALM if not given else f'{_REALM}, error="invalid_token"'
    message = f"{request.method} {request.path} needs Authorization: Bearer <the admin_token>"
    return _refusal(401, "unauthorized", message, {"WWW-Authenticate": challenge})


def _same(given: str, token: str) -> bool:
    """Constant time, whatever the lengths: compare digests."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(token.encode()).digest())


def _refusal(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return render(Answer(status, "forbidden", code, message, False, {}, headers or {}))
