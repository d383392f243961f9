"""seats.py: how many tenants the policy does not name a vendor tracks at once, per replica."""

from __future__ import annotations

import pytest

from proxy.clock import ManualClock
from proxy.policy.model import Limit, OnLimit, TenantLimits, Vendor
from proxy.quota.seats import Seats, seat_life

VENDOR = Vendor(
    "payments",
    hosts=("api.payments.example",),
    limits=(Limit(100, 1, 100),),
    tenant_limits=TenantLimits(default=(Limit(10, 1, 10), Limit(60, 60, 5))),
    on_limit=OnLimit("hold", 0.5),
)


def test_a_seat_lasts_as_long_as_the_tenants_keys() -> None:
    # The slowest default bucket refills its burst in 5 s (5 tokens at 1/s), after a hold's debt; plus 1 s.
    assert seat_life(VENDOR) == pytest.approx(5 + 0.5 + 1)
    assert seat_life(Vendor("bare", hosts=("x.example",))) == pytest.approx(0.5 + 1)


async def test_seats_fill_free_up_in_order_and_are_kept_by_use() -> None:
    clock = ManualClock()
    seats = Seats(clock)
    life = seat_life(VENDOR)
    assert [seats.take(VENDOR, t, 2) for t in ("a", "b")] == [0.0, 0.0]
    assert seats.take(VENDOR, "c", 2) == pytest.approx(life)  # full: told when the oldest frees up
    await clock.advance(life - 1)
    assert seats.take(VENDOR, "a", 2) == 0.0  # a used its seat again: now b's frees first
    assert seats.take(VENDOR, "c", 2) == pytest.approx(1.0)
    await clock.advance(1)
    assert seats.take(VENDOR, "c", 2) == 0.0  # b's seat expired and went to c
    assert seats.count("payments") == 2
    assert seats.take(Vendor("crm", hosts=("crm.example",)), "b", 2) == 0.0  # seats are per vendor
