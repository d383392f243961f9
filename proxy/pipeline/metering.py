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

import functools
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from proxy.deps import Deps
from proxy.limiter import Buckets
from proxy.limiter.quota_headers import SHOPIFY, read_body_quota
from proxy.limiter.teaching import currency_of
from proxy.pipeline.match import Match
from proxy.policy.model import Meter, Vendor
from proxy.quota.estimates import Estimate
from proxy.quota.json_pointer import JsonPointer, load_json
from proxy.quota.usage import Settle, UsageReader
from proxy.tasks import spawn
from proxy.wire.refusals import BadRequest
from proxy.wire.request import Request
from proxy.wire.sse import EventSplitter

_UNREAD: Final = object()  # (Settlement.document not parsed yet)
BODY_MAX: Final = 2 * 1024 * 1024
"""Bytes of a request body read for its estimate; a longer body costs the meter's default."""
ANSWER_MAX: Final = 4 * 1024 * 1024
"""Bytes of a JSON answer (decompressed) kept to read its usage; a longer one keeps its estimate."""


class AccessRecord(Protocol):
    """What metering notes in a request's access record (telemetry's ``AccessRecord``)."""

    path: str
    metered: tuple[tuple[str, float, float | None], ...]


@dataclass
class MeterTooSmall(BadRequest):
    """A request whose estimate is more than one of its meters can ever hold: no wait would
    let it go, so it is refused at once rather than held (400)."""

    code = "meter_exceeded"
    meter: str = ""


@functools.cache
def estimate_of(meter: Meter) -> Estimate:
    e = meter.estimate
    if e.kind == "fixed":
        return Estimate("fixed", fixed=e.amount)
    if e.kind == "json":
        return Estimate("json", pointer=JsonPointer.parse(e.pointer), default=e.amount)
    return Estimate(e.kind)


@functools.cache
def settle_of(meter: Meter) -> Settle | None:
    s = meter.settle
    if s.kind == "none":
        return None
    if s.kind == "json":
        return Settle("json", pointer=JsonPointer.parse(s.pointer))
    if s.kind == "header":
        return Settle("header", header=s.header)
    return Settle(s.kind)


@functools.cache
def body_taught(meter: Meter) -> bool:
    """Whether the meter counts a currency an answer's body states (Shopify's points,
    ``teaching.currency_of``): only for such a meter is a JSON answer read for its quota."""
    return currency_of(meter) == SHOPIFY


async def begin(deps: Deps, match: Match, request: Request, rec: AccessRecord) -> tuple[float, ...]:
    """A metered request's estimates (``estimates``), noted in its access record."""
    vendor = match.vendor
    b = deps.limiter.buckets(vendor, match.tenant, match.endpoint, match.partition, match.klass)
    try:
        estimated = await estimates(vendor, request, rec.path.split("?", 1)[0], b)
    except MeterTooSmall as exc:
        deps.metrics.meter_refused.labels(vendor.name, exc.meter).inc()
        raise
    rec.metered = tuple((m.name, e, None) for m, e in zip(vendor.meters, estimated, strict=True))
    return estimated


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
    """Replace a metered request's estimates with what its answer said, in the background
    (the worker is not kept waiting for the store); ``settlement`` None: the request was not
    served (a vendor 429, a failed exchange), its estimates go back. ``since``: seconds since
    it went (what a refund may give back depends on its buckets since: ``store.settle``)."""
    estimated = tuple(e for _, e, _ in rec.metered)
    if settlement is None:
        actual: tuple[float | None, ...] = (0.0,) * len(estimated)
    else:
        actual = settlement.actual(headers or {})
    rec.metered = tuple((name, e, a) for (name, e, _), a in zip(rec.metered, actual, strict=True))
    name = match.vendor.name
    for meter, e, a in rec.metered:
        deps.metrics.meter_estimated.labels(name, meter).inc(e)
        if settlement is not None and a is not None:
            deps.metrics.meter_settled.labels(name, meter).inc(a)
    b = deps.limiter.buckets(match.vendor, match.tenant, match.endpoint, match.partition, match.klass)
    spawn(deps.limiter.settle(b, differences(estimated, actual), since), name=f"settle-{match.vendor.name}")
    if (
        settlement is not None
        and match.vendor.feedback.headers == "auto"
        and any(map(body_taught, match.vendor.meters))
    ):
        said = read_body_quota(settlement.document())  # (Shopify's throttleStatus)
        if said:
            spawn(deps.limiter.learn_meters(match.vendor, said, match.partition), name=f"learn-{name}")


async def estimates(vendor: Vendor, request: Request, path: str, b: Buckets) -> tuple[float, ...]:
    """One estimate per meter of ``vendor``, from ``request``'s body; raises MeterTooSmall for
    one that exceeds the smallest burst of that meter's buckets (``b``'s)."""
    needs = any(estimate_of(meter).reads_body for meter in vendor.meters)
    body: bytes | None = b""
    if needs and request.has_body:
        body = await request.body.whole(BODY_MAX)
    kind = request.headers.get("Content-Type")
    out: list[float] = []
    for meter in vendor.meters:
        estimate = estimate_of(meter)
        if not request.has_body and meter.estimate.kind not in ("fixed", "json"):
            out.append(0.0)  # a preset's call without a body (GET /v1/models) asks for nothing
            continue
        default = meter.default if meter.default is not None else meter.capacity
        out.append(estimate.cost(body, default, content_type=kind, path=path))
    bursts: dict[int, float] = {}
    for spec, k in zip(b.all[b.request_count :], b.meters, strict=True):
        bursts[k] = min(bursts.get(k, spec.burst), spec.burst)
    for k, meter in enumerate(vendor.meters):
        if k in bursts and out[k] > bursts[k]:
            raise MeterTooSmall(
                f"the request is estimated at {out[k]:g} {meter.name}, more than the {bursts[k]:g} "
                f"vendor {vendor.name}'s meter {meter.name} can ever hold (its smallest burst)",
                meter.name,
            )
    return tuple(out)


class Settlement:
    """What a metered request's answer says it cost, per meter: fed the answer's bytes as
    they are relayed (``watch``), asked at its end (``actual``)."""

    __slots__ = ("_body", "_events", "_inflate", "_json", "_parsed", "_readers", "_size", "_vendor")

    def __init__(self, vendor: Vendor, headers: Mapping[str, str]) -> None:
        self._vendor = vendor
        kind = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        self._events = EventSplitter() if kind == "text/event-stream" else None
        self._json = self._events is None
        self._readers: list[UsageReader | None] = []
        for meter in vendor.meters:
            settle = settle_of(meter)
            self._readers.append(settle.stream() if settle is not None and self._events is not None else None)
        self._body: list[bytes] = []
        self._size = 0
        self._parsed: object = _UNREAD
        coding = (headers.get("Content-Encoding") or "").strip().lower()
        self._inflate = _inflater(coding)
        if coding not in ("", "identity") and self._inflate is None:
            self._json = False  # (a coding it cannot undo: brotli, zstd) the estimate stands
            self._events = None

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

    def actual(self, headers: Mapping[str, str]) -> tuple[float | None, ...]:
        """Per meter, what the answer said the request cost; None: it did not say."""
        out: list[float | None] = []
        for meter, reader in zip(self._vendor.meters, self._readers, strict=True):
            settle = settle_of(meter)
            if settle is None:
                out.append(None)
            elif settle.kind == "header":
                out.append(settle.from_headers(headers))
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


def differences(estimated: tuple[float, ...], actual: tuple[float | None, ...]) -> tuple[float, ...]:
    """What each meter's buckets get back (the estimate less the actual; negative: owed)."""
    return tuple(0.0 if a is None else e - a for e, a in zip(estimated, actual, strict=True))
