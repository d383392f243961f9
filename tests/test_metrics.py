"""Metric children served from a plain dict: bounded, and never a stale series."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from proxy import metrics as metrics_module
from proxy.metrics import Metrics


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
