"""Per-second event counts of the last minutes, for /status ("recent rates") and the live
page's history (/status/history); the refusals of the last minute by reason and by tenant;
the vendor's own signals (429s, blocks, drains) as timestamped events; readings (tokens,
requests held, in flight) sampled once a second by the admin side (``gauge``); how a shared
quota was divided (``share_book``: shares.py).

A fixed ring of one-second slots per (vendor, event): O(1) per event, no timers. The
rings of what the page graphs keep ``HISTORY_SECONDS``; the others a minute. Every memory
here is bounded: rings per (vendor, event) of a fixed set of events, a ring per (vendor,
reading), ``EVENTS_KEPT`` events per vendor, ``TENANTS_KEPT`` tenants per vendor, a
``ShareBook`` per vendor (bounded itself).
"""

from __future__ import annotations

from collections import deque
from typing import Final, NamedTuple

from proxy.clock import Clock
from proxy.telemetry.shares import ShareBook

_SLOTS: Final = 60
"""A minute: the rings nothing graphs (the refusals by reason)."""
HISTORY_SECONDS: Final = 300
"""Five minutes of one-second slots: the rings the live page draws (``HISTORY_EVENTS``)."""
HISTORY_EVENTS: Final = ("forwarded", "held", "deferred", "shed", "vendor_429", "vendor_block", "drain")
"""The events whose rings keep ``HISTORY_SECONDS``."""
EVENTS_KEPT: Final = 50
"""Timestamped events (vendor 429s, blocks, drains) kept per vendor: the newest."""
TENANTS_KEPT: Final = 64
"""Tenants whose refusals are counted per vendor; past that the one refused least lately
makes room (``RefusedTenants``)."""
_TENANT_STEP: Final = 10
"""The tenants' counts are kept in ten-second slots (six: a minute)."""


class Ring:
    """One (vendor, event)'s counts, a slot per second of the last ``size`` seconds."""

    __slots__ = ("counts", "size", "stamps")

    def __init__(self, size: int = _SLOTS) -> None:
        self.size = size
        self.counts = [0] * size
        self.stamps = [-1] * size

    def add(self, second: int) -> None:
        """One event in ``second`` (the clock's, whole)."""
        slot = second % self.size
        if self.stamps[slot] != second:
            self.stamps[slot] = second
            self.counts[slot] = 0
        self.counts[slot] += 1

    def total(self, now: int, window: int) -> int:
        """Events in the last ``window`` slots up to ``now`` (its own, partial, included)."""
        window = min(window, self.size)
        return sum(c for c, s in zip(self.counts, self.stamps, strict=True) if 0 <= now - s < window)

    def at(self, second: int) -> int:
        """Events in ``second`` (0 once it has left the ring)."""
        slot = second % self.size
        return self.counts[slot] if self.stamps[slot] == second else 0


class GaugeRing:
    """One (vendor, reading)'s value at each second of the last ``size`` seconds (the last
    one sampled in it)."""

    __slots__ = ("stamps", "values")

    def __init__(self, size: int = HISTORY_SECONDS) -> None:
        self.values: list[float | None] = [None] * size
        self.stamps = [-1] * size

    def set(self, second: int, value: float | None) -> None:
        slot = second % len(self.stamps)
        self.stamps[slot] = second
        self.values[slot] = value

    def at(self, second: int) -> float | None:
        """The reading of ``second``; None if none was taken then."""
        slot = second % len(self.stamps)
        return self.values[slot] if self.stamps[slot] == second else None


class Event(NamedTuple):
    """One of the vendor's own signals, as this process saw it."""

    at: float
    """The clock's (monotonic) time."""
    kind: str
    """``vendor_429``, ``vendor_block`` or ``drain``."""
    seconds: float | None = None
    """A block's length."""


class RefusedTenants:
    """One vendor's refusals of the last minute by tenant, for at most ``kept`` tenants.

    A tenant not counted yet, when ``kept`` are, takes the place of one no longer refused
    in the last minute, else of the one refused least in it (the oldest of those): a
    tenant refused often stays, a spray of tenant ids churns only the least-refused
    places. O(kept) only then, else O(1)."""

    __slots__ = ("_kept", "_last", "_tenants")

    def __init__(self, kept: int = TENANTS_KEPT) -> None:
        self._kept = kept
        self._tenants: dict[str, Ring] = {}
        self._last: dict[str, str] = {}
        """Each tenant's last refusal's reason."""

    def add(self, tenant: str, reason: str, second: int) -> None:
        step = second // _TENANT_STEP
        ring = self._tenants.get(tenant)
        if ring is None:
            if len(self._tenants) >= self._kept:
                self._evict(step)
            ring = self._tenants[tenant] = Ring(_SLOTS // _TENANT_STEP)
        ring.add(step)
        self._last[tenant] = reason

    def _evict(self, step: int) -> None:
        window = _SLOTS // _TENANT_STEP
        totals = {t: ring.total(step, window) for t, ring in self._tenants.items()}
        gone = min(totals, key=totals.__getitem__)  # the first of the least refused: the oldest
        del self._tenants[gone], self._last[gone]

    def top(self, second: int, n: int) -> list[dict[str, object]]:
        """The ``n`` tenants refused most in the last minute: tenant, count, last reason."""
        step = second // _TENANT_STEP
        window = _SLOTS // _TENANT_STEP
        counted = [(ring.total(step, window), t) for t, ring in self._tenants.items()]
        counted = sorted((c for c in counted if c[0] > 0), key=lambda c: (-c[0], c[1]))[:n]
        return [{"tenant": t, "refused": count, "reason": self._last[t]} for count, t in counted]

    def __len__(self) -> int:
        return len(self._tenants)


class Recent:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._rings: dict[tuple[str, str], Ring] = {}
        self._events: dict[str, deque[Event]] = {}
        self._tenants: dict[str, RefusedTenants] = {}
        self._gauges: dict[tuple[str, str], GaugeRing] = {}
        self._shares: dict[str, ShareBook] = {}

    def add(self, vendor: str, event: str) -> None:
        self.ring(vendor, event).add(int(self._clock.monotonic()))

    def ring(self, vendor: str, event: str) -> Ring:
        """The counts of ``event`` for ``vendor`` (made at its first event)."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            size = HISTORY_SECONDS if event in HISTORY_EVENTS else _SLOTS
            ring = self._rings[(vendor, event)] = Ring(size)
        return ring

    def total(self, vendor: str, event: str, window: int = 60) -> int:
        """Events in the last ``window`` whole seconds (the current partial second included)."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            return 0
        return ring.total(int(self._clock.monotonic()), window)

    def rate(self, vendor: str, event: str, window: int = 10) -> float:
        """Events per second over the last ``window`` complete seconds."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            return 0.0
        # The ``window`` seconds that ended before this one began.
        return ring.total(int(self._clock.monotonic()) - 1, window) / window

    def series(self, vendor: str, event: str, seconds: int = HISTORY_SECONDS) -> list[int]:
        """Counts of the last ``seconds`` complete seconds, oldest first (the last one ended
        less than a second ago)."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            return [0] * seconds
        now = int(self._clock.monotonic())
        return [ring.at(second) for second in range(now - seconds, now)]

    # -- readings, sampled ---------------------------------------------------------------

    def gauge(self, vendor: str, name: str, value: float | None) -> None:
        """``name`` (tokens, held, inflight) of ``vendor`` reads ``value`` this second."""
        ring = self._gauges.get((vendor, name))
        if ring is None:
            ring = self._gauges[(vendor, name)] = GaugeRing()
        ring.set(int(self._clock.monotonic()), value)

    def gauge_series(self, vendor: str, name: str, seconds: int = HISTORY_SECONDS) -> list[float | None]:
        """The readings of the last ``seconds`` seconds, oldest first, the last one this
        second's (None where none was taken)."""
        ring = self._gauges.get((vendor, name))
        if ring is None:
            return [None] * seconds
        now = int(self._clock.monotonic())
        return [ring.at(second) for second in range(now - seconds + 1, now + 1)]

    # -- the vendor's own signals ---------------------------------------------------

    def event(self, vendor: str, kind: str, seconds: float | None = None) -> None:
        """One ``kind`` event (vendor_429, vendor_block, drain) now; also counted per second."""
        events = self._events.get(vendor)
        if events is None:
            events = self._events[vendor] = deque(maxlen=EVENTS_KEPT)
        now = self._clock.monotonic()
        events.append(Event(now, kind, seconds))
        self.ring(vendor, kind).add(int(now))

    def events(self, vendor: str, within: float = HISTORY_SECONDS) -> list[tuple[float, Event]]:
        """(seconds ago, event) of the events of the last ``within`` seconds, oldest first."""
        now = self._clock.monotonic()
        return [(now - e.at, e) for e in self._events.get(vendor, ()) if now - e.at <= within]

    # -- refusals by tenant -----------------------------------------------------------

    def refused_by(self, vendor: str, tenant: str, reason: str) -> None:
        tenants = self._tenants.get(vendor)
        if tenants is None:
            tenants = self._tenants[vendor] = RefusedTenants()
        tenants.add(tenant, reason, int(self._clock.monotonic()))

    def top_tenants(self, vendor: str, n: int = 5) -> list[dict[str, object]]:
        """The ``n`` tenants of ``vendor`` refused most in the last minute (of the
        ``TENANTS_KEPT`` counted)."""
        tenants = self._tenants.get(vendor)
        return [] if tenants is None else tenants.top(int(self._clock.monotonic()), n)

    # -- a shared quota's division (SPEC §13) -----------------------------------------------

    def share_book(self, vendor: str) -> ShareBook:
        """``vendor``'s grants and waits by class and tenant (shares.py), made at its first use."""
        book = self._shares.get(vendor)
        if book is None:
            book = self._shares[vendor] = ShareBook(self._clock)
        return book
