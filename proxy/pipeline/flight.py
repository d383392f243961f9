"""One request on the straight path (lane.py): each step the callback of the one before,
from its store call to its answer written, or handed over to the general path."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from proxy.limiter import AcquireResult, StoreUnavailable
from proxy.limiter.store import Pending
from proxy.pipeline.decide import Admission
from proxy.pipeline.forward import paced, ready
from proxy.pipeline.handover import Carried, GeneralPath
from proxy.pipeline.ledger import Ledger, crashed
from proxy.pipeline.metering import Metered, Settlement, settled
from proxy.pipeline.pacing import Paced, vendor_room
from proxy.pipeline.ratelimit_fields import quota_lines, tightest
from proxy.pipeline.routes import Charge, Route, Terms
from proxy.quota.concurrency import Slot
from proxy.tasks import spawn
from proxy.telemetry.accesslog import quoted_path
from proxy.wire.headers import answer_lines
from proxy.wire.request import Request
from proxy.wire.responder import Responder, date_line, head_end, keeps, status_line
from proxy.wire.upstream import UpstreamConnection, UpstreamFailed
from proxy.wire.vendor_answer import Response

if TYPE_CHECKING:
    from proxy.deps import Deps
    from proxy.wire.http1 import Http1Connection

log = logging.getLogger("quota_proxy")

WHOLE_MAX: Final = 64 * 1024
"""The largest answer body relayed here (all in with its head, one write); larger ones the general path streams."""
# What a flight waits for (``Flight.gone`` undoes it).
_STORE, _ACQUIRING, _CONNECTING, _VENDOR, _RELEASING = 1, 2, 3, 4, 5


class Flight:
    """One request on the straight path: each step is the callback of the one before.
    Its connection (http1.Http1Connection) holds it from the head to ``landed`` (the
    answer written) or ``carry`` (the rest is the general path's, in its serving task)."""

    __slots__ = (
        "asked",
        "charge",
        "conn",
        "cut",
        "dead",
        "deps",
        "estimates",
        "handler",
        "levels",
        "metered",
        "now",
        "request",
        "responder",
        "route",
        "sent",
        "slot",
        "started",
        "terms",
        "upstream",
        "waiting",
        "written",
    )

    def __init__(
        self,
        handler: GeneralPath,
        deps: Deps,
        conn: Http1Connection,
        request: Request,
        route: Route,
        charge: Charge,
        terms: Terms,
        cut: int,
    ) -> None:
        self.handler = handler
        self.deps = deps  # one policy generation for the whole request
        self.started = deps.clock.monotonic()
        self.conn = conn
        self.request = request
        self.responder: Responder | None = None
        self.written = 0  # the status of the answer written to the worker (0: none yet)
        self.route = route
        self.charge = charge
        self.terms = terms
        self.slot: Slot | None = None
        self.cut = cut
        self.dead = False
        self.waiting = 0  # what it waits for: _STORE, _ACQUIRING, _CONNECTING, _VENDOR (0: nothing)
        self.asked: asyncio.Future[Any] | Pending | None = None
        self.upstream: UpstreamConnection | None = None
        self.now = self.sent = 0.0
        self.levels: tuple[float, ...] = ()
        self.metered: Metered = ()
        """A metered request's estimates, and once settled what its answer said (metering.py)."""
        self.estimates: tuple[float, ...] = ()
        """A metered request's estimates, one per meter of its vendor (else none)."""

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
        charge = self.charge
        deps = self.deps
        limiter = deps.limiter
        vendor = route.vendor
        local = limiter.local
        if local is not None and local.current() != "shared":  # the store is out, or just back
            return False
        seats = route.seats
        if seats is not None and self.handler.seats.take(vendor, route.tenant, seats) > 0:
            return False  # no seat free: the general path defers it
        if vendor.partition is not None:
            limiter.partitions.note(vendor.name, charge.partition)
        if charge.caps:
            self.slot = deps.concurrency.slot(vendor, charge.endpoint)
        terms = self.terms
        line = charge.share_line
        if line is not None and terms.max_wait > 0 and self.handler.lines.waiting(line):
            return False  # a hold whose tenant's line holds some: the general path puts it behind them
        call = terms.call
        if call is not None:
            breaker = limiter.breaker
            if not breaker.allow():  # open: the general path refuses it as the breaker says
                return False
            self.waiting = _STORE
            asked = call.send(
                limiter.observations.seen_seq(charge.state_key),
                None if self.slot is None else self.slot.leases,
                self._stored,
                charge.b.costs(charge.cost, self.estimates) if self.estimates else None,
            )
            if asked is None:  # the store's connection is not open: the general path opens it
                self.waiting = 0
                breaker.release()
                return False
            if self.waiting == _STORE:  # (a store in this process has answered already)
                self.asked = asked
            return True
        slot = self.slot
        acquire = limiter.acquire(
            vendor,
            route.tenant,
            terms.max_wait,
            charge.cost,
            enqueue=terms.enqueue,
            endpoint=charge.endpoint,
            partition=charge.partition,
            leases=None if slot is None else slot.leases,
            buckets=charge.b,
            claim=None if terms.reserve is None else "",
            estimates=self.estimates,
        )
        self._wait(_ACQUIRING, spawn(acquire, name="straight-acquire"), self._acquired)
        return True

    def _wait(self, what: int, asked: asyncio.Future[Any], then: Callable[[asyncio.Future[Any]], None]) -> None:
        self.waiting = what
        self.asked = asked
        asked.add_done_callback(then)

    def _stored(self, result: AcquireResult | None, exc: BaseException | None) -> None:
        """The store's decided answer, or why none came (``StoreUnavailable``: the store's
        failure): from the callback that read it, as it comes."""
        limiter = self.deps.limiter
        if self.dead:  # (only a request with leases waits for the reply it no longer needs)
            if result is not None:
                limiter.took(self.route.vendor, self.charge.b, result)
                if result.granted and self.slot is not None:
                    self.deps.concurrency.took(self.slot)
                    self.slot.close()
            return
        self.waiting = 0
        self.asked = None
        try:
            if result is None:
                assert exc is not None
                limiter.not_taken(exc)
                if not isinstance(exc, StoreUnavailable):
                    raise exc
                local = limiter.local
                if local is not None and local.engage(exc):  # the general path asks this replica's share
                    self._carry(self._carried())
                else:
                    self._carry(self._carried(exc))
                return
            self._decided(limiter.took(self.route.vendor, self.charge.b, result))
        except Exception as error:
            self._crash(error)

    def _acquired(self, asked: asyncio.Future[Any]) -> None:
        """The answer of a store without a straight call (``Limiter.acquire``, a task)."""
        if self.dead:
            return
        self.waiting = 0
        self.asked = None
        try:
            exc = asked.exception()
            if isinstance(exc, StoreUnavailable):  # (the limiter has told the breaker)
                self._carry(self._carried(exc))
                return
            if exc is not None:
                raise exc
            self._decided(asked.result())
        except Exception as exc:
            self._crash(exc)

    def _decided(self, result: AcquireResult) -> None:
        """What the store said: go now, or (a hold, a refusal) the general path's to go on with."""
        slot = self.slot
        if not result.granted:
            if result.full >= 0:  # a cap full: the general path waits for a slot, or refuses
                self.slot = None
                self._carry(self._carried())
            else:
                self._carry(self._carried(result))
            return
        if slot is not None:
            self.deps.concurrency.took(slot)
        if result.wait > 0:  # a hold
            self._carry(self._carried(result))
            return
        # (A kept slot claimed late: granted when it matured, paced so: pacing.py.)
        self._go(self.deps.clock.monotonic() + result.wait, result.levels)

    def _carried(self, taken: AcquireResult | StoreUnavailable | None = None) -> Carried:
        """What the general path goes on with before the request was sent."""
        match = self.route.match_for(self.request.target, self.charge)
        return Carried(match, taken, slot=self.slot, metered=self.metered)

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
        charge = self.charge
        specs, room = vendor_room(charge.b, levels, 0.0, charge.cost, self.estimates)
        if conn is None or pacer.still_connecting:  # a connection to open, or others' to wait for
            pace = Paced(specs, now, route.window, room, charge.cost)
            opened = spawn(ready(pool, route.origin, connect, pacer, pace, conn), name="straight-connect")
            self._wait(_CONNECTING, opened, self._connected)
            return
        wait = pacer.reserve(specs, now, route.window, room, charge.cost)
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
        charge = self.charge
        specs, room = vendor_room(charge.b, self.levels, 0.0, charge.cost, self.estimates)
        pace = Paced(specs, self.now, route.window, room, charge.cost)
        match = route.match_for(self.request.target, charge)
        quota = None if charge.limits is None else tightest(charge.limits, self.levels)  # (ratelimit_headers)
        admission = Admission("forwarded", quota, pace)
        return Carried(match, None, admission, upstream, failure, self.upstream, self.sent, self.slot, self.metered)

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
            charge = self.charge
            if status != 429 and status >= 200 and status != 204 and status != 304:
                lines = answer_lines(response.block, route.answer_fields, True)
                if lines is not None and lines[1] <= WHOLE_MAX and (not route.learns or route.learnt(charge, response)):
                    # (Taken: from here on the answer is this path's. A HEAD's has none: its
                    # length is the one a GET would get.)
                    body = response.whole_exactly(0 if route.bodiless else lines[1])
            if lines is None or body is None:
                self._carry(self._sent(upstream=response))  # the general path's relay (and feedback)
                return
            kept, length, date = lines
            if self.metered:  # its cost, settled from the answer (SPEC §14)
                self._settle(response, body)
            request = self.request
            keep = keeps(request, self.conn)
            if not keep:
                request.keep_alive = False
            head = status_line(status, response.reason)
            end = head_end(request.version, keep)
            extra = b"" if charge.limits is None else quota_lines(charge.limits, self.levels)
            answer = b"".join(
                (head, kept, extra, b"" if date else date_line(), b"Content-Length: %d\r\n" % length, end, body)
            )
            slot = self.slot
            if slot is not None and slot.taken:
                # Its leases go back before the worker has its answer: its next call, on any
                # replica, finds the slot free (concurrency.Slot.give_back).
                self.waiting = _RELEASING
                slot.give_back_then(functools.partial(self._released, response, answer))
                return
            self._write(response, answer)
        except Exception as exc:
            self._crash(exc)

    def _settle(self, response: Response, body: bytes) -> None:
        """A metered request's estimates replaced by what its answer (``body``, whole) says."""
        deps, vendor, charge = self.deps, self.route.vendor, self.charge
        settlement = Settlement(vendor, response.first(b"content-type"), response.first(b"content-encoding"))
        settlement.watch(body)
        since = deps.clock.monotonic() - self.sent
        headers = response.headers if settlement.plan.reads_headers else None  # (made only when read)
        self.metered = settled(deps, vendor, charge.b, charge.partition, self.metered, settlement, headers, since)

    def _released(self, response: Response, answer: bytes) -> None:
        """The store has the request's leases back: the answer goes out."""
        if self.dead:
            response.release()  # (the answer was whole: the connection is fit for the next)
            return
        self.waiting = 0
        try:
            self._write(response, answer)
        except Exception as exc:
            self._crash(exc)

    def _write(self, response: Response, answer: bytes) -> None:
        conn = self.conn
        conn.write(answer)
        status = self.written = response.status
        if conn.write_paused or conn.closed:  # a slow worker: its drain, in the serving task
            conn.carry(self.request, self._responder(), functools.partial(self._drained, response))
            return
        response.release()
        self._landed(status)

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
        tally = route.tally
        now = deps.clock.monotonic()
        charge = self.charge
        if broken is not None:
            tally.recent("forwarded")
            tally.answered(status)
            tally.timed(now - self.sent)
            tally.came(route.mode)
            self._account("error", broken, status)
            return
        tally.relayed(route.counts, status, now - self.sent, charge.endpoint_name)
        shared = charge.shared
        if shared is not None:  # (share:) counted by class too
            tally.shared(shared[0], shared[1], route.tenant, "forwarded", charge.cost)
        if route.log:
            cut = self.cut
            path = route.log_path if cut < 0 else quoted_path(self.request.target[cut:])
            deps.access_log.add(charge.line.line(path, status, now - self.started, self.metered))

    # -- the rare ends, accounted as the general path accounts them -------------------------

    def _carry(self, carried: Carried) -> None:
        """The general path goes on with the request, in its connection's serving task."""
        responder = self._responder()
        work = functools.partial(self.handler, self.request, responder, self.deps, self.started, carried)
        self.conn.carry(self.request, responder, work)

    def _crash(self, exc: Exception) -> None:
        if self.upstream is not None and self.waiting == 0:
            self.upstream.close()  # whatever state it was left in, it is not reused
        responder = self._responder()
        if self.slot is not None:
            self.slot.close()
        record = functools.partial(self.route.record, charge=self.charge, request=self.request)
        work = functools.partial(crashed, self.deps, self.request, responder, self.started, exc, record)
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
        slot = self.slot
        if self.metered and waiting in (_CONNECTING, _VENDOR):  # as a failed exchange: its estimate back
            deps, charge = self.deps, self.charge
            since = deps.clock.monotonic() - self.sent
            self.metered = settled(deps, self.route.vendor, charge.b, charge.partition, self.metered, None, None, since)
        if waiting == _STORE:
            assert asked is not None
            if slot is None:
                asked.cancel()  # its reply, when it comes, is dropped
                self.deps.limiter.breaker.release()
            # (else its reply is awaited still: leases it grants are given back, _stored)
        elif waiting == _VENDOR:
            upstream = self.upstream
            assert upstream is not None
            upstream.unanswered(asyncio.CancelledError())
            release = _nothing if slot is None else slot.detach()
            if upstream.draining:
                match = self.route.match_for(self.request.target, self.charge)
                upstream.after(functools.partial(self.handler.heard_out, self.deps, match, release))
            else:
                release()
        elif waiting != _RELEASING:
            if asked is not None:  # _ACQUIRING, _CONNECTING: a task, which undoes its own
                asked.cancel()
            if slot is not None:
                slot.close()
        self.route.tally.came(self.route.mode)
        self._account("error", "the worker went away")

    def _account(self, outcome: str, detail: str, status: int | None = None) -> None:
        ledger = Ledger(self.deps, self.request.method, self.request.target, self.started)
        self.route.record(ledger.rec, self.charge, self.request)
        rec = ledger.rec
        rec.metered = self.metered
        rec.outcome, rec.detail = outcome, detail
        rec.status = rec.upstream_status = status
        ledger.close()


def _nothing() -> None:
    pass
