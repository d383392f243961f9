"""Sending a granted request to its vendor and streaming the answer back.

One pooled keep-alive ClientSession per vendor, so a slow vendor cannot exhaust
another's connections. Bodies stream both ways in chunks with backpressure; a
50 MB upload or download costs a few buffers, not 50 MB.

A vendor with an ``upstream`` keeps a burst's worth of idle connections open (``_keep_warm``):
a burst is granted at once, and if its requests had to connect first (a TLS handshake
to a real vendor) they would reach the vendor late, bunched with the requests granted
after them, one over a strict window that rate + burst fills exactly (issue 10 item 5).
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11
from yarl import URL

from proxy.aiohttp_internals import (
    HeadersWithBody,
    idle_connections,
    no_hidden_resend,
    open_idle_connection,
    send_continue,
)
from proxy.headers import downstream_response_headers, idempotent, upstream_request_headers
from proxy.policy.model import Policy, TlsSettings, Vendor
from proxy.refusals import UpstreamFailed
from proxy.tasks import spawn

log = logging.getLogger("quota_proxy.forward")

_CHUNK = 64 * 1024
_WARM_MAX = 16  # idle connections kept per vendor at most, whatever its burst
_WARM_EVERY = 2.0  # seconds between top-ups of the idle connections
_KEEPALIVE = 30.0  # seconds an idle pooled connection is kept (then closed and, warm, replaced)


def upstream_ssl_context(tls: TlsSettings) -> ssl.SSLContext | bool:
    """Verification on unless the policy turns it off; an extra CA bundle for private CAs."""
    if not tls.upstream_verify:
        return False
    ctx = ssl.create_default_context()
    if tls.upstream_ca_file:
        ctx.load_verify_locations(cafile=tls.upstream_ca_file)
    return ctx


class Upstreams:
    """The client sessions, one per vendor, created at start and closed at shutdown."""

    def __init__(self, policy: Policy, keep: dict[str, aiohttp.ClientSession] | None = None) -> None:
        self._tls = policy.tls
        ssl_ctx: ssl.SSLContext | bool | None = None
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        for vendor in policy.vendors:
            session = (keep or {}).get(vendor.name)
            if session is None:
                if ssl_ctx is None:
                    ssl_ctx = upstream_ssl_context(policy.tls)
                session = _session(ssl_ctx)
            self._sessions[vendor.name] = session
        self._keepers = [
            spawn(_keep_warm(self._sessions[v.name], origin, count), name=f"warm-{v.name}")
            for v in policy.vendors
            if (origin := _origin(v)) and (count := warm_count(v))
        ]

    def session(self, vendor: Vendor) -> aiohttp.ClientSession:
        return self._sessions[vendor.name]

    def updated(self, policy: Policy) -> tuple[Upstreams, list[Callable[[], Awaitable[None]]]]:
        """The sessions for a reloaded policy: a kept vendor keeps its pool (TLS settings
        unchanged); returns them and the closers of the sessions no longer used."""
        keep = self._sessions if policy.tls == self._tls else {}
        self._stop_warming()  # the new policy's keepers take over (its bursts, its upstreams)
        new = Upstreams(policy, keep)
        used = {id(s) for s in new._sessions.values()}
        return new, [s.close for s in self._sessions.values() if id(s) not in used]

    async def close(self) -> None:
        self._stop_warming()
        await asyncio.gather(*(s.close() for s in self._sessions.values()))

    def _stop_warming(self) -> None:
        for task in self._keepers:
            task.cancel()


def warm_count(vendor: Vendor) -> int:
    """Idle connections kept open to ``vendor``: its burst, the most requests its global
    buckets grant at once (the smallest burst: every bucket must grant), capped."""
    if not vendor.limits:
        return 0
    return min(math.ceil(min(lim.burst for lim in vendor.limits)), _WARM_MAX)


def _origin(vendor: Vendor) -> str | None:
    """Where the vendor's requests go when the policy says (``upstream``), else None: with
    the origin taken from each request there is nothing to connect to in advance."""
    return str(URL(vendor.upstream).origin()) if vendor.upstream else None


async def _keep_warm(session: aiohttp.ClientSession, origin: str, count: int) -> None:
    """Keep ``count`` idle connections to ``origin`` in ``session``'s pool until cancelled:
    opened at start, topped up as the vendor or the pool's keep-alive closes them, so that
    a burst (at start, after a lull) leaves as soon as it is granted. A vendor that cannot
    be reached is tried again at the next top-up; requests meet the error themselves."""
    while not session.closed:
        try:
            missing = count - idle_connections(session, origin)
            if missing > 0:
                opened = await asyncio.gather(
                    *(open_idle_connection(session, origin, 5.0) for _ in range(missing)), return_exceptions=True
                )
                failed = [o for o in opened if isinstance(o, BaseException)]
                if failed:
                    log.debug("warming connections to %s: %d of %d failed: %r", origin, len(failed), missing, failed[0])
        except Exception:  # aiohttp internals changed: the proxy works on, cold (aiohttp_internals.py)
            log.debug("cannot warm connections to %s", origin, exc_info=True)
            return
        await asyncio.sleep(_WARM_EVERY)


def _session(ssl_ctx: ssl.SSLContext | bool) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        ssl=ssl_ctx,
        limit=0,  # concurrency is the limiter's job; the pool only reuses connections
        keepalive_timeout=_KEEPALIVE,
        ttl_dns_cache=60,
    )
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    # A request that reaches the vendor has taken its tokens: the library never resends one.
    return no_hidden_resend(session)


async def _continue(request: web.BaseRequest) -> None:
    """Answer ``Expect: 100-continue`` ourselves, once the body is really wanted.

    ``Expect`` is hop-by-hop in practice and is not forwarded; a worker that waits
    for ``100 Continue`` (curl does, for bodies over 1 MB) would otherwise stall
    until its own timeout. It is sent only when the upstream starts reading the
    body, so a request the proxy refuses never invites a body it will not read."""
    if request.version != HttpVersion11 or request.headers.get("Expect", "").lower() != "100-continue":
        return
    await send_continue(request)


async def _body(request: web.BaseRequest) -> AsyncIterator[bytes]:
    await _continue(request)
    async for chunk in request.content.iter_chunked(_CHUNK):
        yield chunk


async def send(
    session: aiohttp.ClientSession,
    vendor: Vendor,
    request: web.BaseRequest,
    url: str,
    tenant_header: str,
) -> aiohttp.ClientResponse:
    """Send the worker's request upstream; return once the vendor's headers are in.

    A failure is a 502/504 that says whether the request may have reached the vendor:
    not when no connection was made (refused, DNS, connect timeout, TLS handshake),
    else it may have (the vendor went silent or the connection broke while it was
    written or awaited), so that only a request that is safe to repeat is retried."""
    headers = upstream_request_headers(request.headers, tenant_header)
    data = _body(request) if request.body_exists else None
    timeout = aiohttp.ClientTimeout(total=None, connect=vendor.timeouts.connect, sock_read=vendor.timeouts.read)
    safe = idempotent(request.method, request.headers)

    def failed(status: int, kind: str, detail: str, *, reached: bool) -> UpstreamFailed:
        return UpstreamFailed(status, kind, f"{vendor.name}{detail}", reached, safe)

    try:
        return await session.request(
            request.method,
            URL(url, encoded=True),  # byte for byte: re-encoding could break a signed URL
            headers=headers,
            data=data,
            allow_redirects=False,
            timeout=timeout,
            compress=None,
        )
    except aiohttp.ClientConnectorCertificateError as exc:
        cert = exc.certificate_error
        raise failed(502, "upstream-tls", f": certificate verification failed: {cert}", reached=False) from exc
    except aiohttp.ClientSSLError as exc:  # raised while connecting: the handshake failed
        raise failed(502, "upstream-tls", f": TLS error: {exc}", reached=False) from exc
    except aiohttp.ConnectionTimeoutError as exc:
        raise failed(504, "upstream-timeout", " did not accept a connection in time", reached=False) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise failed(504, "upstream-timeout", " did not answer in time", reached=True) from exc
    except aiohttp.ClientConnectorError as exc:  # refused, DNS failure, unreachable network
        raise failed(502, "upstream-unreachable", f": cannot connect: {exc.os_error}", reached=False) from exc
    except (aiohttp.ClientError, OSError) as exc:
        detail = f": {type(exc).__name__}: {exc}"
        raise failed(502, "upstream-unreachable", detail, reached=True) from exc


_NO_BODY_STATUS = frozenset({204, 304})


class _UpstreamBroke(Exception):
    """The vendor's body ended early, failed to parse, or went silent past the read timeout."""


async def _upstream_chunk(upstream: aiohttp.ClientResponse) -> bytes:
    """The next piece of the vendor's body (``b""`` at its end); upstream faults become
    ``_UpstreamBroke`` so they are never confused with the worker's connection failing."""
    try:
        return await upstream.content.readany()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _UpstreamBroke(f"{type(exc).__name__}: {exc}") from exc


async def relay(
    upstream: aiohttp.ClientResponse,
    request: web.BaseRequest,
    extra_headers: dict[str, str] | None = None,
) -> tuple[web.StreamResponse, str | None]:
    """Stream the vendor's answer to the worker; returns the response and, if the
    relay did not complete, why.

    If the vendor broke off mid-body, the worker's connection is aborted: a
    truncated body must never look complete. If the worker went away, the
    half-read upstream connection is dropped rather than returned to the pool."""
    resp = HeadersWithBody(status=upstream.status, reason=upstream.reason)
    resp.headers.extend(downstream_response_headers(upstream.headers))
    if extra_headers:  # fields the vendor did not send, or list members added beside the vendor's
        resp.headers.extend(extra_headers)
    no_body = request.method == "HEAD" or upstream.status in _NO_BODY_STATUS or upstream.status < 200
    # Framing is this hop's business: with the vendor's Content-Length the body is
    # sent as is; without one aiohttp chunks it for an HTTP/1.1 worker and delimits
    # it by closing the connection for an HTTP/1.0 one (which cannot take chunks).
    try:
        await resp.prepare(request)
        if not no_body:
            while chunk := await _upstream_chunk(upstream):
                await resp.write(chunk)
        await resp.write_eof()
    except _UpstreamBroke as exc:
        upstream.close()
        resp.force_close()
        if request.transport is not None:
            request.transport.abort()
        return resp, f"upstream broke off mid-response: {exc}"
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError: writing to a closed worker
        upstream.close()
        return resp, "the worker went away mid-response"
    except BaseException:
        upstream.close()  # cancelled (the worker went away): drop the half-read upstream connection
        raise
    upstream.release()
    return resp, None
