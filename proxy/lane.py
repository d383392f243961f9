"""The straight path: the usual request, from its head to its answer, in one coroutine.

Most requests are alike: no body, a vendor whose limits are token buckets that grant at
once, an answer of known length that is all in when its head is. The general request
path (handler.py) serves every request, and pays for it on every one: a parse into
objects, a route through the router, the limiter and the forwarder's layers, a multidict
per message. This path serves the usual request directly. What a request's destination,
method and tenant decide (its route: vendor, buckets, store command, vendor connection
pool, metric series, access-log text) is worked out once per policy (routes.py), and per
request it does what is left:

    route ← the head's target, method and tenant (the parser noted the fields it needs)
    one store call (the acquire packed but for the state's counter) → granted now?
    an idle vendor connection (or a new one) → paced → the head written whole
    the vendor's answer → its fields filtered in one pass → one write to the worker
    metrics, the recent counts and the access-log line, from the route's cells and text

At the first thing that is not usual it hands the request to the general path, which
goes on from there (``Carried``): before the store call, nothing done (the route is not
straight, the breaker is not closed, the store's connection is not open); with the
store's answer when it is not "go now" (a hold, a refusal) or why there was none (the
store unavailable); with the vendor's answer when it is not one this path relays (a 429,
no length, a watched field, a large or unfinished body) or why there was none (a vendor
that cannot be reached, a timeout). Every request is served, counted and logged as the
general path would have: the two share the answers, refusals, feedback, pacing, pools,
metric series and log format, and tests/test_lane.py checks that they write the same.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from bisect import bisect_left
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING, Final, NamedTuple

import hiredis

from proxy.dataplane.http1 import Request, Responder, date_line, status_line
from proxy.dataplane.upstream import Response, UpstreamConnection, UpstreamFailed
from proxy.decide import Admission
from proxy.forward import paced, ready
from proxy.headers import answer_lines, idempotent, request_kinds
from proxy.intercept import Interception
from proxy.ledger import INTERNAL_ERROR, Ledger
from proxy.limiter import AcquireResult, StoreUnavailable
from proxy.limiter.redis_store import acquire_result
from proxy.match import Match
from proxy.pacing import Paced
from proxy.refusals import InternalError
from proxy.responses import write_answer
from proxy.routes import KEY_MAX, Route, Routes

if TYPE_CHECKING:
    from proxy.dataplane.http1 import BodyBroken
    from proxy.deps import Deps
    from proxy.handler import ProxyHandler

log = logging.getLogger("quota_proxy")

WHOLE_MAX: Final = 64 * 1024
"""The largest answer body relayed here (all in with its head, one write); larger ones the general path streams."""
_ReplyError = hiredis.ReplyError
_quoted = encode_basestring_ascii


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


class _HandOver(Exception):
    """The straight path stops here: the general path goes on with ``carried``."""

    def __init__(self, carried: Carried) -> None:
        self.carried = carried


def _nothing() -> None:
    pass


class Lane:
    """The straight path of one handler (``serve``: http1.Lane), its routes per policy generation."""

    def __init__(self, handler: ProxyHandler) -> None:
        self._handler = handler
        self.reset(handler.deps)

    def reset(self, deps: Deps) -> None:
        """Serve ``deps`` (a policy generation) from the next request on."""
        self.deps = deps
        self.routes = Routes(deps)
        self.tenant_header = deps.policy.tenant.header
        self.kinds = request_kinds(self.tenant_header)
        """The classifier the worker-facing parser notes fields with (headers.request_kinds)."""

    async def serve(self, request: Request, responder: Responder) -> None:
        deps = self.deps  # one policy generation for the whole request
        clock = deps.clock
        started = clock.monotonic()
        method = request.method
        target = request.target
        tag = request.tag
        route: Route | bool | None = None
        cut = -1
        if request.kinds is self.kinds:  # its head was read with this policy's tenant header
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
        if route is None or route is False or route is True:
            await self._handler(request, responder, deps, started)
            return
        try:
            await self._straight(deps, request, responder, route, started, cut)
            return
        except _HandOver as over:
            carried = over.carried
        except Exception as exc:  # a bug: accounted and answered as the general path's are
            await self._crashed(deps, request, responder, route, started, exc)
            return
        await self._handler(request, responder, deps, started, carried)

    async def _straight(
        self, deps: Deps, request: Request, responder: Responder, route: Route, started: float, cut: int
    ) -> None:
        clock = deps.clock
        vendor = route.vendor
        limiter = deps.limiter
        target = request.target
        seats = route.seats
        if seats is not None and self._handler.seats.take(vendor, route.tenant, seats) > 0:
            raise _HandOver(Carried(route.match_for(target)))  # no seat free: the general path defers it
        # -- its tokens: one store call -------------------------------------------------
        plan = route.plan
        if plan is not None:
            breaker = limiter.breaker
            if not breaker.allow():  # open: the general path refuses it as the breaker says
                raise _HandOver(Carried(route.match_for(target)))
            seen = limiter.seen_seq(route.state_key)
            asked = plan.send(seen)
            if asked is None:  # the store's connection is not open: the general path opens it
                breaker.release()
                raise _HandOver(Carried(route.match_for(target)))
            try:
                out = await asked
                if type(out) is _ReplyError:
                    out = await plan.reply_error(out, seen)
            except StoreUnavailable as down:
                limiter.store_failed(down)
                raise _HandOver(Carried(route.match_for(target), down)) from None
            except asyncio.CancelledError:
                breaker.release()
                self._gone(deps, request, route, started, None)
                raise
            except Exception as exc:
                failure = plan.failed(exc)
                if failure is None:
                    breaker.release()
                    raise
                limiter.store_failed(failure)
                raise _HandOver(Carried(route.match_for(target), failure)) from None
            now = clock.monotonic()
            levels = tuple(map(float, out[8 : 8 + plan.n]))
            limiter.answered_straight(vendor, route.b, int(out[4]), int(out[7]) / 1000.0, out[5] == b"1", levels, now)
            if out[0] != b"1" or (out[1] != b"0.000" and float(out[1]) > 0):
                raise _HandOver(Carried(route.match_for(target), acquire_result(out, plan.n)))
        else:  # a store without a straight command (memory://, Redis Cluster): its own acquire
            try:
                result = await limiter.acquire(
                    vendor, route.tenant, route.max_wait, route.cost, enqueue=route.enqueue, buckets=route.b
                )
            except StoreUnavailable as down:
                raise _HandOver(Carried(route.match_for(target), down)) from None
            except asyncio.CancelledError:
                self._gone(deps, request, route, started, None)
                raise
            now = clock.monotonic()
            if not result.granted or result.wait > 0:
                raise _HandOver(Carried(route.match_for(target), result))
            levels = result.levels
        # -- to the vendor ----------------------------------------------------------------
        sent = clock.monotonic()
        pool = route.pool
        timeouts = route.timeouts
        conn = pool.idle(route.origin)
        pacer = deps.pacer
        try:
            room = levels[route.tenant_count :]
            if conn is None or pacer.still_connecting:  # a connection to open, or others' to wait for
                pace = Paced(route.vendor_side, now, route.window, room, route.cost)
                conn = await ready(pool, route.origin, timeouts.connect, pacer, pace, conn)
            else:
                wait = pacer.reserve(route.vendor_side, now, route.window, room, route.cost)
                if wait > 0:
                    conn = await paced(pool, conn, pacer, wait, timeouts.connect)
            path = request.url[cut:] if cut >= 0 else route.path
            head = b"".join((route.head_start, path, route.head_end, request.lines, route.head_tail))
            asked_vendor = conn.send_head(head, request.method, timeouts.read)
            try:
                response = await asked_vendor
            except BaseException as exc:
                conn.unanswered(exc)
                raise
        except (UpstreamFailed, OSError) as exc:
            pace = Paced(route.vendor_side, now, route.window, levels[route.tenant_count :], route.cost)
            carried = Carried(route.match_for(target), None, Admission("forwarded", None, pace), None, exc, conn, sent)
            raise _HandOver(carried) from None
        except asyncio.CancelledError:
            self._gone(deps, request, route, started, conn)
            raise
        # -- the answer -------------------------------------------------------------------
        status = response.status
        lines = None
        body = None
        if status != 429 and status >= 200 and status != 204 and status != 304:
            lines = answer_lines(response.block, route.answer_fields, True)
            if lines is not None and lines[1] <= WHOLE_MAX:
                body = response.whole_exactly(lines[1])
        if lines is None or body is None:  # one for the general path's relay (and feedback)
            pace = Paced(route.vendor_side, now, route.window, levels[route.tenant_count :], route.cost)
            carried = Carried(
                route.match_for(target), None, Admission("forwarded", None, pace), response, None, conn, sent
            )
            raise _HandOver(carried)
        kept, length, date = lines
        route.recent.add(int(clock.monotonic()))
        route.answer_cell(status)._value += 1
        keep = responder.keeps
        framing = b"Content-Length: %d\r\n\r\n" if keep else b"Content-Length: %d\r\nConnection: close\r\n\r\n"
        data = b"".join(
            (status_line(status, response.reason), kept, b"" if date else date_line(), framing % length, body)
        )
        broken = None
        try:
            await responder.send_whole(status, data, keep)
        except ConnectionError:  # the worker went away
            response.close()
            broken = "the worker went away mid-response"
        else:
            response.release()
        done = clock.monotonic()
        elapsed = done - sent
        latency = route.latency
        latency.sum._value += elapsed
        latency.buckets[bisect_left(latency.bounds, elapsed)]._value += 1
        deps.sizing.observe(vendor.name, elapsed)
        route.mode_cell._value += 1
        totals = deps.metrics.mode_totals
        totals[route.mode_key] = totals.get(route.mode_key, 0) + 1
        if broken is not None:
            self._account(deps, request, route, started, "error", broken, status, status)
            return
        route.forwarded._value += 1
        if route.log:
            logged_path = route.log_path if cut < 0 else _quoted(target[cut:].split("?", 1)[0][:256])
            ts = round(time.time(), 3)
            ms = round((clock.monotonic() - started) * 1000, 2)
            # AccessRecord.line's text, json's own for each value (float repr, the quoting).
            deps.access_log.add(
                f'{{"ts":{ts!r}{route.log_head}{logged_path}{route.log_mid}{status},"upstream_status":{status}'
                f"{route.log_tail}{ms!r}"
            )

    # -- the rare ends, accounted as the general path accounts them ------------------------

    def _account(
        self,
        deps: Deps,
        request: Request,
        route: Route,
        started: float,
        outcome: str,
        detail: str,
        status: int | None = None,
        upstream_status: int | None = None,
    ) -> None:
        ledger = Ledger(deps, request.method, request.target, started)
        rec = ledger.rec
        rec.host, rec.path = route.host, route.path_of(request)
        rec.vendor, rec.tenant = route.vendor.name, route.tenant
        rec.outcome, rec.detail = outcome, detail
        rec.status, rec.upstream_status = status, upstream_status
        ledger.close()

    def _gone(
        self, deps: Deps, request: Request, route: Route, started: float, conn: UpstreamConnection | None
    ) -> None:
        """The worker went away (its request cancelled) while the store or the vendor was
        asked: counted and logged as the general path does, and a request the vendor still
        works on is heard out (its answer counted and fed back when it comes)."""
        deps.metrics.count_mode(route.vendor.name, route.mode)
        if conn is not None and conn.draining:
            match = route.match_for(request.target)
            conn.after(functools.partial(self._handler.heard_out, deps, match, _nothing))
        self._account(deps, request, route, started, "error", "the worker went away")

    async def _crashed(
        self, deps: Deps, request: Request, responder: Responder, route: Route, started: float, exc: Exception
    ) -> None:
        """A bug: logged, counted (outcome error), answered 500 unless the answer had begun
        (then the connection is cut, never a spliced body)."""
        log.exception("internal error on %s %s", request.method, request.target[:200])
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
