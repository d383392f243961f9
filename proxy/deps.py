"""What the request path needs, as one value: a policy generation and what serves it.

A reload builds a new Deps (``dataclasses.replace`` of the old one, so what it does
not replace is carried over) and swaps it in one assignment: a request reads
``handler.deps`` once and keeps that generation to its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.clock import Clock
from proxy.limiter import Limiter
from proxy.pipeline.accounting import Tally
from proxy.pipeline.forward import Upstreams
from proxy.pipeline.match import Router
from proxy.pipeline.pacing import Pacer
from proxy.policy.model import Policy
from proxy.quota.concurrency import Concurrency
from proxy.quota.sizing import Sizing
from proxy.telemetry.accesslog import AccessLog
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.recent import Recent


@dataclass
class Deps:
    """Everything the request path needs; swapped as a whole on reload."""

    policy: Policy
    router: Router
    limiter: Limiter
    upstreams: Upstreams
    metrics: Metrics
    clock: Clock
    recent: Recent
    access_log: AccessLog
    pacer: Pacer
    """Held requests' last step: evenly paced even after a stalled event loop."""
    concurrency: Concurrency
    """Fleet-wide concurrency caps: each request's leases, its wait for a free slot."""
    sizing: Sizing = field(default_factory=Sizing)
    held: dict[str, int] = field(default_factory=dict)
    """Requests being held right now, per vendor."""
    tallies: dict[str, Tally] = field(default_factory=dict)

    def tally(self, vendor: str) -> Tally:
        """What ``vendor``'s exchanges add to (accounting.py), made at its first."""
        tally = self.tallies.get(vendor)
        if tally is None:
            tally = self.tallies[vendor] = Tally(vendor, self.metrics, self.recent, self.sizing, self.clock)
        return tally
