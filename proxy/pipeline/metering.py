"""A metered request (SPEC §14): what it is estimated to cost in each of its vendor's meters
before it goes, and what the vendor's answer says it cost, read as the answer is relayed.

The estimate reads the request's body whole when it ends within ``BODY_MAX`` (a longer one
costs the meter's default); the body is left to be sent as it came. The settlement watches
the answer's bytes on their way to the worker (``forward.relay``'s ``watch``), never holding
them back: a JSON answer's are kept (up to ``ANSWER_MAX``, decompressed when the vendor
compressed them) and read at its end; an event stream's events are read as they come, so a
stream the worker leaves half way still settles with what the vendor had said by then.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, NamedTuple, Protocol

from proxy.deps import Deps
from proxy.limiter import Buckets
from proxy.limiter.quota_headers import SHOPIFY, read_body_quota
from proxy.limiter.teaching import currency_of
from proxy.pipeline.match import Match
from proxy.policy.model import Meter, Vendor
from proxy.quota.estimates import Estimate, request_document
from proxy.quota.json_pointer import JsonPointer, load_json
from proxy.quota.usage import Settle, UsageReader
from proxy.tasks import spawn
from proxy.wire.refusals import BadRequest
from proxy.wire.request import Request
from proxy.wire.sse import EventSplitter

_UNREAD: Final = object()  # (Settlement.document not parsed yet)
BODY_MAX: Final = 2 * 1024 * 1024
"""Bytes of a request body read for its estimate; a longer body costs the meter's default."""
Metered = tuple[tuple[str, float, float | None], ...]
"""Per meter of a request's vendor: its name, the request's estimate, and what the answer
said it cost (None: not said, or not yet): the access record's ``metered``."""
ANSWER_MAX: Final = 4 * 1024 * 1024
"""Bytes of a JSON answer (decompressed) kept to read its usage; a longer one keeps its estimate."""


class AccessRecord(Protocol):
    """What metering notes in a request's access record (telemetry's ``AccessRecord``)."""

    path: str
    metered: Metered


@dataclass
class MeterTooSmall(BadRequest):
    """A request whose estimate is more than one of its meters can ever hold: no wait would
    let it go, so it is refused at once rather than held (400)."""

    code = "meter_exceeded"
    meter: str = ""


def estimate_of(meter: Meter) -> Estimate:
    e = meter.estimate
    if e.kind == "fixed":
        return Estimate("fixed", fixed=e.amount)
    if e.kind == "json":
        return Estimate("json", pointer=JsonPointer.parse(e.pointer), default=e.amount)
    return Estimate(e.kind)


def settle_of(meter: Meter) -> Settle | None:
    s = meter.settle
    if s.kind == "none":
        return None
    if s.kind == "json":
        return Settle("json", pointer=JsonPointer.parse(s.pointer))
    if s.kind == "header":
        return Settle("header", header=s.header)
    return Settle(s.kind)


class Plan(NamedTuple):
    """How a vendor's meters estimate and settle, worked out once per policy vendor (every
    metered request asks: ``plan_of``)."""

    names: tuple[str, ...]
    each: tuple[tuple[Estimate, float, bool], ...]
    """Per meter: its estimate; the cost of a body it cannot read (its ``default``, else its
    capacity); whether a call without a body asks for nothing (a preset's: GET /v1/models)."""
    settles: tuple[Settle | None, ...]
    reads_headers: bool
    """Whether a settlement reads the answer's fields (a ``header`` settle)."""
    reads_body: bool
    """Whether an estimate reads the request's body."""
    body_taught: bool
    """Whether a JSON answer is read for the vendor's quota: ``feedback.headers: auto`` and a
    meter counting a currency an answer's body states (Shopify's points, ``teaching.currency_of``)."""


_PLANS: dict[int, tuple[Vendor, Plan]] = {}
_PLANS_MAX: Final = 256  # (vendors of the policies loaded since: reloads make new ones)


def plan_of(vendor: Vendor) -> Plan:
    """``vendor``'s ``Plan``, kept by identity (a frozen Vendor hashes all its fields)."""
    hit = _PLANS.get(id(vendor))
    if hit is not None and hit[0] is vendor:
        return hit[1]
    meters = vendor.meters
    estimates = tuple(estimate_of(m) for m in meters)
    settles = tuple(settle_of(m) for m in meters)
    plan = Plan(
        tuple(m.name for m in meters),
        tuple(
            (e, m.default if m.default is not None else m.capacity, m.estimate.kind not in ("fixed", "json"))
            for e, m in zip(estimates, meters, strict=True)
        ),
        settles,
        any(s is not None and s.kind == "header" for s in settles),
        any(e.reads_body for e in estimates),
        vendor.feedback.headers == "auto" and any(currency_of(m) == SHOPIFY for m in meters),
    )
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[id(vendor)] = (vendor, plan)
    return plan


async def begin(deps: Deps, match: Match, request: Request, rec: AccessRecord) -> tuple[float, ...]:
    """A metered request's estimates (``estimates``), noted in its access record (there
    already when the straight path made them: ``Carried.metered``)."""
    if rec.metered:
        return tuple(e for _, e, _ in rec.metered)
    vendor = match.vendor
    b = deps.limiter.buckets(vendor, match.tenant, match.endpoint, match.partition, match.klass)
    body: bytes | None = b""
    if request.has_body and plan_of(vendor).reads_body:
        body = await request.body.whole(BODY_MAX)
    path = rec.path.split("?", 1)[0]
    try:
        estimated = estimates(vendor, body, request.has_body, request.headers.get("Content-Type"), path, b)
    except MeterTooSmall as exc:
        deps.metrics.meter_refused.labels(vendor.name, exc.meter).inc()
        raise
    rec.metered = noted(vendor, estimated)
    return estimated


def estimated_now(vendor: Vendor, request: Request, path: str, b: Buckets) -> tuple[float, ...] | None:
    """The straight path's (lane.py) estimates of a request whose body is in hand, whole (a
    lean one's); None when the general path makes them: a body not in hand, or an estimate
    more than a meter can hold (the general path refuses it, and counts it)."""
    body: bytes | None = b""
    plan = plan_of(vendor)
    if request.has_body and plan.reads_body:
        body = request.body_in_hand()
        if body is None:
            return None
    try:
        return estimates(vendor, body, request.has_body, request.first(b"content-type"), path, b, plan)
    except MeterTooSmall:
        return None


def noted(vendor: Vendor, estimated: tuple[float, ...]) -> Metered:
    """Per meter of ``vendor``: its name, the request's estimate, and what the answer said it
    cost (None: not yet), as the access record keeps them."""
    return tuple(zip(plan_of(vendor).names, estimated, (None,) * len(estimated), strict=True))


def refused(deps: Deps, vendor: Vendor, b: Buckets, binding: int) -> None:
    """A refusal (defer, shed) by bucket ``binding`` of ``b``: counted by its meter, if a meter's."""
    k = binding - b.request_count
    if k >= 0:
        deps.metrics.meter_refused.labels(vendor.name, vendor.meters[b.meters[k]].name).inc()


def settle(
    deps: Deps,
    match: Match,
    rec: AccessRecord,
    settlement: Settlement | None,
    headers: Mapping[str, str] | None,
    since: float = 0.0,
) -> None:
    """``settled``, of the request ``rec`` records."""
    b = deps.limiter.buckets(match.vendor, match.tenant, match.endpoint, match.partition, match.klass)
    rec.metered = settled(deps, match.vendor, b, match.partition, rec.metered, settlement, headers, since)


def settled(
    deps: Deps,
    vendor: Vendor,
    b: Buckets,
    partition: str,
    metered: Metered,
    settlement: Settlement | None,
    headers: Mapping[str, str] | None,
    since: float = 0.0,
) -> Metered:
    """Replace a metered request's estimates (``metered``, as ``noted``) with what its answer
    said, in the background (the worker is not kept waiting for the store), and return them
    with what was said; ``settlement`` None: the request was not served (a vendor 429, a
    failed exchange), its estimates go back. ``since``: seconds since it went (what a refund
    may give back depends on its buckets since: ``store.settle``)."""
    actual = (0.0,) * len(metered) if settlement is None else settlement.actual(headers)
    name = vendor.name
    tally = deps.tally(name)
    out: list[tuple[str, float, float | None]] = []
    given: list[float] = []  # per meter: what its buckets get back (negative: owe)
    for (meter, e, _), a in zip(metered, actual, strict=True):
        tally.metered(meter, e, None if settlement is None else a)
        given.append(0.0 if a is None else e - a)
        out.append((meter, e, a))
    deps.limiter.settle_soon(b, tuple(given), since)
    if settlement is not None and settlement.plan.body_taught:
        quota = read_body_quota(settlement.document())  # (Shopify's throttleStatus)
        if quota:
            spawn(deps.limiter.learn_meters(vendor, quota, partition), name=f"learn-{name}")
    return tuple(out)


def estimates(
    vendor: Vendor,
    body: bytes | None,
    has_body: bool,
    content_type: str | None,
    path: str,
    b: Buckets,
    plan: Plan | None = None,
) -> tuple[float, ...]:
    """One estimate per meter of ``vendor``, from a request's ``body`` (None: longer than
    ``BODY_MAX``); raises MeterTooSmall for one that exceeds the smallest burst of that
    meter's buckets (``b``'s). ``plan``: ``plan_of(vendor)``, when the caller has it."""
    if plan is None:
        plan = plan_of(vendor)
    document = request_document(body, content_type) if plan.reads_body else None  # (read once for every meter)
    out: list[float] = []
    for estimate, default, bodiless in plan.each:
        if bodiless and not has_body:
            out.append(0.0)  # a preset's call without a body (GET /v1/models) asks for nothing
            continue
        out.append(estimate.cost(body, default, content_type=content_type, path=path, document=document))
    for k, burst in b.meter_bursts:
        if out[k] > burst:
            name = vendor.meters[k].name
            raise MeterTooSmall(
                f"the request is estimated at {out[k]:g} {name}, more than the {burst:g} "
                f"vendor {vendor.name}'s meter {name} can ever hold (its smallest burst)",
                name,
            )
    return tuple(out)


class Settlement:
    """What a metered request's answer says it cost, per meter: fed the answer's bytes as
    they are relayed (``watch``), asked at its end (``actual``)."""

    __slots__ = ("_body", "_events", "_inflate", "_json", "_parsed", "_readers", "_settles", "_size", "plan")

    def __init__(self, vendor: Vendor, content_type: str | None, coding: str | None) -> None:
        """An answer of ``content_type`` and ``coding`` (its Content-Type and Content-Encoding)."""
        self.plan = plan_of(vendor)
        self._settles = settles = self.plan.settles
        self._readers: list[UsageReader | None] = []
        self._body: list[bytes] = []
        self._size = 0
        self._parsed: object = _UNREAD
        self._events: EventSplitter | None = None
        self._json = True
        self._inflate: zlib._Decompress | None = None
        if content_type != "application/json":  # (the usual answer's: nothing to work out)
            kind = (content_type or "").split(";", 1)[0].strip().lower()
            if kind == "text/event-stream":
                self._events, self._json = EventSplitter(), False
                self._readers = [None if settle is None else settle.stream() for settle in settles]
        if coding is not None:
            coding = coding.strip().lower()
            self._inflate = _inflater(coding) if coding else None
            if coding not in ("", "identity") and self._inflate is None:
                self._json = False  # (a coding it cannot undo: brotli, zstd) the estimate stands
                self._events = None

    @classmethod
    def of(cls, vendor: Vendor, headers: Mapping[str, str]) -> Settlement:
        """The settlement of an answer with these fields."""
        return cls(vendor, headers.get("Content-Type"), headers.get("Content-Encoding"))

    def watch(self, chunk: bytes) -> None:
        """A piece of the answer's body, as it goes to the worker."""
        if self._inflate is not None:
            try:
                chunk = self._inflate.decompress(chunk, ANSWER_MAX)
            except zlib.error:
                self._json, self._events, self._inflate = False, None, None
                return
        if self._events is not None:
            for event in self._events.feed(chunk):
                for reader in self._readers:
                    if reader is not None:
                        reader.feed(event.name, event.data)
        elif self._json:
            self._size += len(chunk)
            if self._size > ANSWER_MAX:
                self._json, self._body = False, []
            else:
                self._body.append(chunk)

    def document(self) -> object:
        """The JSON answer, parsed once (None: not JSON, or not kept)."""
        if self._parsed is _UNREAD:
            self._parsed = load_json(b"".join(self._body)) if self._json else None
        return self._parsed

    def actual(self, headers: Mapping[str, str] | None) -> tuple[float | None, ...]:
        """Per meter, what the answer said the request cost; None: it did not say.
        ``headers``: the answer's fields (None: none, or no meter settles from them)."""
        out: list[float | None] = []
        readers = self._readers or [None] * len(self._settles)
        for settle, reader in zip(self._settles, readers, strict=True):
            if settle is None:
                out.append(None)
            elif settle.kind == "header":
                out.append(None if headers is None else settle.from_headers(headers))
            elif reader is not None:
                out.append(reader.amount())
            else:
                out.append(settle.from_document(self.document()))
        return tuple(out)


def _inflater(coding: str) -> zlib._Decompress | None:
    if coding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if coding == "deflate":
        return zlib.decompressobj()
    return None
