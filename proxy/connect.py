"""The proxy listener's front door, and CONNECT (what HTTPS_PROXY makes clients send).

Every connection starts here. Its first bytes decide: a plain HTTP request hands
the connection to aiohttp (the request path in handler.py); ``CONNECT host:port``
is answered here, per the vendor's ``connect`` mode:

- ``intercept``: 200, then TLS is terminated with a leaf certificate for the host,
  signed by the proxy's CA, and the HTTP/1.1 requests inside go to the same request
  path as plain ones (same limits, answers, feedback and metrics), sent upstream
  over a new, verified TLS connection.
- ``tunnel``: one token per CONNECT, then bytes pass blindly; concurrent tunnels
  per vendor are capped by ``max_tunnels``.
- ``deny``, a host in no vendor, or a port other than the vendor's: 403.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy.accesslog import AccessRecord
from proxy.decide import request_wish
from proxy.handler import Deps, ProxyHandler
from proxy.metrics import NO_VENDOR
from proxy.names import parse_authority
from proxy.policy.model import Vendor
from proxy.refusals import BadRequest, Denied, Limited, Refusal, UpstreamFailed
from proxy.tasks import spawn
from proxy.tunnel import InterceptedHandler, Tunnel

log = logging.getLogger("quota_proxy.connect")

_CONNECT = b"CONNECT "
_MAX_HEAD = 16 * 1024  # a CONNECT request head larger than this is refused
_HANDSHAKE_TIMEOUT = 10.0
_FIRST_REQUEST_TIMEOUT = 60.0  # a connection that says nothing (or only part of a CONNECT) is closed
_ESTABLISHED = b"HTTP/1.1 200 Connection Established\r\n\r\n"


class ContextSource(Protocol):
    """Server-side TLS contexts with a leaf certificate for a host (tlsca.LeafMinter)."""

    def context_for(self, host: str) -> ssl.SSLContext: ...


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
        if not sep or not name or name != name.strip():
            raise BadRequest(f"malformed header line {line[:100]!r}")
        headers.add(name, value.strip())
    return ConnectHead(parts[1], headers)


def _raw_response(resp: web.Response) -> bytes:
    """A proxy answer to a CONNECT, serialised by hand: the connection is ours, not aiohttp's."""
    body = resp.body if isinstance(resp.body, bytes) else b""
    lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
    lines += [f"{k}: {v}" for k, v in resp.headers.items() if k.lower() not in ("content-length", "connection")]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def tls_error_reason(exc: BaseException) -> str:
    """A short, bounded label for a failed handshake: unknown_ca, bad_certificate, timeout..."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or type(exc).__name__).lower()
        for prefix in ("tlsv1_alert_", "sslv3_alert_", "tlsv13_alert_"):
            reason = reason.removeprefix(prefix)
        return reason[:40]
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "reset"
    if isinstance(exc, ConnectionError | EOFError):
        return "eof"
    return type(exc).__name__.lower()[:40]


class ConnectGate:
    """Owns the listener's connections until each is handed to aiohttp, tunnelled or
    intercepted. ``protocol`` is the listener's protocol factory."""

    def __init__(
        self, handler: ProxyHandler, web_server: web.Server, contexts: Callable[[], ContextSource | None]
    ) -> None:
        self.handler = handler
        self.web = web_server
        self.contexts = contexts
        """The current leaf factory (it changes when a reload changes the CA)."""
        self._doors: set[FrontDoor] = set()
        self._tunnels: dict[str, int] = {}
        self._pipes: set[_Pipe] = set()
        self._empty = asyncio.Event()
        self._empty.set()

    def protocol(self) -> FrontDoor:
        return FrontDoor(self)

    def tunnels_open(self, vendor: str) -> int:
        return self._tunnels.get(vendor, 0)

    # -- lifecycle ---------------------------------------------------------------

    def close_idle(self) -> None:
        """At shutdown: connections that have not sent a request yet are closed."""
        for door in list(self._doors):
            door.close_if_idle()

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

    def track_pipe(self, pipe: _Pipe, *, done: bool = False) -> None:
        """An open blind tunnel (``done``: closed)."""
        if done:
            self._pipes.discard(pipe)
        else:
            self._pipes.add(pipe)
        self._update()

    def _update(self) -> None:
        if self._doors or self._pipes:
            self._empty.clear()
        else:
            self._empty.set()

    def cut(self) -> None:
        for pipe in list(self._pipes):
            pipe.close()
        for door in list(self._doors):
            door.close()

    # -- hand-offs ---------------------------------------------------------------

    def handoff(self, transport: asyncio.Transport, data: bytes) -> None:
        """A plain HTTP connection: aiohttp takes it from here."""
        proto = self.web()
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(data)

    async def connect(self, door: FrontDoor, transport: asyncio.Transport, head: bytes, early: bytes) -> None:
        deps = self.handler.deps
        clock = deps.clock
        started = clock.monotonic()
        rec = AccessRecord("CONNECT", "", "")
        vendor: Vendor | None = None
        tenant = "-"
        mode = "deny"
        try:
            parsed = parse_connect_head(head)
            rec.host = rec.path = parsed.authority
            try:
                host, port = parse_authority(parsed.authority)
            except ValueError as exc:
                raise BadRequest(f"bad CONNECT target: {exc}") from None
            if port is None:
                raise BadRequest(f"CONNECT target {parsed.authority!r} has no port")
            vendor = deps.router.vendor_for_connect(host, port)
            if vendor is None:
                raise Denied(f"CONNECT {host}:{port}: no vendor in the policy has this host on this port", host)
            mode = vendor.connect
            rec.vendor = vendor.name
            if mode == "deny":
                raise Denied(f"CONNECT to {vendor.name} is denied by the policy (connect: deny); "
                             f"call it over http:// with `upstream: https://...`, or set connect: intercept", host)
            named = parsed.headers.get(deps.policy.tenant.header)
            if mode == "tunnel":
                tenant = deps.router.tenant(parsed.headers)
                rec.tenant = tenant
                await self._tunnel(deps, door, transport, vendor, tenant, host, port, parsed, early, rec)
            else:
                if named is not None:
                    tenant = deps.router.tenant(parsed.headers)
                rec.tenant = None if tenant == "-" else tenant
                await self._intercept(deps, door, transport, Tunnel(vendor, host, port, rec.tenant), rec, early)
        except Refusal as refusal:
            resp = self.handler.refuse(deps, refusal, vendor.name if vendor else None, rec)
            rec.status = resp.status
            if vendor is not None:
                deps.metrics.connects.labels(vendor.name, mode, "refused").inc()
            if not transport.is_closing():
                transport.write(_raw_response(resp))
                transport.close()
        except asyncio.CancelledError:
            rec.outcome, rec.detail = "error", "the worker went away"
            raise
        except Exception:
            log.exception("internal error on CONNECT")
            rec.outcome, rec.detail = "error", "internal proxy error"
            transport.abort()
        finally:
            rec.duration = clock.monotonic() - started
            if mode != "intercept" or rec.outcome not in ("forwarded", "held"):
                # An intercepted tunnel is not a request: the requests inside it are counted.
                deps.metrics.count_request(vendor.name if vendor else NO_VENDOR, tenant, rec.outcome)
            rec.emit()

    async def _tunnel(
        self, deps: Deps, door: FrontDoor, transport: asyncio.Transport, vendor: Vendor, tenant: str,
        host: str, port: int, parsed: ConnectHead, early: bytes, rec: AccessRecord,
    ) -> None:
        if self._tunnels.get(vendor.name, 0) >= vendor.max_tunnels:
            raise Limited("defer", 1.0, "tunnels", f"max_tunnels {vendor.max_tunnels} reached")
        # The slot is taken before the (possibly held) admission, so CONNECTs waiting
        # together cannot all pass the cap; it is given back unless the tunnel opens.
        self._tunnels[vendor.name] = self._tunnels.get(vendor.name, 0) + 1
        deps.metrics.tunnels_open.labels(vendor.name).inc()
        opened = False

        def closed() -> None:
            self._tunnels[vendor.name] -= 1
            deps.metrics.tunnels_open.labels(vendor.name).dec()

        try:
            up_transport, up_pipe = await self._open_tunnel(deps, vendor, tenant, host, port, parsed, rec)
            if transport.is_closing():
                up_transport.close()
                raise asyncio.CancelledError
            opened = True
        finally:
            if not opened:
                closed()
        down_pipe = _Pipe()
        transport.write(_ESTABLISHED)
        deps.metrics.connects.labels(vendor.name, "tunnel", "established").inc()
        deps.metrics.count_mode(vendor.name, "tunnel")
        rec.status = 200

        def finished() -> None:
            closed()
            self.track_pipe(down_pipe, done=True)

        door.release()
        down_pipe.join(transport, up_transport, on_closed=finished)
        up_pipe.join(up_transport, transport, on_closed=None)
        self.track_pipe(down_pipe)
        transport.set_protocol(down_pipe)
        if early:
            up_transport.write(early)
        transport.resume_reading()

    async def _open_tunnel(
        self, deps: Deps, vendor: Vendor, tenant: str, host: str, port: int, parsed: ConnectHead,
        rec: AccessRecord,
    ) -> tuple[asyncio.Transport, _Pipe]:
        """Admit the CONNECT (one token) and connect to the vendor."""
        wish = request_wish(vendor.on_limit, parsed.headers)
        rec.outcome = await self.handler.admit(deps, vendor, tenant, wish, rec)
        up_host, up_port = _origin_address(vendor.upstream) if vendor.upstream else (host, port)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(vendor.timeouts.connect):
                return await loop.create_connection(_Pipe, up_host, up_port)
        except TimeoutError:
            raise UpstreamFailed(504, "upstream-timeout", f"{vendor.name}: connecting to {up_host}:{up_port} "
                                                          "timed out") from None
        except OSError as exc:
            raise UpstreamFailed(502, "upstream-unreachable", f"{vendor.name}: cannot connect to "
                                                              f"{up_host}:{up_port}: {exc}") from None

    async def _intercept(
        self, deps: Deps, door: FrontDoor, transport: asyncio.Transport, tunnel: Tunnel, rec: AccessRecord,
        early: bytes = b"",
    ) -> None:
        contexts = self.contexts()
        if contexts is None:
            raise Denied("TLS interception is not set up: the policy has no tls.ca_cert", tunnel.host)
        try:
            ctx = contexts.context_for(tunnel.host)
        except ValueError as exc:
            raise BadRequest(f"cannot intercept {tunnel.host!r}: {exc}") from None
        except Exception as exc:  # CAError: expired CA, host outside its name constraints
            deps.metrics.tls_errors.labels(tunnel.vendor.name, "leaf").inc()
            raise Denied(f"cannot intercept {tunnel.host}: {exc}", tunnel.host) from None
        transport.write(_ESTABLISHED)
        door.release()
        pending = _Pending()
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            handshake = asyncio.ensure_future(loop.start_tls(transport, pending, ctx, server_side=True,
                                                             ssl_handshake_timeout=_HANDSHAKE_TIMEOUT))
            if early:
                # A ClientHello sent right behind the CONNECT head was read with it. start_tls has
                # now installed its protocol and queued connection_made: feed the bytes after that.
                await asyncio.sleep(0)
                loop.call_soon(_feed, transport, early)
            tls = await handshake
        except (ssl.SSLError, OSError, TimeoutError, EOFError, ConnectionError) as exc:
            # asyncio and uvloop end a handshake that overstays its timeout with ConnectionAbortedError.
            timed_out = isinstance(exc, ConnectionAbortedError) and loop.time() - began >= _HANDSHAKE_TIMEOUT
            reason = "timeout" if timed_out else tls_error_reason(exc)
            deps.metrics.tls_errors.labels(tunnel.vendor.name, reason).inc()
            deps.metrics.connects.labels(tunnel.vendor.name, "intercept", "tls-failed").inc()
            log.warning("TLS handshake with a worker failed for %s (%s): does it trust the proxy's CA?",
                        tunnel.host, reason)
            rec.outcome, rec.status, rec.detail = "error", 200, f"TLS handshake failed: {reason}"
            transport.abort()
            return
        if tls is None:  # pragma: no cover - the worker closed during the handshake
            transport.abort()
            return
        proto = InterceptedHandler(self.web, loop=loop, access_log=None)  # type: ignore[arg-type]
        proto.tunnel = tunnel
        tls.set_protocol(proto)
        proto.connection_made(tls)
        if pending.buffer:
            proto.data_received(bytes(pending.buffer))
        if pending.eof:
            proto.eof_received()
        deps.metrics.connects.labels(tunnel.vendor.name, "intercept", "established").inc()
        rec.outcome, rec.status = "forwarded", 200


def _feed(transport: asyncio.Transport, data: bytes) -> None:
    """Hand ``data`` to the transport's protocol as if just read from the socket."""
    proto: Any = transport.get_protocol()
    if hasattr(proto, "buffer_updated"):  # asyncio's SSLProtocol; uvloop's is not a BufferedProtocol subclass
        view = memoryview(data)
        while view:
            buf = proto.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            proto.buffer_updated(n)
            view = view[n:]
    else:
        proto.data_received(data)


def _origin_address(origin: str) -> tuple[str, int]:
    scheme, _, authority = origin.partition("://")
    host, port = parse_authority(authority)
    return host, port or (443 if scheme == "https" else 80)


class FrontDoor(asyncio.Protocol):
    """One new connection, until its first request says what it is."""

    def __init__(self, gate: ConnectGate) -> None:
        self._gate = gate
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._released = False
        self._idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._gate.track_door(self)
        self._idle = asyncio.get_running_loop().call_later(_FIRST_REQUEST_TIMEOUT, self.close_if_idle)

    def _settled(self) -> None:
        """The first request is in: no more first-request timeout."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

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
            self._gate.handoff(self._transport, bytes(buf))
            return
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self._transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
                                      b"Connection: close\r\n\r\n")
                self._transport.close()
            return
        head, early = bytes(buf[:end]), bytes(buf[end + 4 :])
        self._buffer = bytearray()
        self._settled()
        self._transport.pause_reading()
        self._task = spawn(self._gate.connect(self, self._transport, head, early), name="connect")

    def release(self) -> None:
        """The connection now belongs to a tunnel or to TLS: stop tracking it here."""
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


class _Pending(asyncio.Protocol):
    """Holds decrypted bytes that arrive with the last handshake flight, before
    aiohttp's handler is attached to the TLS transport."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.buffer += data

    def eof_received(self) -> bool:
        self.eof = True
        return True


class _Pipe(asyncio.Protocol):
    """One direction of a blind tunnel: what it reads, its peer writes, with backpressure."""

    def __init__(self) -> None:
        self._own: asyncio.Transport | None = None
        self._peer: asyncio.Transport | None = None
        self._on_closed: object = None
        self._done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._own = transport  # type: ignore[assignment]

    def join(self, own: asyncio.Transport, peer: asyncio.Transport, on_closed: object) -> None:
        self._own, self._peer, self._on_closed = own, peer, on_closed

    def data_received(self, data: bytes) -> None:
        if self._peer is not None:
            self._peer.write(data)

    def eof_received(self) -> bool:
        # One side is done: end the tunnel. close() still flushes what is buffered for
        # the peer. (A half-open tunnel would wait on a peer that may never close: a TLS
        # server still waiting for its ClientHello does not.)
        if self._peer is not None:
            self._peer.close()
        return False

    # Flow control: when our transport's buffer fills, stop reading from the peer.
    def pause_writing(self) -> None:
        if self._peer is not None:
            self._peer.pause_reading()

    def resume_writing(self) -> None:
        if self._peer is not None:
            self._peer.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None and not self._peer.is_closing():
            self._peer.close()
        if not self._done:
            self._done = True
            if callable(self._on_closed):
                self._on_closed()

    def close(self) -> None:
        for t in (self._own, self._peer):
            if t is not None and not t.is_closing():
                t.close()
