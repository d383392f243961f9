"""The limiter: buckets of a (vendor, tenant), taken in one store call, behind a breaker.

It also remembers what the store last said about each vendor's global buckets
(so the tokens gauge costs no extra round trip) and which vendors (and partitions)
are blocked after a vendor 429, locally or as announced by other replicas, so that
a held request whose reservation predates the block does not go out during it.

A request of an endpoint class (SPEC §10) takes its ``cost`` from the class's
buckets too; with ``partition:``, the vendor's global and endpoint buckets are those
of the request's partition (buckets.py). What the limiter remembers per state key
(one per partition) is bounded: partitions come from workers' headers.

With ``store.on_failure: local`` it has local shares (degraded.py): a store that
cannot answer does not refuse the request, this replica's share of the limits
decides it; the replica announces itself in the store (presence.py) so that it
knows what its share is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from proxy.clock import Clock
from proxy.limiter.breaker import Breaker
from proxy.limiter.buckets import (
    Buckets,
    block_channel,
    block_channel_pattern,
    block_seconds,
    buckets_for,
    endpoint_buckets,
    global_buckets,
    partition_of_channel,
    probe_key,
    replicas_key,
    state_key,
    vendor_of_channel,
)
from proxy.limiter.degraded import LocalShares
from proxy.limiter.learning import LearnedLimits, plan
from proxy.limiter.partitions import RecentPartitions, shown
from proxy.limiter.quota_headers import QuotaReport
from proxy.limiter.store import (
    AcquireResult,
    BucketSpec,
    BucketStore,
    Leases,
    LeaseSet,
    Reserve,
    StateGuard,
    StoreUnavailable,
)
from proxy.policy.model import Endpoint, Limit, Vendor

log = logging.getLogger("quota_proxy.limiter")

T = TypeVar("T")

_CACHE_MAX = 10_000  # (vendor, tenant, endpoint, partition) bucket lists kept; tenants are unbounded
_STATES_MAX = 10_000  # per-state-key memories (one state per partition) kept before pruning
_CHARGE_WAIT = 10 * 365 * 86400.0  # seconds: a charge is an acquire that is never refused


@dataclass(slots=True)
class Observation:
    """Global bucket levels as the store last reported them, and when (local clock)."""

    levels: tuple[float, ...]
    at: float


@dataclass(frozen=True, slots=True)
class BlockMark:
    """What a held request remembers: which block generation of its (vendor, partition)
    it reserved under."""

    generation: int


_Cached = tuple[Vendor, Buckets]
_BlockKey = tuple[str, str]  # (vendor, partition)


def _bounded(memory: dict[str, T], stale: Callable[[T], bool]) -> None:
    """Make room in a per-state-key memory: forget what no longer matters, and if that
    frees too little (a flood of partitions), all of it: every memory here is an
    optimisation or a safety net that a missing entry only weakens for a moment."""
    if len(memory) < _STATES_MAX:
        return
    for key in [k for k, v in memory.items() if stale(v)]:
        del memory[key]
    if len(memory) >= _STATES_MAX // 2:
        memory.clear()


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
        if local is not None:
            local.tighten = self._as_learned
        self._on_local_grant = on_local_grant
        self._settling = False  # a charge of the shared buckets is on its way (_come_back)
        self._cache: dict[tuple[str, str, str | None, str], _Cached] = {}
        self._observed: dict[str, Observation] = {}
        """Per vendor: its (default partition's) global buckets as the store last said."""
        self._observed_parts: dict[str, Observation] = {}
        """Per state key of a partition other than the default: the same, bounded."""
        self._blocked_until: dict[_BlockKey, float] = {}
        self._block_generation: dict[_BlockKey, int] = {}
        self._generation = 0  # blocks noted so far: a block's generation is never reused
        # Per state key: the highest counter the store reported, and until when (local clock)
        # a missing state would mean a loss: after that its buckets were full again anyway.
        self._seen: dict[str, tuple[int, float]] = {}
        self.partitions = RecentPartitions(clock)
        """Partitions seen lately, per vendor (/status shows how many, never which)."""

    # -- buckets ---------------------------------------------------------------

    def buckets(self, vendor: Vendor, tenant: str, endpoint: Endpoint | None = None, partition: str = "") -> Buckets:
        """The buckets of a request: the tenant's, the endpoint class's (if any) and the
        vendor's global ones (of the partition, "" = the default one), in that order."""
        key = (vendor.name, tenant, None if endpoint is None else endpoint.name, partition)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is vendor:
            return hit[1]
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        b = buckets_for(self.key_prefix, vendor, tenant, endpoint, partition)
        self._cache[key] = (vendor, b)
        return b

    # -- store calls -----------------------------------------------------------

    def acquire(
        self,
        vendor: Vendor,
        tenant: str,
        max_wait: float,
        cost: float = 1.0,
        *,
        enqueue: bool = True,
        endpoint: Endpoint | None = None,
        partition: str = "",
        leases: Leases | None = None,
        buckets: Buckets | None = None,
        claim: str | None = None,
        keeps: bool = True,
        owner: float = 0.0,
    ) -> Coroutine[Any, Any, AcquireResult]:
        """Take ``cost`` from every bucket of the request (``buckets``) now or within
        ``max_wait``, or from none. The result's ``binding`` indexes those buckets.

        Refused, the result's ``hint`` is the caller's slot in its bucket set's deferral
        queue; ``enqueue=False`` (a caller that will not retry: shed) takes no slot.
        With local shares, a store that cannot answer leaves the decision to this
        replica's share (degraded.py). Raises StoreUnavailable when the store fails or
        the breaker is open and there is no share to decide on.
        With ``leases``, the store also takes a lease in each of its sets (concurrency caps),
        or nothing (``full``); a local share alone takes none (concurrency.py).
        ``buckets``: the request's (``Limiter.buckets``), when the caller has them already.
        ``claim``: not None for a caller that defers and will come back: a refusal keeps its
        slot (``AcquireResult.reserved``), and ``claim`` is the slot it was given before ("":
        none; store.Reserve). ``keeps=False``: a caller that holds and claims a slot it was
        given before, keeping none should it be refused. ``owner``: how long after a slot
        matured this caller may take it when its owner has not (kept_slots.Caller.owner).
        """
        b = self.buckets(vendor, tenant, endpoint, partition) if buckets is None else buckets
        if vendor.partition is not None:
            self.partitions.note(vendor.name, partition)
        queue = b.queue if enqueue else None
        reserve = None if claim is None or queue is None else self.reserve(vendor, b, claim, keeps, owner)
        if self.local is None:  # the store alone: its call itself, not one more coroutine around it
            return self._acquire_shared(vendor, b, cost, max_wait, queue, leases, reserve)
        return self._acquire_sharing(self.local, vendor, tenant, b, cost, max_wait, queue, leases, reserve)

    @staticmethod
    def reserve(vendor: Vendor, b: Buckets, claim: str = "", keeps: bool = True, owner: float = 0.0) -> Reserve:
        """How a deferred caller of ``b`` keeps its slot: for as long as it is told to retry
        (``answers_max_wait``: a longer wait says "re-enqueue", and the job comes back later
        as a new request); ``keeps=False``: it keeps none, it only claims; ``owner``: as
        ``acquire``'s."""
        assert b.kept is not None
        horizon = vendor.answers_max_wait if keeps else 0.0
        return Reserve(b.kept, claim, horizon, owner=owner, tenants=b.tenant_count)

    async def _acquire_sharing(
        self,
        local: LocalShares,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        leases: Leases | None,
        reserve: Reserve | None,
    ) -> AcquireResult:
        """``acquire`` with local shares to fall back on (``store.on_failure: local``). A
        share keeps no slot: a claim is the store's to honour."""
        mode = local.current()
        if mode == "shared":
            try:
                return await self._acquire_shared(vendor, b, cost, max_wait, queue, leases, reserve)
            except StoreUnavailable as exc:
                if not local.engage(exc):
                    raise
                return await self._acquire_local(vendor, tenant, b, cost, max_wait, queue, leases)
        if mode == "local" and not await self._come_back(local, vendor):
            return await self._acquire_local(vendor, tenant, b, cost, max_wait, queue, leases)
        return await self._acquire_both(local, vendor, tenant, b, cost, queue, leases)

    async def _acquire_shared(
        self,
        vendor: Vendor,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
    ) -> AcquireResult:
        if not self.breaker.allow():
            raise StoreUnavailable("circuit breaker open")
        try:
            guard = self._guard(vendor, b.state_key)
            result = await self.store.acquire(b.all, cost, max_wait, queue, guard, leases, reserve)
        except BaseException as exc:
            self._not_taken(exc)
            raise
        return self._took(vendor, b, result)

    def take_now(
        self, vendor: Vendor, b: Buckets, cost: float, max_wait: float, queue: str | None, reserve: Reserve | None
    ) -> AcquireResult | None:
        """``acquire`` (no leases, no local shares, a default partition, no claim) answered at
        once by a store that can (memory://: ``take``), for the straight path; None when the
        store answers only asynchronously. Raises StoreUnavailable as ``acquire`` does."""
        take = getattr(self.store, "take", None)
        if take is None:
            return None
        if not self.breaker.allow():
            raise StoreUnavailable("circuit breaker open")
        try:
            guard = self._guard(vendor, b.state_key)
            result: AcquireResult = take(b.all, cost, max_wait, queue, guard, None, reserve)
        except BaseException as exc:
            self._not_taken(exc)
            raise
        return self._took(vendor, b, result)

    def _not_taken(self, exc: BaseException) -> None:
        """A store call the breaker let through ended without an answer: a failure, or
        (cancelled) no verdict, when another probe may try."""
        if isinstance(exc, StoreUnavailable):
            self.store_failed(exc)
        else:
            self.breaker.release()

    def _took(self, vendor: Vendor, b: Buckets, result: AcquireResult) -> AcquireResult:
        """What an answered acquire tells (the breaker, the state's counter, the levels)."""
        self.breaker.success()
        now = self.clock.monotonic()
        self._answered(vendor, b.state_key, result, now)
        self._observe(vendor, b, result.levels, now)
        return result

    def _observe(self, vendor: Vendor, b: Buckets, levels: tuple[float, ...], now: float | None = None) -> None:
        """Remember the global buckets' levels in ``levels`` (every bucket of ``b``), as of
        ``now`` (the clock's, when not given)."""
        start = b.tenant_count + b.endpoint_count
        if start < len(levels):
            if b.partition:
                self._note_levels(vendor, b.partition, b.state_key, levels[start:])
            else:
                at = self.clock.monotonic() if now is None else now
                self._observed[vendor.name] = Observation(levels[start:], at)

    def _note_levels(self, vendor: Vendor, partition: str, key: str, levels: tuple[float, ...]) -> None:
        obs = Observation(levels, self.clock.monotonic())
        if not partition:
            self._observed[vendor.name] = obs
            return
        if key not in self._observed_parts:
            horizon = obs.at - 3600.0  # an hour-old observation: every bucket long full again
            _bounded(self._observed_parts, lambda o: o.at < horizon)
        self._observed_parts[key] = obs

    def _guard(self, vendor: Vendor, key: str) -> StateGuard:
        return StateGuard(key, self.seen_seq(key), vendor.on_limit.max_hold)

    def _answered(self, vendor: Vendor, key: str, result: AcquireResult, now: float | None = None) -> None:
        """What every acquire the store answered tells: the state's counter, a loss
        (``now``: the clock's, when not given)."""
        self._note_state(
            vendor, key, result.seq, result.ttl, result.lost, self.clock.monotonic() if now is None else now
        )
        if result.lost:
            self._state_lost(vendor, key)

    def answered_straight(
        self, vendor: Vendor, b: Buckets, seq: int, ttl: float, lost: bool, levels: tuple[float, ...], now: float
    ) -> None:
        """``_answered`` and ``_observe`` of an acquire the straight path (lane.py) sent
        itself (``RedisStore.straight``), from its reply's fields; the store answered."""
        self.breaker.success()
        self._note_state(vendor, b.state_key, seq, ttl, lost, now)
        if lost:
            self._state_lost(vendor, b.state_key)
        self._observe(vendor, b, levels, now)

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

    # -- local shares (store.on_failure: local) ---------------------------------------

    async def _local_shares(self, local: LocalShares, vendor: Vendor, b: Buckets) -> None:
        part = b.partition
        if not local.knows(vendor, part):
            levels = self._levels_now(vendor, part)
            await local.begin(vendor, b.global_part, levels, self.blocked_for(vendor.name, part), part)

    async def _acquire_local(
        self,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        leases: Leases | None = None,
    ) -> AcquireResult:
        """The store is out: this replica's share decides alone (of the caps too)."""
        local = self.local
        assert local is not None
        await self._local_shares(local, vendor, b)
        result = await local.acquire(vendor, tenant, b, cost, max_wait, queue, alone=True, leases=leases)
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
            for owing, partition in local.owing() or [(vendor, "")]:
                await self._charge(local, owing, partition)
        except StoreUnavailable as exc:
            self.store_failed(exc)
            return False
        except BaseException:
            self.breaker.release()
            raise
        finally:
            self._settling = False
        self.breaker.success()
        local.recovered()
        return True

    async def _charge(self, local: LocalShares, vendor: Vendor, partition: str) -> None:
        """Take the vendor's (partition's) debts (degraded.py) from its shared buckets: an
        acquire that cannot be refused, under the state guard, so a store that came back
        empty is noticed as well."""
        globals_ = global_buckets(self.key_prefix, vendor, partition)
        key = state_key(self.key_prefix, vendor.name, partition)
        debts = await local.debts(vendor, partition) or [(bucket, 0.0) for bucket in globals_[:1]]
        for bucket, debt in debts:
            result = await self.store.acquire((bucket,), debt, _CHARGE_WAIT, None, self._guard(vendor, key))
            self._answered(vendor, key, result)
        if not globals_:
            await self.store.ping()
        local.settled(vendor, partition)

    async def _acquire_both(
        self,
        local: LocalShares,
        vendor: Vendor,
        tenant: str,
        b: Buckets,
        cost: float,
        queue: str | None,
        leases: Leases | None = None,
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
            result = await self._acquire_shared(vendor, b, cost, 0.0, queue, leases)
        except StoreUnavailable as exc:
            local.engage(exc)  # out again: the local grant stands, owed to the store
            local.spent_alone(vendor, cost, b.partition)
            return mine
        if not result.granted:
            await local.refund(vendor, tenant, b, cost)
        return result

    async def release_local(self, leases: Leases) -> tuple[int, ...] | None:
        """Give back a lease a local share granted (degraded.py): the requests still in
        flight on this replica per set; None when the lease is not a local one."""
        return None if self.local is None else await self.local.release(leases)

    async def renew_local(self, leases: tuple[tuple[LeaseSet, str], ...], life: float) -> None:
        if self.local is not None:
            await self.local.renew(leases, life)

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

    def seen_seq(self, key: str) -> int:
        """The counter to check state ``key`` against: 0 once the state may have
        expired of itself (idle: every bucket full, no reservation outstanding)."""
        seq, matters_until = self._seen.get(key, (0, 0.0))
        return seq if self.clock.monotonic() < matters_until else 0

    def _note_state(self, vendor: Vendor, key: str, seq: int, ttl: float, lost: bool, now: float) -> None:
        seen = self._seen.get(key)
        if seen is None or seq >= seen[0] or lost:
            # The state lives ``debt`` + 1 s past its buckets' refill (the ttl the store
            # reports, whoever extended it last): only until then can a missing state be
            # a loss that matters (acquire.lua, "Lost state").
            if seen is None:
                # Many partitions: entries past their time say nothing any more (seen_seq).
                _bounded(self._seen, lambda s: s[1] <= now)
            self._seen[key] = (seq, now + ttl - vendor.on_limit.max_hold - 1.0)

    async def block(self, vendor: Vendor, seconds: float, *, partition: str = "") -> float:
        """A vendor 429: block the global buckets of the vendor's partition that got it
        fleet-wide; returns the block's length.

        Never raises: the block is also kept locally, so this replica honours it
        even when the store cannot record it.
        """
        buckets = global_buckets(self.key_prefix, vendor, partition)
        until = seconds
        try:
            channel = block_channel(self.key_prefix, vendor.name, partition)
            result = await self._feedback(self.store.block(buckets, seconds, channel))
        except StoreUnavailable:
            result = None
        if result is not None:
            until = result.until
            self._note_levels(vendor, partition, state_key(self.key_prefix, vendor.name, partition), result.levels)
        self.note_block(vendor.name, until, partition)
        if self.local is not None and self.local.active:
            await self.local.block(vendor, until, partition)
        return until

    async def drain(self, vendor: Vendor, *, partition: str = "") -> None:
        """Remaining quota below the low watermark: empty the (partition's) global buckets now."""
        if self.local is not None and self.local.active:
            await self.local.drain(vendor, partition)
        buckets = global_buckets(self.key_prefix, vendor, partition)
        try:
            result = await self._feedback(self.store.drain(buckets))
        except StoreUnavailable:
            return
        self._note_levels(vendor, partition, state_key(self.key_prefix, vendor.name, partition), result.levels)

    async def refund(
        self, vendor: Vendor, tenant: str, cost: float = 1.0, *, endpoint: Endpoint | None = None, partition: str = ""
    ) -> bool:
        """A held request that never went out: give its tokens back to every bucket it took
        from (``buckets`` of the same arguments).

        Best effort, never raises: a refund the store cannot take only leaves the
        buckets as short as they were. Returns whether the store (or, degraded, this
        replica's share) took it."""
        b = self.buckets(vendor, tenant, endpoint, partition)
        local = self.local
        if local is not None and local.active and local.knows(vendor, partition):
            await local.refund(vendor, tenant, b, cost)
            if local.current() == "local":
                return True  # the store took none of it
        try:
            levels = await self._feedback(self.store.refund(b.all, cost))
        except StoreUnavailable:
            return False
        self._observe(vendor, b, levels)
        return True

    async def peek(
        self, vendor: Vendor, tenant: str | None = None, *, endpoint: Endpoint | None = None, partition: str = ""
    ) -> tuple[Buckets, tuple[float, ...]]:
        """Levels of the (partition's) global buckets, and the endpoint class's and the
        tenant's if given, in ``buckets`` order, taking nothing."""
        if tenant is None:
            endpoint_part = () if endpoint is None else endpoint_buckets(self.key_prefix, vendor, endpoint, partition)
            b = Buckets(
                endpoint_part + global_buckets(self.key_prefix, vendor, partition),
                0,
                endpoint_count=len(endpoint_part),
                state_key=state_key(self.key_prefix, vendor.name, partition),
                partition=partition,
            )
        else:
            b = self.buckets(vendor, tenant, endpoint, partition)
        levels = await self.store.peek(b.all)
        self._observe(vendor, b, levels)
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
            self.store_failed(exc)
            raise
        self.breaker.success()
        return result

    def store_failed(self, exc: StoreUnavailable) -> None:
        self.breaker.failure()
        if self._on_store_error is not None:
            self._on_store_error(exc)

    # -- what we know without asking -------------------------------------------

    def tokens_available(self, vendor: Vendor) -> float | None:
        """The fullest-possible estimate of the scarcest global bucket (of the default
        partition), extrapolated from the last store answer by refill; None before any answer."""
        levels = self._levels_now(vendor)
        return None if levels is None else min(levels)

    def _levels_now(self, vendor: Vendor, partition: str = "") -> tuple[float, ...] | None:
        """The (partition's) global buckets' levels extrapolated from the last store answer;
        None before any."""
        if partition:
            obs = self._observed_parts.get(state_key(self.key_prefix, vendor.name, partition))
        else:
            obs = self._observed.get(vendor.name)
        if obs is None:
            return None
        elapsed = self.clock.monotonic() - obs.at
        return tuple(
            min(lim.burst, level + elapsed * lim.per_second)
            for lim, level in zip(vendor.limits, obs.levels, strict=False)
        )

    def note_block(self, vendor: str, seconds: float, partition: str = "") -> None:
        """Record a block of ``vendor`` (its ``partition``) for ``seconds`` from now (ours or
        another replica's)."""
        key = (vendor, partition)
        now = self.clock.monotonic()
        until = now + seconds
        if key not in self._blocked_until and len(self._blocked_until) >= _STATES_MAX:
            # Many partitions blocked in turn: forget the blocks that ended (their marks
            # then read "no block since", which is what they would say anyway).
            for old in [k for k, t in self._blocked_until.items() if t <= now]:
                del self._blocked_until[old]
                self._block_generation.pop(old, None)
        if until > self._blocked_until.get(key, 0.0):
            self._blocked_until[key] = until
        self._generation += 1
        self._block_generation[key] = self._generation

    def mark(self, vendor: str, partition: str = "") -> BlockMark:
        return BlockMark(self._block_generation.get((vendor, partition), 0))

    def blocked_since(self, vendor: str, mark: BlockMark, partition: str = "") -> float:
        """Seconds of block left if a block of (vendor, partition) began after ``mark`` was
        taken, else 0."""
        key = (vendor, partition)
        if self._block_generation.get(key, 0) == mark.generation:
            return 0.0
        return max(self._blocked_until.get(key, 0.0) - self.clock.monotonic(), 0.0)

    def blocked_for(self, vendor: str, partition: str = "") -> float:
        """Seconds until the last known block of ``vendor`` (its ``partition``) ends (0 if none)."""
        return max(self._blocked_until.get((vendor, partition), 0.0) - self.clock.monotonic(), 0.0)

    def partitions_blocked(self, vendor: str) -> int:
        """Partitions of ``vendor`` other than the default one blocked now (for /status)."""
        now = self.clock.monotonic()
        return sum(1 for (name, part), until in self._blocked_until.items() if name == vendor and part and until > now)

    async def watch_blocks(self) -> None:
        """Follow other replicas' blocks until cancelled."""

        def on_block(channel: str, data: str) -> None:
            seconds = block_seconds(data)
            vendor = vendor_of_channel(channel)
            if vendor is not None:
                self.note_block(vendor, seconds, partition_of_channel(channel))

        await self.store.watch(block_channel_pattern(self.key_prefix), on_block)

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
        *,
        endpoint: Endpoint | None = None,
        partition: str = "",
    ) -> bool:
        """Teach the buckets a response counted against what the vendor's quota headers say
        (learning.py): its ``endpoint`` class's own when the class has limits (the vendor
        reports that quota: GitHub's search beside its hourly one), else the global buckets
        of its ``partition``. One store call, and only when it changes something. Never
        raises; returns whether the store was called."""
        own = endpoint is None or not endpoint.limits
        buckets: tuple[tuple[BucketSpec, Limit], ...]
        if not own and endpoint is not None:
            buckets = tuple(
                zip(endpoint_buckets(self.key_prefix, vendor, endpoint, partition), endpoint.limits, strict=True)
            )
        else:
            buckets = tuple(zip(global_buckets(self.key_prefix, vendor, partition), vendor.limits, strict=True))
        own = own and not partition  # this replica's view of the default partition's global levels
        memory = self.learned
        memory.reports += 1
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

    def _as_learned(self, spec: BucketSpec) -> BucketSpec:
        """``spec`` at the rate and burst the vendor's headers taught, when lower than its own."""
        memo = self.learned.memos.get(spec.ident)
        rate = None if memo is None else memo.learned_rate(self.clock.monotonic())
        if memo is None or rate is None:
            return spec
        return dataclasses.replace(spec, rate=min(spec.rate, rate), burst=min(spec.burst, memo.burst))

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
        """For /status: per global and endpoint class bucket (of the default partition) what
        was learned, from which header, until when."""
        specs = [*global_buckets(self.key_prefix, vendor)]
        for endpoint in vendor.endpoints:
            specs.extend(endpoint_buckets(self.key_prefix, vendor, endpoint))
        idents = [b.ident for b in specs]
        memory = self.learned
        return {
            "buckets": memory.status(idents, self.clock.monotonic()),
            "reports": memory.reports,
            "store_calls": memory.calls,
        }
