"""The straight path: the usual request, from its head to its answer, driven by the sockets.

Most requests are alike: no body or a small one that comes whole soon after its head (a
payment's form, a JSON document: parsing.BOARD_WAIT), tokens granted at once, an answer
of known length that is all in when its head is. The general request path (handler.py)
serves every request, and pays for it on every one: a parse into objects, the router, the
limiter's and the forwarder's layers, a task that wakes at each step. This path serves the
usual request directly. What a request's destination, method and tenant decide (its
route, routes.py: vendor, pool, metric series, access-log text; and what it is charged,
by endpoint class and partition: buckets, cost, leases, the store call) is worked out once
per policy, and per request a ``Flight`` does what is left, each step run by the callback
of the one before, no task and no coroutine:

    the worker's head parsed → its route and charge
    one store call (tokens and concurrency leases, decoded by the store)  → _stored
    granted now → an idle vendor connection → paced → the head (and body) written
    the vendor's answer → its lines copied in one pass → leases given back → one write
    metrics, the recent counts and the access-log line, from the route's cells and text

At the first thing that is not usual it hands the request to the general path
(handover.py), which goes on from there in the connection's serving task: before the store
call, nothing done; with the store's answer when it is not "go now" (a hold, a refusal, a
full cap) or why there was none; with the vendor's answer when it is not one this path
relays (a 429, no length, a watched field, a large body) or why there was none. Every
request is served, counted and logged as the general path would have: tests/test_lane.py
and tests/test_straight_path.py check that they write the same, and list what goes the
general way. A worker that goes away mid-flight is accounted as the general path's
cancelled request is (``Flight.gone``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from proxy.pipeline.flight import Flight
from proxy.pipeline.handover import GeneralPath
from proxy.pipeline.match import Interception
from proxy.pipeline.metering import estimated_now, noted
from proxy.pipeline.routes import KEY_MAX, Route, Routes, proof_of
from proxy.telemetry.loudly import Loudly
from proxy.wire.headers import request_kinds
from proxy.wire.request import Request

if TYPE_CHECKING:
    from proxy.deps import Deps
    from proxy.wire.http1 import Http1Connection

log = logging.getLogger("quota_proxy")


class Lane:
    """The straight path of one handler, its routes per policy generation (http1.Lane)."""

    def __init__(self, handler: GeneralPath) -> None:
        self.handler = handler
        self._loudly = Loudly(log, handler.deps.clock)
        self.reset(handler.deps)

    def reset(self, deps: Deps) -> None:
        """Serve ``deps`` (a policy generation) from the next request on."""
        self.deps = deps
        self.routes = Routes(deps)
        self.tenant_header = deps.policy.tenant.header
        self.kinds = request_kinds(self.tenant_header)
        """The classifier the worker-facing parser notes fields with (headers.request_kinds)."""
        self.authenticates = deps.router.tenancy.authenticates
        """Tenants come from proxy credentials: a plain request's route is its credentials' too."""

    def flight(self, conn: Http1Connection, request: Request) -> Flight | None:
        """The straight path for a ``lean`` request, when its route is straight (else None:
        the general path serves it); ``Flight.take`` then starts it."""
        try:
            return self._flight(conn, request)
        except Exception as exc:  # a bug (called from the parser's callback): the general path serves it
            self._loudly.warn("route", 60.0, "the straight path could not route %s: %r", request.target[:200], exc)
            return None

    def _flight(self, conn: Http1Connection, request: Request) -> Flight | None:
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
            proof = proof_of(request) if self.authenticates else None
            if target[:1] == "/":  # origin form: a vendor route, or Host
                if len(target) <= KEY_MAX:
                    key: object = (target, request.host, method, request.tenant, proof)
                    route = self.routes.get(key)
            else:
                cut = target.find("/", 8)  # past "http://x" or "https://": where the path starts
                if 0 < cut <= KEY_MAX and "#" not in target:
                    key = (target[:cut], method, request.tenant, proof)
                    route = self.routes.get(key)
        elif type(tag) is Interception and target[:1] == "/":
            cut = 0
            key = (tag.host, tag.port, tag.claim.tenant, tag.claim.proof, method, request.tenant)
            route = self.routes.get(key)
        if route is False:
            route = self.routes.learn(key, request, method, cut)
        if not isinstance(route, Route):
            return None
        charge = route.charge
        if charge is None:
            charge = route.charge_of(request)
            if charge is None:  # a class the share does not have: the general path refuses it
                return None
        terms = charge.terms if request.on_limit is None and request.max_hold is None else charge.terms_for(request)
        if terms is None:  # a wish that cannot be read: the general path answers it
            return None
        if terms.reserve is not None and self.handler.kept.waiting(terms.reserve.key):
            return None  # this bucket set's deferred calls have slots here: the general path claims them
        flight = Flight(self.handler, self.deps, conn, request, route, charge, terms, cut)
        if route.metered:
            path = route.path_of(request).split("?", 1)[0]
            estimates = estimated_now(route.vendor, request, path, charge.b)
            if estimates is None:  # (not in hand, or refused: the general path's)
                return None
            flight.estimates = estimates
            flight.metered = noted(route.vendor, estimates)
        return flight
