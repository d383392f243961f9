"""Where a request wants to go, read from its request line (and Host for origin form).

Absolute form (``GET http://api.x/v1``, what HTTP_PROXY makes clients send):
the target alone names the destination (RFC 9112 §3.2.2); Host is ignored.
Origin form (``GET /v1``): a vendor route prefix or the Host header decides.
The path and query are kept byte for byte: re-encoding could change a signed URL.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from aiohttp import web

from proxy.refusals import BadRequest

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_](?:[a-z0-9_-]{0,62}))*\.?$")


@dataclass(frozen=True, slots=True)
class RequestTarget:
    absolute: bool
    scheme: str
    """``http``/``https`` for absolute form; ``http`` for origin form."""
    host: str
    """Lower-case host name or IP literal (no brackets); empty if origin form had no Host."""
    port: int | None
    """The port the request named explicitly, if any."""
    path_qs: str
    """Raw path and query, always starting with ``/``."""


def parse_authority(authority: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` → (host, port). Raises ValueError."""
    if "@" in authority:
        raise ValueError("user information is not allowed in the target")
    port: int | None = None
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise ValueError(f"bad IPv6 literal in {authority!r}")
        host, rest = authority[1:end], authority[end + 1 :]
        ipaddress.IPv6Address(host.split("%", 1)[0])
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"bad authority {authority!r}")
            port = _port(rest[1:])
        return host.lower(), port
    host, sep, port_text = authority.rpartition(":")
    if not sep:
        host = authority
    else:
        port = _port(port_text)
    host = host.lower()
    if not _HOSTNAME.match(host):
        raise ValueError(f"bad host {host!r}")
    return host.rstrip("."), port


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"bad port {text!r}")
    return int(text)


def parse_target(request: web.BaseRequest) -> RequestTarget:
    raw = request.raw_path
    lower = raw[:8].lower()
    if lower.startswith(("http://", "https://")):
        scheme, rest = raw.split("://", 1)
        cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        authority, path_qs = rest[:cut], rest[cut:]
        try:
            host, port = parse_authority(authority)
        except ValueError as exc:
            raise BadRequest(f"bad request target: {exc}") from None
        path_qs = path_qs.split("#", 1)[0]
        if not path_qs.startswith("/"):
            path_qs = "/" + path_qs
        return RequestTarget(True, scheme.lower(), host, port, path_qs)
    if not raw.startswith("/"):
        raise BadRequest(f"unsupported request target {raw[:100]!r}: use absolute form or a path")
    host_header = request.headers.get("Host", "")
    host, port = "", None
    if host_header:
        try:
            host, port = parse_authority(host_header.strip())
        except ValueError as exc:
            raise BadRequest(f"bad Host header: {exc}") from None
    return RequestTarget(False, "http", host, port, raw)


def parse_tunneled_target(request: web.BaseRequest, host: str, port: int) -> RequestTarget:
    """A request inside an intercepted CONNECT tunnel: the tunnel names the
    destination (the worker asked for ``host:port``); the request line names the path.
    An absolute-form target inside the tunnel must name the same host."""
    raw = request.raw_path
    if raw.startswith("/"):
        return RequestTarget(True, "https", host, port, raw)
    target = parse_target(request)
    if not target.absolute or target.host != host:
        raise BadRequest(f"request target {raw[:100]!r} does not match the tunnel to {host}:{port}")
    return RequestTarget(True, "https", host, port, target.path_qs)
