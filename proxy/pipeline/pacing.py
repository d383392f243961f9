"""Requests reach the vendor no closer together than their grants were, unless the
vendor's bucket had room for it.

The store grants by the vendor's buckets, on the store's clock; the vendor counts
arrivals. Between its grant and its write a request can be delayed while the next ones
are not: a connection still opening (TLS handshakes at a cold start), a busy or stalled
event loop, a held request woken late. Grants that fitted the bucket then reach the vendor
bunched, and a vendor counting a strict window that rate + burst fills exactly sees too
many: one stalled replica releasing 150 ms of its held requests at once put 102 in a
window of 100 while the other replica went on time (issue 10 item 5).

So each replica keeps, per vendor-side bucket (the vendor's global and endpoint-class
buckets of the request's partition), the *lag* of its last write: how long after its
grant it was written. A request is written no less late than that: after a stall the
replica's later requests are shifted by the stall, as far apart as the store granted
them, never bunched, whatever the other replicas do (the grants of a shifted stream fit
the bucket as the grants did). The lag is the longest stall of a busy spell, not a sum:
it ends once the bucket's last write is older than the vendor's longest window (no
window can hold both), and until then costs every request of the spell that much latency.

A lag may not shrink while requests keep coming, unless the bucket had room for it: a
request written less late than the one before it is early against the shifted stream, as
are the ones after it, and their number is at most what the bucket grants over the drop
(rate x drop). So a request granted with that many tokens (and its own) still in the bucket
(the store says how many were left) may drop the lag by that much: by all of it when the
room covers the whole lag (a vendor whose limit does not bind never carries a lag), by
room / rate otherwise, and by no more than that over a window counted from the lag's
highest (``_Lag.peak``), or one room would pay for many drops. A bound bucket keeps its
lag until a quiet window. (Before, only a room for the whole lag dropped it: a lag above
burst / rate never ended while requests kept coming, and on a busy loop every late wake-up
added to it, up to ``MAX_WAIT``: a bucket at two thirds of its rate wrote every request
~1 s late for good.)

The lag is the fleet's, not only the replica's: a replica whose lag grows (a stall) tells
the others through the store (``on_grown``; rare: once per stall), and they ``adopt`` it,
so a stall on one shifts every replica's writes alike rather than putting the stalled
replica's late requests in the windows of the others' on-time ones (about its rate x the
stall more per window: one window of 101 in five 60-s runs of hold/40/2/busy before).

A wait of more than ``MAX_WAIT`` is not a stall to carry on (no request was held that
long by one) but a ledger out of step (a clock jump, a lag from before the store lost
its state): the store granted the request, so it goes, and the lag restarts from it.

All of this holds if a bucket's requests are written in the order they were granted,
which is not a given: a request that must open its connection first (a cold start, a
TLS handshake) is overtaken by one granted after it that finds an idle one, and its own
lag is not known yet when the later one is written. At a cold start the burst waited
for its handshakes while the next grants went out on connections opened meanwhile, 7
requests in the vendor's first 10 ms where the bucket had granted 6, and a window of
101. So a request that has to connect first says so (``connecting``) until it is
written, and a request granted after it, on a bucket it shares without room to spare
for what it may be early by, waits for it to be written first (``after_earlier``; at
most ``MAX_WAIT``). Requests that find a connection and no earlier one still
connecting (nearly all) pay one attribute test.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from proxy.clock import Clock
from proxy.limiter.buckets import Buckets
from proxy.limiter.store import BucketSpec
from proxy.policy.model import Vendor

MAX_WAIT = 1.0  # seconds a write is held at most; longer: the store is trusted (see above)
_MAX_TRACKED = 10_000  # buckets remembered at most (partitions are many)
GROWN = 0.002  # seconds a lag must grow by before the other replicas are told


class Paced(NamedTuple):
    """What the pacer needs of one granted request when it is written (``Pacer.reserve``)."""

    specs: tuple[BucketSpec, ...]
    """Its vendor-side buckets."""
    granted: float
    """When it was granted (the clock's time; a hold: when it matured)."""
    window: float
    """The vendor's longest window (``longest_window``)."""
    room: tuple[float, ...]
    """The tokens each of ``specs`` had left once its own were taken, at its grant."""
    cost: float


def vendor_room(
    b: Buckets, levels: Sequence[float], wait: float, cost: float, estimates: tuple[float, ...] = ()
) -> tuple[tuple[BucketSpec, ...], tuple[float, ...]]:
    """``Paced.specs`` and ``Paced.room`` of a request granted with ``levels`` (the store's,
    one per bucket of ``b``) to be written ``wait`` seconds on (a hold: its buckets refill
    meanwhile). Its request buckets the vendor counts, then, for a metered request, its
    meters' own (SPEC §14: the vendor counts those too, and a stall bunches their tokens as
    it bunches requests), each meter's room told less its estimate and plus ``cost``, as the
    pacer weighs a bucket's room against the request's ``cost``."""
    specs = b.vendor_side
    first = b.tenant_count
    room = list(levels[first : first + len(specs)])
    if b.paced_meters and estimates:
        costs = b.costs(cost, estimates)
        specs = specs + b.paced_meter_part
        room += [levels[i] - costs[i] + cost for i in b.paced_meters]
    if wait > 0:
        room = [level + wait * spec.rate for spec, level in zip(specs, room, strict=False)]
    return specs, tuple(room)


_WINDOWS: dict[int, tuple[Vendor, float]] = {}  # per policy vendor: asked on every request


def longest_window(vendor: Vendor) -> float:
    """Seconds of the vendor's longest limit (global or endpoint class): past it, a request
    that went late no longer shares a window with the next one."""
    hit = _WINDOWS.get(id(vendor))
    if hit is not None and hit[0] is vendor:
        return hit[1]
    limits = [
        *vendor.limits,
        *(limit for endpoint in vendor.endpoints for limit in endpoint.limits),
        *(limit for meter in vendor.meters for limit in meter.limits),
    ]
    window = max((limit.per for limit in limits), default=1.0)
    if len(_WINDOWS) >= 1024:  # reloads leave old vendors behind
        _WINDOWS.clear()
    _WINDOWS[id(vendor)] = (vendor, window)
    return window


class _Lag(NamedTuple):
    """A bucket's lag: that of the replica's last write to it, and when that was."""

    lag: float
    at: float
    peak: float
    """The highest lag since ``since``: within a window of it the lag drops by no more than
    one room allows."""
    since: float


class Pacer:
    """Per vendor-side bucket: the lag of the replica's last write to it (``_Lag``)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._lag: dict[str, _Lag] = {}
        self.on_grown: Callable[[tuple[str, ...], float], None] | None = None
        """Told the buckets whose lag a write made grow by ``GROWN`` or more, and the lag."""
        self._live_until = 0.0
        """No lag recorded can still be live (within its window, ``reserve``) from then on."""
        self._longest = 1.0  # the longest window asked about: how long an adopted lag may live
        self._connecting: dict[int, tuple[frozenset[str], float]] = {}
        self._tickets = itertools.count()
        self._written: asyncio.Future[None] | None = None  # set when one of them is written
        self.still_connecting = 0
        """Requests granted and connecting before they are written (``connecting``)."""

    # -- the order of writes ------------------------------------------------------------

    def connecting(self, specs: Sequence[BucketSpec], granted: float) -> int:
        """A request granted at ``granted`` must open its connection before it is written:
        requests granted after it on these buckets wait for it (``after_earlier``) until
        ``written`` is called with the returned ticket (written, or given up)."""
        ticket = next(self._tickets)
        self._connecting[ticket] = (frozenset(spec.ident for spec in specs), granted)
        self.still_connecting = len(self._connecting)
        return ticket

    def written(self, ticket: int) -> None:
        if self._connecting.pop(ticket, None) is None:
            return
        self.still_connecting = len(self._connecting)
        written, self._written = self._written, None
        if written is not None and not written.done():
            written.set_result(None)

    def earlier(
        self, specs: Sequence[BucketSpec], granted: float, room: Sequence[float] = (), cost: float = 1.0
    ) -> bool:
        """Is a request granted before ``granted`` on one of these buckets still connecting,
        on a bucket without room (``room``) for this one to be early by as much as a
        write may be held (``MAX_WAIT``)?"""
        if not self._connecting:
            return False
        roomy = len(room)
        tight = {
            spec.ident for k, spec in enumerate(specs) if not (k < roomy and room[k] >= spec.rate * MAX_WAIT + cost)
        }
        return any(when < granted and not idents.isdisjoint(tight) for idents, when in self._connecting.values())

    async def after_earlier(
        self, specs: Sequence[BucketSpec], granted: float, room: Sequence[float] = (), cost: float = 1.0
    ) -> None:
        """Return once no request granted before this one (``earlier``) is still
        connecting, or after ``MAX_WAIT`` (one that never connects does not hold the rest
        up for ever)."""
        deadline = self.clock.monotonic() + MAX_WAIT
        while self.earlier(specs, granted, room, cost):
            left = deadline - self.clock.monotonic()
            if left <= 0:
                return
            if self._written is None:
                self._written = asyncio.get_running_loop().create_future()
            timer = asyncio.ensure_future(self.clock.sleep(left))
            try:
                await asyncio.wait((timer, self._written), return_when=asyncio.FIRST_COMPLETED)
            finally:
                timer.cancel()

    def adopt(self, idents: Sequence[str], lag: float) -> None:
        """Another replica's lag for these buckets: this one's writes keep it too, from now
        until a quiet window (or a grant with room for its end)."""
        now = self.clock.monotonic()
        lags = self._lag
        for ident in idents:
            last = lags.get(ident)
            if last is None or last.lag < lag:
                lags[ident] = _Lag(lag, now, lag, now)
                self._live_until = max(self._live_until, now + self._longest)

    def reserve(
        self, specs: Sequence[BucketSpec], granted: float, window: float, room: Sequence[float] = (), cost: float = 1.0
    ) -> float:
        """A request granted at ``granted`` (this clock's time: when the store answered, or
        when its hold matured) is about to be written. Returns the seconds it must wait
        first (0.0 on time), and records the lag it will have been written with.
        ``window``: the vendor's longest window (``longest_window``); ``room[k]``: the tokens
        ``specs[k]`` had left once the request's ``cost`` was taken, at its grant."""
        now = self.clock.monotonic()
        roomy = len(room)
        if now >= self._live_until and granted <= now:
            # No bucket carries a live lag (the usual: a vendor whose limit does not bind, or
            # no stall for a window): on time, if every bucket had room for this one's own
            # delay; what the full reckoning would record is what no record says.
            lag = now - granted
            for k, spec in enumerate(specs):
                if k >= roomy or room[k] < spec.rate * lag + cost:
                    break
            else:
                return 0.0
        if window > self._longest:
            self._longest = window
        lags = self._lag
        at = now
        # ``k < roomy and room[k] >= spec.rate * lag + cost``: did the bucket have room, at
        # the grant, for every request the lag's end makes early besides this one? Inline
        # (no function): it is asked twice per bucket of every request.
        for k, spec in enumerate(specs):
            last = lags.get(spec.ident)
            if last is None or now - last.at >= window:
                continue
            lag = last.lag
            if k < roomy:
                # Early by what the room covers (``spare`` seconds), counted from the peak.
                spare = (room[k] - cost) / spec.rate
                peak = last.peak if now - last.since < window else lag
                if spare >= peak:
                    continue
                if peak - spare < lag:
                    lag = peak - spare
            earliest = granted + lag
            if earliest > at:
                at = earliest
        if at - now > MAX_WAIT:
            at = now
        if len(lags) >= _MAX_TRACKED:
            lags.clear()  # forgotten: on time, as at start
        lag = at - granted
        kept = _Lag(0.0, at, 0.0, at)
        grown: list[str] | None = None
        for k, spec in enumerate(specs):
            ident = spec.ident
            last = lags.get(ident)
            peak = last.peak if last is not None and now - last.since < window else 0.0
            if k < roomy and room[k] >= spec.rate * (lag if lag > peak else peak) + cost:
                # Room for this lag's end too: nothing to keep, nothing to tell (a vendor
                # whose limit does not bind: every request's own delay would be "growth").
                lags[ident] = kept
                continue
            if (
                lag >= GROWN
                and self.on_grown is not None
                and (last is None or lag - last.lag >= GROWN or now - last.at >= window)
            ):
                grown = [ident] if grown is None else [*grown, ident]
            if last is None or lag >= last.peak or now - last.since >= window:
                lags[ident] = _Lag(lag, at, lag, at)  # a new peak, or the old one's window ended
            else:
                lags[ident] = _Lag(lag, at, last.peak, last.since)
            if lag > 0 and at + window > self._live_until:
                self._live_until = at + window
        if grown is not None and self.on_grown is not None:
            self.on_grown(tuple(grown), lag)
        return at - now
