"""Writing one answer to a worker: its head held back to leave with the first piece of
its body, its framing this hop's (framing.py), its connection kept or closed."""

from __future__ import annotations

import time
from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, Protocol

from proxy.wire.framing import NO_BODY_STATUS, NO_CODINGS, AnswerCodings
from proxy.wire.request import Request

_REASONS: Final = {s.value: s.phrase for s in HTTPStatus}


class AnswerSink(Protocol):
    """The worker's connection, as an answer written on it needs it (http1.Http1Connection)."""

    keep_alive: bool
    write_paused: bool
    closed: bool

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def abort(self) -> None: ...


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


def keeps(request: Request, conn: AnswerSink) -> bool:
    """Will the connection stay open after the answer to ``request`` (as the answer's head
    must say)? Not when the worker or this side closes it, nor when a body the worker waits
    to be invited for was not, nor when a chunked body is not whole: where it ends is only
    known once it has parsed, and it may yet break."""
    if not (request.keep_alive and conn.keep_alive):
        return False
    body = request._body  # (none: the usual request, on the straight path)
    return body is None or (not request.waits_to_send and not request.chunk_pending)


_CLOSE_END: Final = b"Connection: close\r\n\r\n"
_KEEP_END_1_0: Final = b"Connection: keep-alive\r\n\r\n"


def head_end(version: str, keep: bool) -> bytes:
    """The end of an answer's head, which says what becomes of the connection: closed, or
    kept (an HTTP/1.0 worker keeps it only when told so)."""
    if not keep:
        return _CLOSE_END
    return _KEEP_END_1_0 if version == "1.0" else b"\r\n"


class Responder:
    """Writes the answer to one request: ``start`` (the head is held back and leaves with
    the first piece of the body), ``write``, ``finish``; or ``send`` for a whole answer."""

    __slots__ = ("_chunked", "_conn", "_finished", "_head", "_left", "_no_body", "_request", "begun", "status")

    def __init__(self, conn: AnswerSink, request: Request) -> None:
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
        head.append(head_end(req.version, keep))
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
        if self._conn.write_paused or self._conn.closed:  # would drain wait or raise? rarely: no coroutine
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
        if self._conn.write_paused or self._conn.closed:  # would drain wait or raise? rarely: no coroutine
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
        if self._conn.write_paused or self._conn.closed:  # would drain wait or raise? rarely: no coroutine
            await self._conn.drain()
        self._finished = True

    @property
    def keeps(self) -> bool:
        """Will the connection stay open after this answer (``keeps``)?"""
        return keeps(self._request, self._conn)

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
        if self._conn.write_paused or self._conn.closed:  # would drain wait or raise? rarely: no coroutine
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
