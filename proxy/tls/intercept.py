"""TLS interception (``connect: intercept``).

Once the front door has answered a CONNECT with 200, TLS is terminated with a leaf
certificate for the host, signed by the proxy's CA, and the HTTP/1.1 requests inside
go to the same request path as plain ones (same limits, answers, feedback and
metrics), sent upstream over a new, verified TLS connection. Each such request
knows where its tunnel leads: ``pipeline.match.interception_of(request)`` (the tag and its
reader live in the request pipeline, which this layer sits on).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.deps import Deps
from proxy.pipeline.match import Interception
from proxy.telemetry.accesslog import AccessRecord
from proxy.wire.refusals import BadRequest, Denied

log = logging.getLogger("quota_proxy.connect")

_HANDSHAKE_TIMEOUT = 10.0
_SHUTDOWN_TIMEOUT = 5.0
"""Seconds a closing connection waits for the worker's close_notify (asyncio's default is
30): an idle pooled client does not read its socket, so at a drain each of its connections
held the proxy until drain_timeout, and a closed one held a place under max_connections."""


class LeafSource(Protocol):
    """Server-side TLS contexts with a leaf certificate for a host (ca.leaves.LeafMinter)."""

    def context_for(self, host: str) -> ssl.SSLContext: ...


Serve = Callable[[Interception], asyncio.Protocol]
"""An HTTP/1.1 protocol serving the request path on a connection, its requests tagged with
where the tunnel leads, its heads and idle time timed (http1.Http1Connection)."""


class Interceptor:
    """Terminates workers' TLS and gives the connection to the data plane (``serve``: the
    request path). ``leaf_minter`` is the current leaf minter (it changes when a reload changes the CA)."""

    def __init__(self, serve: Serve, leaf_minter: Callable[[], LeafSource | None]) -> None:
        self._serve = serve
        self._leaf_minter = leaf_minter

    def prepare(self, deps: Deps, where: Interception) -> Handshake:
        """The TLS context for the host, before the CONNECT is answered; raises the refusal
        if the proxy cannot intercept it."""
        minter = self._leaf_minter()
        if minter is None:
            raise Denied("TLS interception is not set up: the policy has no tls.ca_cert", where.host)
        try:
            ctx = minter.context_for(where.host)
        except ValueError as exc:
            raise BadRequest(f"cannot intercept {where.host!r}: {exc}") from None
        except Exception as exc:  # CAError: expired CA, host outside its name constraints
            deps.metrics.tls_errors.labels(where.vendor.name, "leaf").inc()
            raise Denied(f"cannot intercept {where.host}: {exc}", where.host) from None
        return Handshake(self._serve, deps, where, ctx)


@dataclass(frozen=True, slots=True)
class Handshake:
    """One CONNECT about to be intercepted, its TLS context ready."""

    serve: Serve
    deps: Deps
    where: Interception
    ctx: ssl.SSLContext

    async def take_over(self, transport: asyncio.Transport, early: bytes, rec: AccessRecord) -> bool:
        """TLS with the worker, then the data plane serves the requests inside. False if the
        handshake failed (counted, logged, the connection cut)."""
        metrics, vendor = self.deps.metrics, self.where.vendor.name
        pending = _Pending()
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            handshake = asyncio.ensure_future(
                loop.start_tls(
                    transport,
                    pending,
                    self.ctx,
                    server_side=True,
                    ssl_handshake_timeout=_HANDSHAKE_TIMEOUT,
                    ssl_shutdown_timeout=_SHUTDOWN_TIMEOUT,
                )
            )
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
            metrics.tls_errors.labels(vendor, reason).inc()
            metrics.connects.labels(vendor, "intercept", "tls-failed").inc()
            log.warning(
                "TLS handshake with a worker failed for %s (%s): does it trust the proxy's CA?", self.where.host, reason
            )
            rec.outcome, rec.status, rec.detail = "error", 200, f"TLS handshake failed: {reason}"
            transport.abort()
            return False
        if tls is None:  # pragma: no cover - the worker closed during the handshake
            transport.abort()
            return False
        proto = self.serve(self.where)
        tls.set_protocol(proto)
        proto.connection_made(tls)
        if pending.buffer:
            proto.data_received(bytes(pending.buffer))
        if pending.eof:
            proto.eof_received()
        metrics.connects.labels(vendor, "intercept", "established").inc()
        rec.outcome, rec.status = "forwarded", 200
        return True


CLOSED_IN_HANDSHAKE = "closed_in_handshake"
"""The worker closed the connection during the handshake without a TLS alert. Node does
this when it rejects the proxy's certificate: it reads the server's flight (certificate
included), sends no alert and no Finished, and closes with a FIN. asyncio and uvloop
report that end of stream as a bare ``ConnectionResetError()`` (no errno), which is
not a reset: no RST crossed the wire."""


def tls_error_reason(exc: BaseException) -> str:
    """A short, bounded label for a failed handshake, named after what the worker did:
    the alert it sent (``unknown_ca``, ``bad_certificate``...; OpenSSL-based clients such
    as curl and Python send one when they reject the certificate), ``closed_in_handshake``
    (it closed without an alert, as Node does), ``reset`` (a TCP RST), ``timeout``."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ssl.SSLEOFError):
        return CLOSED_IN_HANDSHAKE
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or type(exc).__name__).lower()
        for prefix in ("tlsv1_alert_", "sslv3_alert_", "tlsv13_alert_"):
            reason = reason.removeprefix(prefix)
        return reason[:40]
    if isinstance(exc, ConnectionResetError) and exc.errno is None:
        return CLOSED_IN_HANDSHAKE  # the event loop's name for an end of stream mid-handshake
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return "reset"
    if isinstance(exc, ConnectionError | EOFError):
        return "eof"
    return type(exc).__name__.lower()[:40]


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


class _Pending(asyncio.Protocol):
    """Holds decrypted bytes that arrive with the last handshake flight, before
    the data plane's protocol is attached to the TLS transport."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.buffer += data

    def eof_received(self) -> bool:
        self.eof = True
        return True
