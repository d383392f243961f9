"""The vendor-facing HTTP/1.1 client of the data plane: one keep-alive connection to a vendor
(``UpstreamConnection``), one request at a time, the answer parsed by llhttp (httptools). Its
pool opens and keeps the connections (pool.py); the answer is read as vendor_answer.py's
``Response``.

A connection goes back to its pool only when its answer was read whole, the vendor said
keep-alive and the whole request was written; anything else closes it. A request is never
sent twice: a connection that broke while the request was being written or awaited is an
``UpstreamFailed`` with ``reached=True`` (the vendor may have it), never a silent resend on
a fresh connection (SPEC §12). An idle connection the vendor is known to have closed is
skipped before anything is written on it, which is not a resend.

Flow control: an answer body holding more than ``BODY_HIGH`` (inbox.py) unread bytes pauses reading
from the vendor; a request body waits while the transport's write buffer is full.

A worker that goes away once its whole request is written and before the answer's head does
not end the request at the vendor, which goes on working on it (and counting it in flight):
nothing tells it the worker left. Its answer is then heard out in the background
(``abandon``): read to its end and dropped (at most ``HEAR_OUT_MAX`` bytes, each read within
the read timeout), the connection back in the pool. ``after`` tells when the vendor is done
with it, for what must wait till then (the request's concurrency slot). Gone mid-answer, the
connection is closed instead: the vendor, writing, sees it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Final, Literal, NamedTuple, Protocol, cast

import httptools

from proxy.tasks import spawn
from proxy.wire.framing import codings
from proxy.wire.vendor_answer import Response

WRITE_HIGH: Final = 256 * 1024
HEAD_MAX: Final = 1024 * 1024
"""Bytes that may come before an answer's head is whole (interim answers' included); more:
the vendor broke off."""
HEAR_OUT_MAX: Final = 1024 * 1024
"""Bytes of a gone worker's answer read and dropped; a longer rest closes the connection."""
_EMPTY_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
"""Methods whose request carries ``Content-Length: 0`` when it has no body (as aiohttp did)."""

_FRAMING: Final = frozenset({"content-length", "transfer-encoding", "host"})
"""This hop's: the request's framing and Host are written here, whatever the caller gave."""

FailureKind = Literal["refused", "connect-timeout", "tls", "certificate", "timeout", "broken"]


class UpstreamFailed(Exception):
    """The request could not be completed. ``reached``: it may have reached the vendor
    (False only when no byte of it was written)."""

    def __init__(self, kind: FailureKind, detail: str, *, reached: bool) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.reached = reached


class UpstreamBroke(Exception):
    """The vendor's answer body ended early, failed to parse, or went silent past the read timeout."""


class Origin(NamedTuple):
    """Where a pool connects. A tuple: it keys the pool's idle connections, looked up twice per
    request, and a tuple hashes in C (a frozen dataclass's hash is Python code)."""

    scheme: str
    host: str
    port: int

    @property
    def authority(self) -> str:
        """What ``Host`` says: the port only when it is not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


class BodySource(Protocol):
    """What a request body is read from: ``read()`` gives the next piece, ``b""`` at the end."""

    async def read(self) -> bytes: ...


class Keeper(Protocol):
    """What a connection needs of the pool that opened it (pool.py's ``Pool``), named here:
    pool.py imports this module, not the reverse."""

    def give_back(self, conn: UpstreamConnection) -> None: ...

    def _forget(self, conn: UpstreamConnection) -> None: ...

    def _hearing(self, task: asyncio.Task[None]) -> None: ...


Landing = Callable[["Response | None", "UpstreamFailed | None"], None]
"""Told of a request's answer (its head in, with what else its read brought), or of why none
came (``send_head_to``)."""


class UpstreamConnection(asyncio.Protocol):
    """One connection to a vendor, one request at a time."""

    def __init__(self, pool: Keeper, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.loop = self._loop = asyncio.get_running_loop()
        self.closed = False
        self.read_timeout: float | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._method = ""
        self._heard: list[bytes] = []  # what came of the answer until its head was whole
        self._head_from = 0  # where in it the head now being parsed begins (after interim answers')
        self._head_size = 0
        self._head: asyncio.Future[Response] | None = None
        self._landing: Landing | None = None  # who hears of the answer's head instead of ``_head``
        self._response: Response | None = None
        self._complete = False
        self._keep_alive = False
        self._written = True
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._in_use = False
        self._writer: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._silent_until = 0.0
        self._host_line = f"Host: {origin.authority}\r\n"
        self.draining = False
        """The answer of a worker that went away is being heard out (``abandon``)."""
        self._after: list[Callable[[Response | None], None]] = []

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.set_write_buffer_limits(high=WRITE_HIGH)

    def data_received(self, data: bytes) -> None:
        if not self._in_use:  # an idle connection should say nothing: it cannot be trusted after this
            self.close()
            return
        if self.read_timeout is not None:
            self._silent_until = self._loop.time() + self.read_timeout
        if self._response is None:  # the head is not all in (per read, not per field: one read, usually)
            self._head_size += len(data)
            if self._head_size > HEAD_MAX:
                self._broke(f"the answer's head is larger than {HEAD_MAX} bytes")
                return
            self._heard.append(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broke("the vendor switched protocols, which the proxy never asked for")
        except httptools.HttpParserError as exc:
            if self._complete:  # bytes after a whole answer: it stands, the connection cannot be trusted
                self.close()
            else:
                known = exc.__context__ if isinstance(exc.__context__, UpstreamBroke) else None  # one of ours, below
                self._broke(str(known) if known is not None else f"malformed answer: {exc}")
        if self._landing is not None and self._response is not None:
            # Told once the read that brought the head is parsed (its body with it, usually,
            # or how it broke), as an awaited head would have been a loop turn later.
            landing, self._landing = self._landing, None
            landing(self._response, None)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._forget(self)
        reason = f"the vendor closed the connection{f' ({exc})' if exc else ''}"
        self._no_head(UpstreamFailed("broken", reason, reached=True))
        if self._response is not None and not self._complete:
            if self._close_delimited():
                self._complete = True
                self._response._end()
            else:
                self._response._fail(UpstreamBroke(reason))
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError(reason))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._response is not None:  # bytes after the answer: one nobody asked for
            raise UpstreamBroke("a second answer to one request")

    def on_headers_complete(self) -> None:
        # No per-field callbacks: the head is found in the bytes heard (llhttp has just
        # checked it whole, CRLF-delimited), its fields split only if something asks.
        heard = self._heard
        data = heard[0] if len(heard) == 1 else b"".join(heard)
        if len(heard) > 1:
            heard[:] = [data]
        start = self._head_from
        found = data.find(b"\r\n\r\n", start)
        if found < 0:  # cannot be: llhttp found the head whole in these bytes
            raise UpstreamBroke("the answer's head is not where the parser ended it")
        end = found + 2  # past the last line's CRLF
        self._head_from = end + 2
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim answer (103 Early Hints...): the real one follows
        line_end = data.find(b"\r\n", start)
        # "HTTP/1.1 200 OK": the reason phrase after the version, the code and a space.
        reason = data[start + 13 : line_end].decode("latin-1") if line_end > start + 13 else ""
        response = Response(self, status, reason, data[line_end + 2 : end] if line_end + 2 < end else b"")
        self._heard = []
        self._response = response
        self._keep_alive = self._parser.should_keep_alive()
        if self._method == "HEAD":
            # llhttp does not know the request was a HEAD: the answer ends with its head. A
            # parser that still waits for the body it announced is not reused.
            self._complete = True
            if "Content-Length" in response.headers or "Transfer-Encoding" in response.headers:
                self._keep_alive = False
            response._end()
        if self._head is not None and not self._head.done():
            self._head.set_result(response)  # (a landing is told at the end of the read: data_received)

    def on_body(self, body: bytes) -> None:
        if self._response is not None and not self._complete:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        response = self._response
        if response is None or self._complete:
            return  # the end of an interim answer, or of a HEAD answer's announced body
        self._complete = True
        response._end()

    # -- sending -----------------------------------------------------------------------

    async def request(
        self,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str]],
        body: BodySource | None,
        content_length: int | None,
        read_timeout: float | None,
        *,
        lines: list[str] | None = None,
    ) -> Response:
        """Send one request, return once the answer's head is in. ``body``: streamed with
        ``content_length`` as its framing, or chunked when that is None; ``headers`` are the
        end-to-end ones (any framing among them is dropped), or ``lines`` instead: the same
        already written (``"Name: value\\r\\n"``, none of this hop's framing nor ``Host``)."""
        if lines is None:
            lines = [f"{name}: {value}\r\n" for name, value in headers if name.lower() not in _FRAMING]
        if body is not None:
            lines.append(
                "Transfer-Encoding: chunked\r\n" if content_length is None else f"Content-Length: {content_length}\r\n"
            )
        elif method in _EMPTY_BODY_METHODS:
            lines.append("Content-Length: 0\r\n")
        lines.append("\r\n")
        head = f"{method} {target} HTTP/1.1\r\n{self._host_line}{''.join(lines)}".encode("latin-1")
        if body is None:
            answer = self.send_head(head, method, read_timeout)
            try:
                return await answer
            except BaseException as exc:
                self.unanswered(exc)
                raise
        self._begin(method, read_timeout)
        self._written = False
        assert self.transport is not None and self._head is not None
        self.transport.write(head)
        writer = self._writer = spawn(self._send_body(body, content_length is None), name="upstream-upload")
        writer.add_done_callback(_retrieve)
        try:
            # The read timeout runs from the end of the upload: a slow worker's upload is not the vendor's silence.
            await asyncio.wait((writer, self._head), return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and not self._head.done():
                writer.result()  # the upload failed: the worker's body broke, or the vendor's connection
            self.awaiting()
            return await self._head  # the read timer fails it when the vendor stays silent
        except BaseException as exc:
            self.unanswered(exc, writer)
            raise

    def _begin(self, method: str, read_timeout: float | None, landing: Landing | None = None) -> None:
        assert self.transport is not None and not self._in_use
        self._in_use = True
        self._method = method
        self.read_timeout = read_timeout
        self._response = None
        self._complete = False
        self._silent_until = 0.0
        self._head_size = 0
        self._heard = []
        self._head_from = 0
        self._landing = landing
        self._head = self._loop.create_future() if landing is None else None

    def send_head(self, head: bytes, method: str, read_timeout: float | None) -> asyncio.Future[Response]:
        """Write a request without a body, ``head`` whole (this hop's framing and ``Host``
        in it), and return the future of its answer's head: the read timer fails it when the
        vendor stays silent. A wait for it that ends in an exception goes to ``unanswered``."""
        self._begin(method, read_timeout)
        self._written = True
        assert self.transport is not None and self._head is not None
        self.transport.write(head)
        self.awaiting()
        return self._head

    def send_head_to(self, head: bytes, method: str, read_timeout: float | None, landing: Landing) -> None:
        """``send_head``, the answer's head (or why none came) told to ``landing`` instead of
        a future: from the reading callback, once the read that brought it is parsed (the
        straight path's, lane.py). ``unanswered`` still takes a wait that ends otherwise."""
        self._begin(method, read_timeout, landing)
        self._written = True
        assert self.transport is not None
        self.transport.write(head)
        self.awaiting()

    def _no_head(self, failure: UpstreamFailed) -> None:
        """No answer's head will come: whoever waits for it is told (a landing whose answer's
        head came in this very read hears of that instead: data_received)."""
        if self._head is not None and not self._head.done():
            self._head.set_exception(failure)
        elif self._landing is not None and self._response is None:
            landing, self._landing = self._landing, None
            landing(None, failure)

    def unanswered(self, exc: BaseException, writer: asyncio.Task[None] | None = None) -> None:
        """The wait for the answer's head ended in ``exc``. Cancelled (the worker went away)
        with the whole request written: the vendor works on it regardless, so its answer is
        heard out. Otherwise the connection is useless. ``writer``: the upload, if any."""
        whole = writer is None or (writer.done() and not writer.cancelled() and writer.exception() is None)
        self._landing = None
        if isinstance(exc, asyncio.CancelledError) and whole:
            self.abandon()
            return
        if writer is not None and not writer.done():
            writer.cancel()
        if self._head is not None and not self._head.done():
            self._head.cancel()  # nobody will await it: the close must not fail it unheard
        self.close()

    async def _send_body(self, body: BodySource, chunked: bool) -> None:
        transport = self.transport
        assert transport is not None
        while chunk := await body.read():
            if self.closed:
                raise UpstreamFailed("broken", "the vendor closed the connection during the upload", reached=True)
            transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            if self._write_paused:
                self._drain_waiter = self._loop.create_future()
                try:  # a vendor that takes no byte of the upload for its read timeout is silent too
                    async with asyncio.timeout(self.read_timeout):
                        await self._drain_waiter
                except TimeoutError:
                    silent = f"took no byte of the upload for {self.read_timeout:g}s"
                    raise UpstreamFailed("timeout", silent, reached=True) from None
                finally:
                    self._drain_waiter = None
        if chunked:
            transport.write(b"0\r\n\r\n")
        self._written = True

    # -- the read timeout -----------------------------------------------------------------

    @property
    def awaiting_answer(self) -> bool:
        """A request is written whole and its answer's head not in yet."""
        waits = (self._head is not None and not self._head.done()) or self._landing is not None
        return self._in_use and self._written and waits

    def awaiting(self) -> None:
        """Someone now waits for the vendor (the answer's head, or more of its body): it has
        ``read_timeout`` from now, or from its last bytes if later, to send something.
        One lazy timer per connection: it moves itself when it fires early."""
        if self.read_timeout is None:
            return
        self._silent_until = max(self._silent_until, self._loop.time() + self.read_timeout)
        if self._timer is None:
            self._timer = self._loop.call_at(self._silent_until, self._read_timer)

    def _read_timer(self) -> None:
        self._timer = None
        if self.closed or not self._in_use or self.read_timeout is None:
            return
        now = self._loop.time()
        head = (self._head is not None and not self._head.done()) or self._landing is not None
        body = self._response is not None and self._response._waiter is not None
        if not (head or body):
            return  # nobody waits (the worker reads slowly): the next wait sets the timer again
        if now < self._silent_until:  # the vendor spoke since: watch until its new deadline
            self._timer = self._loop.call_at(self._silent_until, self._read_timer)
            return
        silent = f"no answer within {self.read_timeout:g}s"
        if head:
            self._no_head(UpstreamFailed("timeout", silent, reached=True))
        if self._response is not None:
            self._response._fail(UpstreamBroke(f"no data for {self.read_timeout:g}s"))
        self.close()

    # -- the end of an exchange ----------------------------------------------------------

    def abandon(self) -> None:
        """The worker went away with its request whole at the vendor: read the vendor's
        answer (its head, if not in yet, and its body) to its end in the background and
        drop it; the connection then goes back to the pool if it can. Closed instead when
        the vendor is silent for the read timeout or the rest is over ``HEAR_OUT_MAX``."""
        if self.closed or self.draining:
            return
        self.draining = True
        task = spawn(self._hear_out(), name="upstream-hear-out")
        task.add_done_callback(_retrieve)
        self._pool._hearing(task)

    def after(self, done: Callable[[Response | None], None]) -> None:
        """Call ``done`` once the vendor is done with this connection's request: at once,
        unless its answer is being heard out (then when that ends, however it ends). It is
        given the answer heard out (its status and headers: the body is gone), if its head came."""
        if self.draining:
            self._after.append(done)
        else:
            done(None)

    async def _hear_out(self) -> None:
        response = self._response
        try:
            if response is None:  # the head is not in yet (the worker's wait for it was cancelled)
                head = self._head = self._loop.create_future()
                self.awaiting()
                response = await head
            heard = 0
            while chunk := await response.read():
                heard += len(chunk)
                if heard > HEAR_OUT_MAX:
                    self.close()
                    return
            self.finished(response)
        except (UpstreamFailed, UpstreamBroke, OSError):
            self.close()  # the vendor broke off or went silent: done with the request all the same
        except BaseException:
            self.close()
            raise
        finally:
            self.draining = False
            after, self._after = self._after, []
            for done in after:
                done(response)

    def finished(self, response: Response) -> None:
        if self._response is not response or self.closed:
            return
        if self._complete and response.done and self._keep_alive and self._written:
            self._in_use = False
            self._response = None
            if self._method == "HEAD":  # llhttp, not told, may still wait for the body the head announced
                self._parser = httptools.HttpResponseParser(self)
            self._pool.give_back(self)
        else:
            self.close()

    def _close_delimited(self) -> bool:
        """Does the answer end at the connection's close (no length, not chunked)?"""
        response = self._response
        if response is None:
            return False
        return "Content-Length" not in response.headers and codings(response.transfer_codings)[-1:] != [b"chunked"]

    def _broke(self, why: str) -> None:
        self._no_head(UpstreamFailed("broken", why, reached=True))
        if self._response is not None:
            self._response._fail(UpstreamBroke(why))
        self.close()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()  # an upload the vendor answered before its end
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pool._forget(self)


def _retrieve(task: asyncio.Task[None]) -> None:
    """An upload's failure is the request's (or nobody's, once the answer is in): never
    'Task exception was never retrieved'."""
    if not task.cancelled():
        task.exception()


async def iterate(body: BodySource) -> AsyncIterator[bytes]:
    while chunk := await body.read():
        yield chunk
