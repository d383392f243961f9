"""Workers' connections to the proxy listener: the cap on how many are open, what a
connection beyond it is told, and what a request head that does not arrive in time is told.

    open connections below the cap       served
    the cap reached, and a connection    that connection is closed (408 if part of a head
      waits for a head over EVICT_AFTER  came) and the new one served: a stalled head
                                         (slowloris) gives way to a worker that talks
    the cap reached, none waits long     turned away: its request head is read (at most
                                         1 s and 16 KiB), then answered 503 + Connection:
                                         close (SPEC §5 body, x-should-retry: true,
                                         Retry-After: 1) and closed; what it still sends is
                                         read and dropped for up to 1 s, so the client reads
                                         the answer rather than a reset
    TURNED_AWAY_MAX already being        closed at once, nothing read or written: a flood
    turned away                          costs no time and no memory

The cap is ``connections.max``, lowered at start when the file-descriptor limit cannot hold
it (fdlimit.py), so the admin listener, the store and the vendors keep the descriptors they
need. ConnectGate counts the open connections; the head and idle timeouts are applied by the
front door (until the first request says what it is) and by the data plane's connections
(wire/http1.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final

from aiohttp import web

from proxy.policy.model import Connections
from proxy.telemetry.metrics import Metrics
from proxy.wire import headers as h
from proxy.wire.answers import Answer, render
from proxy.wire.refusals import ErrorType

log = logging.getLogger("quota_proxy")

EVICT_AFTER: Final = 1.0
"""Seconds a connection must have waited for its request head before a new connection at
the cap may take its place (a worker sends its head in milliseconds)."""
TURNED_AWAY_MAX: Final = 64
"""Connections beyond the cap being answered at once; more are closed unanswered."""
_ANSWER_WAIT: Final = 1.0  # seconds a turned-away connection has to send its request head
_LINGER: Final = 1.0  # seconds what it sends after the answer is read and dropped
_MAX_HEAD: Final = 16 * 1024
_WARN_EVERY: Final = 10.0  # seconds between two log lines about the cap


def raw_response(resp: web.Response) -> bytes:
    """An answer serialised whole, for a connection answered outside the request path (a
    CONNECT, a turned-away or timed-out connection, a head that does not parse); the
    connection closes after it."""
    body = resp.body if isinstance(resp.body, bytes) else b""
    lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
    lines += [f"{k}: {v}" for k, v in resp.headers.items() if k.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def _answer(status: int, error: ErrorType, code: str, message: str, headers: dict[str, str]) -> bytes:
    """A connection-level answer: the request was never served, so it may be sent again."""
    return raw_response(render(Answer(status, error, code, message, True, {"reason": code.replace("_", "-")}, headers)))


REQUEST_TIMEOUT: Final = _answer(
    408,
    "bad_request",
    "request_timeout",
    "the request head did not arrive within connections.head_timeout: the connection is closed; send the request again",
    {h.REASON: "request-timeout"},
)


class ConnectionLimits:
    """The listener's connection settings as they are now (``settings``: the live policy's
    ``connections`` section, which a reload may change), the cap, and the count of
    connections the data plane serves (``http1.ConnectionGuard``)."""

    def __init__(self, settings: Callable[[], Connections], metrics: Metrics, fd_capacity: int | None = None) -> None:
        self._settings = settings
        self._metrics = metrics
        self.fd_capacity = fd_capacity
        """Worker connections the file-descriptor limit can hold (None: not limited)."""
        self.served = 0
        """Connections the data plane serves now: plain HTTP, and HTTP inside intercepted CONNECTs."""
        self._turned_away: set[_TurnedAway] = set()
        self._warned = -_WARN_EVERY
        # Connections waiting for a request head, oldest first: since when, and how to close one.
        self._waiting: dict[object, tuple[float, Callable[[], None]]] = {}

    @property
    def head_timeout(self) -> float:
        return self._settings().head_timeout

    @property
    def idle_timeout(self) -> float:
        return self._settings().idle_timeout

    @property
    def cap(self) -> int:
        """Open connections allowed: ``connections.max``, unless the descriptors cannot hold it."""
        configured = self._settings().max
        return configured if self.fd_capacity is None else min(configured, self.fd_capacity)

    # -- http1.ConnectionGuard ------------------------------------------------

    def opened(self) -> None:
        self.served += 1

    def closed(self) -> None:
        self.served -= 1

    def head_timed_out(self, partial: bool) -> bytes:
        self._metrics.connections_closed.labels("head_timeout").inc()
        return REQUEST_TIMEOUT if partial else b""

    def waiting(self, connection: object, evict: Callable[[], None]) -> None:
        """``connection`` waits for a request head from now; ``evict`` closes it should a new
        connection at the cap need its place."""
        self._waiting.pop(connection, None)
        self._waiting[connection] = (time.monotonic(), evict)

    def not_waiting(self, connection: object) -> None:
        self._waiting.pop(connection, None)

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest for its head, if over EVICT_AFTER."""
        for connection, (since, evict) in self._waiting.items():
            if time.monotonic() - since < min(EVICT_AFTER, self.head_timeout / 2):
                return False  # the oldest is recent: so is every other
            del self._waiting[connection]
            self._metrics.connections_closed.labels("evicted").inc()
            evict()
            return True
        return False

    # -- the cap ------------------------------------------------------------------------

    def turn_away(self, open_now: int) -> asyncio.Protocol | None:
        """None when a new connection may be served (``open_now`` are open); else the
        protocol that turns it away."""
        cap = self.cap
        if open_now < cap or self._evict_oldest():
            return None
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY:
            self._warned = now
            log.warning(
                "%d worker connections open, the cap (connections.max %d): new connections are answered 503",
                open_now,
                cap,
            )
        if len(self._turned_away) >= TURNED_AWAY_MAX:
            self._metrics.connections_closed.labels("ceiling").inc()
            return _Reset()
        self._metrics.connections_closed.labels("over_cap").inc()
        message = (
            f"the proxy has {open_now} connections open, its limit (connections.max {cap}): "
            "retry in a moment, on a new connection"
        )
        headers = {h.RETRY_AFTER: "1", h.REASON: "too-many-connections"}
        answer = _answer(503, "proxy_error", "too_many_connections", message, headers)
        return _TurnedAway(self._turned_away, answer)

    def cut(self) -> None:
        """At shutdown: close the connections being turned away."""
        for turned_away in list(self._turned_away):
            turned_away.close()


class _TurnedAway(asyncio.Protocol):
    """A connection beyond the cap, answered once its request head is in (or after
    ``_ANSWER_WAIT``), then closed after a linger."""

    def __init__(self, registry: set[_TurnedAway], answer: bytes) -> None:
        self._registry = registry
        self._answer = answer
        self._transport: asyncio.Transport | None = None
        self._head = bytearray()
        self._answered = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._registry.add(self)
        self._timer = asyncio.get_running_loop().call_later(_ANSWER_WAIT, self._respond)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return  # the rest of the request: dropped
        self._head += data
        if b"\r\n\r\n" in self._head or len(self._head) > _MAX_HEAD:
            self._respond()

    def eof_received(self) -> bool:
        self._respond()
        return False  # the client sends no more: close once the answer is flushed

    def _respond(self) -> None:
        transport = self._transport
        if self._answered or transport is None or transport.is_closing():
            return
        self._answered = True
        self._head = bytearray()
        if self._timer is not None:
            self._timer.cancel()
        transport.write(self._answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_LINGER, transport.close)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._registry.discard(self)


class _Reset(asyncio.Protocol):
    """Far beyond the cap: closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.abort()  # type: ignore[attr-defined]
