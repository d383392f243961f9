"""The worker-facing connection's parsing half: llhttp's callbacks, which make requests of
the bytes (their fields noted by kind as they come, their framing read once: framing.py),
board a small body, and hand each request to the straight path or the serving queue.

``RequestParsing`` is a part of ``http1.Http1Connection``, which owns the state it uses
(declared below) and the serving half."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Final, Protocol

import httptools

from proxy.wire.body import BodyBroken
from proxy.wire.framing import CHUNKED, NONE, FramingError, request_framing
from proxy.wire.headers import (
    CONNECTION_FIELD,
    EXPECT,
    HOST,
    LENGTH_FIELD,
    QUOTA,
    TENANT,
    THIS_HOP_VALUES,
    TRANSFER,
    WISH_ACTION,
    WISH_CLASS,
    WISH_HOLD,
    learn_request_kind,
    only_this_hop,
    request_kinds,
)
from proxy.wire.request import Request, parsed_request

MAX_HEAD: Final = 64 * 1024
"""Bytes a request head may take (request line and fields together); more: 431. A chunked
body's trailer section is held to it too (its fields are dropped, but each is parsed)."""
MAX_FIELDS: Final = 256
"""Fields a request head may have; more: 431 (thousands of tiny ones fit in ``MAX_HEAD``
and cost a callback each, here and at the vendor)."""
LANE_BODY_MAX: Final = 64 * 1024
"""The largest request body (by its ``Content-Length``) the straight path may send: one
that arrives whole within ``BOARD_WAIT`` of its head goes out with it in one write."""
BOARD_WAIT: Final = 0.25
"""Seconds a small body may take after its head (many clients write the two apart) before
the general path takes the request and streams the body as it comes."""
PIPELINE_AHEAD: Final = 4
"""Parsed requests waiting behind the one being served before reading pauses."""
_KINDS: Final = request_kinds("")
"""The field classifier of a connection served without a lane (no tenant header)."""


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

    def flight(self, conn: Any, request: Request) -> Flight | None: ...


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


class RequestParsing:
    """llhttp's callbacks, on the connection's own state (see the module's doc)."""

    # The connection's state these read and write (http1.Http1Connection.__init__ sets it).
    tag: object
    closed: bool
    _parser: httptools.HttpRequestParser
    _queue: deque[Any]
    _serving: bool
    _lane: Lane | None
    _kinds: dict[bytes, int]
    _flight: Flight | None
    _boarding: Request | None
    _board_timer: asyncio.TimerHandle | None
    _url: bytes
    _fields: list[tuple[bytes, bytes]]
    _marks: list[tuple[int, bytes]]
    _lines: list[bytes]
    _in_head: bool
    _head_seen: int
    _fresh: int
    _trailer_seen: int
    _began: bool
    _parsing: Request | None
    _skip_message: bool
    _broken: bool

    kept_slots: dict[str, str] | None
    answered_at: float | None
    loop: asyncio.AbstractEventLoop

    if TYPE_CHECKING:  # (the connection's, and what a request needs of it: request.WorkerConnection)

        @property
        def stall_limit(self) -> float: ...

        def pause(self, reason: str) -> None: ...

        def resume(self, reason: str) -> None: ...

        def write_interim(self, data: bytes) -> None: ...

        def data_received(self, data: bytes) -> None: ...

        def _head_arrived(self) -> None: ...

        def _wake_queue(self) -> None: ...

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
        host = tenant = expect = on_limit = max_hold = priority = None
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
            elif kind == WISH_ACTION:
                if on_limit is None:
                    on_limit = value
            elif kind == WISH_HOLD:
                if max_hold is None:
                    max_hold = value
            elif kind == WISH_CLASS:
                if priority is None:
                    priority = value
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
            req.on_limit = on_limit
            req.max_hold = max_hold
            req.priority = priority
            req.lines = b"".join(self._lines)
            if self._lane is not None and not self._serving and not self._queue and self.closed is False:
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
