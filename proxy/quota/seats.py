"""A bound on the tenants a vendor tracks at once (``tenant.max_active``), per replica.

Every tenant a vendor serves has store keys of its own (its buckets, its deferral
queue) that live until its buckets would be full again. With tenants taken from an
unauthenticated header, a worker can name a new tenant per request and grow the store
without bound (100,000 tenants, 100,001 keys) until a bounded Redis refuses writes and
the proxy fails closed. So a tenant the policy does not name takes a *seat* on its
first request, kept while its keys can live (refreshed by each request); a vendor has
``max_active`` seats on each replica, and a new tenant finding none free is deferred
until the oldest one frees up. Tenants the policy names never need a seat.

Per request: a dict lookup, and an insertion and amortised eviction for a new tenant.
"""

from __future__ import annotations

from collections import OrderedDict

from proxy.clock import Clock
from proxy.policy.model import Vendor


def seat_life(vendor: Vendor) -> float:
    """Seconds a tenant's store keys can outlive its last request: its default buckets
    refilling from a full hold (``max_hold`` of reservations) to their burst, plus the
    second the store adds to every expiry."""
    refill = max((limit.burst / limit.per_second for limit in vendor.tenant_limits.default), default=0.0)
    return refill + vendor.on_limit.max_hold + 1.0


class Seats:
    """Tenants each vendor tracks now (``take``), on this replica."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._by_vendor: dict[str, OrderedDict[str, float]] = {}
        """Vendor → tenant → when its seat frees up, soonest first."""
        self._lives: dict[str, tuple[Vendor, float]] = {}

    def take(self, vendor: Vendor, tenant: str, cap: int) -> float:
        """Seat ``tenant`` (or keep its seat) at ``vendor``: 0.0, or the seconds until a
        seat frees up when all ``cap`` are taken."""
        now = self._clock.monotonic()
        seated = self._by_vendor.setdefault(vendor.name, OrderedDict())
        until = now + self._life(vendor)
        if tenant in seated:
            seated[tenant] = until
            seated.move_to_end(tenant)
            return 0.0
        while seated:
            first, frees_at = next(iter(seated.items()))
            if frees_at > now:
                break
            del seated[first]
        if len(seated) >= cap:
            return next(iter(seated.values())) - now
        seated[tenant] = until
        return 0.0

    def _life(self, vendor: Vendor) -> float:
        known = self._lives.get(vendor.name)
        if known is None or known[0] is not vendor:  # a reload may change it
            known = self._lives[vendor.name] = (vendor, seat_life(vendor))
        return known[1]

    def count(self, vendor: str) -> int:
        """Seats taken at ``vendor`` (expired ones included until the next ``take``)."""
        return len(self._by_vendor.get(vendor, ()))
