"""Partitions (SPEC §10): a vendor's quota per value of a request header (a credential).

The raw value is a secret (``Authorization: Bearer …``): it is hashed once, when the
request is matched, and only the hash goes further: into store keys and block channels
(all 16 hex digits), the access log (the first 8). Never the value itself.
"""

from __future__ import annotations

import hashlib

from proxy.clock import Clock

DEFAULT = ""
"""The partition of requests without the header: the vendor's keys as without partitions."""

_SHOWN = 8  # hex digits of a partition's hash the access log shows
_RECENT_WINDOW = 300.0  # seconds: a partition seen within counts as "seen recently"
_RECENT_MAX = 10_000  # partitions remembered per vendor; beyond it the count saturates


def partition_hash(value: str) -> str:
    """The partition of a header value: sha256 of the raw value, hex, first 16 digits
    (64 bits: two credentials of one vendor do not share a quota by accident)."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def shown(partition: str) -> str | None:
    """What the access log shows of a partition: its hash's first digits; None for the default."""
    return partition[:_SHOWN] if partition else None


class RecentPartitions:
    """How many partitions of each vendor this replica has seen lately, for /status: the
    hashes with when each was last seen, bounded (a flood of credentials saturates the
    count rather than the memory)."""

    window = _RECENT_WINDOW

    def __init__(self, clock: Clock, limit: int = _RECENT_MAX) -> None:
        self._clock = clock
        self._limit = limit
        self._seen: dict[str, dict[str, float]] = {}

    def note(self, vendor: str, partition: str) -> None:
        seen = self._seen.get(vendor)
        if seen is None:
            seen = self._seen[vendor] = {}
        now = self._clock.monotonic()
        if partition not in seen and len(seen) >= self._limit:
            self._forget_old(seen, now)
            if len(seen) >= self._limit:
                return  # saturated: the count says "at least" the limit
        seen[partition] = now

    def count(self, vendor: str) -> int:
        """Distinct partitions (the default one included) seen within ``window`` seconds."""
        seen = self._seen.get(vendor)
        if not seen:
            return 0
        self._forget_old(seen, self._clock.monotonic())
        return len(seen)

    def _forget_old(self, seen: dict[str, float], now: float) -> None:
        for key in [k for k, at in seen.items() if now - at > self.window]:
            del seen[key]
