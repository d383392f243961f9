"""How many workers a vendor's quota can keep busy: Little's law.

A vendor that allows ``rate`` requests per second, each taking ``latency``
seconds upstream, is saturated by ``rate * latency`` concurrent requests
(100/s * 200 ms = 20). More workers than that only wait in the limiter, so an
autoscaler can be capped there. Latency is an exponentially weighted average of
the observed upstream exchange times.

In the quota layer: a full concurrency cap's retry hint reads the latency (quota/concurrency.py),
the request pipeline feeds it (pipeline/accounting.py), the admin port shows it (/status).
"""

from __future__ import annotations

import math

from proxy.policy.model import Vendor

_ALPHA = 0.05  # weight of each new observation: about the last 20-40 requests dominate


class Sizing:
    def __init__(self) -> None:
        self._latency: dict[str, float] = {}

    def observe(self, vendor: str, seconds: float) -> None:
        previous = self._latency.get(vendor)
        self._latency[vendor] = seconds if previous is None else previous + _ALPHA * (seconds - previous)

    def latency(self, vendor: str) -> float | None:
        """Average upstream latency in seconds, None before the first response."""
        return self._latency.get(vendor)

    @staticmethod
    def rate(vendor: Vendor) -> float:
        """Requests per second the vendor's global limits allow in the long run."""
        return min((lim.per_second for lim in vendor.limits), default=0.0)

    def recommended_concurrency(self, vendor: Vendor) -> int | None:
        """Workers that keep the quota busy (at least 1), None before any latency is known."""
        latency = self.latency(vendor.name)
        if latency is None:
            return None
        return max(1, math.ceil(self.rate(vendor) * latency - 1e-9))
