"""One auto-pipelined Redis connection for the hot path (the acquire script).

redis-py checks a connection out of its pool, writes, awaits the reply and checks
it back in for every command: ~65-85 µs of CPU per EVALSHA on this kind of machine,
as much as the rest of the proxy's request path. Here every caller queues its
command on one shared connection and awaits a future; a busy loop turn's commands
leave in writes of up to ``BATCH_MAX``, replies come back in order (RESP is FIFO per
connection) and one ``data_received`` resolves as many futures as arrived in the
packet. Still one EVALSHA per request, now ~15 µs, and a write per batch, not per request.

A caller that gives up (timeout, cancellation) leaves its future cancelled; its reply
is read and dropped when it comes, so order is never lost. A lost connection fails
every waiter at once and the next call reconnects.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import hiredis
from redis.asyncio.connection import SSLConnection, parse_url


class PipelineError(Exception):
    """The connection failed or Redis answered with an error."""


class ReplyError(PipelineError):
    """Redis answered with an error reply: the connection is fine, and the reply is
    the command's (MOVED, ASK, NOSCRIPT... tell that the command did not run)."""


_ASKING = hiredis.pack_command(("ASKING",))


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """For a reply nobody awaits (ASKING's): a lost connection leaves no unretrieved error."""
    if not fut.cancelled():
        fut.exception()


BATCH_MAX = 8
"""Commands queued before they are written without waiting for the loop turn's end: Redis
starts on a busy turn's first commands while the proxy serves the rest (a whole turn's
batch left both cores idle at times and cost ~10 % of the requests per second)."""


class Reply:
    """What waits for one reply in place of a future: ``then(reply, None)`` (or ``then(None,
    error)``: the connection lost, the reply overdue) is called as it comes, from the
    callback that read it, with no loop turn in between (the straight path's, lane.py).
    ``cancel``: the caller gave up, the reply is dropped when it comes."""

    __slots__ = ("_then",)

    def __init__(self, then: Callable[[Any, BaseException | None], None]) -> None:
        self._then: Callable[[Any, BaseException | None], None] | None = then

    def done(self) -> bool:
        return self._then is None

    def set_result(self, reply: Any) -> None:
        then, self._then = self._then, None
        if then is not None:
            then(reply, None)

    def set_exception(self, error: BaseException) -> None:
        then, self._then = self._then, None
        if then is not None:
            then(None, error)

    def cancel(self) -> bool:
        self._then = None
        return True


class Replied(Protocol):
    """What waits for a reply without a future: a ``Reply``, or the straight path's own
    (redis_acquire.py), which decodes it as it comes."""

    def done(self) -> bool: ...

    def set_result(self, reply: Any) -> None: ...

    def set_exception(self, error: BaseException) -> None: ...

    def cancel(self) -> bool: ...


Waiter = asyncio.Future[Any] | Replied


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._waiters: deque[Waiter] = deque()
        self._deadlines: deque[float] = deque()  # each sent waiter's reply deadline (loop time)
        self._unsent: list[bytes] = []  # this loop turn's commands, written together by _flush
        self._unsent_within: list[float] = []  # their reply timeouts, from the write
        self._flush_due = False  # a _flush_turn is scheduled
        self._latest = 0.0  # the latest deadline sent so far
        self._watch: asyncio.TimerHandle | None = None  # one timer for the waiters' deadlines
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self.last_reply = self._loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        self.last_reply = self._loop.time()
        while (reply := self._reader.gets()) is not False:
            fut = self._waiters.popleft()
            self._deadlines.popleft()
            if not fut.done():  # a caller that timed out left its slot: drop its reply
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        error = PipelineError(f"connection lost: {exc}" if exc else "connection closed")
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._deadlines.clear()
        self._unsent.clear()
        self._unsent_within.clear()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error)

    def send(self, packed: bytes, within: float = math.inf) -> asyncio.Future[Any]:
        """Write ``packed`` at once when nothing is waiting for a reply, else queue it with
        the loop turn's others (written at ``BATCH_MAX``, or when the turn ends); its reply
        fails with TimeoutError when it has not come ``within`` seconds after the write
        (see _expire)."""
        fut: asyncio.Future[Any] = self._loop.create_future()
        self.send_to(packed, fut, within)
        return fut

    def send_to(self, packed: bytes, waiter: Waiter, within: float = math.inf) -> None:
        """``send``, its reply to ``waiter`` (a future, or a ``Reply``)."""
        if self.closed or self.transport is None:
            raise PipelineError("connection closed")
        fut = waiter
        idle = not self._waiters
        self._waiters.append(fut)
        self._unsent.append(packed)
        self._unsent_within.append(within)
        if idle or len(self._unsent) >= BATCH_MAX:
            self._flush()  # an idle connection: at once (latency); a full batch: Redis gets on with it
        elif not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush_turn)

    def _flush_turn(self) -> None:
        self._flush_due = False
        self._flush()

    def _flush(self) -> None:
        """Write the queued commands at once: one system call for a batch of the requests a
        turn serves (a write per command was 7 % of the CPU per request in a profile). Their
        deadlines start now, at the write: a command queued before the loop was held up is
        not charged for the hold-up (a busy loop is not a dead store)."""
        if self.closed or self.transport is None or not self._unsent or self.transport.is_closing():
            return  # (a closing connection fails every waiter, written or not, when it is lost)
        loop = self._loop
        now = loop.time()
        self.transport.write(self._unsent[0] if len(self._unsent) == 1 else b"".join(self._unsent))
        self._unsent.clear()
        for within in self._unsent_within:
            deadline = now + within
            self._deadlines.append(deadline)
            if deadline == math.inf:
                continue
            # Deadlines mostly come in the order commands go out (one store timeout), so one
            # timer, at the oldest waiter's deadline, watches them all: no timer per call. A
            # deadline earlier than one sent before (a Cluster call sent again) gets its own.
            if deadline < self._latest:
                loop.call_at(deadline, _expire, loop, self._waiters[len(self._deadlines) - 1], 2)
            else:
                self._latest = deadline
                if self._watch is None:
                    self._watch = loop.call_at(deadline, self._overdue)
        self._unsent_within.clear()

    def _overdue(self) -> None:
        """The watch's time came: expire every waiter past its deadline, then watch the next."""
        self._watch = None
        loop = self._loop
        now = loop.time()
        # strict=False: the waiters not written yet have no deadline so far
        for fut, deadline in zip(self._waiters, self._deadlines, strict=False):
            if fut.done() or deadline == math.inf:
                continue
            if deadline > now:
                self._watch = loop.call_at(deadline, self._overdue)
                return
            _expire(loop, fut, 2)

    def stuck_for(self) -> float:
        """Seconds since Redis last answered while commands are waiting (0 when none wait)."""
        if not self._waiters:
            return 0.0
        return self._loop.time() - self.last_reply

    def close(self) -> None:
        # abort, not close: over TLS, close() starts a close_notify exchange that needs more
        # turns of the event loop; a store closed as its loop ends (a test, a shutdown) left
        # the socket open ("unclosed transport"). Redis needs no TLS goodbye.
        if self.transport is not None:
            self.transport.abort()


def _expire(loop: asyncio.AbstractEventLoop, fut: Waiter, hops: int) -> None:
    """A reply's deadline passed. The deadline is on the reply, not on the caller's
    wait: a reply that came in time wins even if the busy loop resumes the caller late
    (asyncio.timeout would cancel that caller anyway, and an overloaded replica would
    mistake its own lag for a dead store and trip its breaker). As a margin for loops
    that run due timers before reading their sockets, look again after a couple of
    loop turns before failing."""
    if fut.done():
        return
    if hops:
        loop.call_soon(_expire, loop, fut, hops - 1)
        return
    fut.set_exception(TimeoutError("no reply from Redis within the store timeout"))


def _tls_context(opts: Mapping[str, object]) -> ssl.SSLContext:
    """rediss:// with the TLS options redis-py reads from the URL's query string
    (ssl_ca_certs, ssl_cert_reqs, ssl_check_hostname), so both connections agree."""
    cafile = opts.get("ssl_ca_certs")
    ctx = ssl.create_default_context(cafile=cafile if isinstance(cafile, str) else None)
    reqs = str(opts.get("ssl_cert_reqs", "required")).lower()
    if reqs in ("none", "cert_none"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.check_hostname = bool(opts.get("ssl_check_hostname", True))
        ctx.verify_mode = ssl.CERT_OPTIONAL if reqs in ("optional", "cert_optional") else ssl.CERT_REQUIRED
    return ctx


class PipelinedConnection:
    """``redis://`` or ``rediss://`` (user, password and db from the URL); not Cluster."""

    def __init__(self, url: str, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        opts = parse_url(url)
        self._connect_timeout = connect_timeout
        self._host = opts.get("host", "localhost")
        self._port = int(opts.get("port", 6379))
        self._setup: list[tuple[Any, ...]] = []
        if opts.get("password") is not None:
            user = opts.get("username")
            self._setup.append(("AUTH", user, opts["password"]) if user else ("AUTH", opts["password"]))
        if int(opts.get("db", 0)):
            self._setup.append(("SELECT", int(opts["db"])))
        tls = opts.get("connection_class") is SSLConnection
        self._ssl = (ssl_context or _tls_context(opts)) if tls else None
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._opening: _Protocol | None = None
        self._closed = False

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and not proto.closed:
            return proto
        if self._connecting is None:  # one connect attempt shared by every concurrent caller
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    def preload(self, source: str) -> None:
        """Load a script on every (re)connect, before any EVALSHA goes out: no
        NOSCRIPT round trip per in-flight request after a Redis restart."""
        self._setup.append(("SCRIPT", "LOAD", source))

    async def _connect(self) -> _Protocol:
        # Bounded on its own: callers only wait on it (shielded), so without a bound a
        # peer that never answers the set-up would hold every later call forever.
        loop = asyncio.get_running_loop()
        proto: _Protocol | None = None
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, proto = await loop.create_connection(_Protocol, self._host, self._port, ssl=self._ssl)
                self._opening = proto  # close() ends the set-up too: no transport outlives the store
                for command in self._setup:
                    reply = await proto.send(hiredis.pack_command(command))
                    if isinstance(reply, hiredis.ReplyError):
                        raise PipelineError(f"{command[0]}: {reply}")
                if self._closed:
                    raise PipelineError("connection closed")
        except BaseException:
            if proto is not None:
                proto.close()
            raise
        finally:
            self._opening = None
        self._proto = proto
        return proto

    async def execute(self, *args: Any, reply_within: float | None = None, asking: bool = False) -> Any:
        """Send one command and wait for its reply; TimeoutError when Redis has not
        answered ``reply_within`` seconds after it was sent (a deadline on the reply, not
        on the caller's wait: see _expire). ``asking``: ASKING goes out right before the
        command, nothing between them (Cluster's ASK redirection during a slot migration)."""
        return await self.execute_packed(hiredis.pack_command(args), reply_within=reply_within, asking=asking)

    async def execute_packed(self, packed: bytes, *, reply_within: float | None = None, asking: bool = False) -> Any:
        """``execute`` of a command already packed (RESP)."""
        if reply_within is None:
            proto = await self._connection()
            if asking:
                proto.send(_ASKING).add_done_callback(_retrieve)
            reply = await proto.send(packed)
        else:
            current = self._proto
            if current is None or current.closed:
                loop = asyncio.get_running_loop()
                started = loop.time()
                current = await asyncio.wait_for(self._connection(), reply_within)
                reply_within -= loop.time() - started  # the connect counts against the timeout
            if asking:
                current.send(_ASKING).add_done_callback(_retrieve)
            reply = await current.send(packed, reply_within)
        if isinstance(reply, hiredis.ReplyError):
            raise ReplyError(str(reply))
        return reply

    def open_protocol(self) -> _Protocol | None:
        """The connection's protocol when it is open, else None."""
        proto = self._proto
        return None if proto is None or proto.closed else proto

    def drop_if_stuck(self, after: float) -> None:
        """After a timeout: a connection on which Redis has said nothing for ``after``
        seconds while commands wait is presumed dead (frozen server, lost peer); drop it
        so the next call reconnects. A merely slow event loop keeps it."""
        if self._proto is not None and self._proto.stuck_for() >= after:
            self._proto.close()
            self._proto = None

    def close(self) -> None:
        """For good: a connection still being opened is closed as soon as it opens."""
        self._closed = True
        if self._opening is not None:
            self._opening.close()
        if self._proto is not None:
            self._proto.close()
            self._proto = None


class PipelinedScript:
    """EVALSHA on a PipelinedConnection; loads the script once on NOSCRIPT."""

    def __init__(self, conn: PipelinedConnection, source: str) -> None:
        self._conn = conn
        self._source = source
        conn.preload(source)
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list[Any], reply_within: float | None = None) -> Any:
        return await self.call_packed(
            keys, hiredis.pack_command(("EVALSHA", self.sha, len(keys), *keys, *args)), reply_within
        )

    def send_now(self, packed: bytes, reply_within: float) -> asyncio.Future[Any] | None:
        """The EVALSHA ``packed`` written (or queued) on the open connection, its reply's
        future as it comes (a ``hiredis.ReplyError`` is a reply: see ``reply_error``); None
        when the connection is not open (``call_packed`` connects). Two coroutines fewer
        per call than ``call_packed``: the request path's acquire takes this way."""
        proto = self._conn.open_protocol()
        return None if proto is None else proto.send(packed, reply_within)

    def send_to(self, packed: bytes, waiter: Replied, reply_within: float) -> bool:
        """``send_now``, its reply to ``waiter``; False when the connection is not open."""
        proto = self._conn.open_protocol()
        if proto is None:
            return False
        proto.send_to(packed, waiter, reply_within)
        return True

    async def reply_error(self, error: str, packed: bytes, reply_within: float | None) -> Any:
        """What an error reply to ``packed`` leads to: NOSCRIPT loads the script and sends
        ``packed`` again (it did not run); any other is raised (ReplyError)."""
        if not error.startswith("NOSCRIPT"):
            raise ReplyError(error)
        await self._conn.execute("SCRIPT", "LOAD", self._source, reply_within=reply_within)
        return await self._conn.execute_packed(packed, reply_within=reply_within)

    async def call_packed(self, keys: list[str], packed: bytes, reply_within: float | None = None) -> Any:
        """The EVALSHA ``packed`` (RESP, with this script's sha and ``keys``)."""
        try:
            return await self._conn.execute_packed(packed, reply_within=reply_within)
        except ReplyError as exc:
            return await self.reply_error(str(exc), packed, reply_within)
