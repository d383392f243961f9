"""memory://: the bucket store for one process, with the Lua scripts' semantics.

Each method runs without awaiting, so it is atomic on the event loop: no lock is
needed. Time comes from the injected Clock. Keys expire once their bucket would
have refilled, as Redis keys do, so idle tenants leave nothing behind.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from proxy.clock import Clock
from proxy.limiter.late_slots import (
    OFFERED,
    Move,
    Slot,
    add_slot,
    drop_stale,
    interval,
    late_room,
    late_units,
    leave,
    left_behind,
    slowest,
    standby,
)
from proxy.limiter.memory_leases import LeaseTable
from proxy.limiter.memory_straight import TakeNow
from proxy.limiter.share_memory import Schedules, Turn
from proxy.limiter.store import (
    AcquireResult,
    BlockResult,
    BucketSpec,
    LearnResult,
    Leases,
    LeaseSet,
    Lesson,
    Reserve,
    Settled,
    ShareAsk,
    StateGuard,
    StraightCall,
)

_SWEEP_EVERY = 4096  # operations between sweeps of expired keys
_KEPT_GRACE = 3600.0  # seconds after its last slot matured a reservation set is forgotten


class MemoryStore:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        # key -> [tokens, ts, expires_at, above, half]; on the clock, seconds (when the level
        # last stood above empty, and above half its burst: acquire.lua's `z` and `zh`)
        self._state: dict[str, list[float]] = {}
        # deferral queue key -> (first free slot, expires_at), on the clock
        self._queues: dict[str, tuple[float, float]] = {}
        # state key -> [grants counted (acquire.lua's seq), expires_at]: it goes with the
        # buckets it counts, as the state hash does on Redis (one per partition ever seen, else)
        self._seq: dict[str, tuple[int, float]] = {}
        self._leases = LeaseTable()
        # replica set key -> {member: last announced}, on the clock (presence.lua)
        self._replicas: dict[str, dict[str, float]] = {}
        # bucket ident -> [rate per s, burst, until, settling since (nan = none)], on the
        # clock: what the vendor's headers taught (feedback.lua's lr, lb, lu, lt)
        self._learned: dict[str, list[float]] = {}
        # reservation set key -> {claim: its slot}, on the clock: the slots kept for
        # deferred callers (acquire.lua, "Kept slots")
        self._kept: dict[str, dict[str, Slot]] = {}
        self._moves: dict[str, list[Move]] = {}  # reservation set key -> its late slots' moves
        # bucket ident -> when it was last blocked (feedback.lua's bk)
        self._blocked_at: dict[str, float] = {}
        # share hash key -> a vendor's schedule (acquire.lua, "Share")
        self._schedules = Schedules()
        self._ops = 0

    def __len__(self) -> int:
        """Live keys (after sweeping the expired ones)."""
        self._sweep(self._clock.monotonic())
        return len(self._state) + len(self._queues) + len(self._leases)

    def _limits(self, b: BucketSpec, now: float) -> tuple[float, float]:
        """The rate and burst in force: the lower of the policy's and the learned ones."""
        learned = self._learned.get(b.ident)
        if learned is None or learned[2] <= now:
            return b.rate, b.burst
        return min(b.rate, learned[0]), min(b.burst, learned[1])

    def _level(self, b: BucketSpec, now: float) -> float:
        rate, burst = self._limits(b, now)
        st = self._state.get(b.ident)
        if st is None or st[2] <= now:
            return burst
        return min(burst, st[0] + (now - st[1]) * rate)

    def _store(self, b: BucketSpec, tokens: float, ts: float) -> None:
        # Same expiry as the scripts: once refilled the key equals a missing one.
        rate, burst = self._limits(b, ts)
        high, st = max(tokens, self._level(b, ts)), self._state.get(b.ident)
        above = ts if high > 0 or st is None else st[3]
        half = ts if high > burst / 2 or st is None else st[4]
        self._state[b.ident] = [tokens, ts, ts + (burst - tokens) / rate + 1.0, above, half]

    def _above(self, b: BucketSpec, now: float) -> tuple[float, float]:
        st = self._state.get(b.ident)
        return (now, now) if st is None or st[2] <= now else (st[3], st[4])

    def _tick(self, now: float) -> None:
        self._ops += 1
        if self._ops % _SWEEP_EVERY == 0:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        for key in [k for k, st in self._state.items() if st[2] <= now]:
            del self._state[key]
        for key in [k for k, (_, expires) in self._queues.items() if expires <= now]:
            del self._queues[key]
        for key in [k for k, (_, expires) in self._seq.items() if expires <= now]:
            del self._seq[key]
        for key in [k for k, learned in self._learned.items() if learned[2] <= now]:
            del self._learned[key]
        self._leases.sweep(now)
        for key in [k for k, kept in self._kept.items() if all(m.matures + _KEPT_GRACE <= now for m in kept.values())]:
            del self._kept[key]  # (a refund then: the buckets, long full again, take none of it)
            self._moves.pop(key, None)
        self._schedules.sweep(now)
        for key in [k for k, at in self._blocked_at.items() if at + _KEPT_GRACE <= now]:
            del self._blocked_at[key]  # (no slot kept lives that long)

    async def acquire(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None = None,
        guard: StateGuard | None = None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        return self.take(buckets, cost, max_wait, queue, guard, leases, reserve, share, costs)

    def straight(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None,
        guard: StateGuard,
        sets: tuple[LeaseSet, ...] = (),
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
    ) -> StraightCall | None:
        return TakeNow(self.take, buckets, cost, max_wait, queue, guard, reserve, share)

    def take(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None = None,
        guard: StateGuard | None = None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        """``acquire``, answered at once: the state is this process's (the straight path,
        lane.py, asks without a coroutine)."""
        now = self._clock.monotonic()
        self._tick(now)
        if queue is None:
            reserve = None  # (a slot is kept only for a caller told to retry: one with a queue)
        if leases is None and not self._learned and (reserve is None or self._unkept(reserve)):
            if reserve is None and share is None:
                plain = self._take_plain(buckets, cost, max_wait, queue, guard, now, costs)
                assert plain is not None  # (refused, not None, unless at_once)
                return plain
            if share is None or self._schedules.quiet(share, now):
                # Nothing kept, nobody's turn to wait for: a grant at once is the one pass's
                # (a wait keeps a slot or takes a turn: the general arithmetic below).
                at_once = self._take_plain(buckets, cost, 0.0, queue, guard, now, costs, at_once=True)
                if at_once is not None:
                    return at_once
        charge = costs if costs is not None else (cost,) * len(buckets)  # what each bucket takes
        levels = [self._level(b, now) for b in buckets]
        limits = [self._limits(b, now) for b in buckets]
        rates = [rate for rate, _ in limits]
        # Kept slots (acquire.lua): the unclaimed ones given back, this caller's claim, or
        # one whose owner is late.
        kept: dict[str, Slot] | None = None
        tenants = 0
        refunded = False
        held: str | None = None
        early: float | None = None
        own_claim = ""  # the slot this caller holds, if any (a weak claim's too)
        claim_wait = 0.0
        if reserve is not None:
            kept = self._kept.setdefault(reserve.key, {})
            tenants = reserve.tenants
            void_before = max((self._blocked_at.get(b.ident, -math.inf) for b in buckets), default=-math.inf)
            refunded = drop_stale(kept, now, reserve, void_before, levels, [burst for _, burst in limits])
            weak = reserve.claim.startswith("?")  # (acquire.lua: honoured only once matured)
            if weak:
                reserve = reserve._replace(claim=reserve.claim[1:])
            if reserve.claim.startswith(OFFERED):  # a slot offered, not its own: a new caller
                reserve = reserve._replace(claim="")
            own_claim = reserve.claim
            own = kept.get(reserve.claim) if reserve.claim else None
            if own is not None:
                if own.created <= void_before:
                    del kept[reserve.claim]
                elif own.matures - now <= max_wait:
                    held, claim_wait = reserve.claim, own.matures - now
                elif not weak:
                    early = own.matures - now
            if weak and held is None:
                reserve = reserve._replace(claim="")
        wait, binding, vendor_wait = 0.0, -1, 0.0
        for i, (rate, level, c) in enumerate(zip(rates, levels, charge, strict=True)):
            need = (c - level) / rate
            if need > wait:
                wait, binding = need, i
            if i >= tenants and need > vendor_wait:
                vendor_wait = need
        # The vendor's schedule (share_memory.py; acquire.lua, "Share").
        turn = None
        if share is not None:
            turn = Turn(self._schedules, share, buckets, charge, rates, levels, now)
        mine = turn is None or turn.gate.ok
        sets = leases.sets if leases is not None else ()
        inflight = [len(self._leases.live(ls.key, now)) for ls in sets]
        full = next((j for j, (ls, count) in enumerate(zip(sets, inflight, strict=True)) if count >= ls.cap), -1)
        # One process holds the state and its reservations alike: it cannot lose one
        # without the other, so the guard only counts (acquire.lua's seq).
        counted = self._seq.get(guard.key) if guard is not None else None
        seq = counted[0] if counted is not None and counted[1] > now else 0

        def write() -> None:
            for i, b in enumerate(buckets):
                self._store(b, levels[i], now)

        def take(first: int, last: int) -> None:
            for i in range(first, last):
                levels[i] -= charge[i]

        def counted_grant() -> int:
            if guard is None:
                return seq
            state = self._state
            self._seq[guard.key] = (seq + 1, max((state[b.ident][2] for b in buckets if b.ident in state), default=now))
            return seq + 1

        def take_leases(matures: float) -> None:
            if leases is not None:
                for j, ls in enumerate(sets):
                    self._leases.live(ls.key, now)[leases.id] = matures + leases.life
                    inflight[j] += 1

        def keep(matures: float, scope: str) -> str:
            assert kept is not None
            return add_slot(kept, Slot(matures, cost, now, scope, costs=costs))

        def refused(slot: float, hint: float, reserved: str = "") -> AcquireResult:
            self._leases.forget_empty()
            result = (False, slot, binding, tuple(levels), hint, seq, False, full, tuple(inflight))
            return AcquireResult(*result, 0.0, reserved)

        pool = None
        if kept and held is None and full < 0:
            assert reserve is not None
            moves = self._moves.setdefault(reserve.key, [])
            bursts = [burst for _, burst in limits]
            above = [self._above(b, now) for b in buckets]
            pool = late_units(kept, moves, now, reserve, charge, void_before, levels, rates, bursts, above, max_wait)
        if pool is not None:  # late slots' units (acquire.lua, "Late slots")
            assert kept is not None and reserve is not None
            need, takes = pool
            for i, t in enumerate(takes):
                levels[i] -= t
            write()
            if own_claim:
                leave(kept, now, own_claim, reserve.owner)
            need = max(need, -interval(charge, rates) / 2)  # paced as granted then (acquire.lua)
            take_leases(now + need)
            seq = counted_grant()
            result = (True, need, binding, tuple(levels), need, seq, False, -1, tuple(inflight))
            return AcquireResult(*result, 0.0, "", True)
        if held is not None:  # a kept slot, matured (acquire.lua)
            assert kept is not None and reserve is not None
            scope, taken = kept[held].scope, kept[held].costs

            def adjust(last: int) -> None:  # a metered slot: this call's costs are taken, not the slot's
                for i in range(last if taken is not None else 0):
                    levels[i] -= charge[i] - taken[i]  # type: ignore[index]

            need = max(claim_wait, 0.0, vendor_wait) if scope == "t" else claim_wait  # (late: negative)
            if full < 0 and need <= max_wait:
                del kept[held]
                if need < 0:  # claimed late: a move the late slots' must fit beside (late_slots.py)
                    self._moves.setdefault(reserve.key, []).append((now, tuple(charge)))
                adjust(tenants if scope == "t" else len(buckets))
                if scope == "t":
                    take(tenants, len(buckets))
                if scope == "t" or refunded or taken is not None:
                    write()
                take_leases(now + need)
                seq = counted_grant()
                result = (True, need, binding, tuple(levels), need, seq, False, -1, tuple(inflight))
                return AcquireResult(*result, 0.0, "", True)
            if full < 0 and scope == "t" and need <= reserve.horizon:
                del kept[held]  # the vendor side has no room yet: kept on every bucket now
                adjust(tenants)
                take(tenants, len(buckets))
                write()
                member = keep(now + need, "a")
                seq = counted_grant()
                return refused(need, need, member)
            if refunded:
                write()
            return refused(need, need, held if held == reserve.claim else "")
        if early is not None:  # its slot is still ahead: refused with it again
            assert reserve is not None
            if refunded:
                write()
            assert kept is not None
            hint, _ = standby(kept, now, now + early, reserve, reserve.claim, interval(charge, rates))
            return refused(early, hint, reserve.claim)
        if mine and wait <= (max_wait if turn is None else turn.horizon(max_wait)) and full < 0:
            if queue is not None and queue in self._queues:
                self._restart_if_overflowed(queue, buckets, charge, rates, now)
            take(0, len(buckets))
            write()
            take_leases(now + wait)
            seq = counted_grant()
            if turn is not None:
                turn.granted(wait, any(lv < c for lv, c in zip(levels[: turn.ask.first_global], charge, strict=False)))
            return AcquireResult(True, wait, binding, tuple(levels), wait, seq, False, -1, tuple(inflight))
        if reserve is not None and mine and full < 0 and wait <= reserve.horizon:
            tenant_bound = binding < tenants  # (acquire.lua: only the tenant's buckets, then)
            take(0, tenants if tenant_bound else len(buckets))
            write()
            member = keep(now + wait, "t" if tenant_bound else "a")
            seq = counted_grant()
            if turn is not None:
                turn.kept(wait)
            assert kept is not None
            return refused(wait, standby(kept, now, now + wait, reserve, member, interval(charge, rates))[0], member)
        if refunded:
            write()
        if full >= 0:  # how long the full set's oldest lease has been out (acquire.lua)
            assert leases is not None
            oldest = min(self._leases.live(sets[full].key, now).values())
            return refused(wait, max(0.0, now - (oldest - leases.life)))
        if turn is None:
            hint = self._slot(queue, now, wait, charge[binding] / rates[binding])
            if kept is not None and reserve is not None:  # beyond the horizon: a slot left behind may be its
                offer, offered = standby(kept, now, now + hint, reserve, "", interval(charge, rates))
                if offered:
                    return refused(wait, offer, OFFERED + offered)
            return refused(wait, hint)
        wait, binding, step = turn.refused(wait, binding, charge[binding] / rates[binding])
        hint = self._slot(queue, now, wait, step)
        turn.refused_with(binding, hint)
        return refused(wait, hint)

    def _take_plain(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None,
        guard: StateGuard | None,
        now: float,
        costs: tuple[float, ...] | None = None,
        at_once: bool = False,
    ) -> AcquireResult | None:
        """``take`` without leases, slots or a schedule while nothing is learned: the same
        arithmetic in one pass, for the straight path's every request (``costs``: per bucket;
        ``at_once``: None, and nothing done, instead of a refusal)."""
        state = self._state
        levels = []
        wait, binding = 0.0, -1
        for i, b in enumerate(buckets):
            st = state.get(b.ident)
            if st is None or st[2] <= now:
                level = b.burst
            else:
                level = st[0] + (now - st[1]) * b.rate
                if level > b.burst:
                    level = b.burst
            levels.append(level)
            need = ((cost if costs is None else costs[i]) - level) / b.rate
            if need > wait:
                wait, binding = need, i
        counted = self._seq.get(guard.key) if guard is not None else None
        seq = counted[0] if counted is not None and counted[1] > now else 0
        if wait > max_wait:
            if at_once:
                return None
            self._leases.forget_empty()
            hint = self._slot(queue, now, wait, (cost if costs is None else costs[binding]) / buckets[binding].rate)
            return AcquireResult(False, wait, binding, tuple(levels), hint, seq, False, -1, ())
        if queue is not None and queue in self._queues:
            self._restart_if_overflowed(queue, buckets, costs or (cost,) * len(buckets), [b.rate for b in buckets], now)
        latest = now
        for i, b in enumerate(buckets):  # (_store's expiry and `above`)
            level, st = levels[i] - (cost if costs is None else costs[i]), state.get(b.ident)
            fresh = st is None or st[2] <= now
            above = now if levels[i] > 0 or fresh else st[3]  # type: ignore[index]
            half = now if levels[i] > b.burst / 2 or fresh else st[4]  # type: ignore[index]
            levels[i] = level
            expires = now + (b.burst - level) / b.rate + 1.0
            state[b.ident] = [level, now, expires, above, half]
            if expires > latest:
                latest = expires
        if guard is not None:
            self._seq[guard.key] = (seq + 1, latest)
            seq += 1
        return AcquireResult(True, wait, binding, tuple(levels), wait, seq, False, -1, ())

    def _unkept(self, reserve: Reserve) -> bool:
        """No slot kept in ``reserve``'s set, and the caller claims none: its kept-slot
        arithmetic has nothing to do for a grant."""
        return not reserve.claim and not self._kept.get(reserve.key)

    async def release(self, sets: tuple[LeaseSet, ...], lease_ids: tuple[str, ...], channel: str) -> tuple[int, ...]:
        return self._release(sets, lease_ids)

    def _release(self, sets: tuple[LeaseSet, ...], lease_ids: tuple[str, ...]) -> tuple[int, ...]:
        return self._leases.release(sets, lease_ids, self._clock.monotonic())

    def release_then(
        self,
        sets: tuple[LeaseSet, ...],
        lease_ids: tuple[str, ...],
        channel: str,
        then: Callable[[tuple[int, ...] | None, BaseException | None], None],
    ) -> bool:
        then(self._release(sets, lease_ids), None)
        return True

    async def renew(self, leases: tuple[tuple[LeaseSet, str], ...], life: float) -> int:
        return self._leases.renew(leases, life, self._clock.monotonic())

    async def inflight(self, sets: tuple[LeaseSet, ...]) -> tuple[int, ...]:
        return self._leases.inflight(sets, self._clock.monotonic())

    def _restart_if_overflowed(
        self, queue: str, buckets: tuple[BucketSpec, ...], charge: Sequence[float], rates: Sequence[float], now: float
    ) -> None:
        """A grant that finds the slowest of its buckets overflowed (full while the callers
        told a slot slept) starts ``queue`` again (acquire.lua, "Deferral queue")."""
        i = slowest(charge, rates)
        burst, st = self._limits(buckets[i], now)[1], self._state.get(buckets[i].ident)
        if charge[i] > 0 and (st is None or st[2] <= now or st[0] + (now - st[1]) * rates[i] > burst):
            del self._queues[queue]

    def _slot(self, queue: str | None, now: float, wait: float, step: float) -> float:
        """The refused caller's retry hint: its slot in the queue, never before ``wait`` (acquire.lua)."""
        if queue is None:
            return wait
        tail, expires = self._queues.get(queue, (now, now))
        hint = max(wait, tail - now + step) if expires > now else wait
        self._queues[queue] = (now + hint, now + hint + 1.0)
        return hint

    async def block(self, buckets: tuple[BucketSpec, ...], seconds: float, channel: str) -> BlockResult:
        now = self._clock.monotonic()
        levels: list[float] = []
        longest = 0.0
        for b in buckets:
            level = self._level(b, now)
            rate = self._limits(b, now)[0]
            ts = max(now + seconds, now + max(0.0, -level) / rate)
            self._store(b, 0.0, ts)
            self._blocked_at[b.ident] = now  # slots kept before now are void (feedback.lua's bk)
            levels.append(-(ts - now) * rate)
            longest = max(longest, ts - now)
        return BlockResult(longest, tuple(levels))

    async def drain(self, buckets: tuple[BucketSpec, ...]) -> BlockResult:
        now = self._clock.monotonic()
        levels = tuple(min(self._level(b, now), 0.0) for b in buckets)
        for b, level in zip(buckets, levels, strict=True):
            self._store(b, level, now)
        return BlockResult(0.0, levels)

    async def refund(self, buckets: tuple[BucketSpec, ...], cost: float) -> tuple[float, ...]:
        return self._settle(buckets, (cost,) * len(buckets))

    async def settle(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float = 0.0
    ) -> tuple[float, ...]:
        return self._settle(buckets, amounts, since)

    def settle_then(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float, then: Settled
    ) -> bool:
        then(self._settle(buckets, amounts, since), None)
        return True

    def _settle(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float = 0.0
    ) -> tuple[float, ...]:
        now = self._clock.monotonic()
        levels: list[float] = []
        for b, amount in zip(buckets, amounts, strict=True):
            level = self._level(b, now)
            if amount > 0 and since > 0:  # (store.settle: what its history allows)
                amount = min(amount, late_room(self._limits(b, now)[1], level, self._above(b, now), now - since + 1e-6))
            if amount < 0 or (b.ident in self._state and self._state[b.ident][2] > now):
                level = min(self._limits(b, now)[1], level + amount)
                self._store(b, level, now)
            levels.append(level)
        return tuple(levels)

    async def learn(self, buckets: tuple[BucketSpec, ...], lessons: tuple[Lesson, ...]) -> LearnResult:
        now = self._clock.monotonic()
        levels: list[float] = []
        rates: list[float] = []
        bursts: list[float] = []
        settling: list[float] = []
        for b, lesson in zip(buckets, lessons, strict=True):
            rate, _ = self._limits(b, now)
            level = self._level(b, now)
            learned = self._learned.get(b.ident)
            since = learned[3] if learned is not None else math.nan
            if lesson.forget:
                self._learned.pop(b.ident, None)
                since = math.nan
            elif lesson.rate is not None and lesson.burst is not None:
                if min(b.rate, lesson.rate) < rate * (1 - 1e-9):
                    since = now
                self._learned[b.ident] = [lesson.rate, lesson.burst, now + lesson.ttl, since]
            new_rate, new_burst = self._limits(b, now)
            left = 0.0 if math.isnan(since) else max(since + lesson.window - now, 0.0)
            # The new line goes through the present one's: its level now, or while tokens are
            # reserved, the moment they have all matured (feedback.lua).
            t, ts = level, now
            if level < 0:
                t, ts = 0.0, now - level / rate
                level = -(ts - now) * new_rate
            target = min(level, new_burst)
            if lesson.remaining is not None:
                target = min(target, lesson.remaining - new_rate * left)
            if target < level:
                t, ts, level = target, now, target
            st = self._state.get(b.ident)
            if (st is not None and st[2] > now) or ts != now or t < new_burst:
                self._store(b, t, ts)
            level = min(level, new_burst)
            levels.append(level)
            rates.append(new_rate)
            bursts.append(new_burst)
            settling.append(left)
        return LearnResult(tuple(levels), tuple(rates), tuple(bursts), tuple(settling))

    async def peek(self, buckets: tuple[BucketSpec, ...]) -> tuple[float, ...]:
        now = self._clock.monotonic()
        return tuple(self._level(b, now) for b in buckets)

    async def publish(self, channel: str, data: str) -> None:
        return  # one process: nobody else to tell

    async def watch(self, pattern: str, on_message: Callable[[str, str], None]) -> None:
        return  # one process: it knows its own blocks, releases and lags

    async def left(self, kept_key: str, claims: tuple[str, ...]) -> int:
        return left_behind(self._kept.get(kept_key, {}), claims)

    async def announce(self, key: str, member: str, stale: float, leave: bool = False) -> int:
        now = self._clock.monotonic()
        members = self._replicas.setdefault(key, {})
        if leave:
            members.pop(member, None)
        else:
            members[member] = now
        for gone in [m for m, seen in members.items() if seen < now - stale]:
            del members[gone]
        if not members:
            del self._replicas[key]
        return len(members)

    async def ping(self, probes: tuple[str, ...] = ()) -> None:
        """(Always up.)"""

    async def close(self) -> None:
        self._state.clear()

    def set_level(self, b: BucketSpec, tokens: float, at: float) -> None:
        """Put ``tokens`` in bucket ``b`` as of ``at`` (on the clock): where a replica's
        in-process shares start when the store fails (degraded.py)."""
        self._store(b, min(tokens, b.burst), at)

    def ttl(self, key: str) -> float | None:
        """Seconds until ``key`` expires, None when absent (the scripts' PTTL, for tests)."""
        st, now = self._state.get(key), self._clock.monotonic()
        return None if st is None or st[2] <= now else st[2] - now
