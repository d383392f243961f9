"""The straight path: the usual request, from its head to its answer, driven by the sockets.

Most requests are alike: no body or a small one that comes whole soon after its head (a
payment's form, a JSON document: http1.BOARD_WAIT), a vendor whose limits are token
buckets that grant at once, an answer of known length that is all in when its head is. The general request
path (handler.py) serves every request, and pays for it on every one: a parse into
objects, a route through the router, the limiter and the forwarder's layers, a task
that wakes at each step. This path serves the usual request directly. What a request's
destination, method and tenant decide (its route: vendor, buckets, store command, vendor
connection pool, metric series, access-log text) is worked out once per policy
(routes.py), and per request a ``Flight`` does what is left, each step run by the
callback of the one before, no task and no coroutine:

    the worker's head parsed → its route (the parser noted the fields it needs)
    one store call (the acquire packed but for the state's counter)   → _stored
    granted now → an idle vendor connection → paced → the head (and body) written → _answered
    the vendor's answer → its lines copied in one pass → one write to the worker
    metrics, the recent counts and the access-log line, from the route's cells and text

At the first thing that is not usual it hands the request to the general path, which
goes on from there in the connection's serving task (``Carried``): before the store
call, nothing done (the route is not straight, the breaker is not closed, the store's
connection is not open); with the store's answer when it is not "go now" (a hold, a
refusal) or why there was none (the store unavailable); with the vendor's answer when it
is not one this path relays (a 429, no length, a watched field, a large or unfinished
body) or why there was none (a vendor that cannot be reached, a timeout). Every request
is served, counted and logged as the general path would have: the two share the answers,
refusals, feedback, pacing, pools, metric series and log format, and tests/test_lane.py
checks that they write the same. A worker that goes away mid-flight is accounted as the
general path's cancelled request is (``Flight.gone``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

import hiredis

from proxy.limiter import AcquireResult, StoreUnavailable
from proxy.limiter.pipelined import Reply
from proxy.limiter.redis_store import acquire_result
from proxy.pipeline.decide import Admission
from proxy.pipeline.forward import paced, ready
from proxy.pipeline.ledger import INTERNAL_ERROR, Ledger
from proxy.pipeline.match import Match
from proxy.pipeline.pacing import Paced
from proxy.pipeline.refusals import InternalError
from proxy.pipeline.responses import write_answer
from proxy.pipeline.routes import KEY_MAX, Route, Routes
from proxy.tasks import spawn
from proxy.tls.intercept import Interception
from proxy.wire.headers import answer_lines, idempotent, request_kinds
from proxy.wire.request import Request
from proxy.wire.responder import Responder, date_line, status_line
from proxy.wire.upstream import Response, UpstreamConnection, UpstreamFailed

if TYPE_CHECKING:
    from proxy.deps import Deps
    from proxy.pipeline.kept_slots import KeptSlots
    from proxy.quota.seats import Seats
    from proxy.wire.body import BodyBroken
    from proxy.wire.http1 import Http1Connection

log = logging.getLogger("quota_proxy")

WHOLE_MAX: Final = 64 * 1024
"""The largest answer body relayed here (all in with its head, one write); larger ones the general path streams."""
_ReplyError = hiredis.ReplyError
_quoted = encode_basestring_ascii
# What a flight waits for (``Flight.gone`` undoes it).
_STORE, _ACQUIRING, _CONNECTING, _VENDOR = 1, 2, 3, 4


class Carried(NamedTuple):
    """How far the straight path took a request it hands to the general path: what it did
    is not done again, what it learnt is not asked again."""

    match: Match
    taken: AcquireResult | StoreUnavailable | None = None
    """The store's answer for the request's tokens, or why it gave none; None: not asked yet."""
    admission: Admission | None = None
    """Granted and sent: how it is counted; then ``upstream`` is the vendor's answer (its
    head in) or ``failure`` why the exchange failed, on ``conn``, sent at ``sent``."""
    upstream: Response | None = None
    failure: UpstreamFailed | BodyBroken | OSError | None = None
    conn: UpstreamConnection | None = None
    sent: float = 0.0


def _nothing() -> None:
    pass


class GeneralPath(Protocol):
    """What the straight path hands over to, and shares with, the general path (handler.py):
    the request it cannot finish, a worker gone while the vendor works, the tenants'
    seats and the slots kept for deferred calls."""

    @property
    def deps(self) -> Deps: ...

    @property
    def seats(self) -> Seats: ...

    @property
    def kept(self) -> KeptSlots: ...

    def __call__(
        self,
        request: Request,
        responder: Responder,
        deps: Deps | None = None,
        started: float | None = None,
        carried: Carried | None = None,
    ) -> Awaitable[None]:
        """Go on with ``request`` from where the straight path stopped (``carried``)."""

    def heard_out(self, deps: Deps, match: Match, release: Callable[[], None], response: Response | None) -> None:
        """The vendor is done with a request whose worker went away."""


class Lane:
    """The straight path of one handler, its routes per policy generation (http1.Lane)."""

    def __init__(self, handler: GeneralPath) -> None:
        self.handler = handler
        self.reset(handler.deps)

    def reset(self, deps: Deps) -> None:
        """Serve ``deps`` (a policy generation) from the next request on."""
        self.deps = deps
        self.routes = Routes(deps)
        self.tenant_header = deps.policy.tenant.header
        self.kinds = request_kinds(self.tenant_header)
        """The classifier the worker-facing parser notes fields with (headers.request_kinds)."""

    def flight(self, conn: Http1Connection, request: Request) -> Flight | None:
        """The straight path for a ``lean`` request, when its route is straight (else None:
        the general path serves it); ``Flight.take`` then starts it."""
        if request.kinds is not self.kinds:  # its head was read under another policy's tenant header
            return None
        if conn.kept_slots:  # a deferred call's slot to claim: the general path's (handler.admit)
            return None
        method = request.method
        target = request.target
        tag = request.tag
        route: Route | bool | None = None
        cut = -1
        if tag is None:
            if target[:1] == "/":  # origin form: a vendor route, or Host
                if len(target) <= KEY_MAX:
                    key: object = (target, request.host, method, request.tenant)
                    route = self.routes.get(key)
            else:
                cut = target.find("/", 8)  # past "http://x" or "https://": where the path starts
                if 0 < cut <= KEY_MAX and "#" not in target:
                    key = (target[:cut], method, request.tenant)
                    route = self.routes.get(key)
        elif type(tag) is Interception and target[:1] == "/":
            cut = 0
            key = (tag.host, tag.port, tag.claim.tenant, tag.claim.proof, method, request.tenant)
            route = self.routes.get(key)
        if route is False:
            route = self.routes.learn(key, request, method, cut)
        if not isinstance(route, Route):
            return None
        if route.reserve is not None and self.handler.kept.waiting(route.reserve.key):
            return None  # this bucket set's deferred calls have slots here: the general path claims them
        return Flight(self, conn, request, route, cut)

    async def crashed(
        self, deps: Deps, request: Request, responder: Responder, route: Route, started: float, exc: Exception
    ) -> None:
        """A bug: logged, counted (outcome error), answered 500 unless the answer had begun
        (then the connection is cut, never a spliced body)."""
        log.error("internal error on %s %s", request.method, request.target[:200], exc_info=exc)
        ledger = Ledger(deps, request.method, request.target, started)
        rec = ledger.rec
        rec.host, rec.path = route.host, route.path_of(request)
        rec.vendor, rec.tenant = route.vendor.name, route.tenant
        rec.outcome, rec.detail = "error", INTERNAL_ERROR
        try:
            if responder.begun:
                raise exc
            answer = ledger.refuse(InternalError(INTERNAL_ERROR, idempotent(request.method, request.headers)))
        finally:
            ledger.close()
        await write_answer(responder, answer)


class Flight:
    """One request on the straight path: each step is the callback of the one before.
    Its connection (http1.Http1Connection) holds it from the head to ``landed`` (the
    answer written) or ``carry`` (the rest is the general path's, in its serving task)."""

    __slots__ = (
        "asked",
        "conn",
        "cut",
        "dead",
        "deps",
        "lane",
        "levels",
        "now",
        "request",
        "responder",
        "route",
        "seen",
        "sent",
        "started",
        "upstream",
        "waiting",
        "written",
    )

    def __init__(self, lane: Lane, conn: Http1Connection, request: Request, route: Route, cut: int) -> None:
        self.lane = lane
        self.deps = deps = lane.deps  # one policy generation for the whole request
        self.started = deps.clock.monotonic()
        self.conn = conn
        self.request = request
        self.responder: Responder | None = None
        self.written = 0  # the status of the answer written to the worker (0: none yet)
        self.route = route
        self.cut = cut
        self.dead = False
        self.waiting = 0  # what it waits for: _STORE, _ACQUIRING, _CONNECTING, _VENDOR (0: nothing)
        self.asked: asyncio.Future[Any] | Reply | None = None
        self.upstream: UpstreamConnection | None = None
        self.seen = 0
        self.now = self.sent = 0.0
        self.levels: tuple[float, ...] = ()

    # -- its tokens: one store call --------------------------------------------------------

    def take(self) -> bool:
        """Ask for the request's tokens; False when the general path had better serve it
        from the start (nothing was done: the breaker is not closed, the store's
        connection not open, no tenant seat free)."""
        try:
            return self._take()
        except Exception as exc:  # (called from the parser's callback: nothing may escape)
            self._crash(exc)
            return True

    def _take(self) -> bool:
        route = self.route
        limiter = self.deps.limiter
        seats = route.seats
        if seats is not None and self.lane.handler.seats.take(route.vendor, route.tenant, seats) > 0:
            return False  # no seat free: the general path defers it
        plan = route.plan
        if plan is not None:
            breaker = limiter.breaker
            if not breaker.allow():  # open: the general path refuses it as the breaker says
                return False
            seen = limiter.seen_seq(route.state_key)
            self.seen = seen
            asked = plan.send(seen, self._stored)
            if asked is None:  # the store's connection is not open: the general path opens it
                breaker.release()
                return False
            self.waiting = _STORE
            self.asked = asked
            return True
        queue = route.b.queue if route.enqueue else None
        try:
            result = limiter.take_now(route.vendor, route.b, route.cost, route.max_wait, queue, route.reserve)
        except StoreUnavailable as down:
            self._carry(Carried(route.match_for(self.request.target), down))
            return True
        if result is None:  # a store without a straight command (Redis Cluster, redis-py): its own acquire
            call = limiter.acquire(
                route.vendor,
                route.tenant,
                route.max_wait,
                route.cost,
                enqueue=route.enqueue,
                buckets=route.b,
                claim=None if route.reserve is None else "",
            )
            self._wait(_ACQUIRING, spawn(call, name="straight-acquire"), self._acquired)
            return True
        self._decided(result)
        return True

    def _wait(self, what: int, asked: asyncio.Future[Any], then: Callable[[asyncio.Future[Any]], None]) -> None:
        self.waiting = what
        self.asked = asked
        asked.add_done_callback(then)

    def _stored(self, out: Any, exc: BaseException | None) -> None:
        """The store's reply (``out``), or why none came: from the pipelined connection's
        reading callback (or its timer), as it comes."""
        if self.dead:
            return
        self.waiting = 0
        self.asked = None
        plan = self.route.plan
        assert plan is not None
        try:
            if exc is not None:
                down = exc if isinstance(exc, StoreUnavailable) else plan.failed(exc)
                if down is None:
                    self.deps.limiter.breaker.release()
                    raise exc
                self._store_down(down)
                return
            if type(out) is _ReplyError:  # NOSCRIPT (Redis restarted, flushed): loaded, and asked again
                self._wait(_ACQUIRING, spawn(plan.reply_error(out, self.seen), name="straight-acquire"), self._reloaded)
                return
            self._granted(out)
        except Exception as error:
            self._crash(error)

    def _reloaded(self, asked: asyncio.Future[Any]) -> None:
        """The reply after a NOSCRIPT (the script loaded, the acquire sent again)."""
        if asked.cancelled():  # (gone: the flight is dead)
            return
        exc = asked.exception()
        self._stored(None if exc is not None else asked.result(), exc)

    def _store_down(self, down: StoreUnavailable) -> None:
        self.deps.limiter.store_failed(down)
        self._carry(Carried(self.route.match_for(self.request.target), down))

    def _granted(self, out: list[Any]) -> None:
        deps = self.deps
        route = self.route
        plan = route.plan
        assert plan is not None
        now = deps.clock.monotonic()
        levels = tuple(map(float, out[8 : 8 + plan.n]))
        deps.limiter.answered_straight(
            route.vendor, route.b, int(out[4]), int(out[7]) / 1000.0, out[5] == b"1", levels, now
        )
        if out[0] != b"1":  # a refusal
            self._carry(Carried(route.match_for(self.request.target), acquire_result(out, plan.n)))
            return
        if out[1] != b"0.000":
            wait = float(out[1]) / 1000.0
            if wait > 0:  # a hold
                self._carry(Carried(route.match_for(self.request.target), acquire_result(out, plan.n)))
                return
            now += wait  # a kept slot claimed late: granted when it matured (pacing.py)
        self._go(now, levels)

    def _acquired(self, asked: asyncio.Future[Any]) -> None:
        """The answer of a store without a straight command (its own acquire, a task)."""
        if self.dead:
            return
        self.waiting = 0
        self.asked = None
        try:
            exc = asked.exception()
            if isinstance(exc, StoreUnavailable):  # (the limiter has told the breaker)
                self._carry(Carried(self.route.match_for(self.request.target), exc))
                return
            if exc is not None:
                raise exc
            self._decided(asked.result())
        except Exception as exc:
            self._crash(exc)

    def _decided(self, result: AcquireResult) -> None:
        now = self.deps.clock.monotonic()
        if not result.granted or result.wait > 0:  # a hold, or a refusal
            self._carry(Carried(self.route.match_for(self.request.target), result))
            return
        self._go(now + result.wait, result.levels)  # (a kept slot claimed late: when it matured)

    # -- to the vendor ---------------------------------------------------------------------

    def _go(self, now: float, levels: tuple[float, ...]) -> None:
        """Granted at ``now``: a connection, paced, and the request written."""
        deps = self.deps
        route = self.route
        self.now = now
        self.levels = levels
        self.sent = deps.clock.monotonic()
        pool = route.pool
        conn = pool.idle(route.origin)
        pacer = deps.pacer
        connect = route.timeouts.connect
        room = levels[route.tenant_count :]
        if conn is None or pacer.still_connecting:  # a connection to open, or others' to wait for
            pace = Paced(route.vendor_side, now, route.window, room, route.cost)
            opened = spawn(ready(pool, route.origin, connect, pacer, pace, conn), name="straight-connect")
            self._wait(_CONNECTING, opened, self._connected)
            return
        wait = pacer.reserve(route.vendor_side, now, route.window, room, route.cost)
        if wait > 0:
            self._wait(
                _CONNECTING, spawn(paced(pool, conn, pacer, wait, connect), name="straight-paced"), self._connected
            )
            return
        self._send(conn)

    def _connected(self, asked: asyncio.Future[Any]) -> None:
        """A connection opened, or held by the pacer: write on it."""
        if self.dead:  # (cancelled: the connection, if any, went back to the pool)
            if not asked.cancelled() and asked.exception() is None:
                self.route.pool.give_back(asked.result())
            return
        self.waiting = 0
        self.asked = None
        try:
            exc = asked.exception()
            if isinstance(exc, UpstreamFailed | OSError):
                self._carry(self._sent(failure=exc))
                return
            if exc is not None:
                raise exc
            self._send(asked.result())
        except Exception as exc:
            self._crash(exc)

    def _send(self, conn: UpstreamConnection) -> None:
        route = self.route
        request = self.request
        cut = self.cut
        path = request.url[cut:] if cut >= 0 else route.path
        body = request._body
        if body is None:
            head = b"".join((route.head_start, path, route.head_end, request.lines, route.head_tail))
        else:  # a small body, whole (http1.LANE_BODY_MAX): with its head, in one write
            chunks = body._chunks
            framing = b"Content-Length: %d\r\n\r\n" % sum(map(len, chunks))
            head = b"".join((route.head_start, path, route.head_end, request.lines, framing, *chunks))
        self.upstream = conn
        self.waiting = _VENDOR
        conn.send_head_to(head, request.method, route.timeouts.read, self._answered)

    def _sent(self, upstream: Response | None = None, failure: UpstreamFailed | OSError | None = None) -> Carried:
        """What the general path goes on with once the request was granted and sent."""
        route = self.route
        pace = Paced(route.vendor_side, self.now, route.window, self.levels[route.tenant_count :], route.cost)
        match = route.match_for(self.request.target)
        admission = Admission("forwarded", None, pace)
        return Carried(match, None, admission, upstream, failure, self.upstream, self.sent)

    # -- the answer ------------------------------------------------------------------------

    def _answered(self, response: Response | None, exc: UpstreamFailed | None) -> None:
        """The vendor's answer's head is in (and, a small one, its body), or (``exc``) none
        will come: told by the vendor connection as its read is parsed."""
        if self.dead:
            return
        self.waiting = 0
        upstream = self.upstream
        assert upstream is not None
        try:
            if response is None:
                assert exc is not None
                upstream.unanswered(exc)
                self._carry(self._sent(failure=exc))
                return
            status = response.status
            lines = None
            body = None
            route = self.route
            if status != 429 and status >= 200 and status != 204 and status != 304:
                lines = answer_lines(response.block, route.answer_fields, True)
                if lines is not None and lines[1] <= WHOLE_MAX:
                    body = response.whole_exactly(lines[1])
            if lines is None or body is None:  # one for the general path's relay (and feedback)
                self._carry(self._sent(upstream=response))
                return
            kept, length, date = lines
            route.recent.add(int(self.deps.clock.monotonic()))
            route.answer_cell(status)._value += 1
            conn = self.conn
            request = self.request
            keep = request.keep_alive and conn.keep_alive  # (Responder.keeps: no body waits to be invited)
            if not keep:
                framing = b"Content-Length: %d\r\nConnection: close\r\n\r\n"
            elif request.version == "1.1":
                framing = b"Content-Length: %d\r\n\r\n"
            else:  # an HTTP/1.0 worker keeps the connection only when told so
                framing = b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n"
            if not keep:
                request.keep_alive = False
            head = status_line(status, response.reason)
            conn.write(b"".join((head, kept, b"" if date else date_line(), framing % length, body)))
            self.written = status
            if conn.write_paused or conn.closed:  # a slow worker: its drain, in the serving task
                conn.carry(request, self._responder(), functools.partial(self._drained, response))
                return
            response.release()
            self._landed(status)
        except Exception as exc:
            self._crash(exc)

    async def _drained(self, response: Response) -> None:
        """The rest of an answer the worker was slow to take, in the serving task (which
        then takes the connection's next request itself)."""
        try:
            await self._responder().drained()
        except (ConnectionError, asyncio.CancelledError):  # the worker went away
            response.close()
            self._count(response.status, "the worker went away mid-response")
            raise
        response.release()
        self._count(response.status)

    def _landed(self, status: int) -> None:
        """The answer is written: counted and logged, and the connection's next request taken."""
        self._count(status)
        self.conn.landed(self.request)

    def _count(self, status: int, broken: str | None = None) -> None:
        """The answer is written (or, ``broken``, could not be): counted and logged as the
        general path counts and logs a forwarded request."""
        deps = self.deps
        route = self.route
        clock = deps.clock
        elapsed = clock.monotonic() - self.sent
        latency = route.latency
        latency.sum._value += elapsed
        latency.buckets[bisect_left(latency.bounds, elapsed)]._value += 1
        deps.sizing.observe(route.vendor.name, elapsed)
        route.mode_cell._value += 1
        if broken is not None:
            self._account("error", broken, status)
        else:
            route.forwarded._value += 1
            if route.log:
                cut = self.cut
                target = self.request.target
                logged_path = route.log_path if cut < 0 else _quoted(target[cut:].split("?", 1)[0][:256])
                ts = round(time.time(), 3)
                ms = round((clock.monotonic() - self.started) * 1000, 2)
                # AccessRecord.line's text, json's own for each value (float repr, the quoting).
                deps.access_log.add(
                    f'{{"ts":{ts!r}{route.log_head}{logged_path}{route.log_mid}{status},"upstream_status":{status}'
                    f"{route.log_tail}{ms!r}"
                )

    # -- the rare ends, accounted as the general path accounts them -------------------------

    def _carry(self, carried: Carried) -> None:
        """The general path goes on with the request, in its connection's serving task."""
        responder = self._responder()
        work = functools.partial(self.lane.handler, self.request, responder, self.deps, self.started, carried)
        self.conn.carry(self.request, responder, work)

    def _crash(self, exc: Exception) -> None:
        if self.upstream is not None and self.waiting == 0:
            self.upstream.close()  # whatever state it was left in, it is not reused
        responder = self._responder()
        work = functools.partial(self.lane.crashed, self.deps, self.request, responder, self.route, self.started, exc)
        self.conn.carry(self.request, responder, work)

    def _responder(self) -> Responder:
        """The request's Responder, made when the general path (or a drain) needs one."""
        responder = self.responder
        if responder is None:
            responder = self.responder = Responder(self.conn, self.request)
            if self.written:  # the answer went out: what follows never splices another into it
                responder.wrote(self.written)
        return responder

    def gone(self) -> None:
        """The worker went away: what the flight waits for is given up (a store call, with
        the breaker's probe released; a connection being opened or paced, back to the pool;
        a request the vendor has whole, heard out: it keeps working on it), and the
        request counted and logged as the general path's cancelled one."""
        self.dead = True
        waiting, asked = self.waiting, self.asked
        self.waiting = 0
        self.asked = None
        if waiting == _STORE:
            assert asked is not None
            asked.cancel()  # its reply, when it comes, is dropped
            self.deps.limiter.breaker.release()
        elif waiting == _VENDOR:
            upstream = self.upstream
            assert upstream is not None
            upstream.unanswered(asyncio.CancelledError())
            if upstream.draining:
                match = self.route.match_for(self.request.target)
                upstream.after(functools.partial(self.lane.handler.heard_out, self.deps, match, _nothing))
        elif asked is not None:  # _ACQUIRING, _CONNECTING: a task, which undoes its own
            asked.cancel()
        self.deps.metrics.count_mode(self.route.vendor.name, self.route.mode)
        self._account("error", "the worker went away")

    def _account(self, outcome: str, detail: str, status: int | None = None) -> None:
        request = self.request
        route = self.route
        ledger = Ledger(self.deps, request.method, request.target, self.started)
        rec = ledger.rec
        rec.host, rec.path = route.host, route.path_of(request)
        rec.vendor, rec.tenant = route.vendor.name, route.tenant
        rec.outcome, rec.detail = outcome, detail
        rec.status = rec.upstream_status = status
        ledger.close()


Work = Callable[[], Awaitable[None]]
"""What a connection's serving task goes on with for a request a flight handed over."""
