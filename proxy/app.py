"""Wiring: a policy becomes the store, limiter, upstream sessions, metrics and handler.

Nothing here serves; server.py binds the listeners. Tests build the same object
with a ManualClock or a fresh registry.

A new policy (reload) swaps the handler's Deps in one assignment: requests in
flight or held keep the generation they started with; new requests see the new
one. What did not change is kept: the store and its bucket state, the upstream
connection pools, the CA's leaf cache. What was replaced is closed only after a
grace period long enough for the requests that still use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from proxy.clock import Clock, SystemClock
from proxy.deps import Deps
from proxy.limiter import Breaker, BucketStore, Limiter, StoreUnavailable, open_store
from proxy.limiter.buckets import lag_channel
from proxy.limiter.degraded import LocalShares, grace_for
from proxy.limiter.presence import Presence
from proxy.pipeline.forward import Upstreams
from proxy.pipeline.handler import ProxyHandler
from proxy.pipeline.match import Router
from proxy.pipeline.pacing import Pacer
from proxy.policy.model import Policy
from proxy.quota.concurrency import Concurrency
from proxy.quota.sizing import Sizing
from proxy.tasks import cancel_and_wait, spawn
from proxy.telemetry.accesslog import AccessLog
from proxy.telemetry.metrics import GaugeCollector, Metrics
from proxy.telemetry.recent import Recent

if TYPE_CHECKING:
    from proxy.ca.leaves import LeafMinter

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
        access_log: AccessLog | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = Metrics(self.registry)
        limiter = self._limiter(policy, store)
        sizing = Sizing()
        concurrency = Concurrency(limiter, self.clock, sizing)
        self.handler = ProxyHandler(
            Deps(
                policy=policy,
                router=Router(policy),
                limiter=limiter,
                upstreams=Upstreams(policy),
                metrics=self.metrics,
                clock=self.clock,
                recent=Recent(self.clock),
                access_log=access_log if access_log is not None else AccessLog(),
                pacer=Pacer(self.clock),
                concurrency=concurrency,
                sizing=sizing,
            )
        )
        self.leaf_minter = self._new_leaf_minter(policy)
        self._retiring: set[asyncio.Task[None]] = set()
        self._replica = secrets.token_hex(6)  # tells this replica's lag messages from the others'
        self._telling: set[asyncio.Task[None]] = set()  # lag messages on their way: ended before the store closes
        self.handler.deps.pacer.on_grown = self._tell_lag
        self._watch = self._follow(limiter, concurrency)
        self._declare_gauges()
        for vendor in policy.vendors:
            self.metrics.declare_vendor(vendor.name)

    # -- what the rest of the proxy reads ------------------------------------------

    @property
    def deps(self) -> Deps:
        return self.handler.deps

    @property
    def policy(self) -> Policy:
        return self.handler.deps.policy

    @property
    def limiter(self) -> Limiter:
        return self.handler.deps.limiter

    # -- building ------------------------------------------------------------------

    def _limiter(self, policy: Policy, store: BucketStore | None = None) -> Limiter:
        settings = policy.store
        local = None
        if settings.on_failure == "local":
            grace = grace_for(settings.breaker.cooloff, settings.timeout)
            local = LocalShares(self.clock, Presence(self.clock), grace)
        return Limiter(
            store if store is not None else open_store(settings.url, settings.timeout, self.clock),
            self.clock,
            key_prefix=settings.key_prefix,
            breaker=Breaker(self.clock, settings.breaker.failures, settings.breaker.cooloff),
            on_store_error=self._store_error,
            on_state_lost=lambda vendor: self.metrics.state_lost.labels(vendor).inc(),
            local=local,
            on_local_grant=lambda vendor: self.metrics.degraded_grants.labels(vendor).inc(),
        )

    def _follow(self, limiter: Limiter, concurrency: Concurrency) -> list[asyncio.Task[None]]:
        """The limiter's background work: other replicas' vendor blocks and lease releases,
        and (on_failure: local) this replica's announcements in the store."""
        tasks = [
            spawn(limiter.watch_blocks(), name="watch-vendor-blocks"),
            spawn(concurrency.watch(), name="watch-lease-releases"),
            spawn(self._follow_lags(limiter), name="watch-write-lags"),
        ]
        if limiter.local is not None:
            tasks.append(spawn(limiter.announce(), name="announce-replica"))
        return tasks

    def _tell_lag(self, idents: tuple[str, ...], lag: float) -> None:
        """This replica's write lag grew (a stall): the others keep it too (pacing.py)."""
        limiter = self.handler.deps.limiter
        data = json.dumps([self._replica, round(lag, 6), idents])

        async def tell() -> None:
            with contextlib.suppress(StoreUnavailable):  # best effort: the lag still holds here
                await limiter.store.publish(lag_channel(limiter.key_prefix), data)

        task = spawn(tell(), name="tell-write-lag")
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def _follow_lags(self, limiter: Limiter) -> None:
        def heard(_channel: str, data: str) -> None:
            try:
                replica, lag, idents = json.loads(data)
            except TypeError as exc:  # valid JSON of another shape
                raise ValueError(str(exc)) from None
            if replica != self._replica:
                self.handler.deps.pacer.adopt([str(i) for i in idents], float(lag))

        await limiter.store.watch(lag_channel(limiter.key_prefix), heard)

    def _new_leaf_minter(self, policy: Policy) -> LeafMinter | None:
        """The interception CA's leaf factory, when the policy names a CA."""
        if not (policy.tls.ca_cert and policy.tls.ca_key):
            return None
        from proxy.ca.authority import CertificateAuthority  # cryptography: only when intercepting
        from proxy.ca.leaves import LeafMinter

        ca = CertificateAuthority.load(policy.tls.ca_cert, policy.tls.ca_key)
        return LeafMinter(
            ca, policy.tls.leaf_validity, on_mint=lambda host, seconds: self.metrics.leaf_mint_seconds.observe(seconds)
        )

    # -- reload --------------------------------------------------------------------

    def apply(self, policy: Policy) -> list[str]:
        """Serve ``policy`` from the next request on; returns notes for the operator
        about what a reload cannot change."""
        old = self.handler.deps
        notes: list[str] = []
        if (policy.listen, policy.admin_listen) != (old.policy.listen, old.policy.admin_listen):
            notes.append(
                "listen and admin_listen take effect only on restart; still serving on "
                f"{old.policy.listen} and {old.policy.admin_listen}"
            )
            policy = _keep_listeners(policy, old.policy)
        # What can fail comes first, so a failed reload changes nothing.
        tls_changed = policy.tls != old.policy.tls
        minter = self._new_leaf_minter(policy) if tls_changed else self.leaf_minter
        limiter, concurrency = old.limiter, old.concurrency
        if policy.store != old.policy.store:
            limiter = self._limiter(policy)
            concurrency = Concurrency(limiter, self.clock, old.sizing)
            for task in self._watch:
                task.cancel()
            # Requests in flight give their leases back to the old store; it closes after them.
            self._retire(_closing(old.limiter, old.concurrency, self._watch), policy)
            self._watch = self._follow(limiter, concurrency)
            notes.append("store settings changed: new store connection; bucket state lives on in the store itself")
        upstreams, dropped = old.upstreams.updated(policy)
        for session_close in dropped:
            self._retire(session_close, policy)
        if tls_changed:
            previous, self.leaf_minter = self.leaf_minter, minter
            if previous is not None:
                self._retire(_as_async(previous.close), policy)
        for vendor in policy.vendors:
            self.metrics.declare_vendor(vendor.name)
        self.handler.swap(
            dataclasses.replace(
                old, policy=policy, router=Router(policy), limiter=limiter, upstreams=upstreams, concurrency=concurrency
            )
        )
        return notes

    def _retire(self, close: Callable[[], Awaitable[None]], policy: Policy) -> None:
        """Close something the previous policy used once no request can still need it."""
        grace = policy.drain_timeout + max(
            (v.on_limit.max_hold + v.timeouts.connect + v.timeouts.read for v in policy.vendors), default=0.0
        )

        async def later() -> None:
            try:
                await self.clock.sleep(grace)
            finally:
                await close()

        task = spawn(later(), name="retire-after-reload")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # -- gauges computed at scrape time ----------------------------------------------

    def _declare_gauges(self) -> None:
        Read = Callable[[], Iterable[tuple[list[str], float]]]
        gauges: tuple[tuple[str, str, list[str], Read], ...] = (
            (
                "ratelimit_tokens_available",
                "Tokens in the scarcest global bucket of each vendor, as last seen by this replica.",
                ["limiter"],
                self._tokens,
            ),
            (
                "ratelimit_breaker_open",
                "1 while the store circuit breaker is open or half-open.",
                [],
                lambda: [([], 0.0 if self.limiter.breaker.state == "closed" else 1.0)],
            ),
            (
                "ratelimit_degraded",
                "1 while this replica enforces its share of each vendor's limits in-process because the store "
                "is unavailable (on_failure: local), and during the grace after it returns.",
                ["limiter"],
                lambda: self._degraded(lambda local: 1.0),
            ),
            (
                "ratelimit_degraded_share",
                "The fraction of each limit this replica enforces in-process while degraded (1 / replicas seen "
                "alive in the store before it failed); 0 while on the shared buckets.",
                ["limiter"],
                lambda: self._degraded(lambda local: 1.0 / local.replicas),
            ),
            (
                "ratelimit_replicas_seen",
                "Replicas alive in the store as this replica last saw them (on_failure: local; 0 = never seen).",
                [],
                self._replicas_seen,
            ),
            (
                "ratelimit_max_hold_seconds",
                "Each vendor's on_limit.max_hold, for alerts on hold times.",
                ["limiter"],
                lambda: [([v.name], v.on_limit.max_hold) for v in self.policy.vendors],
            ),
            (
                "ratelimit_configured_rate",
                "Requests per second each vendor's global limits allow in the long run (the slowest window).",
                ["limiter"],
                lambda: [([v.name], self.deps.sizing.rate(v)) for v in self.policy.vendors],
            ),
            (
                "ratelimit_inflight",
                "Requests in flight to each vendor with a concurrency cap, fleet-wide (its leases), as the "
                "store last reported them to this replica.",
                ["limiter"],
                self._inflight,
            ),
            (
                "ratelimit_endpoint_inflight",
                "Requests in flight per endpoint class with a concurrency cap, fleet-wide, as the store last "
                "reported them to this replica.",
                ["limiter", "endpoint"],
                self._endpoint_inflight,
            ),
            (
                "ratelimit_recommended_concurrency",
                "Workers that keep each vendor's quota busy: configured rate x observed upstream latency "
                "(Little's law); cap the autoscaler here.",
                ["limiter"],
                self._recommended,
            ),
        )
        for name, doc, labels, read in gauges:
            self.metrics.add_gauges(GaugeCollector(name, doc, labels, read))

    def _tokens(self) -> Iterator[tuple[list[str], float]]:
        deps = self.handler.deps
        for vendor in deps.policy.vendors:
            tokens = deps.limiter.tokens_available(vendor)
            if tokens is None:
                tokens = min((lim.burst for lim in vendor.limits), default=0.0)
            yield [vendor.name], tokens

    def _degraded(self, value: Callable[[LocalShares], float]) -> Iterator[tuple[list[str], float]]:
        local = self.limiter.local
        active = local is not None and local.active
        for vendor in self.policy.vendors:
            yield [vendor.name], value(local) if local is not None and active else 0.0

    def _replicas_seen(self) -> Iterator[tuple[list[str], float]]:
        local = self.limiter.local
        if local is not None:
            yield [], float(local.presence.replicas())

    def _recommended(self) -> Iterator[tuple[list[str], float]]:
        deps = self.handler.deps
        for vendor in deps.policy.vendors:
            workers = deps.sizing.recommended_concurrency(vendor)
            if workers is not None:
                yield [vendor.name], float(workers)

    def _inflight(self) -> Iterator[tuple[list[str], float]]:
        deps = self.handler.deps
        for vendor in deps.policy.vendors:
            if vendor.concurrency is not None:
                yield [vendor.name], float(deps.concurrency.inflight_seen(vendor))

    def _endpoint_inflight(self) -> Iterator[tuple[list[str], float]]:
        deps = self.handler.deps
        for vendor in deps.policy.vendors:
            for endpoint in vendor.endpoints:
                if endpoint.concurrency is not None:
                    yield [vendor.name, endpoint.name], float(deps.concurrency.inflight_seen(vendor, endpoint))

    def _store_error(self, exc: StoreUnavailable) -> None:
        self.metrics.store_errors.inc()
        log.debug("store error: %s", exc)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()  # their finally blocks close what they held
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self.leaf_minter is not None:
            self.leaf_minter.close()
        deps = self.handler.deps
        await deps.upstreams.close()
        # The watches (and lag messages on their way) end before the store they use.
        await _closing(deps.limiter, deps.concurrency, [*self._watch, *self._telling])()
        deps.access_log.flush()


def _closing(
    limiter: Limiter, concurrency: Concurrency, background: list[asyncio.Task[None]]
) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        for task in background:
            await cancel_and_wait(task)  # a cancellation can be lost (tasks.py): they must end first
        await concurrency.close()  # leases still held go back before the store closes
        await limiter.leave()  # the other replicas stop counting this one at once
        await limiter.store.close()

    return close


def _keep_listeners(policy: Policy, old: Policy) -> Policy:
    return dataclasses.replace(policy, listen=old.listen, admin_listen=old.admin_listen)


def _as_async(close: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        close()

    return run
