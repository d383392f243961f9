"""Metric children served from a plain dict: bounded, and never a stale series."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.telemetry import metrics as metrics_module
from proxy.telemetry.metrics import Metrics


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_the_children_dict_is_bounded_and_counts_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "_MAX_CACHED_CHILDREN", 8)
    registry = CollectorRegistry()
    responses = Metrics(registry).responses
    for _ in range(3):
        for code in range(20):
            responses.labels("payments", str(code)).inc()
            assert len(responses._cached) <= 8
    for code in range(20):
        assert sample(registry, "http_client_responses_total", limiter="payments", code=str(code)) == 3.0


def test_a_removed_series_starts_again_from_zero() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.set_learned_rate("payments", 5.0)
    metrics.set_learned_rate("payments", None)  # removes the series
    assert sample(registry, "ratelimit_learned_rate", limiter="payments") is None
    metrics.learned_rate.labels("payments").inc()  # a fresh child, not the removed one from the dict
    assert sample(registry, "ratelimit_learned_rate", limiter="payments") == 1.0
    metrics.held_now.labels("payments").inc()
    metrics.held_now.clear()
    metrics.held_now.labels("payments").inc()
    assert sample(registry, "ratelimit_held_requests", limiter="payments") == 1.0


def test_values_that_are_not_str_get_the_same_series() -> None:
    registry = CollectorRegistry()
    responses = Metrics(registry).responses
    responses.labels("payments", "429").inc()
    responses.labels("payments", 429).inc()  # prometheus_client str()s it: the same series
    responses.labels(limiter="payments", code="429").inc()
    assert sample(registry, "http_client_responses_total", limiter="payments", code="429") == 3.0
    assert list(responses._cached) == [("payments", "429")]  # only plain str label sets are kept


def test_unlocked_metrics_expose_exactly_what_prometheus_client_would() -> None:
    """Counters, gauges and histograms without prometheus-client's lock, and histogram
    buckets found by bisection: the exposition is byte for byte prometheus-client's own
    (values on bucket bounds, between them, past the last, negative, NaN)."""
    import prometheus_client
    from prometheus_client import generate_latest

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bounds = (0.001, 0.01, 0.1, 1.0)
    histograms = [
        metrics_module.Histogram("h", "h", ["v"], buckets=bounds, registry=ours),
        prometheus_client.Histogram("h", "h", ["v"], buckets=bounds, registry=theirs),
    ]
    counters = [
        metrics_module.Counter("c", "c", ["v"], registry=ours),
        prometheus_client.Counter("c", "c", ["v"], registry=theirs),
    ]
    gauges = [
        metrics_module.Gauge("g", "g", ["v"], registry=ours),
        prometheus_client.Gauge("g", "g", ["v"], registry=theirs),
    ]
    amounts = [0.0, 0.001, 0.0011, 0.01, 0.05, 0.1, 1.0, 1.5, 1e9, -2.0, float("nan"), 0.0999]
    for histogram in histograms:
        for amount in amounts:
            histogram.labels("a").observe(amount)
    for counter in counters:
        counter.labels("a").inc()
        counter.labels("a").inc(2.5)
    for gauge in gauges:
        gauge.labels("a").inc(3)
        gauge.labels("a").dec()
        gauge.labels("b").set(7)

    def without_created(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "_created" not in line]

    assert without_created(generate_latest(ours)) == without_created(generate_latest(theirs))
    assert type(counters[0].labels("a")._value) is metrics_module._Value  # the unlocked value is in use


def test_every_metric_the_pages_name_has_the_labels_they_give_it() -> None:
    """A query in the docs, the deploy files or the alert rules names a metric and labels it
    has (a guide's ``http_client_responses_total{status="429"}`` matched nothing: the label
    is ``code``)."""
    registry = CollectorRegistry()
    Metrics(registry)
    labels: dict[str, set[str]] = {}
    for family in registry.collect():
        names = {family.name, *(s.name for s in family.samples)}
        keys = {k for s in family.samples for k in s.labels} | set(getattr(family, "_labelnames", ()))
        for name in names:
            labels.setdefault(name, set()).update(keys)
    # (a family with no sample yet: its label names from the collector that made it)
    for collector in list(registry._collector_to_names):
        for name in registry._collector_to_names[collector]:
            labels.setdefault(name, set()).update(getattr(collector, "_labelnames", ()))
    root = Path(__file__).resolve().parents[1]
    pages = [
        *root.glob("docs/**/*.md"),
        root / "README.md",
        *root.glob("deploy/**/*.yml"),
        *root.glob("deploy/**/*.yaml"),
    ]
    wrong, checked = [], 0
    for page in pages:
        for match in re.finditer(r"\b([a-z_]+)\{([^}{]*)\}", page.read_text()):
            name, inside = match.groups()
            if name not in labels:
                continue
            checked += 1
            given = set(re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", inside))
            scrape = {"job", "instance", *(["le"] if name.endswith("_bucket") else [])}  # (Prometheus's own)
            if not given <= labels[name] | scrape:
                wrong.append(f"{page.relative_to(root)}: {match.group(0)} (labels: {sorted(labels[name])})")
    assert not wrong, "\n".join(wrong)
    assert checked > 20, checked  # (the pages do name metrics this way)
    assert "code" in labels["http_client_responses_total"], labels["http_client_responses_total"]
