"""memory://'s concurrency leases: per lease set, its leases and when each expires, on the
store's clock (acquire.lua and release.lua keep them in a sorted set per lease set)."""

from __future__ import annotations

from proxy.limiter.store import LeaseSet


class LeaseTable:
    """Lease set key -> {lease id: expires at}; a set with no live lease is forgotten."""

    __slots__ = ("_sets",)

    def __init__(self) -> None:
        self._sets: dict[str, dict[str, float]] = {}

    def __len__(self) -> int:
        return len(self._sets)

    def live(self, key: str, now: float) -> dict[str, float]:
        """The live leases of a set (expired ones dropped)."""
        held = self._sets.setdefault(key, {})
        for lease_id in [i for i, expires in held.items() if expires <= now]:
            del held[lease_id]
        return held

    def forget_empty(self) -> None:
        for key in [k for k, held in self._sets.items() if not held]:
            del self._sets[key]

    def sweep(self, now: float) -> None:
        for key in list(self._sets):
            self.live(key, now)
        self.forget_empty()

    def release(self, sets: tuple[LeaseSet, ...], lease_ids: tuple[str, ...], now: float) -> tuple[int, ...]:
        counts = []
        for ls in sets:
            held = self.live(ls.key, now)
            for lease_id in lease_ids:
                held.pop(lease_id, None)
            counts.append(len(held))
        self.forget_empty()
        return tuple(counts)

    def renew(self, leases: tuple[tuple[LeaseSet, str], ...], life: float, now: float) -> int:
        renewed = 0
        for ls, lease_id in leases:
            held = self.live(ls.key, now)
            if lease_id in held:
                held[lease_id] = max(held[lease_id], now + life)
                renewed += 1
        self.forget_empty()
        return renewed

    def inflight(self, sets: tuple[LeaseSet, ...], now: float) -> tuple[int, ...]:
        counts = tuple(len(self.live(ls.key, now)) for ls in sets)
        self.forget_empty()
        return counts
