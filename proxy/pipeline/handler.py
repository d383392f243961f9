"""The request path: accept → match vendor and tenant → take tokens → forward → feed back → respond.

Every refusal is a typed exception that knows its status and outcome
(wire/refusals.py), answered in one place (responses.py); every request ends in
exactly one outcome, one metric increment and one access-log line (ledger.py).
No error path forwards: a request reaches the vendor only after the store
granted it, or when the store is down and the policy explicitly fails open.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterator

from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.deps import Deps
from proxy.limiter import AcquireResult, BlockMark, BucketSpec, StoreUnavailable
from proxy.limiter.buckets import Buckets
from proxy.limiter.partitions import shown
from proxy.pipeline import metering
from proxy.pipeline.decide import Admission, Defer, Hold, Shed, decide, refusal, request_wish
from proxy.pipeline.feedback import NOTHING, Applied, apply_feedback, changes_nothing
from proxy.pipeline.forward import Carrier, body_broke, relay, send, send_failed, unrelayable
from proxy.pipeline.handover import Carried
from proxy.pipeline.kept_slots import Caller, KeptSlots
from proxy.pipeline.lane import Lane
from proxy.pipeline.ledger import INTERNAL_ERROR, Ledger, accounted
from proxy.pipeline.match import Match, interception_of
from proxy.pipeline.metering import Settlement
from proxy.pipeline.pacing import Paced, longest_window, vendor_room
from proxy.pipeline.ratelimit_fields import blocked_item, fields_for_forwarded, request_limits, tightest
from proxy.pipeline.responses import write_answer
from proxy.pipeline.share_lines import ShareLines, line_of
from proxy.pipeline.target import parse_target, parse_tunneled_target
from proxy.policy.durations import format_duration
from proxy.policy.model import Endpoint, Vendor, Wish
from proxy.quota.concurrency import UNCAPPED, Slot
from proxy.quota.seats import Seats
from proxy.tasks import spawn
from proxy.telemetry.accesslog import AccessRecord
from proxy.telemetry.loudly import Loudly
from proxy.wire.headers import idempotent
from proxy.wire.refusals import Denied, InternalError, Limited, StoreDown
from proxy.wire.request import Request
from proxy.wire.responder import Responder
from proxy.wire.vendor_answer import Response

log = logging.getLogger("quota_proxy")

CONNECT_REFUSED = "CONNECT must be the first request on a new connection to the proxy"


def _as_is(answer: web.Response) -> web.Response | None:
    return answer


def _give_back(
    deps: Deps,
    vendor: Vendor,
    tenant: str,
    mark: BlockMark,
    cost: float,
    endpoint: Endpoint | None,
    partition: str,
    estimates: tuple[float, ...] = (),
) -> None:
    """Refund a held request that will not go out (``Limiter.refund``: every bucket it took
    from, never above its burst), in the background: the worker is gone, a failed one is lost.

    Not after a vendor block began (``mark``): the block restarted the vendor's buckets
    from empty at its end, absorbing the reservation, so a refund would land there as a
    burst at the block's edge (SPEC §6). The tenant's token is lost with it: the limiter
    refunds every bucket of a request or none."""
    if deps.limiter.mark(vendor.name, partition) == mark:
        refund = deps.limiter.refund(vendor, tenant, cost, endpoint=endpoint, partition=partition, estimates=estimates)
        spawn(refund, name=f"refund-{vendor.name}")


@contextlib.contextmanager
def _holding(deps: Deps, vendor: str) -> Iterator[None]:
    """A request of ``vendor`` held meanwhile (its reservation maturing, or its turn under a
    share): counted in /status's ``held_now`` and ``ratelimit_held_now``."""
    deps.held[vendor] = deps.held.get(vendor, 0) + 1
    gauge = deps.metrics.held_now.labels(vendor)
    gauge.inc()
    try:
        yield
    finally:
        deps.held[vendor] -= 1
        gauge.dec()


def _global_reason(deps: Deps, vendor: str, bucket: BucketSpec, partition: str) -> str:
    """Why a global bucket refused (refusals.REASONS): the vendor is blocked after its 429,
    or the bucket is still refilling after a drain, or it is simply empty."""
    if deps.limiter.blocked_for(vendor, partition) > 0:
        return "vendor_block"
    if bucket.rate > 0 and deps.tally(vendor).drained_within(partition, bucket.burst / bucket.rate):
        return "drain"
    return "global"


def _count_answer(deps: Deps, vendor: Vendor, status: int) -> None:
    """A vendor answer in the metrics and the live page's recent counts."""
    deps.tally(vendor.name).answered(status)


class ProxyHandler:
    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self._loudly = Loudly(log, deps.clock)
        self.seats = Seats(deps.clock)
        """The tenant seats of vendors (``tenant.max_active``): the straight path takes them too."""
        self.kept = KeptSlots(deps.clock)
        """The slots kept for deferred calls, by call (kept_slots.py)."""
        self.lines = ShareLines()
        """Held requests waiting for their turn under ``share:`` (share_lines.py)."""
        self.lane = Lane(self)
        """The usual request's straight way through (lane.py), handing the rest to this handler."""

    def swap(self, deps: Deps) -> None:
        """Serve ``deps`` (a reloaded policy) from the next request on."""
        self.deps = deps
        self.lane.reset(deps)

    def left(self, slots: dict[str, str]) -> None:
        """A worker's connection closed holding ``slots`` (``Request.kept_slots``): their
        owners likely never come back, so the store offers each to a later refusal (kept_slots.py)."""
        for kept, claim in slots.items():
            spawn(self.deps.limiter.left(kept, (claim,)), name="left")

    async def __call__(
        self,
        request: Request,
        responder: Responder,
        deps: Deps | None = None,
        started: float | None = None,
        carried: Carried | None = None,
    ) -> None:
        """Serve ``request``; or (from the straight path) go on with one it began at
        ``started`` under ``deps``, as far as ``carried`` says."""
        if deps is None:
            deps = self.deps  # one policy generation for the whole request
        ledger = Ledger(deps, request.method, request.target, started)

        def crashed(exc: Exception) -> web.Response | None:
            log.exception("internal error on %s %s", request.method, request.target[:200])
            if responder.begun:
                raise exc  # the answer had begun: the connection is cut, never a spliced body
            return ledger.refuse(InternalError(INTERNAL_ERROR, idempotent(request.method, request.headers)))

        work = self._handle(deps, request, responder, ledger.rec, carried)
        answer = await accounted(ledger, work, _as_is, crashed)
        if answer is not None:
            await write_answer(responder, answer)

    async def _handle(
        self, deps: Deps, request: Request, responder: Responder, rec: AccessRecord, carried: Carried | None
    ) -> None:
        broken = request.body_broken
        if broken is not None:
            # Its body's framing broke before it was served (in the packet of its head): the
            # vendor could never get it whole, so it takes no tokens and is never sent.
            raise body_broke(request, broken)
        if request.method == "CONNECT":  # the front door answers a connection's first CONNECT
            rec.host = request.target
            raise Denied(CONNECT_REFUSED, request.target)
        tunnel = interception_of(request)
        if tunnel is None:
            target = parse_target(request)
            match = (
                deps.router.match(target, request.headers, method=request.method) if carried is None else carried.match
            )
        else:
            target = parse_tunneled_target(request, tunnel.host, tunnel.port)
            if carried is None:
                match = deps.router.match(target, request.headers, tunnel.claim, request.method)
            else:
                match = carried.match
        rec.host, rec.path = target.host, target.path_qs
        rec.vendor, rec.tenant = match.vendor.name, match.tenant
        if match.endpoint is not None:
            rec.endpoint = match.endpoint.name
        if match.partition:
            rec.partition = shown(match.partition)
        deps.tally(match.vendor.name).came("plain" if tunnel is None else "intercept")
        # The request's leases (concurrency caps) are given back however it ends, once
        # the vendor's answer is relayed (concurrency.py); the straight path's, taken there.
        if carried is not None and carried.slot is not None:
            slot = carried.slot
        else:
            slot = deps.concurrency.slot(match.vendor, match.endpoint)
        if carried is not None:
            rec.metered = carried.metered  # (a metered request's estimates, made on the straight path)
        if carried is not None and carried.admission is not None:  # granted and sent already
            try:
                await self._go(deps, request, responder, match, rec, carried.admission, slot, carried)
            finally:
                slot.close()
            return
        wish = request_wish(match.vendor.on_limit, request.headers)
        estimated = await metering.begin(deps, match, request, rec) if match.vendor.meters else ()
        try:
            admission = await self.admit(
                deps,
                match.vendor,
                match.tenant,
                wish,
                rec,
                slot,
                endpoint=match.endpoint,
                partition=match.partition,
                taken=None if carried is None else carried.taken,
                caller=Caller(request.kept_slots, request.method, request.target, request.headers, request.follows),
                klass=match.klass,
                estimates=estimated,
            )
            await self._go(deps, request, responder, match, rec, admission, slot)
        finally:
            slot.close()  # (not ``with``: two calls fewer per request)

    async def _go(
        self,
        deps: Deps,
        request: Request,
        responder: Responder,
        match: Match,
        rec: AccessRecord,
        admission: Admission,
        slot: Slot,
        carried: Carried | None = None,
    ) -> None:
        """Send an admitted request (or go on with the exchange ``carried`` began) and relay the answer."""
        carrier = Carrier()
        if carried is not None:
            carrier.conn = carried.conn
        try:
            await self._forward(deps, request, responder, match, rec, admission, carrier, carried, slot)
        finally:
            # A worker gone while the vendor still works on its request (the vendor counts
            # it in flight until it has answered): the slot is freed when the answer is
            # in, and the answer fed back like any other.
            if carrier.conn is not None and carrier.conn.draining:
                carrier.conn.after(functools.partial(self.heard_out, deps, match, slot.detach()))
        rec.status = responder.status

    async def admit(
        self,
        deps: Deps,
        vendor: Vendor,
        tenant: str,
        wish: Wish,
        rec: AccessRecord,
        slot: Slot,
        *,
        endpoint: Endpoint | None = None,
        partition: str = "",
        taken: AcquireResult | StoreUnavailable | None = None,
        caller: Caller | None = None,
        klass: int | None = None,
        estimates: tuple[float, ...] = (),
    ) -> Admission:
        """Take the request's tokens (its endpoint class's ``cost`` from every bucket it
        touches: the tenant's, the class's, the partition's global ones) and ``slot``'s
        leases, holding if the decision says so; returns the outcome to record once it is
        sent (forwarded or held), or raises the refusal. ``taken``: the store's answer
        already had (or why there was none), from the straight path. ``caller``: who asks,
        so that a deferred call keeps its slot and its retry claims it (kept_slots.py).
        ``klass``: under ``share:``, the class ``X-Quota-Priority`` named (None: the tenant's).
        ``estimates``: a metered request's, one per meter of the vendor (metering.py)."""
        limiter = deps.limiter
        seats = deps.policy.tenant.max_active
        if seats is not None and tenant not in deps.router.tenancy.named:  # the policy's tenants need none
            self._seat(deps, vendor, tenant, seats)
        cost = 1.0 if endpoint is None else endpoint.cost
        enqueue = wish.action != "shed"
        b = limiter.buckets(vendor, tenant, endpoint, partition, klass)
        if b.share is not None and vendor.share is not None:
            rec.shared = (vendor.share, b.share.klass, cost)
        # A caller that defers comes back: its refusal keeps its slot (store.Reserve), which
        # its retry claims (kept_slots.py), or holds for when it asks to hold.
        call = caller.call(b.kept) if caller is not None and b.kept is not None else None
        mine = "" if call is None or caller is None else self.kept.claim(call[0], caller.connection, call)
        keeps = wish.action == "defer" and call is not None
        claim = mine if keeps or (mine and wish.action == "hold") else None

        def attempt(max_wait: float, turn: bool = False) -> Awaitable[AcquireResult]:
            # (``turn``: a held request's turn under a share, which is not told to retry: no
            # deferral slot, no claim)
            return limiter.acquire(
                vendor,
                tenant,
                max_wait,
                cost,
                enqueue=enqueue and not turn,
                endpoint=endpoint,
                partition=partition,
                leases=slot.leases,
                buckets=b,
                claim=None if turn else claim,
                keeps=keeps,
                owner=0.0 if caller is None else caller.owner,
                estimates=estimates,
            )

        line = line_of(b, tenant) if wish.action == "hold" else None
        joins = None if line is None or taken is not None else self.lines.waiting(line)
        try:
            if isinstance(taken, StoreUnavailable):
                raise taken
            if taken is not None:
                result = taken
            elif joins is not None:  # its tenant's line holds requests: behind them, without asking
                result = joins
            elif slot.leases is None:  # no cap: the tokens alone (what concurrency.acquire would do)
                result = await attempt(wish.max_wait)
            else:
                result = await deps.concurrency.acquire(slot, wish, attempt)
        except StoreUnavailable as exc:
            if deps.policy.store.on_failure != "open":
                wait = limiter.breaker.retry_after()
                raise StoreDown(wait, f"store unavailable: {exc}", blocked_item(vendor, wait)) from None
            self._warn_fail_open(deps, vendor.name, exc)
            rec.metered = ()  # nothing taken, nothing to settle
            deps.metrics.fail_open.labels(vendor.name).inc()
            rec.detail = f"store unavailable, forwarded unlimited (on_failure: open): {exc}"
            return Admission("forwarded")
        if call is not None and caller is not None and (claim is not None or taken is not None):
            reserve = limiter.reserve(vendor, b) if result.reserved else None
            self.kept.kept(call[0], caller.connection, call, claim or "", result, reserve)
        lined = 0.0
        if line is not None and not result.granted and result.full < 0:
            take = functools.partial(attempt, turn=True)
            result, lined = await self._turn(deps, vendor.name, wish, slot, line, result, take)
        return await self._admitted(
            deps, vendor, tenant, wish, rec, slot, b, result, cost, endpoint, partition, lined, estimates
        )

    async def _turn(
        self,
        deps: Deps,
        name: str,
        wish: Wish,
        slot: Slot,
        line: Hashable,
        result: AcquireResult,
        take: Callable[[float], Awaitable[AcquireResult]],
    ) -> tuple[AcquireResult, float]:
        """A hold under ``share:`` refused with its turn (SPEC §13): wait in its ``line``
        (share_lines.py) and ask again (``take``) on the turn, until granted or ``max_hold``
        is spent; returns the last answer and the seconds waited. Nothing is taken while it
        waits."""
        if result.wait > wish.max_hold:  # (not its deferral slot: the line spaces the tenant's holds)
            return result, 0.0

        def ask(max_wait: float) -> Awaitable[AcquireResult]:  # (a cap: its lease too, as a hold waits for one)
            if slot.leases is None:
                return take(max_wait)
            return deps.concurrency.acquire(slot, Wish("hold", max_wait), take)

        with _holding(deps, name):
            return await self.lines.turn(line, deps.clock, wish.max_hold, result, ask)

    async def _admitted(
        self,
        deps: Deps,
        vendor: Vendor,
        tenant: str,
        wish: Wish,
        rec: AccessRecord,
        slot: Slot,
        b: Buckets,
        result: AcquireResult,
        cost: float,
        endpoint: Endpoint | None,
        partition: str,
        lined: float = 0.0,
        estimates: tuple[float, ...] = (),
    ) -> Admission:
        """What the store's ``result`` makes of the request: refused (raised), held, or let go.
        ``lined``: seconds it waited for its turn already (``_turn``)."""
        decision = decide(result, wish)
        if isinstance(decision, Defer | Shed):
            metering.refused(deps, vendor, b, result.binding)
            bucket = b.all[result.binding]
            reason = _global_reason(deps, vendor.name, bucket, partition) if bucket.scope == "global" else ""
            raise refusal(decision, result, b, request_limits(vendor, tenant, endpoint), reason)
        quota = tightest(request_limits(vendor, tenant, endpoint), result.levels) if vendor.ratelimit_headers else None
        wait = result.wait
        specs, room = vendor_room(b, result.levels, wait, cost, estimates)
        pace = Paced(specs, deps.clock.monotonic() + wait, longest_window(vendor), room, cost)
        if slot.waited:
            rec.detail = f"waited {slot.waited * 1000:.0f}ms for a concurrency slot"
        waited = slot.waited + lined
        if isinstance(decision, Hold):
            await self._hold(deps, vendor, tenant, decision.wait, rec, cost, endpoint, partition, waited)
            return Admission("held", quota, pace)
        if waited:
            rec.hold = waited
            deps.metrics.hold_seconds.labels(vendor.name).observe(waited)
            return Admission("held", quota, pace)
        return Admission("forwarded", quota, pace)

    def _seat(self, deps: Deps, vendor: Vendor, tenant: str, cap: int) -> None:
        """A tenant the policy does not name needs one of the vendor's ``tenant.max_active``
        (``cap``) seats before it may create store keys (seats.py); none free: deferred."""
        wait = self.seats.take(vendor, tenant, cap)
        if wait > 0:
            self._loudly.warn(
                f"max_active {vendor.name}",
                60.0,
                "vendor %s is tracking tenant.max_active %d tenants: new tenants are deferred (tenant ids sprayed? "
                "tenant.known_only: true accepts only the policy's tenants)",
                vendor.name,
                cap,
            )
            raise Limited("defer", wait, "tenants", f"tenant.max_active {cap} reached")

    async def _hold(
        self,
        deps: Deps,
        vendor: Vendor,
        tenant: str,
        wait: float,
        rec: AccessRecord,
        cost: float = 1.0,
        endpoint: Endpoint | None = None,
        partition: str = "",
        waited: float = 0.0,
    ) -> None:
        """Sleep until the reservation matures. The store spaced reservations one
        refill interval apart, so held requests leave in order and evenly paced (and,
        woken late, are spaced again when written: pacing.py).
        ``waited``: seconds already held for a concurrency slot.

        A hold whose worker goes away gives its tokens back, once: nothing used them
        (unless a vendor block absorbed them meanwhile, see ``_give_back``)."""
        name = vendor.name
        mark = deps.limiter.mark(name, partition)
        try:
            with _holding(deps, name):
                await deps.clock.sleep(wait)
        except asyncio.CancelledError:
            _give_back(deps, vendor, tenant, mark, cost, endpoint, partition, tuple(e for _, e, _ in rec.metered))
            raise
        finally:
            rec.hold = waited + wait
        deps.metrics.hold_seconds.labels(name).observe(waited + wait)
        # A vendor 429 that arrived while we slept blocks us too: the reservation
        # predates it, the vendor's Retry-After does not.
        blocked = deps.limiter.blocked_since(name, mark, partition)
        if blocked > 0:  # nothing to give back: the block absorbed the reservation
            why = "vendor block: the vendor answered 429"
            raise Limited("defer", blocked, "global", why, quota=blocked_item(vendor, blocked), reason="vendor_block")

    async def _forward(
        self,
        deps: Deps,
        request: Request,
        responder: Responder,
        match: Match,
        rec: AccessRecord,
        admission: Admission,
        carrier: Carrier | None = None,
        carried: Carried | None = None,
        slot: Slot = UNCAPPED,
    ) -> None:
        vendor = match.vendor
        metered = bool(rec.metered)
        sent = deps.clock.monotonic() if carried is None else carried.sent
        try:
            if carried is None:
                upstream = await send(
                    deps.upstreams.pool(vendor),
                    vendor,
                    request,
                    match.origin,
                    match.path_qs,
                    deps.policy.tenant.header,
                    deps.pacer,
                    admission.pace,
                    carrier,
                )
            elif carried.failure is not None:  # the straight path sent it, and the exchange failed
                raise send_failed(vendor, request, carried.failure) from carried.failure
            else:  # the straight path sent it
                assert carried.upstream is not None
                upstream = carried.upstream
        except BaseException:
            if metered:  # a failed exchange gives its estimate back
                metering.settle(deps, match, rec, None, None, deps.clock.monotonic() - sent)
            raise
        rec.upstream_status = upstream.status
        deps.tally(vendor.name).recent(admission.outcome)
        _count_answer(deps, vendor, upstream.status)
        try:
            if changes_nothing(vendor, upstream):
                applied = NOTHING
            else:
                applied = await self._feed_back(deps, match, upstream.status, upstream.headers)
        except BaseException:
            upstream.close()
            raise
        refused = unrelayable(vendor, request, upstream)
        if refused is not None:
            upstream.close()
            raise refused
        extra = {"Retry-After": applied.added_retry_after} if applied.added_retry_after else {}
        if admission.quota is not None:
            extra.update(fields_for_forwarded(upstream.headers, admission.quota))
        settlement = Settlement.of(vendor, upstream.headers) if metered and upstream.status != 429 else None
        try:
            broken = await relay(
                upstream,
                responder,
                extra,
                slot.give_back if slot.taken else None,
                None if settlement is None else settlement.watch,
            )
        finally:
            if metered:  # (a vendor 429 gives the estimate back; a worker gone settles with what was said)
                metering.settle(deps, match, rec, settlement, upstream.headers, deps.clock.monotonic() - sent)
        elapsed = deps.clock.monotonic() - sent
        deps.tally(vendor.name).timed(elapsed)
        rec.outcome = admission.outcome
        if broken:
            rec.outcome, rec.detail = "error", broken

    async def _feed_back(self, deps: Deps, match: Match, status: int, headers: CIMultiDictProxy[str]) -> Applied:
        """Feed a vendor answer back (``apply_feedback``: a 429 blocks the fleet, low quota
        drains it, quota headers teach it), counted and logged."""
        vendor = match.vendor
        applied = await apply_feedback(
            deps.limiter,
            vendor,
            status,
            headers,
            metrics=deps.metrics,
            partition=match.partition,
            endpoint=match.endpoint,
        )
        if applied.blocked_for > 0:
            deps.metrics.vendor_blocks.labels(vendor.name).inc()
            deps.tally(vendor.name).blocked(applied.blocked_for)
            log.warning(
                "vendor %s answered 429: its global buckets%s are blocked for %.3fs fleet-wide",
                vendor.name,
                f" of partition {shown(match.partition)}" if match.partition else "",
                applied.blocked_for,
            )
            if applied.capped_from is not None:
                self._loudly.warn(
                    f"max_retry_after {vendor.name}",
                    60.0,
                    "vendor %s asked to be left alone for %s (Retry-After: %s): the block is capped at "
                    "feedback.max_retry_after %s",
                    vendor.name,
                    format_duration(applied.capped_from),
                    headers.get("Retry-After", "none"),
                    format_duration(vendor.feedback.max_retry_after),
                )
        elif applied.drained:
            deps.metrics.drains.labels(vendor.name).inc()
            deps.tally(vendor.name).drained(match.partition)
        return applied

    def heard_out(self, deps: Deps, match: Match, release: Callable[[], None], response: Response | None) -> None:
        """The vendor is done with a request whose worker went away before the answer's head
        (forward's hearing out): its slot is free again, and its answer, if one came, counts
        and feeds back like any other (a vendor 429 blocks the fleet)."""
        release()
        if response is None:
            return
        vendor = match.vendor
        _count_answer(deps, vendor, response.status)
        if not changes_nothing(vendor, response):
            spawn(self._feed_back_heard(deps, match, response), name=f"feedback-{vendor.name}")

    async def _feed_back_heard(self, deps: Deps, match: Match, response: Response) -> None:
        try:
            await self._feed_back(deps, match, response.status, response.headers)
        except Exception as exc:  # nobody waits for it: a store that cannot take it is only logged
            self._loudly.warn(
                f"heard-out feedback {match.vendor.name}",
                60.0,
                "vendor %s: feeding back the answer of a request whose worker went away failed: %s",
                match.vendor.name,
                exc,
            )

    def _warn_fail_open(self, deps: Deps, vendor: str, exc: StoreUnavailable) -> None:
        # Loud, but one line a second, not one per request.
        self._loudly.warn(
            "fail-open", 1.0, "store unavailable (%s): forwarding %s UNLIMITED because on_failure is open", exc, vendor
        )
