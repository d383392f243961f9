"""Every aiohttp detail the proxy relies on beyond its documented API, in one place.

Each is used because the public API has no way to say it, and each says what
breaks if an aiohttp upgrade removes or changes it. tests/test_aiohttp_internals.py
exercises every one of them, so such an upgrade fails loudly there rather than
subtly in production. Written against aiohttp 3.14.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

# -- the answer's byte count: StreamWriter.output_size ----------------------------------------------
#
# Why: a bug in the request path must not splice a 500 into an answer already on its
# way; aiohttp's own error handling (RequestHandler.handle_error) asks the same question
# with the same counter. request.writer and its output_size are not documented.
# Upgrade: if output_size goes away, answer_begun raises on the error path (a crash
# answers nothing instead of a clean 500) and send_continue fails every upload that
# waits for 100 Continue.


def answer_begun(request: web.BaseRequest) -> bool:
    """Has any byte of the answer been written to the worker?"""
    writer = request.writer
    return writer is not None and writer.output_size > 0


async def send_continue(request: web.BaseRequest) -> None:
    """Write an interim ``100 Continue`` ahead of the answer.

    aiohttp's low-level server has no public way to (web.Application's
    ``expect_handler`` needs its router), so the line goes to the request's writer;
    its bytes are then taken back out of ``output_size``, or aiohttp (and
    ``answer_begun``) would take them for the start of the answer."""
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0


# -- headers sent with the body: StreamResponse._send_headers_immediately ------------------------------
#
# Why: a streamed answer's headers otherwise leave in a write of their own; held back,
# they leave with the first piece of the body (one write per small answer instead of
# two). web.Response does the same through this class attribute.
# Upgrade: if the attribute is renamed, headers are sent immediately again: answers
# stay correct, only a little costlier (bench/throughput.py shows it).


class HeadersWithBody(web.StreamResponse):
    """A StreamResponse whose headers leave with the first piece of the body (or at the end of an empty one)."""

    _send_headers_immediately = False


# -- a tag on a connection: a RequestHandler subclass --------------------------------------------------
#
# Why: the requests inside an intercepted CONNECT tunnel must know where the tunnel
# leads (their own Host may say anything). aiohttp's HTTP/1.1 protocol, RequestHandler,
# is built here by hand (as web.Server.__call__ does) with one more slot for that, and
# read back from request.protocol. Neither the subclassing nor the constructor's
# signature (manager, *, loop, ...) is documented.
# Upgrade: if the constructor changes, every intercepted connection fails at its first
# request; if request.protocol goes away, requests inside tunnels are routed as plain ones.


class _TaggedHandler(web.RequestHandler):
    """aiohttp's HTTP/1.1 handler for one connection, carrying a tag for its requests."""

    __slots__ = ("tag",)

    tag: object


def tagged_handler(server: web.Server, tag: object) -> asyncio.Protocol:
    """An HTTP/1.1 protocol serving ``server``'s handler on a connection the caller attaches;
    every request on it carries ``tag`` (see ``connection_tag``)."""
    proto = _TaggedHandler(server, loop=asyncio.get_running_loop(), access_log=None)  # type: ignore[arg-type]
    proto.tag = tag
    return proto


def connection_tag(request: web.BaseRequest) -> object:
    """The tag of the connection ``request`` came on (None for an untagged one)."""
    proto = request.protocol
    return proto.tag if isinstance(proto, _TaggedHandler) else None


# -- closing a low-level server's connections: Server.pre_shutdown, RequestHandler.force_close ----------
#
# Why: behind the front door the proxy runs web.Server itself, without a runner. At
# shutdown it does what aiohttp's ServerRunner does (pre_shutdown: no connection takes
# another request; the documented Server.shutdown then closes the idle ones), and at
# the drain bound it cuts what is still in flight (force_close on each connection:
# connection_lost then cancels its handler, with handler_cancellation=True).
# Server.shutdown and Server.connections are documented; these two are not.
# Upgrade: if either goes away, SIGTERM ends in a traceback instead of a bounded drain.


def stop_keep_alive(server: web.Server) -> None:
    """No connection takes another request: each closes after the one it is serving."""
    server.pre_shutdown()


def cut_connections(server: web.Server) -> None:
    """Close every connection now, cancelling the requests still in flight on them."""
    for connection in server.connections:
        connection.force_close()


# -- no hidden resend: ClientSession._retry_connection ----------------------------------------------
#
# Why: aiohttp's client sends an idempotent request (GET, HEAD, OPTIONS, TRACE, PUT, DELETE)
# a second time when the connection it went out on is reset or closed before an answer
# (ClientSession._request, ``retry_persistent_connection``; RFC 9112 §9.3.1 allows it). A
# vendor that reads the request and then drops the connection (a load balancer recycling
# it) would receive it twice for one worker request and one token. Every request that
# reaches a vendor must have taken its tokens, so the proxy never lets the library resend:
# the worker gets a 502 saying whether it may retry, and its retry takes a token. The
# switch has no public API; aiohttp's own test client turns it off the same way
# (test_utils.TestClient).
# Upgrade: if the attribute is renamed or removed, no_hidden_resend raises and the proxy
# does not start (it must not run with a resend it cannot turn off); if aiohttp drops the
# resend altogether, delete this entry and its test.


def no_hidden_resend(session: aiohttp.ClientSession) -> aiohttp.ClientSession:
    """``session``, told never to resend a request on a connection that broke."""
    if not hasattr(session, "_retry_connection"):
        raise RuntimeError(
            f"aiohttp {aiohttp.__version__}: ClientSession._retry_connection is gone; "
            "proxy/aiohttp_internals.py must learn how to stop its request resend"
        )
    session._retry_connection = False
    return session
