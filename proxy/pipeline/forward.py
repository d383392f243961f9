"""Sending a granted request to its vendor and streaming the answer back.

One pool of keep-alive connections per vendor (wire/pool.py), so a slow vendor
cannot exhaust another's connections. Bodies stream both ways in pieces with backpressure;
a 50 MB upload or download costs a few buffers, not 50 MB. A request is never sent twice.

A vendor with an ``upstream`` keeps a burst's worth of idle connections open (``_keep_warm``):
a burst is granted at once, and if its requests had to connect first (a TLS handshake
to a real vendor) they would reach the vendor late, bunched with the requests granted
after them, one over a strict window that rate + burst fills exactly (issue 10 item 5).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import ssl
from collections.abc import Awaitable, Callable, Mapping

from proxy.names import parse_authority
from proxy.pipeline.pacing import Paced, Pacer
from proxy.policy.model import Policy, TlsSettings, Vendor
from proxy.tasks import spawn
from proxy.wire.body import BodyBroken, BodyStalled
from proxy.wire.framing import NO_CODINGS, answer_codings
from proxy.wire.headers import (
    answer_fields,
    answer_lines,
    downstream_response_headers,
    idempotent,
    upstream_request_lines,
)
from proxy.wire.pool import Pool
from proxy.wire.refusals import BadRequest, BodyTimeout, Refusal, UpstreamFailed
from proxy.wire.request import Request
from proxy.wire.responder import Responder
from proxy.wire.upstream import Origin, UpstreamBroke, UpstreamConnection
from proxy.wire.upstream import UpstreamFailed as Failed
from proxy.wire.vendor_answer import Response

log = logging.getLogger("quota_proxy.forward")

_WARM_MAX = 16  # idle connections kept per vendor at most, whatever its burst
_WARM_EVERY = 2.0  # seconds between top-ups of the idle connections
_KEEPALIVE = 30.0  # seconds an idle pooled connection is kept (then closed and, warm, replaced)
_WHOLE_MAX = 64 * 1024  # an answer body all in and at most this big is relayed in one write


def upstream_ssl_context(tls: TlsSettings) -> ssl.SSLContext | bool:
    """Verification on unless the policy turns it off; an extra CA bundle for private CAs."""
    if not tls.upstream_verify:
        return False
    ctx = ssl.create_default_context()
    if tls.upstream_ca_file:
        ctx.load_verify_locations(cafile=tls.upstream_ca_file)
    return ctx


class Upstreams:
    """The connection pools, one per vendor, created at start and closed at shutdown."""

    def __init__(self, policy: Policy, keep: dict[str, Pool] | None = None) -> None:
        self._tls = policy.tls
        ssl_ctx: ssl.SSLContext | bool | None = None
        self._pools: dict[str, Pool] = {}
        for vendor in policy.vendors:
            pool = (keep or {}).get(vendor.name)
            if pool is None:
                if ssl_ctx is None:
                    ssl_ctx = upstream_ssl_context(policy.tls)
                pool = Pool(ssl_ctx, keepalive=_KEEPALIVE)
            self._pools[vendor.name] = pool
        self._keepers = [
            spawn(_keep_warm(self._pools[v.name], origin, count), name=f"warm-{v.name}")
            for v in policy.vendors
            if (origin := _origin(v)) and (count := warm_count(v))
        ]

    def pool(self, vendor: Vendor) -> Pool:
        return self._pools[vendor.name]

    def updated(self, policy: Policy) -> tuple[Upstreams, list[Callable[[], Awaitable[None]]]]:
        """The pools for a reloaded policy: a kept vendor keeps its pool (TLS settings
        unchanged); returns them and the closers of the pools no longer used."""
        keep = self._pools if policy.tls == self._tls else {}
        self._stop_warming()  # the new policy's keepers take over (its bursts, its upstreams)
        new = Upstreams(policy, keep)
        used = {id(p) for p in new._pools.values()}
        return new, [p.close for p in self._pools.values() if id(p) not in used]

    async def heard_out(self) -> None:
        """Return once no pool is hearing out an answer (``Pool.heard_out``)."""
        await asyncio.gather(*(p.heard_out() for p in self._pools.values()))

    async def close(self) -> None:
        self._stop_warming()
        await asyncio.gather(*(p.close() for p in self._pools.values()))

    def _stop_warming(self) -> None:
        for task in self._keepers:
            task.cancel()


def warm_count(vendor: Vendor) -> int:
    """Idle connections kept open to ``vendor``: its burst, the most requests its global
    buckets grant at once (the smallest burst: every bucket must grant), capped."""
    if not vendor.limits:
        return 0
    return min(math.ceil(min(lim.burst for lim in vendor.limits)), _WARM_MAX)


@functools.lru_cache(maxsize=1024)
def origin_of(origin: str) -> Origin:
    """``scheme://authority`` (a vendor's ``upstream``, or the origin a request named) →
    where to connect; a vendor's few origins are parsed once each."""
    scheme, _, rest = origin.partition("://")
    authority = rest.split("/", 1)[0]
    host, port = parse_authority(authority)
    scheme = scheme.lower()
    return Origin(scheme, host, port if port is not None else (443 if scheme == "https" else 80))


def _origin(vendor: Vendor) -> Origin | None:
    """Where the vendor's requests go when the policy says (``upstream``), else None: with
    the origin taken from each request there is nothing to connect to in advance."""
    return origin_of(vendor.upstream) if vendor.upstream else None


async def _keep_warm(pool: Pool, origin: Origin, count: int) -> None:
    """Keep ``count`` idle connections to ``origin`` in ``pool`` until cancelled: opened at
    start, topped up as the vendor or the pool's keep-alive closes them, so that a burst (at
    start, after a lull) leaves as soon as it is granted. A vendor that cannot be reached is
    tried again at the next top-up; requests meet the error themselves."""
    while not pool.closed:
        failed = await pool.warm(origin, count, 5.0)
        if failed:
            log.debug("warming connections to %s: %d failed: %r", origin, len(failed), failed[0])
        await asyncio.sleep(_WARM_EVERY)


class Carrier:
    """Which vendor connection carries a request, once it has one: a request whose worker
    went away keeps its concurrency slot while the vendor is still working on it."""

    __slots__ = ("conn",)

    def __init__(self) -> None:
        self.conn: UpstreamConnection | None = None


class _WorkerBody:
    """The worker's body as the upstream reads it: the first read invites an
    ``Expect: 100-continue`` body (http1.Body), so a refused request never invites one."""

    __slots__ = ("_body",)

    def __init__(self, request: Request) -> None:
        self._body = request.body

    async def read(self) -> bytes:
        return await self._body.read()


_FAILURES = {
    # kind: (status, X-Quota-Error, detail prefix)
    "refused": (502, "upstream-unreachable", ": "),
    "connect-timeout": (504, "upstream-timeout", " "),
    "tls": (502, "upstream-tls", ": "),
    "certificate": (502, "upstream-tls", ": "),
    "timeout": (504, "upstream-timeout", " "),
    "broken": (502, "upstream-unreachable", ": "),
}


def classify(vendor: Vendor, method: str, headers: Mapping[str, str], failure: Failed) -> UpstreamFailed:
    """A failed exchange as the 502/504 that says whether the request may have reached the
    vendor: not when no connection was made (refused, DNS, connect timeout, TLS handshake),
    else it may have (the vendor went silent or the connection broke while it was written
    or awaited), so that only a request that is safe to repeat is retried."""
    status, kind, sep = _FAILURES[failure.kind]
    detail = failure.detail
    if failure.kind == "connect-timeout":
        detail = "did not accept a connection in time"
    elif failure.kind == "timeout":
        detail = "did not answer in time"
    safe = idempotent(method, headers)
    return UpstreamFailed(status, kind, f"{vendor.name}{sep}{detail}", failure.reached, safe)


async def send(
    pool: Pool,
    vendor: Vendor,
    request: Request,
    origin: str,
    target: str,
    tenant_header: str,
    pacer: Pacer | None = None,
    pace: Paced | None = None,
    carrier: Carrier | None = None,
) -> Response:
    """Send the worker's request to ``origin`` (``scheme://authority``), ``target`` its path
    and query byte for byte (re-encoding could break a signed URL); return once the vendor's
    headers are in. Raises refusals.UpstreamFailed (``classify``).

    With a ``pacer`` and what it needs (``pace``), the request is written no less late after
    its grant than the last one of its vendor-side buckets was within the vendor's longest
    window, unless they had the room for it: at the last moment, its connection in hand, so
    that whatever delayed one request (a connection opening, a busy loop) cannot bunch it
    with the ones granted after it (pacing.py)."""
    lines = upstream_request_lines(request.raw, tenant_header)
    timeouts = vendor.timeouts
    try:
        where = origin_of(origin)
        conn = pool.idle(where)
        if pacer is not None and pace is not None:
            conn = await ready(pool, where, timeouts.connect, pacer, pace, conn)
        elif conn is None:
            conn = await pool.open(where, timeouts.connect)
        if carrier is not None:
            carrier.conn = conn
        return await conn.request(
            request.method,
            target,
            (),
            _WorkerBody(request) if request.has_body else None,
            request.length if request.has_body and request.length >= 0 else None,  # else chunked
            timeouts.read,
            lines=lines,
        )
    except (Failed, BodyBroken, OSError) as exc:
        raise send_failed(vendor, request, exc) from exc


def send_failed(vendor: Vendor, request: Request, exc: Failed | BodyBroken | OSError) -> Refusal:
    """The refusal of a request whose exchange with the vendor failed with ``exc``."""
    if isinstance(exc, Failed):
        return classify(vendor, request.method, request.headers, exc)
    if isinstance(exc, BodyStalled):  # the worker's side: it stopped sending its body
        request.keep_alive = False  # the rest of the body may still come: the answer closes
        return BodyTimeout(str(exc))
    if isinstance(exc, BodyBroken):  # the worker's side, not the vendor's: its body's framing broke
        return body_broke(request, exc)
    failure = Failed("broken", f"{type(exc).__name__}: {exc}", reached=True)
    return classify(vendor, request.method, request.headers, failure)


def body_broke(request: Request, why: BaseException) -> BadRequest:
    """The refusal of a request whose body broke off (its framing, or the worker's
    connection); its answer closes the connection, whatever of the body may still come."""
    request.keep_alive = False
    return BadRequest(f"the request body broke off: {why}")


async def ready(
    pool: Pool, where: Origin, connect: float | None, pacer: Pacer, pace: Paced, conn: UpstreamConnection | None
) -> UpstreamConnection:
    """The connection a granted request is written on, when the pacer lets it go (pacing.py):
    ``conn`` (an idle one the caller found) or a new one; after any request granted before
    it that is still connecting (whose lag is not known yet: it must not be overtaken);
    then held as long as the lag of its buckets' last writes says."""
    ticket = pacer.connecting(pace.specs, pace.granted) if conn is None else None
    try:
        if conn is None:
            conn = await pool.open(where, connect)
        if pacer.still_connecting and pacer.earlier(pace.specs, pace.granted, pace.room, pace.cost):
            try:
                await pacer.after_earlier(pace.specs, pace.granted, pace.room, pace.cost)
            except BaseException:
                pool.give_back(conn)  # nothing was written on it
                raise
            if conn.closed:  # the vendor closed it meanwhile
                conn = pool.idle(where) or await pool.open(where, connect)
        wait = pacer.reserve(*pace)
    finally:
        if ticket is not None:
            pacer.written(ticket)
    if wait > 0:
        conn = await paced(pool, conn, pacer, wait, connect)
    return conn


async def paced(
    pool: Pool, conn: UpstreamConnection, pacer: Pacer, wait: float, connect: float | None
) -> UpstreamConnection:
    """Hold ``conn`` for the ``wait`` seconds the pacer asked; the connection to write on
    then (another if the vendor closed this one meanwhile). A wait cut short (the worker
    went away) puts the unused connection back."""
    try:
        await pacer.clock.sleep(wait)
    except BaseException:
        pool.give_back(conn)
        raise
    if conn.closed:
        return pool.idle(conn.origin) or await pool.open(conn.origin, connect)
    return conn


def unrelayable(vendor: Vendor, request: Request, upstream: Response) -> UpstreamFailed | None:
    """The 502 of a vendor answer that cannot reach this worker as it is: a transfer coding
    (``gzip``) that an HTTP/1.0 worker cannot be told of (RFC 9112 §6.1), which the proxy
    will not undo for it nor drop silently."""
    if request.version != "1.0" or answer_codings(upstream.transfer_codings) is NO_CODINGS:
        return None
    said = ", ".join(value.decode("latin-1") for value in upstream.transfer_codings)
    detail = f"{vendor.name}: its answer's Transfer-Encoding ({said}) cannot be relayed to an HTTP/1.0 worker"
    return UpstreamFailed(502, "upstream-unrelayable", detail, True, idempotent(request.method, request.headers))


async def relay(
    upstream: Response,
    responder: Responder,
    extra_headers: dict[str, str] | None = None,
    before_end: Callable[[], Awaitable[None]] | None = None,
    watch: Callable[[bytes], None] | None = None,
) -> str | None:
    """Stream the vendor's answer to the worker; returns why the relay did not complete, if it did not.

    If the vendor broke off mid-body, the worker's connection is cut: a truncated body
    must never look complete. If the worker went away, the half-read upstream connection
    is dropped rather than returned to the pool: the vendor, busy writing the answer, sees
    the close at once and stops (unlike one still working on it: ``UpstreamConnection.abandon``).
    Framing is this hop's business: with the vendor's Content-Length the body is sent as is;
    without one it is chunked for an HTTP/1.1 worker and delimited by the close for an
    HTTP/1.0 one; a transfer coding the vendor applied besides chunked is said to the
    worker as it was (framing.answer_codings: ``unrelayable`` first).

    ``before_end`` runs once the vendor's answer is all in, before the worker is sent the
    last of it (the request's concurrency lease given back: the worker's next request must
    find it free, SPEC §10). ``watch`` sees each piece of the body as it is relayed (a
    metered request's settlement reads the vendor's usage from it: metering.py), never
    holding it back."""
    try:
        written = answer_lines(upstream.block, answer_fields(), False)  # the usual answer: its lines copied
        if written is None:  # a Connection field: the fields it names are dropped too, the general filter
            headers = downstream_response_headers(upstream.headers)
            if extra_headers:
                headers.extend(extra_headers.items())
            codings = answer_codings(upstream.transfer_codings)
            responder.start(upstream.status, upstream.reason, headers, codings=codings)
        else:
            lines, length, date = written
            head = [lines]
            if extra_headers:  # fields the vendor did not send, or list members added beside the vendor's
                head.append("".join(f"{name}: {value}\r\n" for name, value in extra_headers.items()).encode("latin-1"))
            codings = NO_CODINGS if length >= 0 else answer_codings(upstream.transfer_codings)
            responder.start_lines(upstream.status, upstream.reason, head, length, date, codings)
        whole = upstream.whole(_WHOLE_MAX)
        if whole is not None:  # all in already (a small answer): one write, no read per piece
            if watch is not None:
                watch(whole)
            if before_end is not None:
                await before_end()
            await responder.complete(whole)
        else:
            while chunk := await upstream.read():
                if watch is not None:
                    watch(chunk)
                if before_end is not None and upstream.done:  # the last piece
                    await before_end()
                    before_end = None
                await responder.write(chunk)
            if before_end is not None:
                await before_end()
            await responder.finish()
    except UpstreamBroke as exc:
        upstream.close()
        responder.abort()
        return f"upstream broke off mid-response: {exc}"
    except ConnectionError:  # writing to a worker that went away
        upstream.close()  # the vendor, writing the answer, sees the close at once and stops
        return "the worker went away mid-response"
    except BaseException:
        upstream.close()  # cancelled (the worker went away): as above
        raise
    upstream.release()
    return None
