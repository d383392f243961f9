"""What a request inside an intercepted CONNECT tunnel carries with it: where the
tunnel leads. aiohttp's handler for such a connection keeps it in a slot, so the
request path can read it from ``request.protocol``."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from proxy.policy.model import Vendor


@dataclass(frozen=True, slots=True)
class Tunnel:
    """Where an intercepted connection leads; requests inside it go there."""

    vendor: Vendor
    host: str
    port: int
    tenant: str | None
    """The tenant named on the CONNECT itself, the default for requests inside."""


class InterceptedHandler(RequestHandler):
    """aiohttp's HTTP/1.1 handler, for the requests inside one intercepted tunnel."""

    __slots__ = ("tunnel",)

    tunnel: Tunnel


def tunnel_of(request: web.BaseRequest) -> Tunnel | None:
    proto = request.protocol
    return proto.tunnel if isinstance(proto, InterceptedHandler) else None
