"""Where a request wants to go, read from its request line (and Host for origin form).

Absolute form (``GET http://api.x/v1``, what HTTP_PROXY makes clients send):
the target alone names the destination (RFC 9112 §3.2.2); Host is ignored.
Origin form (``GET /v1``): a vendor route prefix or the Host header decides.
The path and query are kept byte for byte: re-encoding could change a signed URL.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from proxy import names
from proxy.wire.refusals import BadRequest

# Workers name the same few authorities over and over: parsed once each (a malformed one,
# which raises, is not kept).
parse_authority = functools.lru_cache(maxsize=1024)(names.parse_authority)

_K = TypeVar("_K", str, tuple[str, str])


class HasTarget(Protocol):
    """A request as the data plane parsed it (http1.Request)."""

    @property
    def raw_path(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


@dataclass(frozen=True, slots=True)
class RequestTarget:
    absolute: bool
    scheme: str
    """``http``/``https`` for absolute form; ``http`` for origin form."""
    host: str
    """Normalised host name or IP literal (``proxy.names.parse_host``); empty if origin form had no Host."""
    port: int | None
    """The port the request named explicitly, if any."""
    path_qs: str
    """Raw path and query, always starting with ``/``."""


# Workers send the same few targets over and over: each parsed once (a RequestTarget is
# immutable, so sharing one is safe). Bounded: emptied when full; long targets (query
# strings that differ every time) are not kept.
_CACHE_MAX = 4096
_CACHE_KEY_MAX = 512
_absolute: dict[str, RequestTarget] = {}
_origin_form: dict[tuple[str, str], RequestTarget] = {}


def parse_target(request: HasTarget) -> RequestTarget:
    raw = request.raw_path
    if raw[:1] == "/":
        host_header = request.headers.get("Host", "")
        key = (raw, host_header)
        target = _origin_form.get(key)
        if target is None:
            target = _parse_origin_form(raw, host_header)
            _remember(_origin_form, key, target, len(raw) + len(host_header))
        return target
    target = _absolute.get(raw)
    if target is None:
        target = _parse(request)
        _remember(_absolute, raw, target, len(raw))
    return target


def _remember(cache: dict[_K, RequestTarget], key: _K, target: RequestTarget, size: int) -> None:
    if size <= _CACHE_KEY_MAX:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        cache[key] = target


def _parse(request: HasTarget) -> RequestTarget:
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
    return _parse_origin_form(raw, request.headers.get("Host", ""))


def _parse_origin_form(raw: str, host_header: str) -> RequestTarget:
    host, port = "", None
    if host_header:
        try:
            host, port = parse_authority(host_header.strip())
        except ValueError as exc:
            raise BadRequest(f"bad Host header: {exc}") from None
    return RequestTarget(False, "http", host, port, raw)


def parse_tunneled_target(request: HasTarget, host: str, port: int) -> RequestTarget:
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
