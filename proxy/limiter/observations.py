"""What the store's answers told this replica, per state key (one per partition): the levels
of the vendor's global buckets (so the tokens gauge and the local shares cost no extra round
trip), and the state's counter, by which the store notices a state it lost. Both memories
are bounded: partitions come from workers' headers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from proxy.clock import Clock
from proxy.limiter.buckets import Buckets, state_key
from proxy.limiter.partitions import shown
from proxy.limiter.store import AcquireResult, StateGuard
from proxy.policy.model import Vendor

log = logging.getLogger("quota_proxy.limiter")

T = TypeVar("T")


@dataclass(slots=True)
class Observation:
    """Global bucket levels as the store last reported them, and when (local clock)."""

    levels: tuple[float, ...]
    at: float


def _bounded(memory: dict[str, T], stale: Callable[[T], bool], limit: int) -> None:
    """Make room in a per-state-key memory: forget what no longer matters, and if that
    frees too little (a flood of partitions), all of it: every memory here is an
    optimisation or a safety net that a missing entry only weakens for a moment."""
    if len(memory) < limit:
        return
    for key in [k for k, v in memory.items() if stale(v)]:
        del memory[key]
    if len(memory) >= limit // 2:
        memory.clear()


class Observations:
    """The levels and the state counters the store last reported."""

    def __init__(
        self, clock: Clock, key_prefix: str, *, limit: int, on_state_lost: Callable[[str], None] | None = None
    ) -> None:
        self.clock = clock
        self.key_prefix = key_prefix
        self.limit = limit
        """Per-state-key memories kept before pruning."""
        self._on_state_lost = on_state_lost
        self.observed: dict[str, Observation] = {}
        """Per vendor: its (default partition's) global buckets as the store last said."""
        self.observed_parts: dict[str, Observation] = {}
        """Per state key of a partition other than the default: the same, bounded."""
        self.observed_meters: dict[str, Observation] = {}
        """Per state key (any partition): its meters' own buckets (SPEC §14), bounded."""
        # Per state key: the highest counter the store reported, and until when (local clock)
        # a missing state would mean a loss: after that its buckets were full again anyway.
        self.seen: dict[str, tuple[int, float]] = {}

    # -- levels ----------------------------------------------------------------

    def observe(self, vendor: Vendor, b: Buckets, levels: tuple[float, ...], now: float | None = None) -> None:
        """Remember the global buckets' levels in ``levels`` (every bucket of ``b``), as of
        ``now`` (the clock's, when not given)."""
        start, end = b.tenant_count + b.endpoint_count, b.request_count  # (a meter's buckets: after)
        if start < end <= len(levels):
            if b.partition:
                self.note_levels(vendor, b.partition, b.state_key, levels[start:end])
            else:
                at = self.clock.monotonic() if now is None else now
                self.observed[vendor.name] = Observation(levels[start:end], at)
        if b.paced_meters and len(levels) == len(b.all):
            at = self.clock.monotonic() if now is None else now
            obs = Observation(tuple(levels[i] for i in b.paced_meters), at)
            if b.state_key not in self.observed_meters:
                horizon = at - 3600.0
                _bounded(self.observed_meters, lambda o: o.at < horizon, self.limit)
            self.observed_meters[b.state_key] = obs

    def note_levels(self, vendor: Vendor, partition: str, key: str, levels: tuple[float, ...]) -> None:
        obs = Observation(levels, self.clock.monotonic())
        if not partition:
            self.observed[vendor.name] = obs
            return
        if key not in self.observed_parts:
            horizon = obs.at - 3600.0  # an hour-old observation: every bucket long full again
            _bounded(self.observed_parts, lambda o: o.at < horizon, self.limit)
        self.observed_parts[key] = obs

    def levels_now(self, vendor: Vendor, partition: str = "") -> tuple[float, ...] | None:
        """The (partition's) global buckets' levels extrapolated from the last store answer;
        None before any."""
        if partition:
            obs = self.observed_parts.get(state_key(self.key_prefix, vendor.name, partition))
        else:
            obs = self.observed.get(vendor.name)
        if obs is None:
            return None
        elapsed = self.clock.monotonic() - obs.at
        return tuple(
            min(lim.burst, level + elapsed * lim.per_second)
            for lim, level in zip(vendor.limits, obs.levels, strict=False)
        )

    def fleet_levels_now(self, vendor: Vendor, b: Buckets) -> tuple[float, ...] | None:
        """The levels of ``b``'s own vendor buckets (``Buckets.fleet_indexes``: the requests',
        then the meters'), extrapolated from the last store answer; one never seen 0, as
        empty; None before any answer."""
        requests = self.levels_now(vendor, b.partition)
        if not b.paced_meters:
            return requests
        meters = self.meter_levels_now(vendor, b.state_key)
        if requests is None and meters is None:
            return None
        n = len(b.fleet_indexes) - len(b.paced_meters)
        seen = (requests or ())[:n]
        return (*seen, *(0.0,) * (n - len(seen)), *(meters or ()))

    def meter_levels_now(self, vendor: Vendor, key: str) -> tuple[float, ...] | None:
        """The meters' own buckets of state ``key`` (their limits in order, meter by meter),
        extrapolated from the last store answer; None before any."""
        obs = self.observed_meters.get(key)
        if obs is None:
            return None
        elapsed = self.clock.monotonic() - obs.at
        limits = [lim for meter in vendor.meters for lim in meter.limits]
        return tuple(
            min(lim.burst, level + elapsed * lim.per_second) for lim, level in zip(limits, obs.levels, strict=False)
        )

    # -- state counters --------------------------------------------------------

    def guard(self, vendor: Vendor, key: str) -> StateGuard:
        return StateGuard(key, self.seen_seq(key), vendor.on_limit.max_hold)

    def answered(self, vendor: Vendor, key: str, result: AcquireResult, now: float | None = None) -> None:
        """What every acquire the store answered tells: the state's counter, a loss
        (``now``: the clock's, when not given)."""
        self._note_state(
            vendor, key, result.seq, result.ttl, result.lost, self.clock.monotonic() if now is None else now
        )
        if result.lost:
            self._state_lost(vendor, key)

    def _state_lost(self, vendor: Vendor, key: str) -> None:
        part = self._partition_of(vendor, key)
        log.error(
            "the store lost %s's bucket state%s (restarted empty, flushed, evicted or failed over to a "
            "lagging replica): its buckets restart owing up to %.3fs of reservations, never full",
            vendor.name,
            f" (partition {shown(part)})" if part else "",
            vendor.on_limit.max_hold,
        )
        if self._on_state_lost is not None:
            self._on_state_lost(vendor.name)

    def _partition_of(self, vendor: Vendor, key: str) -> str:
        """The partition of one of the vendor's state keys ("" = the default one)."""
        head = f"{state_key(self.key_prefix, vendor.name)[: -len('state')]}p:"
        return key[len(head) : -len(":state")] if key.startswith(head) else ""

    def seen_seq(self, key: str) -> int:
        """The counter to check state ``key`` against: 0 once the state may have
        expired of itself (idle: every bucket full, no reservation outstanding)."""
        seq, matters_until = self.seen.get(key, (0, 0.0))
        return seq if self.clock.monotonic() < matters_until else 0

    def _note_state(self, vendor: Vendor, key: str, seq: int, ttl: float, lost: bool, now: float) -> None:
        seen = self.seen.get(key)
        if seen is None or seq >= seen[0] or lost:
            # The state lives ``debt`` + 1 s past its buckets' refill (the ttl the store
            # reports, whoever extended it last): only until then can a missing state be
            # a loss that matters (acquire.lua, "Lost state").
            if seen is None:
                # Many partitions: entries past their time say nothing any more (seen_seq).
                _bounded(self.seen, lambda s: s[1] <= now, self.limit)
            self.seen[key] = (seq, now + ttl - vendor.on_limit.max_hold - 1.0)
