"""Every aiohttp detail the proxy relies on beyond its documented API, in one place.

Each is used because the public API has no way to say it, and each says what
breaks if an aiohttp upgrade removes or changes it. tests/test_aiohttp_internals.py
exercises every one of them, so such an upgrade fails loudly there rather than
subtly in production. Written against aiohttp 3.14.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

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


# -- one served connection: a RequestHandler subclass, its head and idle timers ---------------------
#
# Why: every connection of the proxy listener is handed to aiohttp by hand (the front door
# reads its first bytes; an intercepted CONNECT first terminates TLS), so aiohttp's HTTP/1.1
# protocol, RequestHandler, is built here as web.Server.__call__ does, with three additions:
#
# - a tag for its requests: the requests inside an intercepted CONNECT must know where the
#   tunnel leads (their own Host may say anything); read back from request.protocol.
# - a request-head timeout, which aiohttp does not have: a head must arrive whole within
#   ``head_timeout`` from the connection's start, or from the first byte of a later request;
#   else 408 (or, with nothing received, silence) and close. It needs two private attributes:
#   ``_waiter`` (pending exactly while the connection waits for its next request head, the
#   test aiohttp's own keep-alive timer makes: a byte then starts a head, not a body) and
#   ``_request_count`` (heads parsed so far: a head arrived whole when it moves).
# - the idle keep-alive timeout: the documented ``keepalive_timeout`` (aiohttp's default is
#   an hour), with ``keep_alive(True)`` (undocumented; it cancels the pending idle timer) so
#   the idle timer covers silence between requests only, never a head being received.
#
# Neither the subclassing nor the constructor's signature (manager, *, loop, ...) is documented.
# Upgrade: if the constructor changes, every connection fails at its first request; if
# request.protocol goes away, requests inside tunnels are routed as plain ones; if _waiter or
# _request_count change meaning, heads stop timing out (slowloris holds connections again)
# or a request being served is cut: tests/test_aiohttp_internals.py fails either way.


class ConnectionGuard(Protocol):
    """What a served connection reports to, and the timeouts it applies (read per connection)."""

    @property
    def head_timeout(self) -> float: ...

    @property
    def idle_timeout(self) -> float: ...

    def opened(self) -> None:
        """A connection is being served."""

    def closed(self) -> None:
        """A served connection is gone (called once per ``opened``)."""

    def head_timed_out(self, partial: bool) -> bytes:
        """A head did not arrive in time: the bytes to write before closing (``partial``:
        part of it arrived; b"" closes silently)."""

    def waiting(self, connection: object, evict: Callable[[], None]) -> None:
        """``connection`` waits for a request head; ``evict`` closes it (the cap needs its place)."""

    def not_waiting(self, connection: object) -> None:
        """``connection`` no longer waits for a head (it arrived, or the connection is gone)."""


class _ServedConnection(web.RequestHandler):
    """aiohttp's HTTP/1.1 handler for one connection, with a tag for its requests and a
    request-head timer."""

    __slots__ = ("_deadline", "_guard", "_head_bytes", "_open", "_timer", "tag")

    def __init__(self, server: web.Server, guard: ConnectionGuard, tag: object, deadline: float) -> None:
        super().__init__(
            server,
            loop=asyncio.get_running_loop(),
            access_log=None,  # type: ignore[arg-type]  # None turns aiohttp's access log off
            keepalive_timeout=guard.idle_timeout,
        )
        self.tag = tag
        self._guard = guard
        self._deadline = deadline
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = False
        self._open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._open = True
        self._guard.opened()
        self.keep_alive(True)  # no idle timer before the first answer: the head timer rules
        self._arm(self._deadline)

    def data_received(self, data: bytes) -> None:
        if data:
            if self._timer is None and self._waiting():  # a new head begins: no longer idle
                self.keep_alive(True)
                self._arm(asyncio.get_running_loop().time() + self._guard.head_timeout)
            self._head_bytes = True
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:  # a head arrived whole
            self._disarm()
            self._head_bytes = False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._open:
            self._open = False
            self._guard.closed()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        """Is aiohttp waiting for the next request's head (not serving one, not lingering)?"""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _arm(self, when: float) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_at(when, self._head_timeout)
        self._guard.waiting(self, self._evicted)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._guard.not_waiting(self)

    def _evicted(self) -> None:
        """A new connection at the cap takes this one's place: it is closed as if its head
        had timed out (408 if part of one came)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._head_bytes and self.transport is not None:
            self.transport.write(self._guard.head_timed_out(True))
        self.force_close()

    def _head_timeout(self) -> None:
        # Armed only while no request is being served, disarmed when a head arrives whole:
        # so this head is overdue, whether or not aiohttp's task has started waiting for it
        # (a connection handed over with its deadline already past).
        self._timer = None
        self._guard.not_waiting(self)
        answer = self._guard.head_timed_out(self._head_bytes)
        if answer and self.transport is not None:
            self.transport.write(answer)
        self.force_close()  # flushes what was written, then closes


def served_connection(
    server: web.Server, guard: ConnectionGuard, *, tag: object = None, head_deadline: float | None = None
) -> asyncio.Protocol:
    """An HTTP/1.1 protocol serving ``server``'s handler on a connection the caller attaches;
    every request on it carries ``tag`` (see ``connection_tag``). The first request's head
    must be in by ``head_deadline`` (loop time; default: ``guard.head_timeout`` from now)."""
    deadline = asyncio.get_running_loop().time() + guard.head_timeout if head_deadline is None else head_deadline
    return _ServedConnection(server, guard, tag, deadline)


def connection_tag(request: web.BaseRequest) -> object:
    """The tag of the connection ``request`` came on (None for an untagged one)."""
    proto = request.protocol
    return proto.tag if isinstance(proto, _ServedConnection) else None


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


# -- opening pooled connections ahead of requests: BaseConnector.connect, ._conns -----------------
#
# Why: a vendor's first burst after a start (or a lull) is granted at once, but each
# request of it must first open a connection (a TLS handshake to a real vendor) while the
# requests granted after it find the pool warm; the burst then reaches the vendor late and
# bunched with them, over a strict window's limit (issue 10 item 5). aiohttp has no public
# way to open a connection without sending a request, nor to count the idle ones.
# Upgrade: if connect()'s signature or the pool's layout changes, warming fails (logged at
# debug, the proxy works as before, cold) and tests/test_aiohttp_internals.py fails.


def idle_connections(session: aiohttp.ClientSession, origin: str) -> int:
    """Idle pooled connections of ``session`` to ``origin`` (``scheme://host:port``) still
    open (one the vendor closed stays in the pool until a request or the pool's sweep
    drops it)."""
    key = _request(session, origin).connection_key
    idle = session.connector._conns.get(key, ())  # type: ignore[union-attr]
    return sum(1 for proto, _ in idle if proto.is_connected())


async def open_idle_connection(session: aiohttp.ClientSession, origin: str, connect_within: float) -> None:
    """Open one connection to ``origin`` and leave it idle in ``session``'s pool, where the
    next request to that origin takes it; sends nothing on it."""
    connector = session.connector
    assert connector is not None
    conn = await connector.connect(_request(session, origin), [], aiohttp.ClientTimeout(connect=connect_within))
    conn.release()  # unused: back to the pool as a keep-alive connection


def _request(session: aiohttp.ClientSession, origin: str) -> aiohttp.ClientRequest:
    from yarl import URL

    # The arguments session.request() passes that enter the connection key (ssl=True: the
    # connector's own context), so that a request finds the connection warmed here.
    return aiohttp.ClientRequest("GET", URL(origin), loop=asyncio.get_running_loop(), session=session, ssl=True)
