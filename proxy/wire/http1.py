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
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, Protocol, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.tasks import spawn
from proxy.wire.framing import (
    CHUNKED,
    NO_BODY_STATUS,
    NO_CODINGS,
    NONE,
    AnswerCodings,
    FramingError,
    RequestFraming,
    request_framing,
)
from proxy.wire.headers import (
    CONNECTION_FIELD,
    EXPECT,
    HOST,
    LENGTH_FIELD,
    QUOTA,
    TENANT,
    THIS_HOP_VALUES,
    TRANSFER,
    learn_request_kind,
    only_this_hop,
    request_kinds,
)
from proxy.wire.inbox import Inbox

log = logging.getLogger("quota_proxy.dataplane")

MAX_HEAD: Final = 64 * 1024
"""Bytes a request head may take (request line and fields together); more: 431. A chunked
body's trailer section is held to it too (its fields are dropped, but each is parsed)."""
MAX_FIELDS: Final = 256
"""Fields a request head may have; more: 431 (thousands of tiny ones fit in ``MAX_HEAD``
and cost a callback each, here and at the vendor)."""
PIPELINE_AHEAD: Final = 4
"""Parsed requests waiting behind the one being served before reading pauses."""
WRITE_HIGH: Final = 256 * 1024
LANE_BODY_MAX: Final = 64 * 1024
"""The largest request body (by its ``Content-Length``) the straight path may send: one
that arrives whole within ``BOARD_WAIT`` of its head goes out with it in one write."""
BOARD_WAIT: Final = 0.25
"""Seconds a small body may take after its head (many clients write the two apart) before
the general path takes the request and streams the body as it comes."""
DISCARD_MAX: Final = 16 * 1024 * 1024
"""An unread request body up to this size is read and dropped after the answer, keeping the
connection; a larger one (or one that takes over ``DISCARD_WAIT``) closes it."""
DISCARD_WAIT: Final = 5.0
CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS: Final = {s.value: s.phrase for s in HTTPStatus}
_KINDS: Final = request_kinds("")
"""The field classifier of a connection served without a lane (no tenant header)."""


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


class BodyBroken(ConnectionError):
    """The worker's connection ended (or its framing broke) before the body was complete."""


class BodyStalled(BodyBroken):
    """The worker sent no byte of its body for the connection's ``idle_timeout`` while it
    was being read."""


class Body(Inbox):
    """A request body as it arrives: ``read()`` gives the next piece, ``b""`` at its end."""

    __slots__ = ("_conn", "_continue", "_discarding", "_end_waiter", "_since", "_stall")

    def __init__(self, conn: Http1Connection, expect_continue: bool) -> None:
        super().__init__()
        self._conn = conn
        self._end_waiter: asyncio.Future[None] | None = None
        self._continue = expect_continue
        self._discarding = False
        self._since = 0.0  # when the read now waiting began to wait
        self._stall: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        """Has the body arrived whole (whatever was read of it)?"""
        return self._done

    @property
    def broken(self) -> BaseException | None:
        """Why the body broke off (its framing, or the worker went away), if it did."""
        return self._exc

    @property
    def continue_pending(self) -> bool:
        """The worker waits for ``100 Continue``, not sent yet."""
        return self._continue

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._conn.loop

    def _pause(self) -> None:
        self._conn.pause("body")

    def _resume(self) -> None:
        self._conn.resume("body")

    def _reading(self) -> None:
        if self._continue:  # the body is wanted now: invite it
            self._continue = False
            self._conn.write_interim(CONTINUE)

    def _waiting(self) -> None:
        """A read waits for the worker's next bytes: they are owed within ``idle_timeout``
        from now (time the reader spent elsewhere, or paused, is not the worker's). One
        timer, moved on lazily: not one per piece."""
        loop = self._conn.loop
        self._since = loop.time()
        if self._stall is None:
            self._stall = loop.call_at(self._since + self._conn.stall_limit, self._check_stall)

    def _check_stall(self) -> None:
        self._stall = None
        if self._done or self._exc is not None or self._waiter is None or self._waiter.done():
            return  # not waiting now: the next wait sets the timer again
        limit = self._conn.stall_limit
        due = self._since + limit
        if self._conn.loop.time() < due:
            self._stall = self._conn.loop.call_at(due, self._check_stall)
            return
        self._fail(BodyStalled(f"no byte of the request body came for {limit:g}s (connections.idle_timeout)"))

    # -- from the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._discarding:
            self._size += len(data)  # counted, not kept
            if self._size > DISCARD_MAX:
                self._fail(BodyBroken("unread body too large to discard"))
            return
        super()._feed(data)

    def _discard(self) -> None:
        """The answer is out and nobody will read the rest: drop it as it comes."""
        self._discarding = True
        self._drop_unread()

    async def _finished(self) -> None:
        """The rest of a discarded body is in (a reader of the body may still be waiting:
        an upload the vendor answered before its end, being cancelled)."""
        while not self._done and self._exc is None:
            waiter = self._end_waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._end_waiter = None
        if self._exc is not None:
            raise self._exc

    def _wake(self) -> None:
        super()._wake()
        if self._end_waiter is not None and not self._end_waiter.done():
            self._end_waiter.set_result(None)
        if self._stall is not None and (self._done or self._exc is not None):
            self._stall.cancel()
            self._stall = None


class Request:
    """One request head as the worker sent it, and its body.

    Made from the parser's pieces (``parsed``) without decoding them: the fields stay the
    bytes they came as (``raw``), decoded to ``fields`` and looked up by name (``headers``)
    only when something asks, and a request without a body gets its (ended) ``body`` only
    if something reads it. What the straight path (lane.py) needs of the usual request was
    noted while its head was parsed (``lean`` and what follows it)."""

    __slots__ = (
        "_body",
        "_conn",
        "_fields",
        "_headers",
        "has_body",
        "host",
        "keep_alive",
        "kinds",
        "lean",
        "length",
        "lines",
        "method",
        "raw",
        "raw_path",
        "tag",
        "target",
        "tenant",
        "url",
        "version",
    )

    def __init__(
        self,
        method: str,
        target: str,
        version: str,
        headers: CIMultiDictProxy[str],
        body: Body,
        keep_alive: bool,
        has_body: bool,
        tag: object = None,
        fields: list[tuple[str, str]] | None = None,
        length: int = 0,
    ) -> None:
        self.method = method
        self.target = self.raw_path = target
        """The request target byte for byte (latin-1): absolute form, a path, an authority
        (``raw_path`` too, as aiohttp's requests name it)."""
        self.url = target.encode("latin-1")
        """The same, as the bytes it came as."""
        self.version = version
        """``"1.1"`` or ``"1.0"``."""
        self._headers: CIMultiDictProxy[str] | None = headers
        self._fields: list[tuple[str, str]] | None = list(headers.items()) if fields is None else fields
        self.raw: list[tuple[bytes, bytes]] = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in self._fields]
        """The fields as the worker sent them, in their order, as bytes."""
        self._body: Body | None = body
        self._conn: Http1Connection | None = None
        self.keep_alive = keep_alive
        self.has_body = has_body
        """The head announced a body (a Content-Length above 0, or chunked)."""
        self.length = length
        """The body's bytes by its ``Content-Length`` (0: none), or -1: chunked (framing.py)."""
        self.tag = tag
        """What the connection was tagged with (an interception: where its tunnel leads)."""
        self.lean = False
        """Nothing in the head needs the general request path (lane.py): no body, no
        ``X-Quota-*``, ``Expect`` or other hop's ``Connection`` options, HTTP/1.1."""
        self.kinds: dict[bytes, int] | None = None
        """The field classifier the head was read with (headers.request_kinds)."""
        self.host: bytes | None = None
        """The first ``Host`` field's value."""
        self.tenant: bytes | None = None
        """The first tenant header field's value (the classifier's tenant header)."""
        self.lines = b""
        """The ``PLAIN`` fields as ``Name: value\r\n`` lines: what a vendor is sent of them."""

    @property
    def fields(self) -> list[tuple[str, str]]:
        """The fields as the worker sent them, in their order (what ``headers`` holds)."""
        fields = self._fields
        if fields is None:
            fields = self._fields = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.raw]
        return fields

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The fields by name, made when first asked for."""
        headers = self._headers
        if headers is None:
            headers = self._headers = CIMultiDictProxy(CIMultiDict(self.fields))
        return headers

    @property
    def body(self) -> Body:
        body = self._body
        if body is None:  # none was announced: an ended body, made when first asked for
            assert self._conn is not None
            body = self._body = Body(self._conn, False)
            body._done = True
        return body

    @property
    def body_broken(self) -> BaseException | None:
        """Why the body broke off, if it did (a request without one: never)."""
        body = self._body
        return None if body is None else body._exc

    @property
    def kept_slots(self) -> dict[str, str] | None:
        """What the request path keeps for the worker's connection between its requests
        (the slots kept for its deferred calls: handler.admit); None without a connection."""
        conn = self._conn
        if conn is None:
            return None
        kept = conn.kept_slots
        if kept is None:
            kept = conn.kept_slots = {}
        return kept

    @property
    def follows(self) -> float | None:
        """Seconds since the previous answer on this connection was written (None: the
        connection's first request): a worker's next call comes right after its answer,
        a retry after a wait."""
        conn = self._conn
        if conn is None or conn.answered_at is None:
            return None
        return conn.loop.time() - conn.answered_at

    @property
    def chunk_pending(self) -> bool:
        """The chunked body has not all come (or broke off)."""
        body = self._body
        return self.length < 0 and body is not None and (not body._done or body._exc is not None)

    @property
    def waits_to_send(self) -> bool:
        """The worker waits for ``100 Continue`` before sending its body, not sent yet."""
        body = self._body
        return body is not None and body._continue


_new_request = object.__new__


def parsed_request(
    conn: Http1Connection,
    method: str,
    url: bytes,
    version: str,
    raw: list[tuple[bytes, bytes]],
    framing: RequestFraming,
    expect_continue: bool,
    tag: object,
) -> Request:
    """A request from the parser's pieces, made without ``Request.__init__``'s decoding."""
    has_body = framing.body != NONE
    req: Request = _new_request(Request)
    req.method = method
    req.target = req.raw_path = url.decode("latin-1")
    req.url = url
    req.version = version
    req._headers = None
    req._fields = None
    req.raw = raw
    req._body = Body(conn, expect_continue) if has_body else None
    req._conn = conn
    req.keep_alive = framing.keep_alive
    req.has_body = has_body
    req.length = framing.length
    req.tag = tag
    req.lean = False
    req.kinds = None
    req.host = req.tenant = None
    req.lines = b""
    return req


_date_cache: tuple[int, bytes] = (0, b"")
_OURS: Final = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
"""Fields of this hop's framing, written by the responder whatever the handler gave."""


def date_line() -> bytes:
    """The ``Date`` field line, made once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode("latin-1"))
    return _date_cache[1]


_STATUS_LINES: dict[tuple[int, str], bytes] = {}


def status_line(status: int, reason: str) -> bytes:
    """``HTTP/1.1 <status> <reason>\r\n`` (the status's own phrase when ``reason`` is empty),
    made once per (status, reason): vendors answer with the same few."""
    line = _STATUS_LINES.get((status, reason))
    if line is None:
        if len(_STATUS_LINES) >= 1024:  # reasons are the vendors' to choose
            _STATUS_LINES.clear()
        line = _STATUS_LINES[(status, reason)] = f"HTTP/1.1 {status} {reason or _REASONS.get(status, '')}\r\n".encode(
            "latin-1"
        )
    return line


class Responder:
    """Writes the answer to one request: ``start`` (the head is held back and leaves with
    the first piece of the body), ``write``, ``finish``; or ``send`` for a whole answer."""

    __slots__ = ("_chunked", "_conn", "_finished", "_head", "_left", "_no_body", "_request", "begun", "status")

    def __init__(self, conn: Http1Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._head: bytes | None = None
        self._chunked = False
        self._no_body = False
        self._left: int | None = None
        self._finished = False
        self.begun = False
        """Has any byte of the answer been written (an interim 100 Continue aside)?"""
        self.status = 0

    @property
    def started(self) -> bool:
        return self.status != 0

    @property
    def finished(self) -> bool:
        return self._finished

    def start(
        self,
        status: int,
        reason: str,
        headers: Iterable[tuple[str, str]],
        *,
        length: int = -1,
        codings: AnswerCodings = NO_CODINGS,
    ) -> None:
        """The answer's status and end-to-end headers (hop-by-hop ones are this hop's: any
        given are dropped). A ``Content-Length`` among them frames the body (``length``, when
        given, instead of theirs); else chunks. ``codings``: as ``start_lines``."""
        found = -1
        date = False
        lines = []
        for name, value in headers:
            low = name.lower()
            if low in _OURS:
                if low == "content-length" and value.strip().isdigit():
                    found = int(value)
                continue
            if low == "date":
                date = True
            lines.append(f"{name}: {value}\r\n")
        head = ["".join(lines).encode("latin-1")] if lines else []
        self.start_lines(status, reason, head, length if length >= 0 else found, date, codings)

    def start_lines(
        self,
        status: int,
        reason: str,
        head: list[bytes],
        length: int,
        date: bool,
        codings: AnswerCodings = NO_CODINGS,
    ) -> None:
        """``start`` with the end-to-end fields already written: ``head``, pieces of
        ``Name: value\\r\\n`` lines as bytes, none of this hop's framing (``Content-Length``
        is ``length``, -1 for none); ``date``: a ``Date`` is among them. ``head`` is the
        responder's from now on. ``codings``: the transfer codings of the body written
        (framing.answer_codings), said in ``Transfer-Encoding`` (an HTTP/1.1 worker's)."""
        assert self.status == 0, "answer already started"
        req = self._request
        self.status = status
        if not reason:
            reason = _REASONS.get(status, "")
        bodiless = status in NO_BODY_STATUS or status < 200
        self._no_body = bodiless or req.method == "HEAD"
        if not date:
            head.append(date_line())
        keep = self.keeps
        if bodiless:
            pass  # no framing field: the answer ends with its head, whatever one would say
        elif length >= 0:
            head.append(b"Content-Length: %d\r\n" % length)  # (a HEAD's: the length a GET would get)
            if not self._no_body:
                self._left = length
        elif codings.to_close:  # (an HTTP/1.1 worker's): as the vendor sent it, to the close
            head.append(b"Transfer-Encoding: %s\r\n" % codings.to_close)
            keep = False
        elif not self._no_body:
            if req.version == "1.1":
                self._chunked = True
                if codings.before_chunked:
                    head.append(b"Transfer-Encoding: %s, chunked\r\n" % codings.before_chunked)
                else:
                    head.append(b"Transfer-Encoding: chunked\r\n")
            else:
                keep = False  # an HTTP/1.0 worker takes no chunks: the close delimits the body
        if not keep:
            req.keep_alive = False
            head.append(b"Connection: close\r\n\r\n")
        elif req.version == "1.0":
            head.append(b"Connection: keep-alive\r\n\r\n")
        else:
            head.append(b"\r\n")
        self._head = status_line(status, reason) + b"".join(head)

    async def write(self, data: bytes) -> None:
        assert self.status and not self._finished
        if self._no_body or not data:
            return
        if self._left is not None:
            if len(data) > self._left:
                raise ValueError("more body than the Content-Length said")
            self._left -= len(data)
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self._emit(data)
        if self._conn._write_paused or self._conn._closed:  # would drain wait or raise? rarely: no coroutine
            await self._conn.drain()

    async def finish(self) -> None:
        """The answer is complete. A body shorter than its Content-Length cannot be, so the
        connection is cut instead (a truncated body must never look complete)."""
        assert self.status
        if self._finished:
            return
        if self._left:
            self.abort()
            return
        self._finished = True
        self._emit(b"0\r\n\r\n" if self._chunked else b"")
        if self._conn._write_paused or self._conn._closed:  # would drain wait or raise? rarely: no coroutine
            await self._conn.drain()

    async def complete(self, data: bytes) -> None:
        """``write(data)`` then ``finish()``, the head, ``data`` and the end of the body in one
        write to the socket (a small answer that is all in)."""
        assert self.status and not self._finished
        if self._no_body or not data:
            data = b""
        elif self._left is not None:
            if len(data) > self._left:
                raise ValueError("more body than the Content-Length said")
            self._left -= len(data)
        if self._left:  # shorter than its Content-Length: cut, as ``finish`` does
            self._emit(data)
            self.abort()
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        self._emit(data)
        if self._conn._write_paused or self._conn._closed:  # would drain wait or raise? rarely: no coroutine
            await self._conn.drain()
        self._finished = True

    @property
    def keeps(self) -> bool:
        """Will the connection stay open after this answer (as the answer's head must say)?
        Not when a body the worker waits to be invited for was not, nor when a chunked body
        is not whole: where it ends is only known once it has parsed, and it may yet break."""
        req = self._request
        return req.keep_alive and self._conn.keep_alive and not req.waits_to_send and not req.chunk_pending

    def wrote(self, status: int) -> None:
        """Its caller wrote the answer (head and body, ``status``) on the connection itself,
        and the worker has not taken it all yet: ``drained`` finishes it (the straight
        path's, lane.py, for a slow worker)."""
        assert self.status == 0, "answer already started"
        self.status = status
        self.begun = True

    async def drained(self) -> None:
        """Finish what ``wrote`` began (ConnectionError: the worker went away)."""
        await self._conn.drain()
        self._finished = True

    async def send(self, status: int, reason: str, headers: Iterable[tuple[str, str]], body: bytes = b"") -> None:
        """A whole answer at once, ``Content-Length`` set from ``body``."""
        self.start(status, reason, headers, length=len(body))
        if body and not self._no_body:
            self._left = 0
            self._emit(body)
        self._finished = True
        self._emit(b"")
        if self._conn._write_paused or self._conn._closed:  # would drain wait or raise? rarely: no coroutine
            await self._conn.drain()

    def abort(self) -> None:
        """Cut the connection now: what was written of the answer is all the worker gets."""
        self._finished = True
        self._request.keep_alive = False
        self._conn.abort()

    def _emit(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            data = head + data
        if data:
            self.begun = True
            self._conn.write(data)


Handler = Callable[[Request, Responder], Awaitable[None]]
"""Serves one request: must start and finish (or abort) the answer before returning."""


class Flight(Protocol):
    """A request the straight path serves by callbacks (proxy/pipeline/lane.py): the connection holds
    it from its head until it calls ``landed`` or ``carry``."""

    def take(self) -> bool:
        """Start; False when nothing was done and the request is the handler's after all."""

    def gone(self) -> None:
        """The worker went away: give up what the flight waits for, account for it."""


class Lane(Protocol):
    """The usual request's way through (proxy/pipeline/lane.py): it names the classifier the parser
    notes each field's kind with, and takes ``lean`` requests it can serve straight."""

    @property
    def kinds(self) -> dict[bytes, int]: ...

    @property
    def tenant_header(self) -> str: ...

    def flight(self, conn: Http1Connection, request: Request) -> Flight | None: ...


class _Work:
    """What the serving task goes on with for a request a flight handed over (``carry``)."""

    __slots__ = ("request", "responder", "work")

    def __init__(self, request: Request, responder: Responder, work: Callable[[], Awaitable[None]]) -> None:
        self.request = request
        self.responder = responder
        self.work = work


class _HeadRefused(Exception):
    """A head llhttp accepts and the proxy does not: answered ``status``, then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ParseError:
    __slots__ = ("message", "status")

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class Http1Connection(asyncio.Protocol):
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
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._open = False
        self._closed = False
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
        if self._broken or self._closed:
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

    def eof_received(self) -> bool:
        # A worker that stops sending has gone away, as aiohttp takes it too: the request
        # being served is cancelled (a held one gives its tokens back), the connection closed.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
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
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._skip_message:
            return
        self._in_head = True
        self._began = True
        self._head_seen = self._fresh = self._trailer_seen = 0
        self._url = b""
        self._fields = []
        self._marks = []
        self._lines = []
        self._kinds = self._lane.kinds if self._lane is not None else _KINDS

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._fresh += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fresh += len(name) + len(value) + 4
        if self._in_head:
            fields = self._fields
            if len(fields) >= MAX_FIELDS:
                raise _HeadRefused(431, f"request head with more than {MAX_FIELDS} fields")
            fields.append((name, value))
            kind = self._kinds.get(name)
            if kind is None:
                kind = learn_request_kind(self._kinds, name, self._lane.tenant_header if self._lane is not None else "")
            if kind:  # one the proxy reads or drops: looked at once the head is whole
                self._marks.append((kind, value))
            else:
                self._lines += (name, b": ", value, b"\r\n")
        else:  # a trailer field: dropped (Trailer is hop-by-hop, as aiohttp drops them too)
            self._trailer_seen += len(name) + len(value) + 4
            if self._trailer_seen > MAX_HEAD:
                raise _HeadRefused(431, f"trailer section larger than {MAX_HEAD} bytes")

    def on_headers_complete(self) -> None:
        if self._skip_message:
            return
        if self._fresh > MAX_HEAD:  # its parts alone are over: the whole head came in one read
            raise _HeadRefused(431, f"request head larger than {MAX_HEAD} bytes")
        self._in_head = False
        parser = self._parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":  # llhttp takes HTTP/0.9's "GET /path" too
            raise _HeadRefused(400, f"HTTP/{version} is not supported: the proxy speaks HTTP/1.0 and HTTP/1.1")
        method = parser.get_method().decode("latin-1")
        # The fields the proxy reads (the first of each name counts, as a lookup by name
        # finds it; every one of those that frame the message) and whether any of them
        # needs the general request path.
        host = tenant = expect = None
        hosts = 0
        lengths: list[bytes] = []
        transfers: list[bytes] = []
        lean = True
        for kind, value in self._marks:
            if kind == HOST:
                hosts += 1
                if host is None:
                    host = value
            elif kind == TENANT:
                if tenant is None:
                    tenant = value
            elif kind == CONNECTION_FIELD:
                if value not in THIS_HOP_VALUES and not only_this_hop(value):
                    lean = False  # it names fields to drop too: the general filter
            elif kind == LENGTH_FIELD:
                lengths.append(value)
            elif kind == TRANSFER:
                transfers.append(value)
            elif kind == EXPECT:
                if expect is None:
                    expect = value
                lean = False
            elif kind == QUOTA:
                lean = False
        try:
            framing = request_framing(
                version,
                method,
                hosts=hosts,
                lengths=lengths,
                transfers=transfers,
                keep_alive=parser.should_keep_alive(),
            )
        except FramingError as exc:
            raise _HeadRefused(400, f"malformed request: {exc}") from None
        has_body = framing.body != NONE
        continues = has_body and version == "1.1" and expect is not None and expect.lower() == b"100-continue"
        req = parsed_request(self, method, self._url, version, self._fields, framing, continues, self.tag)
        self._parsing = req
        if lean and framing.body != CHUNKED and method != "CONNECT":
            req.lean = True
            req.kinds = self._kinds
            req.host = host
            req.tenant = tenant
            req.lines = b"".join(self._lines)
            if self._lane is not None and not self._serving and not self._queue and self._closed is False:
                # Nothing before it on this connection: the straight path may take it now,
                # by callbacks, without the serving task (it hands over what it cannot do).
                if not has_body:
                    if self._fly(req):
                        return
                elif framing.length <= LANE_BODY_MAX:
                    # A small body: the request boards once it is whole (on_message_complete),
                    # if that is soon; else the serving task reads it as it comes (_unboard).
                    # Meanwhile the connection is busy with it, as if served.
                    self._boarding = req
                    self._serving = True
                    self._head_arrived()
                    return
        self._enqueue(req)

    def _fly(self, req: Request) -> bool:
        """The straight path takes ``req`` now, if it will (else False: nothing was done)."""
        assert self._lane is not None
        flight = self._lane.flight(self, req)
        if flight is None:
            return False
        self._serving = True
        self._flight = flight
        self._head_arrived()
        if flight.take():
            return True
        self._flight = None
        self._serving = False
        return False

    def _enqueue(self, req: Request) -> None:
        """``req`` for the serving task, after the requests before it."""
        self._queue.append(req)
        if len(self._queue) > PIPELINE_AHEAD:
            self.pause("pipeline")
        self._head_arrived()
        self._wake_queue()

    def _boarded(self) -> Request | None:
        """The boarding request, no longer boarding (None: there was none)."""
        req, self._boarding = self._boarding, None
        if req is not None:
            self._serving = False
            if self._board_timer is not None:
                self._board_timer.cancel()
                self._board_timer = None
        return req

    def _unboard(self) -> None:
        """A boarding request whose body did not come whole within ``BOARD_WAIT`` (or whose
        read broke off): the serving task serves it, reading the rest as it comes."""
        req = self._boarded()
        if req is not None:
            self._enqueue(req)

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None and self._parsing._body is not None:
            self._parsing._body._feed(body)

    def on_message_complete(self) -> None:
        if self._skip_message:
            self._skip_message = False
        parsing = self._parsing
        if parsing is not None:
            if parsing._body is not None:
                parsing._body._end()
            self._parsing = None
            if parsing is self._boarding:  # its small body is whole: the straight path may take it
                self._boarded()
                if not self._fly(parsing):
                    self._enqueue(parsing)

    # -- parsing edge cases ------------------------------------------------------------

    def _upgraded(self, rest: bytes) -> None:
        """llhttp stops at an ``Upgrade`` (or CONNECT) head as if the protocol switched; the
        proxy never switches it. A CONNECT ends the connection after its answer; any other
        request goes on as plain HTTP, its body framed as its head said."""
        req = self._queue[-1] if self._queue else None
        self._parser = httptools.HttpRequestParser(self)
        if not isinstance(req, Request) or req.method == "CONNECT":
            self._broken = True  # what follows a CONNECT head is not HTTP: read no further
            self.pause("connect")
            return
        if req.has_body:
            # Parse the body with a head of its own framing (as its head's was decided),
            # its callbacks going to ``req``.
            framing = "Transfer-Encoding: chunked\r\n" if req.length < 0 else f"Content-Length: {req.length}\r\n"
            req.body._done = False
            self._parsing = req
            self._skip_message = True
            try:
                self._parser.feed_data(f"POST / HTTP/{req.version}\r\n{framing}\r\n".encode("latin-1"))
            except httptools.HttpParserError as exc:
                self._parse_failed(400, f"malformed request: {exc}")
                return
        if rest:
            self.data_received(rest)

    def _parse_failed(self, status: int, message: str) -> None:
        """Answer ``status`` once the requests before it are answered, then close."""
        self._broken = True
        self._in_head = False
        self._head_arrived()
        if self._parsing is not None:
            if self._parsing._body is not None:
                self._parsing._body._fail(BodyBroken(message))
            self._parsing = None
        self._queue.append(_ParseError(status, message))
        self.pause("broken")
        self._wake_queue()

    # -- flow control ------------------------------------------------------------------

    def pause(self, reason: str) -> None:
        if not self._pauses and self.transport is not None and not self._closed:
            self.transport.pause_reading()
        self._pauses.add(reason)

    def resume(self, reason: str) -> None:
        if reason not in self._pauses:
            return
        self._pauses.discard(reason)
        if not self._pauses and self.transport is not None and not self._closed:
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self._closed:
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
        if self._closed:
            raise ConnectionResetError("the worker's connection closed")
        if not self._write_paused:
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
