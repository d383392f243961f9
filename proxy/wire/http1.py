"""The worker-facing HTTP/1.1 server of the data plane: one asyncio protocol per connection,
llhttp (httptools) parsing, requests served one at a time in arrival order.

    bytes in  → parser callbacks → Request (method, target, headers) + its Body stream
    handler   → Responder: the head leaves with the first piece of the body; Content-Length
                when the handler gives one, else chunked (HTTP/1.1) or close-delimited (1.0)

Flow control both ways: a Body holding more than ``BODY_HIGH`` (inbox.py) bytes the handler has not
read pauses reading from the worker (resumed below ``BODY_LOW``), more than ``PIPELINE_AHEAD``
parsed requests waiting their turn pause it too, and ``Responder.write`` waits while the
transport's write buffer is over its high-water mark (pause_writing / resume_writing).

A head that does not parse is answered 400, one larger than ``MAX_HEAD`` 431, after the
answers to the requests before it, and the connection is closed. ``Upgrade`` is never
honoured (the proxy speaks HTTP only): the request is served as a plain one and the
connection stays HTTP; a CONNECT is handed to the handler (which refuses it) and the
connection closed after the answer. Heads are timed as the ``ConnectionGuard`` says
(head_timeout from the connection's start or from the first byte of a later head,
idle_timeout between requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final, Protocol, cast

import httptools

from proxy.tasks import spawn
from proxy.wire.body import BodyBroken
from proxy.wire.parsing import (
    _KINDS,
    BOARD_WAIT,
    MAX_HEAD,
    PIPELINE_AHEAD,
    Flight,
    Lane,
    RequestParsing,
    _HeadRefused,
    _ParseError,
)
from proxy.wire.request import Request
from proxy.wire.responder import Responder

log = logging.getLogger("quota_proxy.dataplane")

WRITE_HIGH: Final = 256 * 1024
_QUICKACK: Final = getattr(socket, "TCP_QUICKACK", None)  # (Linux)
DISCARD_WAIT: Final = 5.0


class ConnectionGuard(Protocol):
    """What a served connection reports to, and the timeouts it applies (read per head)."""

    @property
    def head_timeout(self) -> float: ...

    @property
    def idle_timeout(self) -> float: ...

    def opened(self) -> None: ...

    def closed(self) -> None: ...

    def head_timed_out(self, partial: bool) -> bytes:
        """The bytes to write before closing a connection whose head is overdue (b"": none)."""

    def waiting(self, connection: object, evict: Callable[[], None]) -> None: ...

    def not_waiting(self, connection: object) -> None: ...


Refuse = Callable[[int, str], bytes]
"""A connection-level answer (400, 431, 500) as bytes, ``Connection: close`` included."""


def plain_refusal(status: int, message: str) -> bytes:
    """A minimal JSON answer, for servers built without the proxy's own answers."""
    reason = {400: "Bad Request", 431: "Request Header Fields Too Large"}.get(status, "Internal Server Error")
    kind = "bad_request" if status < 500 else "proxy_error"
    body = json.dumps({"error": {"type": kind, "message": message}, "message": message}).encode()
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode("latin-1") + body


Handler = Callable[[Request, Responder], Awaitable[None]]
"""Serves one request: must start and finish (or abort) the answer before returning."""


class _Work:
    """What the serving task goes on with for a request a flight handed over (``carry``)."""

    __slots__ = ("request", "responder", "work")

    def __init__(self, request: Request, responder: Responder, work: Callable[[], Awaitable[None]]) -> None:
        self.request = request
        self.responder = responder
        self.work = work


class Http1Connection(RequestParsing, asyncio.Protocol):
    """One worker connection, served by ``handler``. ``deadline``: loop time by which the
    first head must be in (default: ``guard.head_timeout`` from the connection's start);
    ``tag``: where the connection came from (an interception), for the handler;
    ``registry``: told when the connection opens (True) and closes (False);
    ``keep_alive``: False to close after the first answer (the server is stopping)."""

    def __init__(
        self,
        handler: Handler,
        guard: ConnectionGuard,
        *,
        refuse: Refuse = plain_refusal,
        tag: object = None,
        deadline: float | None = None,
        registry: Callable[[Http1Connection, bool], None] | None = None,
        keep_alive: bool = True,
        lane: Lane | None = None,
    ) -> None:
        self._handler = handler
        self._registry = registry
        self._guard = guard
        self._refuse = refuse
        self.tag = tag
        self._deadline = deadline
        self.loop = self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._parser: httptools.HttpRequestParser = httptools.HttpRequestParser(self)
        self._queue: deque[Request | _ParseError | _Work] = deque()
        self._queue_waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pauses: set[str] = set()
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._open = False
        self.closed = False
        self.keep_alive = keep_alive
        """False once the server stops: each connection closes after its current answer."""
        self.kept_slots: dict[str, str] | None = None
        """Slots kept for this worker's deferred calls (Request.kept_slots), None before any."""
        self.answered_at: float | None = None
        """Loop time the last answer on this connection was written whole (None: none yet)."""
        self._serving = False
        # the message being parsed
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._marks: list[tuple[int, bytes]] = []  # the fields of the head the proxy reads or drops
        self._lines: list[bytes] = []  # the PLAIN ones, as the pieces of their lines
        self._lane = lane
        self._kinds: dict[bytes, int] = _KINDS
        self._flight: Flight | None = None  # the straight path's request in flight (lane.py)
        self._boarding: Request | None = None  # a usual request whose small body is still coming
        self._board_timer: asyncio.TimerHandle | None = None
        self._in_head = False
        self._head_seen = 0
        self._fresh = 0
        self._trailer_seen = 0
        self._began = False
        self._parsing: Request | None = None
        self._skip_message = False
        self._broken = False
        # timers
        self._timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        self._head_bytes = False

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        self._open = True
        self._guard.opened()
        if self._registry is not None:
            self._registry(self, True)
        deadline = self._deadline if self._deadline is not None else self._loop.time() + self._guard.head_timeout
        self._arm_head(deadline)
        self._task = spawn(self._serve(), name="http1-connection")

    def data_received(self, data: bytes) -> None:
        if self._broken or self.closed:
            return
        waiting = not self._serving and not self._queue
        if data and waiting and not self._in_head:
            self._head_bytes = True  # a new head begins: no longer idle
        was_in_head = self._in_head
        self._began = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._unboard()
            self._upgraded(data[exc.args[0] :])
            return
        except httptools.HttpParserCallbackError as exc:
            self._unboard()
            if isinstance(exc.__context__, _HeadRefused):
                self._parse_failed(exc.__context__.status, str(exc.__context__))
                return
            raise
        except httptools.HttpParserError as exc:
            self._unboard()
            self._parse_failed(400, f"malformed request: {exc}")
            return
        if self._boarding is not None and self._board_timer is None:  # its body is not whole yet
            self._board_timer = self._loop.call_later(BOARD_WAIT, self._unboard)
            self._ack_now()
        if self._in_head:
            # A head that began in an earlier read owns all of this one; one that began in
            # this read is counted by its parsed parts (its unfinished field: at most one read).
            self._head_seen += self._fresh if self._began or not was_in_head else len(data)
            if self._head_seen > MAX_HEAD:
                self._parse_failed(431, f"request head larger than {MAX_HEAD} bytes")
                return
            if waiting and self._timer_kind != "head":
                # Timed from its first byte, which came now: a head that arrives whole in one
                # read (the usual case) never needs the timer.
                self._arm_head(self._loop.time() + self._guard.head_timeout)

    def _ack_now(self) -> None:
        # A client that writes a head and then a small body with Nagle's algorithm on (http.client
        # through requests' proxy connections, so Stripe's SDK) holds the body until the head is
        # ACKed, and the kernel delays that ACK by 40 ms while the proxy has nothing to answer:
        # 44 ms on every POST. An ACK now lets the body come.
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None and _QUICKACK is not None:
            with contextlib.suppress(OSError):  # (not a TCP socket)
                sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)

    def eof_received(self) -> bool:
        # A worker that stops sending has gone away, as aiohttp takes it too: the request
        # being served is cancelled (a held one gives its tokens back), the connection closed.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self._boarded()  # (gone before its body was whole: as a request never served, as one queued)
        if self._open:
            self._open = False
            self._guard.closed()
            if self._registry is not None:
                self._registry(self, False)
        broken = BodyBroken("the worker's connection closed")
        if self._parsing is not None and self._parsing._body is not None:
            self._parsing._body._fail(broken)
        for item in self._queue:
            if isinstance(item, Request) and item._body is not None:
                item._body._fail(broken)
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("the worker's connection closed"))
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.gone()  # as a cancelled request: what it waits for given up, accounted
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the request being served is cancelled, as aiohttp's handler_cancellation does

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- flow control ------------------------------------------------------------------

    def pause(self, reason: str) -> None:
        if not self._pauses and self.transport is not None and not self.closed:
            self.transport.pause_reading()
        self._pauses.add(reason)

    def resume(self, reason: str) -> None:
        if reason not in self._pauses:
            return
        self._pauses.discard(reason)
        if not self._pauses and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def write_interim(self, data: bytes) -> None:
        self.write(data)

    @property
    def stall_limit(self) -> float:
        """Seconds the worker may send no byte of a body being read, or take no byte of an
        answer being written, before the request is cut: the connections' ``idle_timeout``."""
        return self._guard.idle_timeout

    async def drain(self) -> None:
        """Wait until the worker takes enough of what is written; one that takes nothing for
        ``stall_limit`` seconds is cut (ConnectionResetError), so that it cannot hold the
        request's vendor connection and concurrency slot for ever."""
        if self.closed:
            raise ConnectionResetError("the worker's connection closed")
        if not self.write_paused:
            return
        self._drain_waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(self.stall_limit, self._write_stalled, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._drain_waiter = None

    def _write_stalled(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():
            return
        limit = self.stall_limit
        log.info("a worker took no byte of its answer for %gs (connections.idle_timeout): its connection is cut", limit)
        waiter.set_exception(ConnectionResetError(f"the worker took no byte of its answer for {limit:g}s"))
        self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Close now, cancelling the request being served (the server's drain bound)."""
        self.abort()

    @property
    def head_started(self) -> bool:
        """Part of a request head is in, not yet the whole of it (while no request is served)."""
        return self._head_bytes

    @property
    def idle(self) -> bool:
        """Waiting for a request, none being served or queued."""
        return not self._serving and not self._queue

    def stop_keep_alive(self) -> None:
        """Take no further request: close after the current answer, or now if idle."""
        self.keep_alive = False
        if self.idle and not self._in_head and self.transport is not None:
            self.transport.close()

    # -- serving -----------------------------------------------------------------------

    def _wake_queue(self) -> None:
        if self._queue_waiter is not None and not self._queue_waiter.done():
            self._queue_waiter.set_result(None)

    # -- a flight's ends (lane.py) ------------------------------------------------------

    def carry(self, request: Request, responder: Responder, work: Callable[[], Awaitable[None]]) -> None:
        """The flight of ``request`` stops: the serving task goes on with ``work``, ahead of
        any request that came after it."""
        self._flight = None
        self._serving = False
        self._queue.appendleft(_Work(request, responder, work))
        self._wake_queue()

    def landed(self, request: Request) -> None:
        """The flight of ``request`` wrote its answer whole: the connection takes the next
        request, or closes (the serving task's end of a request, for one it never saw)."""
        self._flight = None
        if self._answered(request) and self._queue:
            self._wake_queue()  # requests pipelined behind it: the serving task's

    async def _serve(self) -> None:
        transport = self.transport
        assert transport is not None
        while True:
            queue = self._queue
            while not queue or self._flight is not None:  # (inline, not a coroutine of its own)
                self._queue_waiter = self._loop.create_future()
                try:
                    await self._queue_waiter
                finally:
                    self._queue_waiter = None
            item = queue.popleft()
            if len(queue) <= PIPELINE_AHEAD and self._pauses:
                self.resume("pipeline")
            if isinstance(item, _ParseError):
                if item.status:
                    self.write(self._refuse(item.status, item.message))
                transport.close()
                return
            self._serving = True
            if isinstance(item, _Work):  # a flight handed its request over: go on from there
                responder, work = item.responder, item.work
                request = item.request
            else:
                request = item
                responder = Responder(self, request)
                work = functools.partial(self._handler, request, responder)
            try:
                await work()
            except asyncio.CancelledError:
                transport.abort()
                raise
            except ConnectionError:  # the worker went away, or its body's framing broke
                nxt = self._queue[0] if self._queue else None
                if isinstance(nxt, _ParseError) and nxt.status and not responder.begun:
                    self.write(self._refuse(nxt.status, nxt.message))
                    transport.close()
                else:
                    transport.abort()
                return
            except Exception:
                log.exception("internal error serving %s %s", request.method, request.target[:200])
                if responder.begun:
                    transport.abort()
                else:
                    self.write(self._refuse(500, "internal error"))
                    transport.close()
                return
            if not responder._finished:
                log.error(
                    "handler returned without finishing the answer to %s %s", request.method, request.target[:200]
                )
                transport.abort()
                return
            body = request._body
            if request.keep_alive and body is not None and not body._done:
                if body._continue:
                    request.keep_alive = False  # the body was never invited: the worker may not send it
                else:
                    body._discard()
                    try:
                        async with asyncio.timeout(DISCARD_WAIT):
                            await body._finished()
                    except (TimeoutError, BodyBroken):
                        request.keep_alive = False
            if not self._answered(request):
                return

    def _answered(self, request: Request) -> bool:
        """``request`` is answered: close the connection (False) or wait for the next (True)."""
        self._serving = False
        self.answered_at = self._loop.time()
        if not (request.keep_alive and self.keep_alive):
            if self.transport is not None:
                self.transport.close()
            return False
        if not self._queue:
            self._head_bytes = self._in_head
            if self._in_head:
                self._arm_head(self._loop.time() + self._guard.head_timeout)
            else:
                self._arm_idle()
        return True

    # -- timers ------------------------------------------------------------------------

    _timer_kind = ""

    def _arm_head(self, when: float) -> None:
        self._disarm()
        self._timer_kind = "head"
        self._timer = self._loop.call_at(when, self._head_timed_out)
        self._guard.waiting(self, self._evicted)

    def _arm_idle(self) -> None:
        """Idle from now. Lazily: a timer already set for an earlier idle period is left to
        fire and moves itself to this one's end (one timer per idle_timeout, not per request)."""
        self._idle_since = self._loop.time()
        if self._timer is None:
            self._timer_kind = "idle"
            self._timer = self._loop.call_at(self._idle_since + self._guard.idle_timeout, self._idle_timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            if self._timer_kind == "head":
                self._guard.not_waiting(self)
            self._timer_kind = ""

    def _head_arrived(self) -> None:
        if self._timer_kind == "head":
            self._disarm()
        self._head_bytes = False

    def _head_timed_out(self) -> None:
        self._timer = None
        self._timer_kind = ""
        self._guard.not_waiting(self)
        self._timed_out()

    def _evicted(self) -> None:
        """A new connection at the cap takes this one's place, as if its head had timed out."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_kind = ""
        self._timed_out()

    def _timed_out(self) -> None:
        if self._serving or self._queue or self.transport is None:
            return
        answer = self._guard.head_timed_out(self._head_bytes)
        if answer:
            self.write(answer)
        self._broken = True
        self.transport.close()

    def _idle_timed_out(self) -> None:
        self._timer = None
        self._timer_kind = ""
        if self.transport is None or not self.idle or self._in_head or self._head_bytes:
            return  # busy again: its next idle period sets a timer of its own
        due = self._idle_since + self._guard.idle_timeout  # (the setting read here, not per request)
        if self._loop.time() < due:  # idle again since, later: wait for that period's end
            self._timer_kind = "idle"
            self._timer = self._loop.call_at(due, self._idle_timed_out)
            return
        self.transport.close()
