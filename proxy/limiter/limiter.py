"""The limiter: buckets of a (vendor, tenant), taken in one store call, behind a breaker.

It also remembers what the store last said about each vendor's global buckets
(observations.py: so the tokens gauge costs no extra round trip) and which vendors (and
partitions) are blocked after a vendor 429, locally or as announced by other replicas
(blocks.py), so that a held request whose reservation predates the block does not go
out during it.

A request of an endpoint class (SPEC §10) takes its ``cost`` from the class's
buckets too; with ``partition:``, the vendor's global and endpoint buckets are those
of the request's partition (buckets.py). What the limiter remembers per state key
(one per partition) is bounded: partitions come from workers' headers.

With ``store.on_failure: local`` it has local shares (degraded.py, fallback.py): a
store that cannot answer does not refuse the request, this replica's share of the limits
decides it; the replica announces itself in the store (presence.py) so that it
knows what its share is.

What vendors' quota headers teach the buckets (SPEC §10): teaching.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from proxy.clock import Clock
from proxy.limiter.blocks import BlockMark, Blocks
from proxy.limiter.breaker import Breaker
from proxy.limiter.buckets import (
    Buckets,
    block_channel,
    buckets_for,
    endpoint_buckets,
    global_buckets,
    meter_vendor_buckets,
    probe_key,
    replicas_key,
    state_key,
)
from proxy.limiter.degraded import LocalShares
from proxy.limiter.fallback import Fallback
from proxy.limiter.learning import LearnedLimits
from proxy.limiter.observations import Observation, Observations
from proxy.limiter.partitions import RecentPartitions
from proxy.limiter.quota_headers import BucketReport, QuotaReport
from proxy.limiter.store import (
    SLOT_LIFE,
    AcquireResult,
    BucketSpec,
    BucketStore,
    Leases,
    LeaseSet,
    Reserve,
    StateGuard,
    StoreUnavailable,
    StraightCall,
)
from proxy.limiter.teaching import Teacher
from proxy.policy.model import Endpoint, Vendor
from proxy.tasks import spawn

T = TypeVar("T")

_CACHE_MAX = 10_000  # (vendor, tenant, endpoint, partition) bucket lists kept; tenants are unbounded
_STATES_MAX = 10_000  # per-state-key memories (one state per partition) kept before pruning

_Cached = tuple[Vendor, Buckets]


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
        self.observations = Observations(clock, key_prefix, limit=_STATES_MAX, on_state_lost=on_state_lost)
        """What the store's answers said: global levels, state counters (observations.py)."""
        self.blocks = Blocks(clock, limit=_STATES_MAX)
        """The vendor blocks this replica knows of (blocks.py)."""
        self.teacher = Teacher(store, clock, key_prefix, feedback=self._feedback, observations=self.observations)
        """What vendors' quota headers taught the buckets (teaching.py)."""
        self.local = local
        """This replica's shares of the limits (``store.on_failure: local``), else None."""
        self._fallback: Fallback | None = None
        if local is not None:
            local.tighten = self.teacher.as_learned
            self._fallback = Fallback(
                local,
                store,
                breaker,
                key_prefix,
                shared=self._acquire_shared,
                failed=self.store_failed,
                observations=self.observations,
                blocks=self.blocks,
                on_grant=on_local_grant,
            )
        self._cache: dict[tuple[str, str, str | None, str, int | None], _Cached] = {}
        self.partitions = RecentPartitions(clock)
        """Partitions seen lately, per vendor (/status shows how many, never which)."""

    # The per-state-key memories under the names they had here (test_partition_state.py).
    @property
    def _observed_parts(self) -> dict[str, Observation]:
        return self.observations.observed_parts

    @property
    def _seen(self) -> dict[str, tuple[int, float]]:
        return self.observations.seen

    @property
    def _blocked_until(self) -> dict[tuple[str, str], float]:
        return self.blocks.until

    @property
    def _block_generation(self) -> dict[tuple[str, str], int]:
        return self.blocks.generations

    # -- buckets ---------------------------------------------------------------

    def buckets(
        self,
        vendor: Vendor,
        tenant: str,
        endpoint: Endpoint | None = None,
        partition: str = "",
        klass: int | None = None,
    ) -> Buckets:
        """The buckets of a request: the tenant's, the endpoint class's (if any) and the
        vendor's global ones (of the partition, "" = the default one), in that order; under
        a share, with its place in the vendor's schedule in class ``klass`` (None: the
        tenant's class)."""
        key = (vendor.name, tenant, None if endpoint is None else endpoint.name, partition, klass)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is vendor:
            return hit[1]
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        b = buckets_for(self.key_prefix, vendor, tenant, endpoint, partition, klass)
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
        estimates: tuple[float, ...] = (),
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
        ``estimates``: one per meter of the vendor (SPEC §14), what the request is estimated
        to cost in that meter's currency, taken from its buckets with the others (a refusal
        keeps its slot only when none of its meters settles: ``keeps_slots``).
        """
        b = self.buckets(vendor, tenant, endpoint, partition) if buckets is None else buckets
        if vendor.partition is not None:
            self.partitions.note(vendor.name, partition)
        queue = b.queue if enqueue else None
        costs = b.costs(cost, estimates) if b.meters else None
        keeping = claim is not None and queue is not None and self.keeps_slots(b)
        reserve = self.reserve(vendor, b, claim or "", keeps, owner) if keeping else None
        if self._fallback is None:  # the store alone: its call itself, not one more coroutine around it
            return self._acquire_shared(vendor, b, cost, max_wait, queue, leases, reserve, costs)
        return self._fallback.acquire(vendor, tenant, b, cost, max_wait, queue, leases, reserve, costs)

    @staticmethod
    def keeps_slots(b: Buckets) -> bool:
        """Whether a deferred call of ``b`` keeps its slot (SPEC §6). One of a meter that
        settles keeps none: kept slots run seconds ahead, so what a settlement gives back
        funds a slot that many seconds later, in a vendor window that does not hold the call
        that gave it back (bench/meters.py part a: 95 % used, then a vendor 429 that voided
        every slot; kept at most 0.42-1 s ahead, smaller overruns, still 429s); given back as
        units only callers asking now may take, or not at all, it is mostly lost (74-81 %,
        bench/README.md). Its deferral queue is what paces it ("Deferral queue": 94-95 %). A
        meter whose estimate is its cost is counted as requests are, and keeps its slot as
        they do."""
        return not b.settles

    @staticmethod
    def reserve(vendor: Vendor, b: Buckets, claim: str = "", keeps: bool = True, owner: float = 0.0) -> Reserve:
        """How a deferred caller of ``b`` keeps its slot: for as long as it is told to retry
        (``answers_max_wait``: a longer wait says "re-enqueue", and the job comes back later
        as a new request), and until ``SLOT_LIFE`` plus its SDK's jitter after the slot matures;
        ``keeps=False``: it keeps none, it only claims; ``owner``: as ``acquire``'s."""
        assert b.kept is not None
        horizon = vendor.answers_max_wait if keeps else 0.0
        life = SLOT_LIFE + vendor.answers.retry_jitter
        return Reserve(b.kept, claim, horizon, owner=owner, life=life, tenants=b.tenant_count)

    async def _acquire_shared(
        self,
        vendor: Vendor,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        if not self.breaker.allow():
            raise StoreUnavailable("circuit breaker open")
        try:
            guard = self.observations.guard(vendor, b.state_key)
            store = self.store
            if costs is None:  # (the usual call, as every store has taken it)
                result = await store.acquire(b.all, cost, max_wait, queue, guard, leases, reserve, b.share)
            else:
                result = await store.acquire(b.all, cost, max_wait, queue, guard, leases, reserve, b.share, costs)
        except BaseException as exc:
            self._not_taken(exc)
            raise
        return self.took(vendor, b, result)

    def straight(
        self,
        vendor: Vendor,
        b: Buckets,
        cost: float,
        max_wait: float,
        queue: str | None,
        sets: tuple[LeaseSet, ...],
        reserve: Reserve | None,
    ) -> StraightCall | None:
        """``acquire`` of ``b`` (no local shares, no claim), with a lease in each of ``sets``,
        prepared for the straight path to send per request (store.StraightCall: the state's
        counter and the lease id are each call's own); None when the store has no such
        call. Its answers go to ``took`` (or, none, ``not_taken``), as this limiter's own do."""
        guard = StateGuard(b.state_key, 0, vendor.on_limit.max_hold)
        return self.store.straight(b.all, cost, max_wait, queue, guard, sets, reserve, b.share)

    def not_taken(self, exc: BaseException) -> None:
        """A store call the breaker let through ended without an answer (see ``_not_taken``)."""
        self._not_taken(exc)

    def _not_taken(self, exc: BaseException) -> None:
        """A store call the breaker let through ended without an answer: a failure, or
        (cancelled) no verdict, when another probe may try."""
        if isinstance(exc, StoreUnavailable):
            self.store_failed(exc)
        else:
            self.breaker.release()

    def took(self, vendor: Vendor, b: Buckets, result: AcquireResult) -> AcquireResult:
        """What an answered acquire tells (the breaker, the state's counter, the levels):
        this limiter's own, and the straight path's (``straight``)."""
        self.breaker.success()
        now = self.clock.monotonic()
        self.observations.answered(vendor, b.state_key, result, now)
        self.observations.observe(vendor, b, result.levels, now)
        return result

    # -- local shares (store.on_failure: local) ---------------------------------------

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

    # -- feedback and reads ----------------------------------------------------

    async def block(self, vendor: Vendor, seconds: float, *, partition: str = "") -> float:
        """A vendor 429: block the global buckets of the vendor's partition that got it
        fleet-wide; returns the block's length.

        Never raises: the block is also kept locally, so this replica honours it
        even when the store cannot record it. The vendor's meters' buckets are blocked with
        them (a token quota's 429 stops the calls as a request quota's does).
        """
        requests = global_buckets(self.key_prefix, vendor, partition)
        buckets = requests + self._meters(vendor, partition)
        until = seconds
        try:
            channel = block_channel(self.key_prefix, vendor.name, partition)
            result = await self._feedback(self.store.block(buckets, seconds, channel))
        except StoreUnavailable:
            result = None
        if result is not None:
            until = result.until
            self.observations.note_levels(
                vendor, partition, state_key(self.key_prefix, vendor.name, partition), result.levels[: len(requests)]
            )
        self.note_block(vendor.name, until, partition)
        if self.local is not None and self.local.active:
            await self.local.block(vendor, until, partition)
        return until

    async def drain(self, vendor: Vendor, *, partition: str = "") -> None:
        """Remaining quota below the low watermark: empty the (partition's) global buckets now."""
        if self.local is not None and self.local.active:
            await self.local.drain(vendor, partition)
        requests = global_buckets(self.key_prefix, vendor, partition)
        try:
            result = await self._feedback(self.store.drain(requests + self._meters(vendor, partition)))
        except StoreUnavailable:
            return
        self.observations.note_levels(
            vendor, partition, state_key(self.key_prefix, vendor.name, partition), result.levels[: len(requests)]
        )

    async def peek_meters(self, vendor: Vendor) -> tuple[tuple[BucketSpec, ...], tuple[float, ...]]:
        """The vendor's own meter buckets (of the default partition) and their levels, taking
        nothing (/status)."""
        specs = self._meters(vendor, "")
        return specs, (await self._feedback(self.store.peek(specs)) if specs else ())

    def _meters(self, vendor: Vendor, partition: str) -> tuple[BucketSpec, ...]:
        """The vendor's (partition's) own buckets of its meters (not its tenants'), meter by meter."""
        return tuple(
            s for meter in vendor.meters for s in meter_vendor_buckets(self.key_prefix, vendor, meter, partition)
        )

    async def refund(
        self,
        vendor: Vendor,
        tenant: str,
        cost: float = 1.0,
        *,
        endpoint: Endpoint | None = None,
        partition: str = "",
        estimates: tuple[float, ...] = (),
    ) -> bool:
        """A held request that never went out: give its tokens back to every bucket it took
        from (``buckets`` of the same arguments; a meter's, its ``estimates``).

        Best effort, never raises: a refund the store cannot take only leaves the
        buckets as short as they were. Returns whether the store (or, degraded, this
        replica's share) took it."""
        b = self.buckets(vendor, tenant, endpoint, partition)
        costs = b.costs(cost, estimates) if b.meters else None
        local = self.local
        if local is not None and local.active and local.knows(vendor, partition):
            await local.refund(vendor, tenant, b, cost, costs)
            if local.current() == "local":
                return True  # the store took none of it
        try:
            given = self.store.refund(b.all, cost) if costs is None else self.store.settle(b.all, costs)
            levels = await self._feedback(given)
        except StoreUnavailable:
            return False
        self.observations.observe(vendor, b, levels)
        return True

    async def settle(self, b: Buckets, differences: tuple[float, ...], since: float = 0.0) -> tuple[float, ...] | None:
        """A metered request's answer said what it cost (SPEC §14): each of its meters'
        buckets gets ``differences[k]`` (meter k's estimate less its actual amount) back, or
        owes it (negative). Levels of the meters' buckets after; None when the store could
        not take it (best effort, never raises: the estimate then stands)."""
        metered, amounts = b.meter_part, tuple([differences[k] for k in b.meters])
        return await self._settle(metered, amounts, since) if any(amounts) else None

    def settle_soon(self, b: Buckets, differences: tuple[float, ...], since: float = 0.0) -> None:
        """``settle``, not awaited: by the store's call without a coroutine (no task per
        metered request: ``store.settle_then``), else in a task."""
        metered, amounts = b.meter_part, tuple([differences[k] for k in b.meters])
        if any(amounts) and not self.store.settle_then(metered, amounts, since, self._settled):
            spawn(self._settle(metered, amounts, since), name="settle")

    async def _settle(
        self, metered: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float
    ) -> tuple[float, ...] | None:
        try:
            return await self._feedback(self.store.settle(metered, amounts, since))
        except StoreUnavailable:
            return None

    def _settled(self, levels: tuple[float, ...] | None, exc: BaseException | None) -> None:
        """The store's answer to ``settle_soon`` (as ``_feedback`` takes one: best effort)."""
        if exc is None:
            self.breaker.success()
        elif isinstance(exc, StoreUnavailable):
            self.store_failed(exc)

    async def left(self, kept: str, claims: tuple[str, ...]) -> None:
        """A worker's connection closed holding the slots ``claims`` of reservation set
        ``kept`` (store.BucketStore.left). Best effort, never raises: a mark the store cannot
        take only leaves those slots to whoever asks when they mature."""
        with contextlib.suppress(StoreUnavailable):
            await self.store.left(kept, claims)

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
        self.observations.observe(vendor, b, levels)
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
        levels = self.observations.levels_now(vendor)
        return None if levels is None else min(levels)

    def seen_seq(self, key: str) -> int:
        """The counter to check state ``key`` against (observations.py)."""
        return self.observations.seen_seq(key)

    def note_block(self, vendor: str, seconds: float, partition: str = "") -> None:
        """Record a block of ``vendor`` (its ``partition``) for ``seconds`` from now (ours or
        another replica's)."""
        self.blocks.note(vendor, seconds, partition)

    def mark(self, vendor: str, partition: str = "") -> BlockMark:
        return self.blocks.mark(vendor, partition)

    def blocked_since(self, vendor: str, mark: BlockMark, partition: str = "") -> float:
        """Seconds of block left if a block of (vendor, partition) began after ``mark`` was
        taken, else 0."""
        return self.blocks.since(vendor, mark, partition)

    def blocked_for(self, vendor: str, partition: str = "") -> float:
        """Seconds until the last known block of ``vendor`` (its ``partition``) ends (0 if none)."""
        return self.blocks.left(vendor, partition)

    def partitions_blocked(self, vendor: str) -> int:
        """Partitions of ``vendor`` other than the default one blocked now (for /status)."""
        return self.blocks.partitions_blocked(vendor)

    async def watch_blocks(self) -> None:
        """Follow other replicas' blocks until cancelled."""
        await self.blocks.watch(self.store, self.key_prefix)

    # -- learned limits (SPEC §10) ---------------------------------------------

    @property
    def learned(self) -> LearnedLimits:
        """What this replica taught the store from vendors' quota headers (learning.py)."""
        return self.teacher.memory

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
        return await self.teacher.learn(vendor, reports, endpoint=endpoint, partition=partition)

    async def learn_meters(
        self, vendor: Vendor, reports: Mapping[str, QuotaReport | BucketReport], partition: str = ""
    ) -> bool:
        """Teach the vendor's meters what its token quota headers (or an answer's body) say
        (``Teacher.learn_meters``)."""
        return await self.teacher.learn_meters(vendor, reports, partition)

    def knows(
        self, vendor: Vendor, reports: Sequence[QuotaReport], *, endpoint: Endpoint | None = None, partition: str = ""
    ) -> bool:
        """Would ``learn`` change nothing (no store call)? Then the reports are counted as
        learnt (the straight path's answers: it hands the others to the general path)."""
        return self.teacher.known(vendor, reports, endpoint=endpoint, partition=partition)

    def learned_rate(self, vendor: Vendor) -> float | None:
        """Requests/s of the vendor's tightest learned global bucket; None when none is learned."""
        return self.teacher.learned_rate(vendor)

    def learned_status(self, vendor: Vendor) -> dict[str, object]:
        """For /status: per global and endpoint class bucket (of the default partition) what
        was learned, from which header, until when."""
        return self.teacher.status(vendor)
