"""What the straight path (lane.py) knows of a request before it reads more than its head.

A *route* is what a request's destination, method and tenant decide once a policy is
loaded: its vendor, what it is charged (``Charge``: its buckets, cost, leases and the
store command that takes them, by endpoint class and partition), the pool
its vendor connection comes from, the first line and ``Host`` of what the vendor is
sent, its metric series and the constant parts of its access-log line. Workers send the
same few of them over and over, so each is worked out once per policy generation (by
the general path's own router, tenancy, limiter and metrics) and kept in a ``Routes``
table; per request only the path is cut from the target (and, for a vendor with
endpoint classes or a partition, its charge looked up by class and partition).

The key is what decides the route without parsing: for an absolute-form target
(``GET http://api.x/v1/...``) its ``scheme://authority`` part, the method and the tenant
header's value; inside an intercepted tunnel, where the tunnel leads; for an origin-form
target (a vendor ``route`` or a ``Host``), the whole target and ``Host``.

Every policy feature is served here for the usual request (tests/test_straight_path.py
lists them). (A tenant the policy does not name takes its seat here as it would there:
``seats``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING, Final, NamedTuple

from multidict import CIMultiDict

from proxy.limiter.partitions import DEFAULT, partition_hash, shown
from proxy.limiter.store import Reserve
from proxy.pipeline.accounting import Tally
from proxy.pipeline.decide import request_wish
from proxy.pipeline.feedback import learnt, remaining_watched
from proxy.pipeline.forward import origin_of
from proxy.pipeline.kept_slots import FOLLOW_UP
from proxy.pipeline.match import Match, interception_of
from proxy.pipeline.pacing import longest_window
from proxy.pipeline.ratelimit_fields import request_limits
from proxy.pipeline.share_lines import line_of
from proxy.pipeline.target import parse_target, parse_tunneled_target
from proxy.policy.model import Wish
from proxy.quota.endpoints import endpoint_for
from proxy.telemetry.accesslog import ForwardedLine, quoted_path
from proxy.wire.headers import MAX_HOLD, ON_LIMIT, answer_fields
from proxy.wire.ratelimit_item import RATELIMIT
from proxy.wire.refusals import BadRequest, Refusal

if TYPE_CHECKING:
    from proxy.deps import Deps
    from proxy.limiter.buckets import Buckets
    from proxy.limiter.store import BucketSpec, StraightCall
    from proxy.policy.model import Endpoint, Share, Vendor
    from proxy.telemetry.accesslog import AccessRecord
    from proxy.wire.pool import Pool
    from proxy.wire.request import Request
    from proxy.wire.upstream import Origin
    from proxy.wire.vendor_answer import Response

ROUTES_MAX: Final = 4096
"""Routes kept per table; past that it starts over (tenants and targets are the workers')."""
_WISHES_MAX: Final = 64
"""Terms kept per charge for wishes other than the vendor's; past that it starts over."""
CHARGES_MAX: Final = 1024
"""Charges (one per endpoint class and partition) kept per route; past that it starts over."""
KEY_MAX: Final = 512
"""Longest target (origin form: the whole of it) a route is kept for."""
_EMPTY_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})  # sent with Content-Length: 0 (upstream.py)


class Terms(NamedTuple):
    """How a request's tokens are asked for, by what its worker wishes when the bucket is
    empty (policy.model.Wish: the vendor's ``on_limit``, or ``X-Quota-On-Limit`` and
    ``X-Quota-Max-Hold``)."""

    max_wait: float
    """Seconds the store may make it wait (a hold's ``max_hold``; else 0)."""
    enqueue: bool
    """Refused, it takes a place in the deferral queue (not a shed)."""
    reserve: Reserve | None
    """How a refusal keeps its slot (a defer); the straight path takes only requests of
    connections that hold none (handler.admit claims them)."""
    call: StraightCall | None
    """The store call that takes its tokens and leases (None: the store has none, or the
    vendor has no state to guard: ``Limiter.acquire``, in a task)."""


class Charge:
    """What a request of a route is charged, by its endpoint class and partition (SPEC §10):
    its buckets and cost, the store call that takes them, the leases of its concurrency
    caps, how a deferral keeps its slot, and the metric series and access-log text that
    depend on them. One per route for a vendor without classes or partitions."""

    __slots__ = (
        "_deps",
        "_wished",
        "b",
        "caps",
        "cost",
        "endpoint",
        "endpoint_name",
        "limits",
        "line",
        "match",
        "partition",
        "share_line",
        "shared",
        "state_key",
        "tenant_count",
        "terms",
        "vendor_side",
    )

    def __init__(self, deps: Deps, match: Match, method: str, host: str) -> None:
        vendor = match.vendor
        endpoint = match.endpoint
        self._deps = deps
        self.match = match
        self.endpoint = endpoint
        self.partition = match.partition
        self.b: Buckets = deps.limiter.buckets(vendor, match.tenant, endpoint, match.partition, match.klass)
        share = self.b.share
        self.shared: tuple[Share, int] | None = (
            None if share is None or vendor.share is None else (vendor.share, share.klass)
        )
        """Under ``share:``: the vendor's share and its requests' class (counted by class)."""
        self.share_line = line_of(self.b, match.tenant)
        """Under ``share:``: the line its held requests wait in on this replica (share_lines.py)."""
        self.tenant_count = self.b.tenant_count
        self.vendor_side: tuple[BucketSpec, ...] = self.b.vendor_side
        self.cost = 1.0 if endpoint is None else endpoint.cost
        self.state_key = self.b.state_key
        self.caps = deps.concurrency.sets(vendor, endpoint)
        """The lease sets its requests take a lease in (concurrency caps: ``Concurrency.slot``)."""
        on_limit = vendor.on_limit
        self.terms = self._terms(Wish(on_limit.action, on_limit.max_hold))
        """Its requests' terms by the vendor's ``on_limit``."""
        self._wished: dict[Wish, Terms] = {}
        self.endpoint_name = None if endpoint is None else endpoint.name
        self.limits = request_limits(vendor, match.tenant, endpoint) if vendor.ratelimit_headers else None
        """Its buckets' limits, for the RateLimit fields of its answers (``ratelimit_headers``)."""
        self.line = ForwardedLine.of(method, host, vendor.name, match.tenant, self.endpoint_name, shown(self.partition))
        """Its requests' access-log line but for the path."""

    def terms_for(self, request: Request) -> Terms | None:
        """The terms of a request whose worker wishes otherwise (``X-Quota-On-Limit``,
        ``X-Quota-Max-Hold``); None for a wish that cannot be read (a 400)."""
        fields = CIMultiDict[str]()
        if request.on_limit is not None:
            fields[ON_LIMIT] = request.on_limit.decode("latin-1")
        if request.max_hold is not None:
            fields[MAX_HOLD] = request.max_hold.decode("latin-1")
        try:
            wish = request_wish(self.match.vendor.on_limit, fields)
        except Refusal:
            return None
        terms = self._wished.get(wish)
        if terms is None:
            if len(self._wished) >= _WISHES_MAX:  # max_hold is the workers' to choose
                self._wished.clear()
            terms = self._wished[wish] = self._terms(wish)
        return terms

    def _terms(self, wish: Wish) -> Terms:
        deps = self._deps
        vendor = self.match.vendor
        limiter = deps.limiter
        enqueue = wish.action != "shed"
        # A slot's owner keeps its head start (kept_slots.FOLLOW_UP) over a request taken
        # here, which has no slot of its own: a retry of a call deferred on this replica
        # takes the general path, which claims its slot.
        keeps = wish.action == "defer" and limiter.keeps_slots(self.b)
        reserve = limiter.reserve(vendor, self.b, owner=FOLLOW_UP) if keeps else None
        queue = self.b.queue if enqueue else None
        call = (
            limiter.straight(vendor, self.b, self.cost, wish.max_wait, queue, self.caps, reserve)
            if self.state_key
            else None
        )
        return Terms(wish.max_wait, enqueue, reserve, call)


class Route:
    """One route of one policy generation: what its requests have in common."""

    __slots__ = (
        "_charges",
        "_classes",
        "_deps",
        "_method",
        "_share",
        "answer_fields",
        "bodiless",
        "charge",
        "counts",
        "cut",
        "head_end",
        "head_start",
        "head_tail",
        "host",
        "learns",
        "log",
        "log_path",
        "match",
        "metered",
        "mode",
        "origin",
        "partition_header",
        "path",
        "pool",
        "seats",
        "tally",
        "target_path",
        "tenant",
        "timeouts",
        "vendor",
        "window",
    )

    def __init__(
        self, deps: Deps, match: Match, method: str, mode: str, cut: int, target_host: str, target_path: str
    ) -> None:
        vendor = match.vendor
        self._deps = deps
        self._method = method
        self.match = match
        self.vendor: Vendor = vendor
        self.tenant = match.tenant
        self.mode = mode
        """How its requests come: ``plain`` or ``intercept``."""
        self.cut = cut
        """Where the path starts in the request's target (-1: the target is not the path, ``path`` is)."""
        self.path = match.path_qs.encode("latin-1")
        self.host = target_host
        """The host the target names (the access log's ``host``)."""
        self.target_path = target_path
        """The target's path and query (the access log's ``path``), when ``cut`` is -1."""
        self.metered = bool(vendor.meters)
        """Its requests are estimated from their bodies, and settled from their answers (SPEC §14)."""
        self.bodiless = method == "HEAD"
        """Its answers end with their head (whatever length they announce)."""
        self.window = longest_window(vendor)
        cap = deps.policy.tenant.max_active
        self.seats = cap if cap is not None and match.tenant not in deps.router.tenancy.named else None
        """The vendor's ``tenant.max_active`` when the tenant needs one of its seats (seats.py)."""
        self._charges: dict[tuple[str | None, bytes, bytes | None], Charge] = {}
        """By endpoint class, the partition field's value (b"": none) and ``X-Quota-Priority``'s."""
        self._classes: dict[str, Endpoint | None] = {}
        """The endpoint class of each path (without its query) seen."""
        self.partition_header = None if vendor.partition is None else vendor.partition.header.lower().encode("latin-1")
        """The field whose value names the request's partition (None: the vendor has none)."""
        by_path = bool(vendor.endpoints) and cut >= 0
        self._share = vendor.share if vendor.share is not None and len(vendor.share.classes) > 1 else None
        """The vendor's share when a request may name its class (``X-Quota-Priority``)."""
        self.charge: Charge | None = (
            None
            if by_path or vendor.partition is not None or self._share is not None
            else Charge(deps, match, method, target_host)
        )
        """What every request of the route is charged; None: it depends on the request (``charge_of``)."""
        # What the vendor is sent before and after the path, and the worker's own fields.
        self.origin: Origin = origin_of(match.origin)
        self.pool: Pool = deps.upstreams.pool(vendor)
        self.timeouts = vendor.timeouts
        self.head_start = f"{method} ".encode("latin-1")
        self.head_end = f" HTTP/1.1\r\nHost: {self.origin.authority}\r\n".encode("latin-1")
        self.head_tail = b"Content-Length: 0\r\n\r\n" if method in _EMPTY_BODY_METHODS else b"\r\n"
        self.learns = vendor.feedback.headers == "auto"
        """The vendor's answers teach its limits (``feedback.headers: auto``): each is read
        whole (``Flight._learnt``)."""
        remaining = None if self.learns else remaining_watched(vendor.feedback)
        watched: tuple[str, ...] = () if remaining is None else (remaining.lower(),)
        if vendor.ratelimit_headers:
            watched += (RATELIMIT.lower(),)
        self.answer_fields = answer_fields(*watched)
        """What the relay looks at in the vendor's answer head (headers.answer_lines): with
        the field whose low value drains the buckets, which feedback must read, and the
        vendor's own ``RateLimit``, which decides whether the proxy's goes beside it."""
        self.tally: Tally = deps.tally(vendor.name)
        """What its exchanges add to (accounting.py), as the general path's do."""
        self.counts = self.tally.forwarded(mode, match.tenant)
        """The series its forwarded requests add to, resolved."""
        self.log = deps.policy.access_log and deps.access_log.writes
        self.log_path = quoted_path(target_path) if cut < 0 else ""
        """The access log's ``path`` as JSON text, when ``cut`` is -1."""

    def charge_of(self, request: Request) -> Charge | None:
        """What ``request`` is charged: its endpoint class (by its path), partition (by
        its partition field's value) and, under a share, class (``X-Quota-Priority``), each
        worked out once per path and value; None for a class the share does not have (the
        general path refuses it)."""
        vendor = self.vendor
        endpoint = self.match.endpoint
        if vendor.endpoints and self.cut >= 0:
            path = request.target[self.cut :].split("?", 1)[0]
            classes = self._classes
            if path in classes:
                endpoint = classes[path]
            else:
                if len(classes) >= CHARGES_MAX:  # paths are the workers' (ids in them)
                    classes.clear()
                endpoint = classes[path] = endpoint_for(vendor, self._method, path)
        name = self.partition_header
        value = (request.raw_field(name) if name is not None else None) or b""
        priority = request.priority if self._share is not None else None
        key = (None if endpoint is None else endpoint.name, value, priority)
        charge = self._charges.get(key)
        if charge is None:
            klass = None
            if priority is not None and self._share is not None:
                klass = self._share.class_of(self.tenant, priority.decode("latin-1").strip())
                if klass is None:
                    return None
            if len(self._charges) >= CHARGES_MAX:  # partitions are the workers' credentials
                self._charges.clear()
            # An empty value is the default partition, as an absent field is.
            partition = partition_hash(value.decode("latin-1")) if value else DEFAULT
            match = dataclasses.replace(self.match, endpoint=endpoint, partition=partition, klass=klass)
            charge = self._charges[key] = Charge(self._deps, match, self._method, self.host)
        return charge

    def record(self, rec: AccessRecord, charge: Charge, request: Request) -> None:
        """What the access-log record of ``request`` says whatever its outcome."""
        rec.host, rec.path = self.host, self.path_of(request)
        rec.vendor, rec.tenant = self.vendor.name, self.tenant
        if charge.endpoint is not None:
            rec.endpoint = charge.endpoint.name
        rec.partition = shown(charge.partition)

    def learnt(self, charge: Charge, answer: Response) -> bool:
        """Does ``answer`` teach nothing the buckets do not know (feedback.learnt)? Else
        the general path feeds it back. (Asked only when the vendor ``learns``.)"""
        deps = self._deps
        return learnt(deps.limiter, deps.metrics, self.vendor, answer.headers, charge.endpoint, charge.partition)

    def path_of(self, request: Request) -> str:
        """The path and query a request of this route names (the access log's ``path``)."""
        return self.target_path if self.cut < 0 else request.target[self.cut :]

    def match_for(self, target: str, charge: Charge) -> Match:
        """The request's Match (its charge's, with the request's own path)."""
        if self.cut < 0:
            return charge.match
        return dataclasses.replace(charge.match, path_qs=target[self.cut :])


class Routes:
    """The routes of one policy generation (``Deps``), learnt as requests come."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self._table: dict[Hashable, Route | None] = {}

    def get(self, key: Hashable) -> Route | bool | None:
        """The route of ``key``; False when it is not known yet; None when the general path
        decides (its requests are refused, or read otherwise)."""
        return self._table.get(key, False)

    def learn(self, key: Hashable, request: Request, method: str, cut: int) -> Route | None:
        """The route of ``request`` (of ``key``), worked out by the general path's own
        parts; None when the general path must decide (a refusal, a target it reads
        otherwise than ``cut`` says). Kept, unless the request's target says nothing
        about the next one's."""
        deps = self.deps
        tunnel = interception_of(request)
        try:
            if tunnel is None:
                target = parse_target(request)
                match = deps.router.match(target, request.headers, method=method)
            else:
                target = parse_tunneled_target(request, tunnel.host, tunnel.port)
                match = deps.router.match(target, request.headers, tunnel.claim, method)
        except BadRequest:
            return None  # the general path refuses it; the next request of the key may be fine
        except Refusal:
            self._keep(key, None)  # the general path refuses it (and counts and logs the refusal)
            return None
        if cut >= 0 and match.path_qs != request.target[cut:]:
            return None  # a fragment, a query right after the authority...: this target is not cut so
        mode = "plain" if tunnel is None else "intercept"
        route = Route(deps, match, method, mode, cut, target.host, target.path_qs)
        self._keep(key, route)
        return route

    def _keep(self, key: Hashable, route: Route | None) -> None:
        table = self._table
        if len(table) >= ROUTES_MAX:
            table.clear()
        table[key] = route


def proof_of(request: Request) -> bytes | None:
    """The request's first ``Proxy-Authorization`` (the one a lookup by name finds): part of
    its route's key when tenants come from proxy credentials."""
    return request.raw_field(b"proxy-authorization")
