"""Blind tunnels (``connect: tunnel``): one token per CONNECT, then bytes pass both ways unread.

Concurrent tunnels per vendor are capped by ``max_tunnels`` (this replica) and, fleet-wide,
by the vendor's ``concurrency``: an open tunnel holds a lease in the vendor's set (a
tunnel has no path, so no endpoint class's), taken when it is admitted, renewed while it
is open, given back when it closes (concurrency.py). ``BlindTunnels.dial``
admits the CONNECT and connects to the vendor; once the front door has answered it
with 200, ``BlindTunnels.splice`` joins the worker's connection to the vendor's.

A tunnel that carries no byte either way for longer than the vendor's ``timeouts.read``
(and the ``connections.idle_timeout``) is closed: no exchange inside it can still be
waiting for an answer, and an idle tunnel would hold its slot and its lease for ever
(an SDK's pooled connection, or a client that never closes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from proxy.deps import Deps
from proxy.names import default_port, parse_authority
from proxy.pipeline.decide import Admission, request_wish
from proxy.policy.model import Vendor, Wish
from proxy.quota.concurrency import Slot
from proxy.telemetry.accesslog import AccessRecord
from proxy.wire.refusals import Limited, UpstreamFailed

log = logging.getLogger("quota_proxy.tunnel")

Admit = Callable[[Deps, Vendor, str, Wish, AccessRecord, Slot], Awaitable[Admission]]
"""Take a request's tokens and its slot's leases, holding if need be (ProxyHandler.admit)."""


class BlindTunnels:
    """The open blind tunnels: counted per vendor (the cap, /status), and kept so that a
    drain can wait for them and cut them. ``on_change``: a tunnel opened or closed."""

    def __init__(self, admit: Admit, on_change: Callable[[], None]) -> None:
        self._admit = admit
        self._on_change = on_change
        self._open: dict[str, int] = {}
        self._pipes: set[_Pipe] = set()

    def count(self, vendor: str) -> int:
        """A vendor's open tunnels, counting the CONNECTs still held for their token."""
        return self._open.get(vendor, 0)

    @property
    def open_tunnels(self) -> int:
        """Tunnels spliced and open, all vendors (a CONNECT still being dialled is not one yet)."""
        return len(self._pipes)

    @property
    def idle(self) -> bool:
        """No tunnel is open."""
        return not self._pipes

    def cut(self) -> None:
        for pipe in list(self._pipes):
            pipe.close()

    async def dial(
        self,
        deps: Deps,
        vendor: Vendor,
        tenant: str,
        headers: Mapping[str, str],
        address: tuple[str, int],
        rec: AccessRecord,
    ) -> Dialled:
        """Admit the CONNECT to ``address`` (one token) and connect to the vendor; raises the refusal."""
        if self.count(vendor.name) >= vendor.max_tunnels:
            raise Limited("defer", 1.0, "tunnels", f"max_tunnels {vendor.max_tunnels} reached")
        # The slot is taken before the (possibly held) admission, so CONNECTs waiting
        # together cannot all pass the cap; it is given back unless the tunnel opens.
        self._open[vendor.name] = self.count(vendor.name) + 1
        deps.metrics.tunnels_open.labels(vendor.name).inc()
        slot = deps.concurrency.slot(vendor, None)
        try:
            wish = request_wish(vendor.on_limit, headers)
            rec.outcome = (await self._admit(deps, vendor, tenant, wish, rec, slot)).outcome
            up_transport, up_pipe = await _connect(vendor, address)
        except BaseException:
            self._closed(deps, vendor.name, slot)
            raise
        idle_after = max(vendor.timeouts.read, deps.policy.connections.idle_timeout)
        return Dialled(deps, vendor.name, up_transport, up_pipe, slot, idle_after)

    def abandon(self, tunnel: Dialled) -> None:
        """The worker went away before the tunnel opened: close the vendor's side, free the slot."""
        tunnel.up_transport.close()
        self._closed(tunnel.deps, tunnel.vendor, tunnel.slot)

    def splice(self, tunnel: Dialled, transport: asyncio.Transport, early: bytes) -> None:
        """Join the worker's connection (already answered 200) to the vendor's; ``early``:
        bytes the worker sent right behind its CONNECT."""
        deps, vendor = tunnel.deps, tunnel.vendor
        deps.metrics.connects.labels(vendor, "tunnel", "established").inc()
        deps.tally(vendor).came("tunnel")
        down_pipe = _Pipe()
        idle = _Silence(tunnel.idle_after, down_pipe.close)

        def finished() -> None:
            idle.cancel()
            self._closed(deps, vendor, tunnel.slot)
            self._track(down_pipe, done=True)

        down_pipe.join(transport, tunnel.up_transport, on_closed=finished, idle=idle)
        tunnel.up_pipe.join(tunnel.up_transport, transport, on_closed=None, idle=idle)
        self._track(down_pipe)
        transport.set_protocol(down_pipe)
        if early:
            tunnel.up_transport.write(early)
        transport.resume_reading()

    def _closed(self, deps: Deps, vendor: str, slot: Slot) -> None:
        """A tunnel's slot is free again (here, and its lease fleet-wide)."""
        slot.close()
        self._open[vendor] -= 1
        deps.metrics.tunnels_open.labels(vendor).dec()

    def _track(self, pipe: _Pipe, *, done: bool = False) -> None:
        if done:
            self._pipes.discard(pipe)
        else:
            self._pipes.add(pipe)
        self._on_change()


@dataclass(frozen=True, slots=True)
class Dialled:
    """An admitted CONNECT whose vendor connection is open: it holds a tunnel slot
    until ``BlindTunnels.splice`` (then until the tunnel closes) or ``abandon``."""

    deps: Deps
    vendor: str
    up_transport: asyncio.Transport
    up_pipe: _Pipe
    slot: Slot
    """Its leases (the vendor's concurrency cap), held until it closes."""
    idle_after: float
    """Seconds without a byte either way after which the tunnel is closed."""


async def _connect(vendor: Vendor, address: tuple[str, int]) -> tuple[asyncio.Transport, _Pipe]:
    """Connect to the vendor: its ``upstream`` if it has one, else where the CONNECT asked."""
    up_host, up_port = _origin_address(vendor.upstream) if vendor.upstream else address
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(vendor.timeouts.connect):
            return await loop.create_connection(_Pipe, up_host, up_port)
    except TimeoutError:
        detail = f"{vendor.name}: connecting to {up_host}:{up_port} timed out"
        raise UpstreamFailed(504, "upstream-timeout", detail, reached=False) from None
    except OSError as exc:
        detail = f"{vendor.name}: cannot connect to {up_host}:{up_port}: {exc}"
        raise UpstreamFailed(502, "upstream-unreachable", detail, reached=False) from None


def _origin_address(origin: str) -> tuple[str, int]:
    scheme, _, authority = origin.partition("://")
    host, port = parse_authority(authority)
    return host, port or default_port(scheme)


class _Silence:
    """When a tunnel last carried a byte (either way); ``close`` once it has been silent
    ``limit`` seconds. One timer, moved on lazily: not one per chunk."""

    __slots__ = ("_close", "_loop", "_timer", "last", "limit")

    def __init__(self, limit: float, close: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._close = close
        self.limit = limit
        self.last = self._loop.time()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(self.last + limit, self._check)

    def touch(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        due = self.last + self.limit
        if self._loop.time() >= due:
            self._timer = None
            log.debug("a blind tunnel silent for %.1fs is closed", self.limit)
            self._close()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Pipe(asyncio.Protocol):
    """One direction of a blind tunnel: what it reads, its peer writes, with backpressure."""

    def __init__(self) -> None:
        self._own: asyncio.Transport | None = None
        self._peer: asyncio.Transport | None = None
        self._on_closed: Callable[[], None] | None = None
        self._idle: _Silence | None = None
        self._done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._own = transport  # type: ignore[assignment]

    def join(
        self,
        own: asyncio.Transport,
        peer: asyncio.Transport,
        on_closed: Callable[[], None] | None,
        idle: _Silence | None = None,
    ) -> None:
        self._own, self._peer, self._on_closed, self._idle = own, peer, on_closed, idle

    def data_received(self, data: bytes) -> None:
        if self._idle is not None:
            self._idle.touch()
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
        if self._idle is not None:
            self._idle.touch()  # a slow reader took what was buffered: the tunnel is in use
        if self._peer is not None:
            self._peer.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is not None and not self._peer.is_closing():
            self._peer.close()
        if not self._done:
            self._done = True
            if self._on_closed is not None:
                self._on_closed()

    def close(self) -> None:
        for t in (self._own, self._peer):
            if t is not None and not t.is_closing():
                t.close()
