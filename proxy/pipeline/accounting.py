"""What an exchange with a vendor adds to, in one place for both request paths.

The general path (handler.py, ledger.py) and the straight one (lane.py) count the same
things: the vendor's answer (``http_client_responses_total``; a 429 on the live page), the
time the vendor took (``http_client_request_duration_seconds`` and the sizing estimate),
how the request came (``ratelimit_requests_by_mode_total``), its outcome
(``ratelimit_requests_total``, ``ratelimit_endpoint_requests_total``; for a vendor with
``share:`` also ``ratelimit_class_requests_total`` and its share book, ``shared``) and the
live page's recent counts, and a metered request's estimate and settled amount per meter
(``ratelimit_meter_estimated_total``, ``ratelimit_meter_settled_total``: ``metered``). A
refusal (deferred or shed, never the forwarded request) is also counted by its reason and
its tenant (``refused``); a vendor 429, a block and a drain are kept as events
(``answered``, ``blocked``, ``drained``). A vendor's ``Tally`` holds the series it
adds to, resolved once, so that a request adds to them without looking its labels up
(prometheus-client's ``labels()`` took a microsecond or more each).

With prometheus-client's multiprocess mode (``Metrics.cells_available`` false) the values
are files shared between processes: each change goes through the client's own methods.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any, NamedTuple

from proxy.telemetry.metrics import HistogramCells

if TYPE_CHECKING:
    from proxy.clock import Clock
    from proxy.policy.model import Share
    from proxy.quota.sizing import Sizing
    from proxy.telemetry.metrics import Metrics
    from proxy.telemetry.recent import Recent, Ring
    from proxy.telemetry.shares import ShareBook


class Forwarded(NamedTuple):
    """The series a route's forwarded requests add to (``Tally.forwarded``)."""

    ring: Ring
    mode: Any
    request: Any


_SERIES_MAX = 4096
"""Series kept per vendor and kind (tenants are the workers'); past that it starts over."""


class Tally:
    """The series one vendor's exchanges add to (``Deps.tally``)."""

    __slots__ = (
        "_answers",
        "_book",
        "_classes",
        "_clock",
        "_drained_at",
        "_endpoints",
        "_latency",
        "_meters",
        "_metrics",
        "_modes",
        "_plain",
        "_recent",
        "_requests",
        "_rings",
        "_sizing",
        "vendor",
    )

    def __init__(self, vendor: str, metrics: Metrics, recent: Recent, sizing: Sizing, clock: Clock) -> None:
        self.vendor = vendor
        self._metrics = metrics
        self._recent = recent
        self._sizing = sizing
        self._clock = clock
        self._plain = metrics.cells_available
        """Values this process adds to directly (else through the client: multiprocess mode)."""
        self._latency: HistogramCells | None = metrics.upstream_cells(vendor) if self._plain else None
        self._answers: dict[int, Any] = {}
        self._modes: dict[str, Any] = {}
        self._requests: dict[tuple[str, str], Any] = {}
        self._endpoints: dict[tuple[str, str], Any] = {}
        self._rings: dict[str, Ring] = {}
        self._meters: dict[tuple[str, bool], Any] = {}
        """``ratelimit_meter_{estimated,settled}_total``'s series: by meter, and whether settled."""
        self._classes: dict[str, dict[str, Any]] = {}
        """``ratelimit_class_requests_total``'s series: by class name, then outcome."""
        self._book: ShareBook | None = None
        self._drained_at: dict[str, float] = {}
        """Per partition ("" the default one): when its global buckets were last drained."""

    def forwarded(self, mode: str, tenant: str) -> Forwarded:
        """The series a forwarded request of ``tenant`` that came by ``mode`` adds to,
        resolved for a route to keep (``relayed``)."""
        ring = self._recent.ring(self.vendor, "forwarded")
        return Forwarded(ring, self._mode(mode), self._request(tenant, "forwarded"))

    def relayed(self, counts: Forwarded, status: int, elapsed: float, endpoint: str | None) -> None:
        """A request forwarded without a hold whose answer (``status``, ``elapsed`` seconds
        after the request's write) was relayed whole (the straight path's usual request):
        ``recent``, ``answered``, ``timed``, ``came`` and ``ended`` in one, on the series its
        route resolved (``forwarded``)."""
        counts.ring.add(int(self._clock.monotonic()))
        self.answered(status)
        self.timed(elapsed)
        if self._plain:  # (the values themselves: see answered)
            counts.mode._value += 1
            counts.request._value += 1
        else:
            counts.mode.inc(1)
            counts.request.inc(1)
        if endpoint is not None:
            self._endpoint(endpoint, "forwarded").inc(1)

    def metered(self, meter: str, estimated: float, settled: float | None) -> None:
        """A metered request's estimate in ``meter``, and what its answer said it cost
        (None: not said, or not served)."""
        self._add(self._meter(meter, False), estimated)
        if settled is not None:
            self._add(self._meter(meter, True), settled)

    def _meter(self, meter: str, settled: bool) -> Any:
        cell = self._meters.get((meter, settled))
        if cell is None:  # (a vendor's meters are the policy's: a few)
            counter = self._metrics.meter_settled if settled else self._metrics.meter_estimated
            cell = self._meters[meter, settled] = self._value(counter.labels(self.vendor, meter))
        return cell

    def _add(self, cell: Any, amount: float) -> None:
        if self._plain:  # (the value itself: see answered)
            cell._value += amount
        else:
            cell.inc(amount)

    def answered(self, status: int) -> None:
        """The vendor answered ``status`` (a 429 shows on the live page too)."""
        cell = self._answers.get(status)
        if cell is None:
            cell = self._answers[status] = self._value(self._metrics.responses.labels(self.vendor, str(status)))
        if self._plain:  # the value itself: its inc() takes a lock for threads the loop does not run
            cell._value += 1
        else:
            cell.inc(1)
        if status == 429:
            self._recent.event(self.vendor, "vendor_429")

    def timed(self, elapsed: float) -> None:
        """The vendor took ``elapsed`` seconds, from the request's write to the end of its answer."""
        latency = self._latency
        if latency is not None:
            latency.sum._value += elapsed
            latency.buckets[bisect_left(latency.bounds, elapsed)]._value += 1
        else:
            self._metrics.upstream_seconds.labels(self.vendor).observe(elapsed)
        self._sizing.observe(self.vendor, elapsed)

    def came(self, mode: str) -> None:
        """A request came ``plain`` or ``intercept`` (inside a tunnel)."""
        self._mode(mode).inc(1)

    def _mode(self, mode: str) -> Any:
        cell = self._modes.get(mode)
        if cell is None:
            cell = self._modes[mode] = self._value(self._metrics.by_mode.labels(self.vendor, mode))
        return cell

    def ended(self, tenant: str, outcome: str, endpoint: str | None = None) -> None:
        """A request of ``tenant`` (of the class ``endpoint``) ended as ``outcome``."""
        self._request(tenant, outcome).inc(1)
        if endpoint is not None:
            self._endpoint(endpoint, outcome).inc(1)

    def shared(self, share: Share, klass: int, tenant: str, outcome: str, cost: float = 1.0) -> None:
        """A request of ``tenant`` in the class ``share.classes[klass]`` of this vendor's shared
        quota (SPEC §13) ended as ``outcome`` (as for ``ended``), having taken ``cost`` tokens
        if it was forwarded: ``ratelimit_class_requests_total`` and the share book /status
        reads (telemetry/shares.py)."""
        name = share.classes[klass]
        cells = self._classes.get(name)
        if cells is None:
            if len(self._classes) >= _SERIES_MAX:
                self._classes.clear()
            cells = self._classes[name] = {}
        cell = cells.get(outcome)
        if cell is None:
            cell = cells[outcome] = self._value(self._metrics.class_requests.labels(self.vendor, name, outcome))
        if self._plain:  # (the value itself: see answered)
            cell._value += 1
        else:
            cell.inc(1)
        book = self._book
        if book is None:
            book = self._book = self._recent.share_book(self.vendor)
        book.add(name, tenant, outcome, cost)

    def _endpoint(self, endpoint: str, outcome: str) -> Any:
        key = (endpoint, outcome)
        cell = self._endpoints.get(key)
        if cell is None:
            cell = self._endpoints[key] = self._value(
                self._metrics.endpoint_requests.labels(self.vendor, endpoint, outcome)
            )
        return cell

    def _request(self, tenant: str, outcome: str) -> Any:
        key = (tenant, outcome)
        cell = self._requests.get(key)
        if cell is None:
            if len(self._requests) >= _SERIES_MAX:
                self._requests.clear()
            cell = self._requests[key] = self._value(self._metrics.request_child(self.vendor, tenant, outcome))
        return cell

    def recent(self, event: str) -> None:
        """One ``event`` (forwarded, held, deferred, shed, vendor_429) on the live page."""
        ring = self._rings.get(event)
        if ring is None:
            ring = self._rings[event] = self._recent.ring(self.vendor, event)
        ring.add(int(self._clock.monotonic()))

    def refused(self, outcome: str, reason: str, tenant: str | None) -> None:
        """A request of ``tenant`` deferred or shed (``outcome``) for ``reason``
        (refusals.REASONS): the live page's counts by reason and its top tenants."""
        self.recent(outcome)
        self.recent(f"{outcome}:{reason}")
        self._recent.refused_by(self.vendor, "-" if tenant is None else tenant, reason)

    def blocked(self, seconds: float) -> None:
        """The vendor's 429 blocked its global buckets for ``seconds`` (an event on the page)."""
        self._recent.event(self.vendor, "vendor_block", seconds)

    def drained(self, partition: str = "") -> None:
        """The vendor's remaining quota fell below ``low_watermark``: its (``partition``'s)
        global buckets were emptied (an event on the page; later refusals say ``drain``)."""
        if partition not in self._drained_at and len(self._drained_at) >= _SERIES_MAX:
            self._drained_at.clear()
        self._drained_at[partition] = self._clock.monotonic()
        self._recent.event(self.vendor, "drain")

    def drained_within(self, partition: str, seconds: float) -> bool:
        """Were the (``partition``'s) global buckets drained in the last ``seconds``?"""
        at = self._drained_at.get(partition)
        return at is not None and self._clock.monotonic() - at <= seconds

    def _value(self, child: Any) -> Any:
        """What a change of the series ``child`` goes to: its value, or itself (multiprocess)."""
        return child._value if self._plain else child
