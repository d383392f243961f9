"""Fleet-wide concurrency caps (SPEC §10): a lease per request in flight.

A vendor's ``concurrency`` (and an endpoint class's) is a lease set in the store
(``lease_sets`` in limiter/buckets.py). A request takes a lease in every set that
applies together with its tokens, in the same store call (acquire.lua); a full set
refuses, taking nothing. Around that call this module keeps what one replica needs:

- ``Slot``: one request's (or one blind tunnel's) leases. ``with concurrency.slot(...)``
  gives them back on every way out (answer relayed, upstream error, worker gone,
  hold cancelled, a refusal after the grant, drain), once, in the background so
  that no answer waits for the store.
- Arrival order: a request held for a slot waits in a FIFO per lease set on this
  replica, woken when a lease is released (here, or announced by another replica
  over the store's pub/sub), never by polling; each wake retries the acquire with
  the hold time left, up to ``max_hold``; then the request's action (defer or shed).
- Renewal: a lease lives the vendor's connect + read timeouts (plus a margin)
  unless renewed; each vendor's live leases are renewed in one store call every
  third of that, so a long download or an open tunnel keeps its slot, and a
  replica that died (SIGKILL) frees its slots within one life.

With ``store.on_failure: local`` a request granted by the replica's local share
takes a lease in that replica's share of each cap (proxy/limiter/degraded.py), given
back and renewed in-process; waiters are woken by those releases like by the store's.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from proxy.clock import Clock
from proxy.limiter import Limiter, StoreUnavailable
from proxy.limiter.buckets import lease_sets, release_channel, release_channel_pattern
from proxy.limiter.presence import replica_id
from proxy.limiter.store import AcquireResult, Leases, LeaseSet
from proxy.policy.model import Endpoint, Vendor, Wish
from proxy.quota.sizing import Sizing
from proxy.tasks import cancel_and_wait, spawn
from proxy.wire.refusals import Limited

log = logging.getLogger("quota_proxy.concurrency")

LIFE_MARGIN = 0.5
"""Seconds a lease outlives the vendor's connect + read timeouts before its first renewal."""
_MIN_HINT = 0.01  # seconds: the least a full cap's retry hint says (a slot may free any moment)
_MAX_HINT = 60.0  # seconds: the most (an exchange out that long is the vendor's timeout's business)
_RELEASE_MAX = 256  # lease ids in one store call
_CLOSE_WAIT = 1.0  # seconds close() waits for the last releases to reach the store
_CACHE_MAX = 1024  # (vendor, endpoint) lease set tuples kept

Attempt = Callable[[float], Awaitable[AcquireResult]]
"""One acquire of a request's tokens and leases, given how long it may wait for a reservation."""


def lease_life(vendor: Vendor) -> float:
    """Seconds a lease lives unless renewed: longer than a live exchange can go without
    the vendor saying anything, so only a dead replica's leases run out."""
    return vendor.timeouts.connect + vendor.timeouts.read + LIFE_MARGIN


class Slot:
    """The leases of one request (or blind tunnel), given back once when it ends.

    ``taken`` once the store granted them; ``close`` (or leaving the ``with`` block)
    releases them in the background. A vendor without caps gets ``UNCAPPED``."""

    __slots__ = ("_owner", "leases", "taken", "vendor", "waited")

    def __init__(self, owner: Concurrency | None, vendor: str, leases: Leases | None) -> None:
        self._owner = owner
        self.vendor = vendor
        self.leases = leases
        """None: no cap applies, nothing to take."""
        self.taken = False
        self.waited = 0.0
        """Seconds the request waited for a free slot (0: it did not)."""

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.taken and self._owner is not None:
            self.taken = False
            self._owner.release(self)

    async def give_back(self) -> None:
        """Give the leases back now and wait until the store has them (or failed): the
        vendor's answer is in, and the worker, once it has it, may call again at once
        (on any replica) and must find the slot free. ``close`` then does nothing."""
        if self.taken and self._owner is not None:
            self.taken = False
            await self._owner.release_now(self)

    def give_back_then(self, then: Callable[[], None]) -> None:
        """``give_back`` for a caller without a coroutine (the straight path, lane.py):
        ``then()`` once the store has the leases back (or failed to take them)."""
        if self.taken and self._owner is not None:
            self.taken = False
            self._owner.release(self, then)
        else:
            then()

    def detach(self) -> Callable[[], None]:
        """Leave the leases taken past the ``with`` block: they are given back when the
        returned function is called, by whoever knows the request has ended (the vendor's
        connection, hearing out the answer of a worker that went away)."""
        if not self.taken or self._owner is None:
            return _nothing
        self.taken = False
        return functools.partial(self._owner.release, self)


def _nothing() -> None:
    pass


UNCAPPED = Slot(None, "", None)
"""What a request of a vendor without caps holds: nothing."""


class _Waiter:
    """A request held for a slot, in a lease set's queue, in arrival order (``seq``)."""

    __slots__ = ("future", "key", "seq", "vendor", "woken")

    def __init__(self, seq: int, key: str, vendor: str) -> None:
        self.seq = seq
        self.key = key
        self.vendor = vendor
        self.woken = False
        """A wake not yet used by a retry: a slot may be free."""
        self.future: asyncio.Future[None] | None = None

    def wake(self) -> None:
        self.woken = True
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


class Concurrency:
    """This replica's side of the fleet-wide caps: slots, waiters, renewals, what the store said."""

    def __init__(self, limiter: Limiter, clock: Clock, sizing: Sizing, replica: str | None = None) -> None:
        self._limiter = limiter
        self._store = limiter.store
        self._prefix = limiter.key_prefix
        self.clock = clock
        self._sizing = sizing
        self._replica = replica or replica_id()
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._sets: dict[tuple[str, str | None], tuple[Vendor, Endpoint | None, tuple[LeaseSet, ...]]] = {}
        self._queues: dict[str, list[_Waiter]] = {}
        self._held: dict[str, int] = {}  # vendor -> requests held for a slot now
        self._inflight: dict[str, int] = {}  # set key -> fleet-wide leases as the store last said
        # set key -> releases heard (announced, or given back locally): a request that finds
        # its set full retries at once when one was heard while its acquire was on its way
        self._releases: dict[str, int] = {}
        self._live: dict[str, dict[str, Slot]] = {}  # vendor -> lease id -> slot, renewed
        self._renewers: dict[str, asyncio.Task[None]] = {}
        self._releasing: set[asyncio.Future[None]] = set()
        # (vendor, sets) -> the leases given back this loop turn (with what to call once the
        # store has them): one store call for them all
        self._to_release: dict[tuple[str, tuple[LeaseSet, ...]], list[tuple[Leases, Callable[[], None] | None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- slots -------------------------------------------------------------------

    def sets(self, vendor: Vendor, endpoint: Endpoint | None) -> tuple[LeaseSet, ...]:
        key = (vendor.name, None if endpoint is None else endpoint.name)
        hit = self._sets.get(key)
        if hit is not None and hit[0] is vendor and hit[1] is endpoint:
            return hit[2]
        if len(self._sets) >= _CACHE_MAX:
            self._sets.clear()
        sets = lease_sets(self._prefix, vendor, endpoint)
        self._sets[key] = (vendor, endpoint, sets)
        return sets

    def slot(self, vendor: Vendor, endpoint: Endpoint | None) -> Slot:
        """The slot a request of ``vendor`` (class ``endpoint``) needs; not taken yet."""
        sets = self.sets(vendor, endpoint)
        if not sets:
            return UNCAPPED
        return Slot(self, vendor.name, Leases(f"{self._replica}:{next(self._ids)}", lease_life(vendor), sets))

    async def acquire(self, slot: Slot, wish: Wish, attempt: Attempt) -> AcquireResult:
        """Take the request's tokens and its slot's leases with ``attempt``.

        A full cap: a hold waits in arrival order for a free slot and retries with the
        hold time left, up to its ``max_hold``; otherwise (or then) the refusal is raised
        (Limited, scope ``concurrency``). A refusal by the buckets is returned, as is a
        grant; the slot is then ``taken`` and must be closed."""
        leases = slot.leases
        if leases is None:
            return await attempt(wish.max_wait)
        hold = wish.action == "hold"
        start = self.clock.monotonic()
        deadline = start + wish.max_wait
        waiter: _Waiter | None = None
        if hold:  # requests already waiting here for one of these sets came first
            queued = next((ls.key for ls in leases.sets if self._queues.get(ls.key)), None)
            if queued is not None:
                waiter = self._enqueue(slot.vendor, queued)
        heard_meanwhile = False
        try:
            while True:
                if waiter is not None and not heard_meanwhile:
                    await self._sleep(waiter, deadline - self.clock.monotonic())
                left = max(deadline - self.clock.monotonic(), 0.0)
                heard = self._heard(leases.sets)
                result = await attempt(left)
                # A release announced while the answer was on its way woke nobody yet.
                heard_meanwhile = self._heard(leases.sets) != heard
                # A full set has no room to wake anyone for (a local share's cap is smaller
                # than the one the sets name: waking by it would spin the waiters).
                self._saw(leases.sets, result.inflight, wake=result.full < 0)
                if result.granted:
                    self._take(slot)
                    return result
                if result.full < 0 or result.wait > left:
                    return result  # the buckets refuse too: theirs is the answer
                full = leases.sets[result.full]
                if not hold or left <= 0:
                    raise self._refusal(slot.vendor, wish, full, result.hint)
                if waiter is None:
                    waiter = self._enqueue(slot.vendor, full.key)
                elif waiter.key != full.key:
                    self._leave(waiter)
                    waiter = self._enqueue(slot.vendor, full.key, waiter.seq)
        finally:
            if waiter is not None:
                self._leave(waiter)
                slot.waited = self.clock.monotonic() - start

    def _refusal(self, vendor: str, wish: Wish, full: LeaseSet, oldest: float) -> Limited:
        """A full cap's refusal. When to retry: when the oldest request in flight (out for
        ``oldest`` seconds, fleet-wide) is likely done: at the vendor's usual latency, or,
        before any exchange was timed, after as long again as it has been out."""
        latency = self._sizing.latency(vendor)
        left = oldest if latency is None else latency - oldest
        wait = min(max(left, _MIN_HINT), _MAX_HINT)
        return Limited("shed" if wish.action == "shed" else "defer", wait, "concurrency", full.label)

    def took(self, slot: Slot) -> None:
        """The store granted ``slot``'s leases (with the request's tokens): it is ``taken``,
        and renewed while the request is out."""
        self._take(slot)

    def _take(self, slot: Slot) -> None:
        assert slot.leases is not None
        slot.taken = True
        self._live.setdefault(slot.vendor, {})[slot.leases.id] = slot
        if slot.vendor not in self._renewers:
            self._renewers[slot.vendor] = spawn(self._renew(slot.vendor), name=f"renew-leases-{slot.vendor}")

    def release(self, slot: Slot, then: Callable[[], None] | None = None) -> None:
        """Give a slot's leases back, in the background (``Slot.close`` calls this), and
        ``then()`` once the store has them (or failed to take them). The releases of a loop
        turn on the same sets go to the store together, in one call (one per request was a
        second EVALSHA per request on a vendor with a cap)."""
        leases = slot.leases
        assert leases is not None
        live = self._live.get(slot.vendor)
        if live is not None:
            live.pop(leases.id, None)
        if not self._to_release:
            loop = self._loop
            if loop is None or loop.is_closed():  # remembered: get_running_loop() makes a getpid() call
                loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._give_back_turn)
        self._to_release.setdefault((slot.vendor, leases.sets), []).append((leases, then))

    async def release_now(self, slot: Slot) -> None:
        """``release``, returning when the store has the leases back (or failed to take
        them: they then run out within their life). A caller cancelled meanwhile does not
        cancel the release."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.release(slot, functools.partial(_settle, done))
        await asyncio.shield(done)

    def _give_back_turn(self) -> None:
        batches, self._to_release = self._to_release, {}
        for (vendor, sets), group in batches.items():
            for start in range(0, len(group), _RELEASE_MAX):
                part = group[start : start + _RELEASE_MAX]
                if self._limiter.local is None and self._sent_back(vendor, sets, part):
                    continue
                task = spawn(self._give_back(vendor, sets, part), name="release-leases")
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)

    def _sent_back(
        self, vendor: str, sets: tuple[LeaseSet, ...], group: list[tuple[Leases, Callable[[], None] | None]]
    ) -> bool:
        """The group's release sent without a task (``BucketStore.release_then``), its
        waiters told from the callback that reads the reply; False: nothing sent."""
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()  # (what close() waits for)
        ids = tuple(leases.id for leases, _ in group)
        then = functools.partial(self._given_back, vendor, sets, group, done)
        if not self._store.release_then(sets, ids, release_channel(self._prefix, vendor), then):
            return False
        if not done.done():
            self._releasing.add(done)
            done.add_done_callback(self._releasing.discard)
        return True

    def _given_back(
        self,
        vendor: str,
        sets: tuple[LeaseSet, ...],
        group: list[tuple[Leases, Callable[[], None] | None]],
        done: asyncio.Future[None],
        counts: tuple[int, ...] | None,
        exc: BaseException | None,
    ) -> None:
        try:
            if counts is not None:
                self._saw(sets, counts)
            else:  # the leases run out by themselves within their life
                log.debug("could not release %d lease(s) of %s (%s)", len(group), vendor, exc)
        finally:
            if not done.done():
                done.set_result(None)
            for _, then in group:
                if then is not None:
                    then()

    async def _give_back(
        self, vendor: str, sets: tuple[LeaseSet, ...], group: list[tuple[Leases, Callable[[], None] | None]]
    ) -> None:
        try:
            await self._give_back_now(vendor, sets, [leases for leases, _ in group])
        finally:
            for _, then in group:
                if then is not None:
                    then()

    async def _give_back_now(self, vendor: str, sets: tuple[LeaseSet, ...], group: list[Leases]) -> None:
        if self._limiter.local is None:  # (no share granted any of them: no await per lease)
            ids = [leases.id for leases in group]
            group = []
        else:
            ids = []
        for leases in group:
            local = await self._limiter.release_local(leases)
            if local is None:
                ids.append(leases.id)
                continue
            # granted by a local share while the store was out
            for ls in sets:
                self._releases[ls.key] = self._releases.get(ls.key, 0) + 1
            self._saw(sets, local)
        if not ids:
            return
        try:
            counts = await self._store.release(sets, tuple(ids), release_channel(self._prefix, vendor))
        except StoreUnavailable as exc:  # the leases run out by themselves within their life
            log.debug("could not release %d lease(s) of %s (%s)", len(ids), vendor, exc)
            return
        self._saw(sets, counts)

    # -- waiting for a slot ----------------------------------------------------------

    def _enqueue(self, vendor: str, key: str, seq: int | None = None) -> _Waiter:
        waiter = _Waiter(next(self._seq) if seq is None else seq, key, vendor)
        queue = self._queues.setdefault(key, [])
        if not queue or queue[-1].seq < waiter.seq:
            queue.append(waiter)
        else:  # moved from another set's queue: keeps its place by arrival
            queue.insert(bisect.bisect([w.seq for w in queue], waiter.seq), waiter)
        self._held[vendor] = self._held.get(vendor, 0) + 1
        return waiter

    def _leave(self, waiter: _Waiter) -> None:
        queue = self._queues.get(waiter.key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._held[waiter.vendor] -= 1
            if not queue:
                del self._queues[waiter.key]
            elif waiter.woken:  # a wake it did not use may stand for a free slot: pass it on
                self._wake(waiter.key, sum(w.woken for w in queue) + 1)

    async def _sleep(self, waiter: _Waiter, left: float) -> None:
        """Until ``waiter`` is woken or ``left`` seconds have passed; a wake that came
        while it was retrying is used at once."""
        if not waiter.woken and left > 0:
            future = waiter.future = asyncio.get_running_loop().create_future()
            timer = spawn(self.clock.sleep(left), name="slot-wait")
            try:
                await asyncio.wait((future, timer), return_when=asyncio.FIRST_COMPLETED)
            finally:
                timer.cancel()
                waiter.future = None
        waiter.woken = False  # this wake is used by the retry that follows

    def _wake(self, key: str, free: int) -> None:
        """``free`` slots of set ``key`` may be free: see that as many of its first waiters retry."""
        queue = self._queues.get(key)
        if not queue or free <= 0:
            return
        woken = sum(w.woken for w in queue)
        for waiter in queue:
            if woken >= free:
                return
            if not waiter.woken:
                waiter.wake()
                woken += 1

    def _saw(self, sets: tuple[LeaseSet, ...], inflight: tuple[int, ...], *, wake: bool = True) -> None:
        """What the store said (an acquire or a release): fleet-wide counts (a local share's
        own while the store is out), and room for waiters."""
        for ls, count in zip(sets, inflight, strict=False):
            self._inflight[ls.key] = count
            if wake and ls.key in self._queues:
                self._wake(ls.key, ls.cap - count)

    def heard_release(self, keys: tuple[str, ...]) -> None:
        """A release announced fleet-wide (release.lua): each of ``keys`` gained room."""
        for key in keys:
            self._releases[key] = self._releases.get(key, 0) + 1
            self._wake(key, 1)

    def _heard(self, sets: tuple[LeaseSet, ...]) -> int:
        return sum(self._releases.get(ls.key, 0) for ls in sets)

    async def watch(self) -> None:
        """Wake waiters on the releases other replicas announce, until cancelled."""
        await self._store.watch(
            release_channel_pattern(self._prefix), lambda _channel, data: self.heard_release(tuple(data.split()))
        )

    # -- renewal -------------------------------------------------------------------

    async def _renew(self, vendor: str) -> None:
        """Keep ``vendor``'s live leases alive, one store call every third of their life,
        until none is left."""
        try:
            while live := self._live.get(vendor):
                await self.clock.sleep(min(_life(s) for s in live.values()) / 3)
                live = self._live.get(vendor, {})
                pairs = tuple((ls, lease_id) for lease_id, slot in live.items() for ls in _sets(slot))
                if not pairs:
                    continue
                life = max(_life(s) for s in live.values())
                await self._limiter.renew_local(pairs, life)
                try:
                    await self._store.renew(pairs, life)
                except StoreUnavailable as exc:  # next time, then; a lease outlives two misses
                    log.debug("could not renew %d lease(s) of %s (%s)", len(pairs), vendor, exc)
        finally:
            self._renewers.pop(vendor, None)

    # -- what the rest of the proxy reads ------------------------------------------------

    def inflight_seen(self, vendor: Vendor, endpoint: Endpoint | None = None) -> int:
        """Leases in the vendor's set (or the endpoint class's), fleet-wide, as the store last
        said (0 before it said anything)."""
        sets = lease_sets(self._prefix, vendor, endpoint)
        return self._inflight.get(sets[0].key, 0) if sets else 0

    def held_for_slot(self, vendor: str) -> int:
        """Requests of ``vendor`` waiting on this replica for a free slot."""
        return self._held.get(vendor, 0)

    async def status(self, vendor: Vendor) -> dict[str, Any]:
        """/status: the vendor's cap, its fleet-wide leases now (asking the store), and the
        requests held here for a slot; the same per endpoint class with a cap."""
        own = lease_sets(self._prefix, vendor, None)
        classes = [(e, lease_sets(self._prefix, vendor, e)[0]) for e in vendor.endpoints if e.concurrency is not None]
        sets = own + tuple(ls for _, ls in classes)
        counts: tuple[int | None, ...] = ()
        if sets:
            try:
                now = await self._store.inflight(sets)
            except StoreUnavailable:
                counts = tuple(self._inflight.get(ls.key) for ls in sets)
            else:
                self._saw(sets, now)
                counts = now
        entry: dict[str, Any] = {
            "cap": vendor.concurrency,
            "inflight": counts[0] if own else None,
            "held_for_slot": self.held_for_slot(vendor.name),
        }
        if classes:
            entry["endpoints"] = {
                e.name: {"cap": e.concurrency, "inflight": count}
                for (e, _), count in zip(classes, counts[len(own) :], strict=True)
            }
        return entry

    async def close(self) -> None:
        """Shutting down: give back what is still held, wait (briefly) for the releases to
        reach the store, stop renewing."""
        for live in self._live.values():
            for slot in list(live.values()):
                slot.close()
        if self._to_release:
            self._give_back_turn()
        if self._releasing:
            await asyncio.wait(set(self._releasing), timeout=_CLOSE_WAIT)
        for task in list(self._renewers.values()):
            await cancel_and_wait(task)


def _settle(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _life(slot: Slot) -> float:
    return slot.leases.life if slot.leases is not None else LIFE_MARGIN


def _sets(slot: Slot) -> tuple[LeaseSet, ...]:
    return slot.leases.sets if slot.leases is not None else ()
