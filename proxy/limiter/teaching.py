"""Teaching the shared buckets what vendors' quota headers say (SPEC §10): which buckets a
response's reports are about, one store call and only when it changes something, and what
was taught, for the local shares, the learned-rate gauge and /status. What a report teaches,
and the memory of it: learning.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Mapping, Sequence
from typing import Protocol, TypeVar

from proxy.clock import Clock
from proxy.limiter.buckets import endpoint_buckets, global_buckets, meter_vendor_buckets
from proxy.limiter.learning import LearnedLimits, Teaching, bucket_plan, plan
from proxy.limiter.observations import Observation, Observations
from proxy.limiter.quota_headers import SHOPIFY, BucketReport, QuotaReport
from proxy.limiter.store import BucketSpec, BucketStore, StoreUnavailable
from proxy.policy.model import Endpoint, Limit, Meter, Vendor

T = TypeVar("T")


class Feedback(Protocol):
    """A store call past the breaker's gate whose failures still count (``Limiter._feedback``)."""

    def __call__(self, call: Awaitable[T], /) -> Awaitable[T]: ...


class Teacher:
    """What vendors' quota headers teach a limiter's buckets."""

    def __init__(
        self, store: BucketStore, clock: Clock, key_prefix: str, *, feedback: Feedback, observations: Observations
    ) -> None:
        self.store = store
        self.clock = clock
        self.key_prefix = key_prefix
        self._feedback = feedback
        self._observations = observations
        self.memory = LearnedLimits()
        """What this replica taught the store (learning.py)."""

    async def learn(
        self,
        vendor: Vendor,
        reports: Sequence[QuotaReport],
        *,
        endpoint: Endpoint | None = None,
        partition: str = "",
    ) -> bool:
        """Teach the buckets a response counted against what the vendor's quota headers say
        (``Limiter.learn``). Never raises; returns whether the store was called."""
        self.memory.reports += 1
        buckets, todo, own = self._todo(vendor, reports, endpoint, partition)
        if not todo:
            return False
        return await self._teach(vendor, buckets, todo, own)

    async def learn_meters(
        self, vendor: Vendor, reports: Mapping[str, QuotaReport | BucketReport], partition: str = ""
    ) -> bool:
        """Teach each meter that counts the currency of one of ``reports`` (``currency_of``;
        ``quota_headers.read_meter_quota``, ``read_body_quota``) what the vendor says of it:
        its vendor-side buckets, only ever tightening (SPEC §14). Never raises; whether the
        store was called."""
        called = False
        for meter in vendor.meters:
            report = reports.get(currency_of(meter) or "")
            if report is None:
                continue
            specs = meter_vendor_buckets(self.key_prefix, vendor, meter, partition)
            buckets = tuple(zip(specs, meter.limits, strict=True))
            if isinstance(report, BucketReport):
                teachings = bucket_plan(report, meter.limits)
            else:
                teachings = plan([report], meter.limits)
            now = self.clock.monotonic()
            todo = [(i, t) for i, t in sorted(teachings.items()) if self.memory.needs_call(buckets[i][0], t, None, now)]
            if todo:
                called = await self._teach(vendor, buckets, todo, False) or called
        return called

    def known(
        self, vendor: Vendor, reports: Sequence[QuotaReport], *, endpoint: Endpoint | None = None, partition: str = ""
    ) -> bool:
        """Do the buckets know all ``reports`` teach already (``learn`` would not call the
        store)? Then the reports are counted as ``learn`` counts them; else nothing is, and
        ``learn`` is the caller's to call."""
        if self._todo(vendor, reports, endpoint, partition)[1]:
            return False
        self.memory.reports += 1
        return True

    def _todo(
        self, vendor: Vendor, reports: Sequence[QuotaReport], endpoint: Endpoint | None, partition: str
    ) -> tuple[tuple[tuple[BucketSpec, Limit], ...], list[tuple[int, Teaching]], bool]:
        """The buckets the reports are about, what to teach them (nothing that the store
        knows already), and whether they are this replica's default partition's globals."""
        own = endpoint is None or not endpoint.limits
        buckets: tuple[tuple[BucketSpec, Limit], ...]
        if not own and endpoint is not None:
            buckets = tuple(
                zip(endpoint_buckets(self.key_prefix, vendor, endpoint, partition), endpoint.limits, strict=True)
            )
        else:
            buckets = tuple(zip(global_buckets(self.key_prefix, vendor, partition), vendor.limits, strict=True))
        own = own and not partition  # this replica's view of the default partition's global levels
        memory = self.memory
        teachings = plan(reports, [lim for _, lim in buckets])
        if not teachings:
            return buckets, [], own
        now = self.clock.monotonic()
        observed = self._levels_learned(vendor) if own else None
        todo = [
            (i, t)
            for i, t in sorted(teachings.items())
            if memory.needs_call(buckets[i][0], t, None if observed is None else observed[i], now)
        ]
        return buckets, todo, own

    async def _teach(
        self,
        vendor: Vendor,
        buckets: tuple[tuple[BucketSpec, Limit], ...],
        todo: list[tuple[int, Teaching]],
        own: bool,
    ) -> bool:
        memory = self.memory
        specs = tuple(buckets[i][0] for i, _ in todo)
        memory.calls += 1
        try:
            result = await self._feedback(self.store.learn(specs, tuple(t.lesson for _, t in todo)))
        except StoreUnavailable:
            return True
        now = self.clock.monotonic()
        for k, (i, t) in enumerate(todo):
            memory.record(vendor.name, buckets[i][0], t, result, k, now)
        obs = self._observations.observed.get(vendor.name)
        if own and obs is not None and len(obs.levels) == len(buckets):
            levels = list(self._levels_learned(vendor) or obs.levels)
            for k, (i, _) in enumerate(todo):
                levels[i] = result.levels[k]
            self._observations.observed[vendor.name] = Observation(tuple(levels), now)
        return True

    def as_learned(self, spec: BucketSpec) -> BucketSpec:
        """``spec`` at the rate and burst the vendor's headers taught, when lower than its own."""
        memo = self.memory.memos.get(spec.ident)
        rate = None if memo is None else memo.learned_rate(self.clock.monotonic())
        if memo is None or rate is None:
            return spec
        return dataclasses.replace(spec, rate=min(spec.rate, rate), burst=min(spec.burst, memo.burst))

    def _levels_learned(self, vendor: Vendor) -> tuple[float, ...] | None:
        """The global buckets' levels now, extrapolated from the last store answer at the
        rates the store last said they refill at (learned or the policy's)."""
        obs = self._observations.observed.get(vendor.name)
        if obs is None:
            return None
        elapsed = self.clock.monotonic() - obs.at
        memos = self.memory.memos
        out = []
        for b, level in zip(global_buckets(self.key_prefix, vendor), obs.levels, strict=False):
            memo = memos.get(b.ident)
            rate, burst = (memo.rate, memo.burst) if memo is not None else (b.rate, b.burst)
            out.append(min(burst, level + elapsed * rate))
        return tuple(out)

    def learned_rate(self, vendor: Vendor) -> float | None:
        """Requests/s of the vendor's tightest learned global bucket; None when none is learned."""
        idents = [b.ident for b in global_buckets(self.key_prefix, vendor)]
        return self.memory.tightest(idents, self.clock.monotonic())

    def status(self, vendor: Vendor) -> dict[str, object]:
        """For /status: per global and endpoint class bucket (of the default partition) what
        was learned, from which header, until when."""
        specs = [*global_buckets(self.key_prefix, vendor)]
        for endpoint in vendor.endpoints:
            specs.extend(endpoint_buckets(self.key_prefix, vendor, endpoint))
        idents = [b.ident for b in specs]
        memory = self.memory
        return {
            "buckets": memory.status(idents, self.clock.monotonic()),
            "reports": memory.reports,
            "store_calls": memory.calls,
        }


_PRESETS = frozenset({"openai", "anthropic_input", "anthropic_output"})


def currency_of(meter: Meter) -> str | None:
    """The currency a meter counts, as the vendor's quota reports name it: its estimate
    preset's (OpenAI's tokens, Anthropic's input or output tokens), or Shopify's points for
    a meter settled from a GraphQL answer's ``/extensions/cost/``; None: no report teaches it."""
    if meter.estimate.kind in _PRESETS:
        return meter.estimate.kind
    if meter.settle.kind == "json" and meter.settle.pointer.startswith("/extensions/cost/"):
        return SHOPIFY
    return None
