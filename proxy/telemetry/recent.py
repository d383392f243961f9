"""Per-second event counts over the last minute, for /status ("recent rates").

A fixed ring of one-second slots per (vendor, event): O(1) per event, no timers.
"""

from __future__ import annotations

from proxy.clock import Clock

_SLOTS = 60


class Ring:
    """One (vendor, event)'s counts, a slot per second of the last minute."""

    __slots__ = ("counts", "stamps")

    def __init__(self) -> None:
        self.counts = [0] * _SLOTS
        self.stamps = [-1] * _SLOTS

    def add(self, second: int) -> None:
        """One event in ``second`` (the clock's, whole)."""
        slot = second % _SLOTS
        if self.stamps[slot] != second:
            self.stamps[slot] = second
            self.counts[slot] = 0
        self.counts[slot] += 1


class Recent:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._rings: dict[tuple[str, str], Ring] = {}

    def add(self, vendor: str, event: str) -> None:
        self.ring(vendor, event).add(int(self._clock.monotonic()))

    def ring(self, vendor: str, event: str) -> Ring:
        """The counts of ``event`` for ``vendor`` (made at its first event)."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            ring = self._rings[(vendor, event)] = Ring()
        return ring

    def total(self, vendor: str, event: str, window: int = 60) -> int:
        """Events in the last ``window`` whole seconds (the current partial second included)."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            return 0
        now = int(self._clock.monotonic())
        return sum(c for c, s in zip(ring.counts, ring.stamps, strict=True) if 0 <= now - s < min(window, _SLOTS))

    def rate(self, vendor: str, event: str, window: int = 10) -> float:
        """Events per second over the last ``window`` complete seconds."""
        ring = self._rings.get((vendor, event))
        if ring is None:
            return 0.0
        now = int(self._clock.monotonic())
        total = sum(c for c, s in zip(ring.counts, ring.stamps, strict=True) if 1 <= now - s <= window)
        return total / window
