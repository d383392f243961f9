"""The proxy listener's front door, and CONNECT (what HTTPS_PROXY makes clients send).

Every connection starts here: beyond the cap on open connections it is turned away
(connections.py); a connection whose first request head does not arrive within
``connections.head_timeout`` is closed (408 if part of a head came). Its first bytes
decide: a plain HTTP request hands the connection to the data plane's HTTP/1.1 server
(wire/http1.py, serving the request path in handler.py); ``CONNECT host:port`` is
answered here, per the vendor's ``connect`` mode:

- ``intercept``: 200, then TLS is terminated and the requests inside go to the
  request path (intercept.py).
- ``tunnel``: one token per CONNECT, then bytes pass blindly; concurrent tunnels
  per vendor are capped by ``max_tunnels`` (blind_tunnel.py).
- ``deny``, a host in no vendor, or a port other than the vendor's: 403.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from proxy.deps import Deps
from proxy.names import parse_authority
from proxy.pipeline.handler import ProxyHandler
from proxy.pipeline.ledger import Ledger, accounted
from proxy.pipeline.match import Interception
from proxy.policy.model import Vendor
from proxy.tasks import spawn
from proxy.tls.blind_tunnel import BlindTunnels
from proxy.tls.intercept import Interceptor, LeafSource
from proxy.wire.answers import Answer, render
from proxy.wire.connections import ConnectionLimits, raw_response
from proxy.wire.framing import NONE, FramingError, request_framing
from proxy.wire.http1 import Http1Connection
from proxy.wire.refusals import (
    BadRequest,
    Denied,
    ErrorType,
    Limited,
    ProxyAuthRequired,
    Refusal,
    StoreDown,
    UpstreamFailed,
)

log = logging.getLogger("quota_proxy.connect")

_CONNECT = b"CONNECT "
_MAX_HEAD = 16 * 1024  # a CONNECT request head larger than this is refused
_ESTABLISHED = b"HTTP/1.1 200 Connection Established\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ConnectHead:
    authority: str
    headers: CIMultiDict[str]


def parse_connect_head(head: bytes) -> ConnectHead:
    """``CONNECT host:port HTTP/1.1`` and its headers. Raises BadRequest."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise BadRequest("undecodable CONNECT request") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
        raise BadRequest(f"malformed CONNECT request line {lines[0][:100]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or _CONTROL.search(line) is not None:
            raise BadRequest(f"malformed header line {line[:100]!r}")
        headers.add(name, value.strip(" \t"))
    # The one framing reading (framing.py), as for any request; and a CONNECT has no content
    # (RFC 9110 §9.3.6): what follows its head is the tunnel's, never a body.
    try:
        framing = request_framing(
            "1.1",
            "CONNECT",
            hosts=len(headers.getall("Host", [])),
            lengths=[v.encode("latin-1") for v in headers.getall("Content-Length", [])],
            transfers=[v.encode("latin-1") for v in headers.getall("Transfer-Encoding", [])],
            keep_alive=False,
        )
    except FramingError as exc:
        raise BadRequest(f"malformed CONNECT request: {exc}") from None
    if framing.body != NONE:
        raise BadRequest("a CONNECT request has no content: what follows its head belongs to the tunnel")
    return ConnectHead(parts[1], headers)


_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f]")
"""Characters no field line may hold (a tab aside): a bare CR or LF, a NUL..."""


def _refusal(status: int, message: str) -> bytes:
    """A request the data plane could not parse (400) or take (431, 500): never counted as
    a request, since none was read; answered in the proxy's own JSON, then closed."""
    error: ErrorType = "proxy_error" if status >= 500 else "bad_request"
    code = {400: "bad_request", 431: "request_header_fields_too_large"}.get(status, "internal_error")
    return raw_response(render(Answer(status, error, code, message, False, {}, {})))


class ConnectGate:
    """Owns the listener's connections until each is handed to the data plane, tunnelled or
    intercepted, and counts them all. ``protocol`` is the listener's protocol factory;
    ``leaf_minter`` the current leaf minter (it changes when a reload changes the CA);
    ``limits`` the cap and the timeouts."""

    def __init__(
        self,
        handler: ProxyHandler,
        leaf_minter: Callable[[], LeafSource | None],
        limits: ConnectionLimits,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self._doors: set[FrontDoor] = set()
        self._served: set[Http1Connection] = set()
        self._served_empty = asyncio.Event()
        self._served_empty.set()
        self._keep_alive = True
        self._handshakes = 0
        self._empty = asyncio.Event()
        self._empty.set()
        self.tunnels = BlindTunnels(handler.admit, on_change=self._update)
        self.interceptor = Interceptor(lambda tag: self.serve(tag=tag), leaf_minter)

    def serve(self, *, tag: object = None, head_deadline: float | None = None) -> Http1Connection:
        """The data plane's protocol for one connection: the request path on it, its
        requests tagged with ``tag``, its first head due by ``head_deadline``."""
        return Http1Connection(
            self.handler,
            self.limits,
            refuse=_refusal,
            tag=tag,
            deadline=head_deadline,
            registry=self._served_changed,
            keep_alive=self._keep_alive,
            lane=self.handler.lane,
        )

    def _served_changed(self, conn: Http1Connection, is_open: bool) -> None:
        if is_open:
            self._served.add(conn)
            self._served_empty.clear()
        else:
            self._served.discard(conn)
            if not self._served:
                self._served_empty.set()
            if conn.kept_slots:  # a deferred call's slot, its owner gone with the connection
                self.handler.left(conn.kept_slots)

    def protocol(self) -> asyncio.Protocol:
        return self.limits.turn_away(self.open_connections) or FrontDoor(self)

    @property
    def open_connections(self) -> int:
        """Workers' connections open now, whatever they became: undecided or CONNECTs being
        answered, TLS handshakes, connections the data plane serves, blind tunnels."""
        return len(self._doors) + self._handshakes + self.limits.served + self.tunnels.open_tunnels

    # -- lifecycle ---------------------------------------------------------------

    def close_idle(self) -> None:
        """At shutdown: connections that have not sent a request yet are closed, and each
        served connection closes after the answer it is writing (at once if idle)."""
        self._keep_alive = False
        for door in list(self._doors):
            door.close_if_idle()
        for conn in list(self._served):
            conn.stop_keep_alive()

    async def served_drained(self) -> None:
        """Wait until every served connection is closed (bound it with a timeout)."""
        await self._served_empty.wait()

    async def drained(self) -> None:
        """Wait until no tunnel and no undecided CONNECT is left (bound it with a timeout)."""
        await self._empty.wait()

    def track_door(self, door: FrontDoor, *, done: bool = False) -> None:
        """A connection not yet handed over (``done``: handed over or gone)."""
        if done:
            self._doors.discard(door)
        else:
            self._doors.add(door)
        self._update()

    def _update(self) -> None:
        if self._doors or not self.tunnels.idle:
            self._empty.clear()
        else:
            self._empty.set()

    def cut(self) -> None:
        """Close every connection now, cancelling the requests still in flight on them."""
        self.tunnels.cut()
        self.limits.cut()
        for door in list(self._doors):
            door.close()
        for conn in list(self._served):
            conn.close()

    # -- hand-offs ---------------------------------------------------------------

    def handoff(self, transport: asyncio.Transport, data: bytes, head_deadline: float) -> None:
        """A plain HTTP connection: the data plane takes it from here; its first head is due by ``head_deadline``."""
        proto = self.serve(head_deadline=head_deadline)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(data)

    async def connect(self, door: FrontDoor, head: bytes, early: bytes) -> None:
        """A connection's first request is a CONNECT: refuse it, or answer 200 and give the
        connection to a blind tunnel or an interception. ``early``: bytes sent behind the head."""
        deps = self.handler.deps
        ledger = Ledger(deps, "CONNECT", "")
        transport = door.transport

        def answer(resp: web.Response) -> None:
            if not transport.is_closing():
                transport.write(raw_response(resp))
                transport.close()

        def crashed(exc: Exception) -> None:
            log.exception("internal error on CONNECT")
            transport.abort()

        await accounted(ledger, self._dispatch(deps, ledger, door, head, early), answer, crashed)

    async def _dispatch(self, deps: Deps, ledger: Ledger, door: FrontDoor, head: bytes, early: bytes) -> None:
        try:
            await self._connect(deps, ledger, door, head, early)
        except Refusal as refusal:  # its reason, where requests and httpx show it: the status line
            name = ledger.rec.vendor  # (set once the target named a vendor of this policy)
            refusal.reason_phrase = connect_reason(refusal, deps.policy.vendor(name) if name else None)
            raise

    async def _connect(self, deps: Deps, ledger: Ledger, door: FrontDoor, head: bytes, early: bytes) -> None:
        rec = ledger.rec
        parsed = parse_connect_head(head)
        rec.host = rec.path = parsed.authority
        try:
            host, port = parse_authority(parsed.authority)
        except ValueError as exc:
            raise BadRequest(f"bad CONNECT target: {exc}") from None
        if port is None:
            raise BadRequest(f"CONNECT target {parsed.authority!r} has no port")
        tenancy = deps.router.tenancy
        # Proxy credentials are checked before anything else is said (407 first).
        claim = tenancy.of_connect(parsed.headers) if tenancy.authenticates else None
        rec.tenant = claim.tenant if claim is not None else None
        vendor = deps.router.vendor_for_connect(host, port)
        if vendor is None:
            raise Denied(f"CONNECT {host}:{port}: no vendor in the policy has this host on this port", host)
        rec.vendor = vendor.name
        try:
            if vendor.connect == "deny":
                raise Denied(
                    f"CONNECT to {vendor.name} is denied by the policy (connect: deny); "
                    f"call it over http:// with `upstream: https://...`, or set connect: intercept",
                    host,
                )
            if vendor.connect == "tunnel":
                tenant = rec.tenant = claim.tenant if claim and claim.tenant else deps.router.tenant(parsed.headers)
                tunnel = await self.tunnels.dial(deps, vendor, tenant, parsed.headers, (host, port), rec)
                if door.transport.is_closing():  # the worker went away while the vendor was dialled
                    self.tunnels.abandon(tunnel)
                    raise asyncio.CancelledError
                door.established()
                rec.status = 200
                self.tunnels.splice(tunnel, door.transport, early)
            else:
                claim = claim or tenancy.of_connect(parsed.headers)
                rec.tenant = claim.tenant
                handshake = self.interceptor.prepare(deps, Interception(vendor, host, port, claim))
                self._handshakes += 1  # counted open from the door's release to the data plane's taking over
                try:
                    door.established()
                    if await handshake.take_over(door.transport, early, rec):
                        ledger.counted = False  # an interception is not a request: the requests inside it are
                finally:
                    self._handshakes -= 1
        except Refusal:
            deps.metrics.connects.labels(vendor.name, vendor.connect, "refused").inc()
            raise


def connect_reason(refusal: Refusal, vendor: Vendor | None) -> str:
    """A refused CONNECT's reason phrase: what ``requests`` and ``httpx`` show of it
    (``ProxyError: Tunnel connection failed: 403 CONNECT denied by policy (connect: deny)``),
    since they never read the body. Made of fixed words and the vendor's name (the policy's,
    a token), never of what the client sent."""
    if isinstance(refusal, Denied):
        if vendor is None:
            return "CONNECT denied: no vendor in the policy has this host and port"
        if vendor.connect == "deny":
            return "CONNECT denied by policy (connect: deny)"
        return f"CONNECT denied: cannot intercept {vendor.name} (see the body)"
    name = vendor.name if vendor is not None else "the vendor"
    match refusal:
        case ProxyAuthRequired():
            return "Proxy credentials required"
        case BadRequest():
            return "Bad CONNECT request"
        case Limited(action="shed"):
            return f"Shed: {name} is over its quota (do not retry now)"
        case Limited():
            return f"Deferred: {name} is over its quota (retry after Retry-After)"
        case StoreDown():
            return "Deferred: the quota store is unavailable"
        case UpstreamFailed():
            return f"Cannot reach {name}"
    return "CONNECT refused"


class FrontDoor(asyncio.Protocol):
    """One new connection, until its first request says what it is."""

    def __init__(self, gate: ConnectGate) -> None:
        self._gate = gate
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._released = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def transport(self) -> asyncio.Transport:
        assert self._transport is not None
        return self._transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._gate.track_door(self)
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + self._gate.limits.head_timeout
        self._timer = loop.call_at(self._deadline, self._head_timed_out)
        self._gate.limits.waiting(self, self._head_timed_out)

    def _settled(self) -> None:
        """The first request is in (or handed to the data plane, which times the rest of it)."""
        self._gate.limits.not_waiting(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        """The first request head is not in (or a new connection at the cap needs this one's
        place): 408 if part of one came, else just close."""
        self._settled()
        if self._task is None and self._transport is not None:
            answer = self._gate.limits.head_timed_out(bool(self._buffer))
            if answer:
                self._transport.write(answer)
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._task is not None:  # early bytes after a CONNECT head: kept for the tunnel
            self._buffer += data
            return
        self._buffer += data
        buf = self._buffer
        if len(buf) < len(_CONNECT) and _CONNECT.startswith(bytes(buf)):
            return
        assert self._transport is not None
        if not buf.startswith(_CONNECT):
            self._settled()
            self._gate.track_door(self, done=True)
            self._gate.handoff(self._transport, bytes(buf), self._deadline)
            return
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self._transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                self._transport.close()
            return
        head, early = bytes(buf[:end]), bytes(buf[end + 4 :])
        self._buffer = bytearray()
        self._settled()
        self._transport.pause_reading()
        self._task = spawn(self._gate.connect(self, head, early), name="connect")

    def established(self) -> None:
        """Answer the CONNECT with 200: the connection now belongs to a tunnel or to TLS,
        no longer tracked here."""
        self.transport.write(_ESTABLISHED)
        self._released = True
        self._gate.track_door(self, done=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._settled()
        self._gate.track_door(self, done=True)
        if self._task is not None and not self._task.done() and not self._released:
            self._task.cancel()

    def close_if_idle(self) -> None:
        if self._task is None and self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.abort()
