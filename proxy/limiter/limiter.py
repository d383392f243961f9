"""The limiter: buckets of a (vendor, tenant), taken in one store call, behind a breaker.

It also remembers what the store last said about each vendor's global buckets
(so the tokens gauge costs no extra round trip) and which vendors are blocked
after a vendor 429, locally or as announced by other replicas, so that a held
request whose reservation predates the block does not go out during it.

With ``store.on_failure: local`` it has local shares (degraded.py): a store that
cannot answer does not refuse the request, this replica's share of the limits
decides it; the replica announces itself in the store (presence.py) so that it
knows what its share is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from proxy.clock import Clock
from proxy.limiter.breaker import Breaker
from proxy.limiter.buckets import (
    Buckets,
    block_channel,
    block_channel_pattern,
    buckets_for,
    global_buckets,
    probe_key,
    replicas_key,
    state_key,
    vendor_of_channel,
)
from proxy.limiter.degraded import LocalShares
from proxy.limiter.learning import LearnedLimits, plan
from proxy.limiter.store import AcquireResult, BucketSpec, BucketStore, StateGuard, StoreUnavailable
from proxy.policy.model import Limit, Vendor
from proxy.quota_headers import QuotaReport

log = logging.getLogger("quota_proxy.limiter")

T = TypeVar("T")

_CACHE_MAX = 10_000  # (vendor, tenant) bucket lists kept; tenants are unbounded
_CHARGE_WAIT = 10 * 365 * 86400.0  # seconds: a charge is an acquire that is never refused


@dataclass(slots=True)
class Observation:
    """Global bucket levels as the store last reported them, and when (local clock)."""

    levels: tuple[float, ...]
    at: float


@dataclass(frozen=True, slots=True)
class BlockMark:
    """What a held request remembers: which block generation it reserved under."""

    generation: int


class Limiter:
    def __init__(
        self,
        store: BucketStore,
        clock: Clock,
        *,
        key_prefix: str,
        breaker: Breaker,
        on_store_error: Callable[[StoreUnavailable], None] | None = None,
        on_state_lost: Callable[[str], None] | None = None,
        local: LocalShares | None = None,
        on_local_grant: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.breaker = breaker
        self.key_prefix = key_prefix
        self._on_store_error = on_store_error
        self._on_state_lost = on_state_lost
        self.local = local
        """This replica's shares of the limits (``store.on_failure: local``), else None."""
        self._on_local_grant = on_local_grant
        self._settling = False  # a charge of the shared buckets is on its way (_come_back)
        self._cache: dict[tuple[str, str], tuple[Vendor, Buckets]] = {}
        self._observed: dict[str, Observation] = {}
        self._blocked_until: dict[str, float] = {}
        self._block_generation: dict[str, int] = {}
        # Per state key: the highest counter the store reported, and until when (local clock)
        # a missing state would mean a loss: after that its buckets were full again anyway.
        self._seen: dict[str, tuple[int, float]] = {}

    # -- buckets ---------------------------------------------------------------

    def buckets(self, vendor: Vendor, tenant: str) -> Buckets:
        key = (vendor.name, tenant)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is vendor:
            return hit[1]
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        b = buckets_for(self.key_prefix, vendor, tenant)
        self._cache[key] = (vendor, b)
        return b

    # -- store calls -----------------------------------------------------------

    async def acquire(
        self, vendor: Vendor, tenant: str, max_wait: float, cost: float = 1.0, *, enqueue: bool = True
    ) -> AcquireResult:
        """Take ``cost`` from every bucket of (vendor, tenant) now or within ``max_wait``, or from none.

        Refused, the result's ``hint`` is the caller's slot in the (vendor, tenant) deferral
        queue; ``enqueue=False`` (a caller that will not retry: shed) takes no slot.
        With local shares, a store that cannot answer leaves the decision to this
        replica's share (degraded.py). Raises StoreUnavailable when the store fails or
        the breaker is open and there is no share to decide on.
        """
        b = self.buckets(vendor, tenant)
        queue = b.queue if enqueue else None
        local = self.local
        mode = "shared" if local is None else local.current()
        if mode == "shared":
            try:
                return await self._acquire_shared(vendor, b, cost, max_wait, queue)
            except StoreUnavailable as exc:
                if local is None or not local.engage(exc):
                    raise
                return await self._acquire_local(vendor, tenant, b, cost, max_wait, queue)
        assert local is not None
        if mode == "local" and not await self._come_back(local, vendor):
            return await self._acquire_local(vendor, tenant, b, cost, max_wait, queue)
        return await self._acquire_both(local, vendor, tenant, b, cost, queue)

    async def _acquire_shared(
        self, vendor: Vendor, b: Buckets, cost: float, max_wait: float, queue: str | None
    ) -> AcquireResult:
        if not self.breaker.allow():
            raise StoreUnavailable("circuit breaker open")
        try:
            result = await self.store.acquire(b.all, cost, max_wait, queue, self._guard(vendor))
        except StoreUnavailable as exc:
            self._store_failed(exc)
            raise
        except BaseException:
            self.breaker.release()
            raise
        self.breaker.success()
        self._answered(vendor, result)
        if b.tenant_count < len(result.levels):
            self._observed[vendor.name] = Observation(result.levels[b.tenant_count :], self.clock.monotonic())
        return result

    def _guard(self, vendor: Vendor) -> StateGuard:
        return StateGuard(state_key(self.key_prefix, vendor.name), self._seen_seq(vendor), vendor.on_limit.max_hold)

    def _answered(self, vendor: Vendor, result: AcquireResult) -> None:
        """What every acquire the store answered tells: the state's counter, a loss."""
        self._note_state(vendor, result)
        if result.lost:
            log.error(
                "the store lost %s's bucket state (restarted empty, flushed, evicted or failed over to a "
                "lagging replica): its buckets restart owing up to %.3fs of reservations, never full",
                vendor.name,
                vendor.on_limit.max_hold,
            )
            if self._on_state_lost is not None:
                self._on_state_lost(vendor.name)

    # -- local shares (store.on_failure: local) ---------------------------------------

    async def _local_shares(self, local: LocalShares, vendor: Vendor, b: Buckets) -> None:
        if not local.knows(vendor):
            await local.begin(vendor, b.global_part, self._levels_now(vendor), self.blocked_for(vendor.name))

    async def _acquire_local(
        self, vendor: Vendor, tenant: str, b: Buckets, cost: float, max_wait: float, queue: str | None
    ) -> AcquireResult:
        """The store is out: this replica's share decides alone."""
        local = self.local
        assert local is not None
        await self._local_shares(local, vendor, b)
        result = await local.acquire(vendor, tenant, b, cost, max_wait, queue, alone=True)
        if result.granted and self._on_local_grant is not None:
            self._on_local_grant(vendor.name)
        return result

    async def _come_back(self, local: LocalShares, vendor: Vendor) -> bool:
        """Is the store back? When the breaker lets a call through, charge the shared
        buckets with what this replica granted alone (those calls are the probe; with
        nothing to charge, a charge of nothing is). True: the store took every charge."""
        if self._settling or not self.breaker.allow():
            return False
        self._settling = True
        try:
            for owing in local.owed() or [vendor]:
                await self._charge(local, owing)
        except StoreUnavailable as exc:
            self._store_failed(exc)
            return False
        except BaseException:
            self.breaker.release()
            raise
        finally:
            self._settling = False
        self.breaker.success()
        local.recovered()
        return True

    async def _charge(self, local: LocalShares, vendor: Vendor) -> None:
        """Take the vendor's debts (degraded.py) from its shared buckets: an acquire that
        cannot be refused, under the state guard, so a store that came back empty is
        noticed as well."""
        globals_ = global_buckets(self.key_prefix, vendor)
        debts = await local.debts(vendor) or [(bucket, 0.0) for bucket in globals_[:1]]
        for bucket, debt in debts:
            self._answered(vendor, await self.store.acquire((bucket,), debt, _CHARGE_WAIT, None, self._guard(vendor)))
        if not globals_:
            await self.store.ping()
        local.settled(vendor)

    async def _acquire_both(
        self, local: LocalShares, vendor: Vendor, tenant: str, b: Buckets, cost: float, queue: str | None
    ) -> AcquireResult:
        """Just back from an outage: the local share and the shared buckets must both grant,
        and at once. A hold would be booked on two buckets at two different times and leave
        at the later one, later than the shared bucket booked it: when the grace ends, the
        shared bucket's next grants would bunch with it. So during the grace a request is
        forwarded now or deferred (with the hint of whichever refused)."""
        await self._local_shares(local, vendor, b)
        mine = await local.acquire(vendor, tenant, b, cost, 0.0, queue, alone=False)
        if not mine.granted:
            return mine  # this replica's share refuses: nothing was taken anywhere
        try:
            result = await self._acquire_shared(vendor, b, cost, 0.0, queue)
        except StoreUnavailable as exc:
            local.engage(exc)  # out again: the local grant stands, owed to the store
            local.spent_alone(vendor, cost)
            return mine
        if not result.granted:
            await local.refund(vendor, tenant, b, cost)
        return result

    async def announce(self) -> None:
        """With local shares: keep this replica in the store's replica set until cancelled."""
        if self.local is not None:
            await self.local.presence.run(self.store, replicas_key(self.key_prefix))

    async def leave(self) -> None:
        """Shutting down: leave the replica set (best effort)."""
        if self.local is not None:
            await self.local.presence.leave(self.store, replicas_key(self.key_prefix))

    def serves_without_store(self) -> bool:
        """Whether this replica can still grant with the store out (it knows its share)."""
        return self.local is not None and (self.local.active or self.local.presence.replicas() > 0)

    def _seen_seq(self, vendor: Vendor) -> int:
        """The state counter to check the store against: 0 once the state may have
        expired of itself (idle: every bucket full, no reservation outstanding)."""
        seq, matters_until = self._seen.get(state_key(self.key_prefix, vendor.name), (0, 0.0))
        return seq if self.clock.monotonic() < matters_until else 0

    def _note_state(self, vendor: Vendor, result: AcquireResult) -> None:
        key = state_key(self.key_prefix, vendor.name)
        seq, _ = self._seen.get(key, (0, 0.0))
        if result.seq >= seq or result.lost:
            # The state lives ``debt`` + 1 s past its buckets' refill (the ttl the store
            # reports, whoever extended it last): only until then can a missing state be
            # a loss that matters (acquire.lua, "Lost state").
            until = self.clock.monotonic() + result.ttl - vendor.on_limit.max_hold - 1.0
            self._seen[key] = (result.seq, until)

    async def block(self, vendor: Vendor, seconds: float) -> float:
        """A vendor 429: block its global buckets fleet-wide; returns the block's length.

        Never raises: the block is also kept locally, so this replica honours it
        even when the store cannot record it.
        """
        buckets = global_buckets(self.key_prefix, vendor)
        until = seconds
        try:
            channel = block_channel(self.key_prefix, vendor.name)
            result = await self._feedback(self.store.block(buckets, seconds, channel))
        except StoreUnavailable:
            result = None
        if result is not None:
            until = result.until
            self._observed[vendor.name] = Observation(result.levels, self.clock.monotonic())
        self.note_block(vendor.name, until)
        if self.local is not None and self.local.active:
            await self.local.block(vendor, until)
        return until

    async def drain(self, vendor: Vendor) -> None:
        """Remaining quota below the low watermark: empty the global buckets now."""
        if self.local is not None and self.local.active:
            await self.local.drain(vendor)
        buckets = global_buckets(self.key_prefix, vendor)
        try:
            result = await self._feedback(self.store.drain(buckets))
        except StoreUnavailable:
            return
        self._observed[vendor.name] = Observation(result.levels, self.clock.monotonic())

    async def refund(self, vendor: Vendor, tenant: str, cost: float = 1.0) -> bool:
        """A held request of (vendor, tenant) that never went out: give its tokens back.

        Best effort, never raises: a refund the store cannot take only leaves the
        buckets as short as they were. Returns whether the store (or, degraded, this
        replica's share) took it."""
        b = self.buckets(vendor, tenant)
        local = self.local
        if local is not None and local.active and local.knows(vendor):
            await local.refund(vendor, tenant, b, cost)
            if local.current() == "local":
                return True  # the store took none of it
        try:
            levels = await self._feedback(self.store.refund(b.all, cost))
        except StoreUnavailable:
            return False
        if b.tenant_count < len(levels):
            self._observed[vendor.name] = Observation(levels[b.tenant_count :], self.clock.monotonic())
        return True

    async def peek(self, vendor: Vendor, tenant: str | None = None) -> tuple[Buckets, tuple[float, ...]]:
        """Levels of the vendor's global buckets (and the tenant's, if given), taking nothing."""
        b = Buckets(global_buckets(self.key_prefix, vendor), 0) if tenant is None else self.buckets(vendor, tenant)
        levels = await self.store.peek(b.all)
        if len(levels) > b.tenant_count:
            self._observed[vendor.name] = Observation(levels[b.tenant_count :], self.clock.monotonic())
        return b, levels

    async def ping(self, vendors: Iterable[Vendor] = ()) -> None:
        """Raise StoreUnavailable unless the store answers and can take each vendor's
        writes (readiness: whether a grant could succeed, not only whether Redis is up)."""
        await self.store.ping(tuple(probe_key(self.key_prefix, v.name) for v in vendors))

    async def _feedback(self, call: Awaitable[T]) -> T:
        # Feedback bypasses the breaker's gate (it is rare and must not be lost to a
        # half-open probe slot) but its failures still count.
        try:
            result = await call
        except StoreUnavailable as exc:
            self._store_failed(exc)
            raise
        self.breaker.success()
        return result

    def _store_failed(self, exc: StoreUnavailable) -> None:
        self.breaker.failure()
        if self._on_store_error is not None:
            self._on_store_error(exc)

    # -- what we know without asking -------------------------------------------

    def tokens_available(self, vendor: Vendor) -> float | None:
        """The fullest-possible estimate of the scarcest global bucket, extrapolated
        from the last store answer by refill; None before any answer."""
        levels = self._levels_now(vendor)
        return None if levels is None else min(levels)

    def _levels_now(self, vendor: Vendor) -> tuple[float, ...] | None:
        """The global buckets' levels extrapolated from the last store answer; None before any."""
        obs = self._observed.get(vendor.name)
        if obs is None:
            return None
        elapsed = self.clock.monotonic() - obs.at
        return tuple(
            min(lim.burst, level + elapsed * lim.per_second)
            for lim, level in zip(vendor.limits, obs.levels, strict=False)
        )

    def note_block(self, vendor: str, seconds: float) -> None:
        """Record a block of ``vendor`` for ``seconds`` from now (ours or another replica's)."""
        until = self.clock.monotonic() + seconds
        if until > self._blocked_until.get(vendor, 0.0):
            self._blocked_until[vendor] = until
        self._block_generation[vendor] = self._block_generation.get(vendor, 0) + 1

    def mark(self, vendor: str) -> BlockMark:
        return BlockMark(self._block_generation.get(vendor, 0))

    def blocked_since(self, vendor: str, mark: BlockMark) -> float:
        """Seconds of block left if a block began after ``mark`` was taken, else 0."""
        if self._block_generation.get(vendor, 0) == mark.generation:
            return 0.0
        return max(self._blocked_until.get(vendor, 0.0) - self.clock.monotonic(), 0.0)

    def blocked_for(self, vendor: str) -> float:
        """Seconds until the last known block of ``vendor`` ends (0 if none)."""
        return max(self._blocked_until.get(vendor, 0.0) - self.clock.monotonic(), 0.0)

    async def watch_blocks(self) -> None:
        """Follow other replicas' blocks until cancelled."""

        def on_block(channel: str, seconds: float) -> None:
            vendor = vendor_of_channel(channel)
            if vendor is not None:
                self.note_block(vendor, seconds)

        await self.store.watch_blocks(block_channel_pattern(self.key_prefix), on_block)

    # -- learned limits (SPEC §10) ---------------------------------------------

    @property
    def learned(self) -> LearnedLimits:
        """What this replica taught the store from vendors' quota headers (learning.py)."""
        memory = self.__dict__.get("_learned_limits")
        if memory is None:
            memory = self.__dict__["_learned_limits"] = LearnedLimits()
        return memory

    async def learn(
        self,
        vendor: Vendor,
        reports: Sequence[QuotaReport],
        buckets: tuple[tuple[BucketSpec, Limit], ...] | None = None,
    ) -> bool:
        """Teach the buckets what the vendor's quota headers say (learning.py): one store
        call, and only when it changes something. ``buckets`` (each with its policy limit)
        defaults to the vendor's global ones. Never raises; returns whether the store was called."""
        memory = self.learned
        memory.reports += 1
        own = buckets is None
        if buckets is None:
            buckets = tuple(zip(global_buckets(self.key_prefix, vendor), vendor.limits, strict=True))
        teachings = plan(reports, [lim for _, lim in buckets])
        if not teachings:
            return False
        now = self.clock.monotonic()
        observed = self._levels_learned(vendor) if own else None
        todo = [
            (i, t)
            for i, t in sorted(teachings.items())
            if memory.needs_call(buckets[i][0], t, None if observed is None else observed[i], now)
        ]
        if not todo:
            return False
        specs = tuple(buckets[i][0] for i, _ in todo)
        memory.calls += 1
        try:
            result = await self._feedback(self.store.learn(specs, tuple(t.lesson for _, t in todo)))
        except StoreUnavailable:
            return True
        now = self.clock.monotonic()
        for k, (i, t) in enumerate(todo):
            memory.record(vendor.name, buckets[i][0], t, result, k, now)
        obs = self._observed.get(vendor.name)
        if own and obs is not None and len(obs.levels) == len(buckets):
            levels = list(self._levels_learned(vendor) or obs.levels)
            for k, (i, _) in enumerate(todo):
                levels[i] = result.levels[k]
            self._observed[vendor.name] = Observation(tuple(levels), now)
        return True

    def _levels_learned(self, vendor: Vendor) -> tuple[float, ...] | None:
        """The global buckets' levels now, extrapolated from the last store answer at the
        rates the store last said they refill at (learned or the policy's)."""
        obs = self._observed.get(vendor.name)
        if obs is None:
            return None
        elapsed = self.clock.monotonic() - obs.at
        memos = self.learned.memos
        out = []
        for b, level in zip(global_buckets(self.key_prefix, vendor), obs.levels, strict=False):
            memo = memos.get(b.ident)
            rate, burst = (memo.rate, memo.burst) if memo is not None else (b.rate, b.burst)
            out.append(min(burst, level + elapsed * rate))
        return tuple(out)

    def learned_rate(self, vendor: Vendor) -> float | None:
        """Requests/s of the vendor's tightest learned global bucket; None when none is learned."""
        idents = [b.ident for b in global_buckets(self.key_prefix, vendor)]
        return self.learned.tightest(idents, self.clock.monotonic())

    def learned_status(self, vendor: Vendor) -> dict[str, object]:
        """For /status: per global bucket what was learned, from which header, until when."""
        idents = [b.ident for b in global_buckets(self.key_prefix, vendor)]
        memory = self.learned
        return {
            "buckets": memory.status(idents, self.clock.monotonic()),
            "reports": memory.reports,
            "store_calls": memory.calls,
        }
