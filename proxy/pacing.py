"""Held requests leave evenly paced, even after the event loop stalled.

The store spaces reservations one refill interval apart, and each held request sleeps
until its own. But a stalled event loop (a long garbage collection, a throttled
container, a busy core) wakes every sleeper whose time came during the stall at once:
twenty held requests can leave within a few milliseconds and overrun a vendor that
counts a strict sliding window (SPEC §6: held requests leave evenly paced). So each
replica also keeps the store's spacing itself: per vendor, a held request leaves no
sooner after the previous one than its reservation was due after the previous one's.
On time this waits nothing; after a stall, the late ones leave spread as the store
spaced them, not together.
"""

from __future__ import annotations

from proxy.clock import Clock


class Pacer:
    """Per vendor: when the last held request was due, and when it left."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._last: dict[str, tuple[float, float]] = {}

    async def leave(self, vendor: str, due: float) -> float:
        """Wait (if need be) until a held request of ``vendor`` due at ``due`` (the clock's
        time its reservation matured) may leave: no sooner after the last one that left
        than it was due after it. Returns the seconds waited."""
        now = self._clock.monotonic()
        at = now
        last = self._last.get(vendor)
        if last is not None:
            last_due, last_left = last
            at = max(now, last_left + max(0.0, due - last_due))
        self._last[vendor] = (max(due, last[0]) if last is not None else due, at)
        if at > now:
            await self._clock.sleep(at - now)
        return at - now
