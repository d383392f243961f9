"""Refunds: the tokens of a hold that never went out go back, never above the burst.

Same contract for memory:// (ManualClock) and Redis (its own TIME; assertions allow a
few milliseconds of refill).
"""

from __future__ import annotations

import pytest

from proxy.limiter.store import BucketSpec, BucketStore

TOL = 0.05


def bucket(key: str, rate: float, burst: float, scope: str = "global", field: str = "") -> BucketSpec:
    return BucketSpec(f"test:{{v}}:{key}", rate, burst, scope, key, field)  # type: ignore[arg-type]


async def test_a_refund_gives_back_what_a_hold_reserved(store: BucketStore) -> None:
    b = (bucket("r", rate=1, burst=2),)
    for _ in range(2):
        assert (await store.acquire(b, 1, 0)).granted
    held = [await store.acquire(b, 1, 60) for _ in range(5)]  # reservations: the level goes to -5
    assert all(r.granted for r in held)
    assert held[-1].wait == pytest.approx(5.0, abs=TOL)
    # Three of the five workers went away while held.
    for _ in range(3):
        await store.refund(b, 1)
    (level,) = await store.peek(b)
    assert level == pytest.approx(-2, abs=TOL)
    # The next caller waits for the two that are still held, not for the five.
    nxt = await store.acquire(b, 1, 60)
    assert nxt.wait == pytest.approx(3.0, abs=TOL)


async def test_a_refund_never_fills_a_bucket_above_its_burst(store: BucketStore) -> None:
    b = (bucket("cap", rate=1, burst=3),)
    assert (await store.acquire(b, 1, 0)).granted
    for _ in range(4):
        await store.refund(b, 1)
    (level,) = await store.peek(b)
    assert level == pytest.approx(3, abs=TOL)


async def test_a_refund_to_a_missing_bucket_creates_nothing(store: BucketStore) -> None:
    b = (bucket("absent", rate=1, burst=3),)
    levels = await store.refund(b, 1)
    assert levels == (3.0,)  # full, as a missing bucket reads
    assert (await store.acquire(b, 3, 0)).granted  # and no more than full


async def test_a_refund_reaches_every_bucket_of_the_request(store: BucketStore) -> None:
    tenant = bucket("rt", rate=1, burst=1, scope="tenant")
    glob = bucket("state", rate=1, burst=1, field="g:1/1/1")
    both = (tenant, glob)
    assert (await store.acquire(both, 1, 0)).granted
    assert (await store.acquire(both, 1, 10)).granted  # held: both at -1
    await store.refund(both, 1)
    levels = await store.peek(both)
    assert levels == pytest.approx((0, 0), abs=TOL)
