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

The shift lasts while the vendor's held requests keep coming: once the last one left
longer ago than the vendor's longest window, no window can hold it and the next one, so
the next one leaves when due (the stall is forgotten rather than kept as an offset).
"""

from __future__ import annotations

from proxy.clock import Clock
from proxy.policy.model import Vendor


def longest_window(vendor: Vendor) -> float:
    """Seconds of the vendor's longest limit (global or endpoint class): past it, a held
    request that left late no longer shares a window with the next one."""
    limits = [*vendor.limits, *(limit for endpoint in vendor.endpoints for limit in endpoint.limits)]
    return max((limit.per for limit in limits), default=1.0)


class Pacer:
    """Per vendor: when the last held request was due, and when it left."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._last: dict[str, tuple[float, float]] = {}

    async def leave(self, vendor: str, due: float, *, window: float) -> float:
        """Wait (if need be) until a held request of ``vendor`` due at ``due`` (the clock's
        time its reservation matured) may leave: no sooner after the last one that left
        than it was due after it, unless that one left ``window`` seconds ago or more.
        Returns the seconds waited."""
        now = self._clock.monotonic()
        at = now
        last = self._last.get(vendor)
        if last is not None and now - last[1] >= window:
            last = None  # no window holds both: the shift a stall left ends here
        if last is not None:
            last_due, last_left = last
            at = max(now, last_left + max(0.0, due - last_due))
        self._last[vendor] = (max(due, last[0]) if last is not None else due, at)
        if at > now:
            await self._clock.sleep(at - now)
        return at - now
