"""Wiring: a policy becomes the store, limiter, upstream sessions, metrics and handler.

Nothing here serves; server.py binds the listeners. Tests build the same object
with a ManualClock or a fresh registry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from proxy.admin import AdminState
from proxy.clock import Clock, SystemClock
from proxy.forward import Upstreams
from proxy.handler import Deps, ProxyHandler
from proxy.limiter import Breaker, BucketStore, Limiter, StoreUnavailable, open_store
from proxy.match import Router
from proxy.metrics import GaugeCollector, Metrics
from proxy.policy.model import Policy
from proxy.recent import Recent
from proxy.tasks import spawn

if TYPE_CHECKING:
    from proxy.tlsca import LeafMinter

log = logging.getLogger("quota_proxy")


class Runtime:
    """The live proxy state for one policy, plus what must be closed at shutdown."""

    def __init__(
        self,
        policy: Policy,
        *,
        clock: Clock | None = None,
        registry: CollectorRegistry | None = None,
        store: BucketStore | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.store = store or open_store(policy.store.url, policy.store.timeout, self.clock)
        breaker = Breaker(self.clock, policy.store.breaker.failures, policy.store.breaker.cooloff)
        self.limiter = Limiter(
            self.store, self.clock, key_prefix=policy.store.key_prefix, breaker=breaker,
            on_store_error=self._store_error,
        )
        self.deps = Deps(
            policy=policy,
            router=Router(policy),
            limiter=self.limiter,
            upstreams=Upstreams(policy),
            metrics=self.metrics,
            clock=self.clock,
            recent=Recent(self.clock),
        )
        self.handler = ProxyHandler(self.deps)
        self.contexts = self._leaf_minter(policy)
        self.admin = AdminState(lambda: self.handler.deps)
        self.metrics.add_gauges(GaugeCollector(
            "ratelimit_tokens_available",
            "Tokens in the scarcest global bucket of each vendor, as last seen by this replica.",
            ["limiter"], self._tokens,
        ))
        self.metrics.add_gauges(GaugeCollector(
            "ratelimit_breaker_open", "1 while the store circuit breaker is open or half-open.", [],
            lambda: [([], 0.0 if self.limiter.breaker.state == "closed" else 1.0)],
        ))
        self.metrics.add_gauges(GaugeCollector(
            "ratelimit_max_hold_seconds", "Each vendor's on_limit.max_hold, for alerts on hold times.",
            ["limiter"], lambda: [([v.name], v.on_limit.max_hold) for v in self.policy.vendors],
        ))
        self.metrics.add_gauges(GaugeCollector(
            "ratelimit_configured_rate",
            "Requests per second each vendor's global limits allow in the long run (the slowest window).",
            ["limiter"],
            lambda: [([v.name], min((lim.per_second for lim in v.limits), default=0.0)) for v in self.policy.vendors],
        ))
        self._watch = spawn(self.limiter.watch_blocks(), name="watch-vendor-blocks")

    def _leaf_minter(self, policy: Policy) -> LeafMinter | None:
        """The interception CA's leaf factory, when the policy names a CA."""
        if not (policy.tls.ca_cert and policy.tls.ca_key):
            return None
        from proxy.tlsca import CertificateAuthority, LeafMinter  # cryptography: only when intercepting

        ca = CertificateAuthority.load(policy.tls.ca_cert, policy.tls.ca_key)
        return LeafMinter(ca, policy.tls.leaf_validity,
                          on_mint=lambda host, seconds: self.metrics.leaf_mint_seconds.observe(seconds))

    @property
    def policy(self) -> Policy:
        return self.handler.deps.policy

    def _tokens(self) -> Iterator[tuple[list[str], float]]:
        deps = self.handler.deps
        for vendor in deps.policy.vendors:
            tokens = deps.limiter.tokens_available(vendor)
            if tokens is None:
                tokens = min((lim.burst for lim in vendor.limits), default=0.0)
            yield [vendor.name], tokens

    def _store_error(self, exc: StoreUnavailable) -> None:
        self.metrics.store_errors.inc()
        log.debug("store error: %s", exc)

    async def close(self) -> None:
        self._watch.cancel()
        if self.contexts is not None:
            self.contexts.close()
        await self.deps.upstreams.close()
        await self.store.close()
