"""Every metric the proxy exports, declared once on an injected registry.

Label ``limiter`` is the vendor name. Each request is counted exactly once in
``ratelimit_requests_total`` under one outcome:

    forwarded  sent to the vendor without waiting
    held       sent to the vendor after a hold
    deferred   answered 429 + Retry-After (limit reached, or store down and failing closed)
    shed       answered 503
    denied     answered 403 (no vendor) or 400 (malformed)
    error      upstream unreachable or timed out, or the worker went away
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Self

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client import values as prometheus_values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

OUTCOMES = ("forwarded", "held", "deferred", "shed", "denied", "error")
NO_VENDOR = "none"  # the limiter label of requests that matched no vendor
OTHER_TENANTS = "_other"
_MAX_TENANT_LABELS = 500  # distinct tenant label values before the rest share one

_MAX_CACHED_CHILDREN = 10_000  # label sets per metric served from the plain dict

_HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _CachedLabels(MetricWrapperBase):
    """``labels(...)`` served from a plain dict after a label set's first call:
    prometheus_client takes a lock, str()s every value and builds a tuple on each
    call (about 1 µs, several times per request). Only label sets of plain str are
    kept: no other value equals one, so a hit is exactly the child prometheus_client
    would return. At most ``_MAX_CACHED_CHILDREN`` of them: past that the dict
    starts over (the series themselves stay)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cached: dict[tuple[object, ...], Self] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Self:
        try:
            child = self._cached.get(labelvalues)
        except TypeError:  # unhashable: prometheus_client str()s it
            child = None
        if child is not None and not labelkwargs:
            return child
        child = super().labels(*labelvalues, **labelkwargs)
        if not labelkwargs and all(type(value) is str for value in labelvalues):
            if len(self._cached) >= _MAX_CACHED_CHILDREN:
                self._cached.clear()
            self._cached[labelvalues] = child
        return child

    def remove(self, *labelvalues: Any) -> None:
        self._cached.clear()
        super().remove(*labelvalues)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        self._cached.clear()
        super().remove_by_labels(labels)

    def clear(self) -> None:
        self._cached.clear()
        super().clear()


class _Value:
    """A metric value without prometheus-client's lock (``values.MutexValue``): the proxy
    changes and reads its metrics on its event loop's thread only, and the lock cost
    about 0.3 µs per increment, several per request. (With prometheus-client's
    multiprocess mode, never used here, its own value class is kept.)"""

    __slots__ = ("_exemplar", "_value")
    _multiprocess = False

    def __init__(self, value: float = 0.0) -> None:
        self._value = value
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


Value = _Value
"""A series' value as the request paths add to it (pipeline/accounting.py), its own event
loop's thread being the only one that changes it."""


class HistogramCells(NamedTuple):
    """A histogram series' values as the request paths observe into them (accounting.py):
    ``sum._value += x; buckets[bisect_left(bounds, x)]._value += 1`` (``Histogram.observe``)."""

    sum: _Value
    buckets: list[_Value]
    bounds: list[float]


def _cell_of(value: Any) -> _Value:
    if type(value) is not _Value:  # prometheus-client's multiprocess mode: Metrics.cells_available is False
        raise TypeError(f"not a plain metric value: {type(value).__name__}")
    return value


def _unlocked(value: Any) -> Any:
    return _Value(value.get()) if type(value) is prometheus_values.MutexValue else value  # type: ignore[no-untyped-call]


class Counter(_CachedLabels, _Counter):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _unlocked(self._value)

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        """prometheus-client's inc without its three nested calls for the usual case (an
        observable counter, no exemplar): several increments per request."""
        if exemplar is None and amount >= 0 and (self._labelvalues or not self._labelnames):
            value = self._value
            if type(value) is _Value:
                value._value += amount
            else:
                value.inc(amount)
            return
        super().inc(amount, exemplar)


class Gauge(_CachedLabels, _Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _unlocked(self._value)


class Histogram(_CachedLabels, _Histogram):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _unlocked(self._sum)
        self._buckets = [_unlocked(b) for b in self._buckets]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """prometheus-client's observe, finding the bucket by bisection rather than a loop
        over every bound (what it counts is the same: the first bound >= amount)."""
        if exemplar or amount != amount:  # exemplars and NaN: as prometheus-client does
            super().observe(amount, exemplar)
            return
        if not (self._labelvalues or not self._labelnames):
            self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(amount)
        self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "ratelimit_requests",
            "Requests by vendor, tenant and outcome (each counted once).",
            ["limiter", "tenant", "outcome"],
            registry=registry,
        )
        self.endpoint_requests = Counter(
            "ratelimit_endpoint_requests",
            "Requests of a vendor's endpoint class (SPEC §10) by outcome (each counted once, and also in "
            "ratelimit_requests_total); endpoint names are the policy's, so the labels are bounded.",
            ["limiter", "endpoint", "outcome"],
            registry=registry,
        )
        self.class_requests = Counter(
            "ratelimit_class_requests",
            "Requests of a vendor with share: by priority class (SPEC §13) and outcome (each counted once, and "
            "also in ratelimit_requests_total); class names are the policy's, so the labels are bounded.",
            ["limiter", "class", "outcome"],
            registry=registry,
        )
        self.deferred = Counter(
            "ratelimit_deferred", "Requests answered 429 + Retry-After by the proxy.", ["limiter"], registry=registry
        )
        self.shed = Counter("ratelimit_shed", "Requests answered 503 by the proxy.", ["limiter"], registry=registry)
        self.hold_seconds = Histogram(
            "ratelimit_hold_seconds",
            "Time requests were held before being forwarded.",
            ["limiter"],
            buckets=_HOLD_BUCKETS,
            registry=registry,
        )
        self.store_errors = Counter(
            "ratelimit_store_errors", "Store calls that failed or timed out.", registry=registry
        )
        self.state_lost = Counter(
            "ratelimit_store_state_lost",
            "Times the store was found to have lost a vendor's bucket state (restarted empty, flushed, "
            "evicted, failed over to a lagging replica); its buckets then restart owing, never full.",
            ["limiter"],
            registry=registry,
        )
        self.fail_open = Counter(
            "ratelimit_fail_open",
            "Requests forwarded unlimited because the store was down (on_failure: open).",
            ["limiter"],
            registry=registry,
        )
        self.degraded_grants = Counter(
            "ratelimit_degraded_grants",
            "Requests granted by this replica's local share alone while the store was unavailable (on_failure: local).",
            ["limiter"],
            registry=registry,
        )
        self.vendor_blocks = Counter(
            "ratelimit_vendor_blocks",
            "Vendor 429s that blocked the vendor's global buckets.",
            ["limiter"],
            registry=registry,
        )
        self.drains = Counter(
            "ratelimit_low_watermark_drains",
            "Drains of the global buckets on low remaining quota.",
            ["limiter"],
            registry=registry,
        )
        self.held_now = Gauge(
            "ratelimit_held_requests", "Requests being held right now.", ["limiter"], registry=registry
        )
        self.responses = Counter(
            "http_client_responses", "Vendor responses by status code.", ["limiter", "code"], registry=registry
        )
        self.upstream_seconds = Histogram(
            "http_client_request_duration_seconds",
            "Vendor exchange time, request sent to body relayed.",
            ["limiter"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.by_mode = Counter(
            "ratelimit_requests_by_mode",
            "Requests that matched a vendor, by how they came: plain HTTP, inside an intercepted CONNECT, "
            "or a CONNECT tunnel (one per tunnel).",
            ["limiter", "mode"],
            registry=registry,
        )
        self.connects = Counter(
            "ratelimit_connects",
            "CONNECT requests by vendor, mode and result.",
            ["limiter", "mode", "result"],
            registry=registry,
        )
        self.tls_errors = Counter(
            "ratelimit_tls_errors",
            "TLS failures: workers' handshakes with the proxy (e.g. a worker that does not trust its CA) "
            "and the proxy's with vendors (reason upstream_*).",
            ["limiter", "reason"],
            registry=registry,
        )
        self.tunnels_open = Gauge(
            "ratelimit_tunnels_open",
            "CONNECT tunnels open right now (connect: tunnel).",
            ["limiter"],
            registry=registry,
        )
        self.leaf_mint_seconds = Histogram(
            "ratelimit_leaf_mint_seconds",
            "Time to mint a leaf certificate for an intercepted host.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=registry,
        )
        self.connections_closed = Counter(
            "ratelimit_connections_closed",
            "Worker connections the proxy closed itself: over_cap (beyond connections.max, answered 503), "
            "ceiling (far beyond it, closed unanswered), head_timeout (a request head not in within "
            "connections.head_timeout).",
            ["reason"],
            registry=registry,
        )
        for reason in ("over_cap", "ceiling", "head_timeout"):
            self.connections_closed.labels(reason)
        self.reloads = Counter(
            "ratelimit_config_reload", "Policy reloads by result (success, failure).", ["result"], registry=registry
        )
        for result in ("success", "failure"):
            self.reloads.labels(result)  # both series exist from the start, for alerts
        self.learned_rate = Gauge(
            "ratelimit_learned_rate",
            "Requests per second of each vendor's tightest global bucket learned from the vendor's own quota "
            "headers (feedback.headers: auto), as this replica knows it; absent while the policy's limits apply.",
            ["limiter"],
            registry=registry,
        )
        # Meters (SPEC §14): each in its own currency (tokens, points), per vendor and meter.
        self.meter_estimated = Counter(
            "ratelimit_meter_estimated",
            "What metered requests were estimated to cost when they took their meter's buckets.",
            ["limiter", "meter"],
            registry=registry,
        )
        self.meter_settled = Counter(
            "ratelimit_meter_settled",
            "What the vendor's answers said metered requests cost (those that said; a vendor 429 or a "
            "failed exchange: nothing).",
            ["limiter", "meter"],
            registry=registry,
        )
        self.meter_refused = Counter(
            "ratelimit_meter_refused",
            "Metered requests refused on a meter's bucket (deferred, shed) or larger than it can ever hold.",
            ["limiter", "meter"],
            registry=registry,
        )
        self._learned_rates: dict[str, float] = {}
        self._children: dict[tuple[str, str, str], Counter] = {}
        self._tenants: set[str] = set()

    def declare_vendor(self, limiter: str) -> None:
        """Create a vendor's rare-event series at zero, so that its first vendor 429,
        fail-open or block shows up as an increase (rate() needs a previous sample)."""
        self.responses.labels(limiter, "429")
        for counter in (
            self.deferred,
            self.shed,
            self.fail_open,
            self.degraded_grants,
            self.vendor_blocks,
            self.drains,
            self.state_lost,
        ):
            counter.labels(limiter)

    def set_learned_rate(self, limiter: str, rate: float | None) -> None:
        """``ratelimit_learned_rate``: set, or removed when nothing is learned (None)."""
        if rate is None:
            if self._learned_rates.pop(limiter, None) is not None:
                self.learned_rate.remove(limiter)
        elif self._learned_rates.get(limiter) != rate:
            self._learned_rates[limiter] = rate
            self.learned_rate.labels(limiter).set(rate)

    def count_request(self, limiter: str, tenant: str, outcome: str) -> None:
        key = (limiter, tenant, outcome)
        child = self._children.get(key)
        if child is None:
            if len(self._children) > 4 * _MAX_TENANT_LABELS * len(OUTCOMES):
                self._children.clear()
            child = self.requests.labels(limiter, self._tenant_label(tenant), outcome)
            self._children[key] = child
        child.inc()

    @property
    def cells_available(self) -> bool:
        """Are this registry's values plain ones the straight path may add to (not
        prometheus-client's multiprocess mode, where every change is its own)?"""
        return not getattr(prometheus_values.ValueClass, "_multiprocess", False)

    def request_child(self, limiter: str, tenant: str, outcome: str) -> Any:
        """The ``ratelimit_requests_total`` series ``count_request(limiter, tenant, outcome)`` adds to."""
        return self.requests.labels(limiter, self._tenant_label(tenant), outcome)

    def upstream_cells(self, limiter: str) -> HistogramCells:
        """``http_client_request_duration_seconds{limiter}``."""
        child = self.upstream_seconds.labels(limiter)
        return HistogramCells(_cell_of(child._sum), [_cell_of(b) for b in child._buckets], list(child._upper_bounds))

    def mode_total(self, limiter: str, mode: str) -> int:
        """Requests of ``limiter`` that came by ``mode`` since start (for /status)."""
        child: Any = self.by_mode._metrics.get((limiter, mode))  # (not labels(): no series made for a mode unseen)
        return 0 if child is None else int(child._value.get())

    def _tenant_label(self, tenant: str) -> str:
        # Tenants come from workers' headers: bound the label's cardinality.
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) >= _MAX_TENANT_LABELS:
            return OTHER_TENANTS
        self._tenants.add(tenant)
        return tenant

    def add_gauges(self, collector: Collector) -> None:
        self.registry.register(collector)


class GaugeCollector(Collector):
    """A gauge computed at scrape time from the proxy's own state (no store call)."""

    def __init__(
        self, name: str, doc: str, labels: list[str], read: Callable[[], Iterable[tuple[list[str], float]]]
    ) -> None:
        self._name, self._doc, self._labels, self._read = name, doc, labels, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc, labels=self._labels)
        for values, value in self._read():
            family.add_metric(values, value)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._doc, labels=self._labels)
