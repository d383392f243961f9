"""Kept slots (acquire.lua, "Kept slots"; store.Reserve): a deferred caller's slot is its
own until it comes back, an early retry is given the same slot again, and a slot nobody
claims is used by someone else or given back, never lost.

The same contract for memory:// (ManualClock) and redis:// (its own TIME, so the
assertions allow some milliseconds of real time).
"""

from __future__ import annotations

import asyncio

import pytest

from proxy.clock import ManualClock
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.store import AcquireResult, BucketSpec, BucketStore, Leases, LeaseSet, Reserve, StateGuard

TOL = 0.03  # seconds of real time a Redis-backed assertion may drift
QUEUE = "test:{v}:q:default"
KEPT = Reserve("test:{v}:r:default", "", horizon=5.0, owner=0.1, life=0.5)
STATE = "test:{v}:state"


def bucket(name: str, rate: float, burst: float) -> BucketSpec:
    return BucketSpec(STATE, rate, burst, "global", name, field=f"g:{name}")


async def later(store: BucketStore, clock: ManualClock, seconds: float) -> None:
    if isinstance(store, MemoryStore):
        await clock.advance(seconds)
    else:
        await asyncio.sleep(seconds)


def guard(seen: int = 0) -> StateGuard:
    return StateGuard(STATE, seen, 0.0)


async def back_at_its_hint(
    store: BucketStore, clock: ManualClock, b: tuple[BucketSpec, ...], refused: AcquireResult
) -> AcquireResult:
    """A precise retrier refused with ``refused``: it asks again at its hint, with its claim."""
    await later(store, clock, refused.hint)
    return await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=refused.reserved))


async def test_a_refusal_keeps_its_slot_and_the_next_one_comes_after_it(store: BucketStore) -> None:
    b = (bucket("a", rate=10, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    first = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    second = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert not first.granted and not second.granted
    assert first.reserved and second.reserved and first.reserved != second.reserved
    # Each slot is exact (the hint is the slot) and the second one token after the first.
    assert first.hint == pytest.approx(first.wait) and first.wait == pytest.approx(0.1, abs=TOL)
    assert second.wait - first.wait == pytest.approx(0.1, abs=TOL)
    assert second.levels[0] == pytest.approx(-2.0, abs=TOL * 10)  # taken as holds are


async def test_an_early_claim_is_given_the_same_slot_and_takes_nothing(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("e", rate=10, burst=1),)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    await later(store, clock, 0.03)
    again = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert not again.granted and again.reserved == kept.reserved
    assert again.wait == pytest.approx(kept.wait - 0.03, abs=TOL)  # the same slot, nearer
    # Nothing was taken: a caller without a claim is told the slot after the kept one.
    other = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert other.wait == pytest.approx(again.wait + 0.1, abs=TOL)


async def test_a_matured_claim_is_granted_without_taking_again(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("m", rate=10, burst=1),)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    await later(store, clock, kept.wait + 0.01)
    claimed = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert claimed.granted and claimed.claimed and not claimed.reserved
    assert claimed.wait == pytest.approx(-0.01, abs=TOL) and claimed.wait <= 0  # granted when it matured
    assert claimed.levels[0] == pytest.approx(0.0, abs=TOL * 10)  # refilled since, nothing taken now
    # Claimed once: the same claim again is a new request.
    twice = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert not twice.claimed


async def test_a_claim_that_matures_within_max_wait_is_held(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("h", rate=10, burst=1),)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    held = await store.acquire(b, 1, 0.5, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert held.granted and held.claimed and held.wait == pytest.approx(kept.wait, abs=TOL)


async def test_a_late_owners_slot_goes_to_a_caller_without_one(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("l", rate=5, burst=1),)  # (taken 0.12 s late: within its tolerance, burst / rate)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    # Another deferred caller's slot after it: the bucket stays below empty (a late slot is
    # not moved past a time the bucket stood above it).
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).reserved
    await later(store, clock, kept.wait + 0.02)
    # Within ``owner`` of its maturity the slot is its owner's: a newcomer gets a slot of its own.
    newcomer = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert not newcomer.granted and newcomer.reserved
    await later(store, clock, KEPT.owner)
    # Past it, whoever comes without a slot takes it.
    late = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert late.granted and late.claimed
    owner = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert not owner.claimed  # taken: the owner is a new request now


async def test_a_slot_nobody_claims_gives_back_only_its_tenants_tokens(store: BucketStore, clock: ManualClock) -> None:
    """Its time has passed: a vendor-side token given back now would be granted on top of
    the slots already given out (a level is a count, not a schedule)."""
    glob = bucket("n", rate=2, burst=5)
    mine = tenant_bucket("nobody", rate=2, burst=5)
    kept_mine = KEPT._replace(key="test:{v}:r:nobody", tenants=1)
    for _ in range(5):
        assert (await store.acquire((mine, glob), 1, 0, QUEUE, guard(), None, kept_mine)).granted
    kept = await store.acquire((mine, glob), 1, 0, QUEUE, guard(), None, kept_mine)
    assert kept.reserved and kept.wait == pytest.approx(0.5, abs=TOL)
    await later(store, clock, kept.wait + KEPT.life + 0.05)
    tenant, vendor_side = await store.peek((mine, glob))
    assert tenant == pytest.approx(-1 + 2 * (kept.wait + KEPT.life + 0.05), abs=TOL * 4)  # not given back yet
    after = await store.acquire((mine, glob), 1, 0, QUEUE, guard(), None, kept_mine)
    assert after.granted and not after.claimed
    assert after.levels[0] == pytest.approx(tenant + 1 - 1, abs=TOL * 4)  # the tenant's token back, one taken
    assert after.levels[1] == pytest.approx(vendor_side - 1, abs=TOL * 4)  # the vendor side's is not


async def test_a_refusal_beyond_the_horizon_keeps_no_slot(store: BucketStore) -> None:
    b = (bucket("z", rate=10, burst=1),)
    short = KEPT._replace(horizon=0.15)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, short)).granted
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, short)).reserved  # 0.1 s: kept
    beyond = await store.acquire(b, 1, 0, QUEUE, guard(), None, short)
    assert not beyond.granted and not beyond.reserved  # 0.2 s: a hint only, from the queue
    assert beyond.hint >= beyond.wait == pytest.approx(0.2, abs=TOL)


async def test_a_shed_keeps_no_slot(store: BucketStore) -> None:
    b = (bucket("s", rate=10, burst=1),)
    assert (await store.acquire(b, 1, 0, None, guard(), None, KEPT)).granted
    shed = await store.acquire(b, 1, 0, None, guard(), None, KEPT)  # no queue: not told to retry
    assert not shed.granted and not shed.reserved


async def test_a_vendor_block_voids_the_slots_kept_before_it(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("k", rate=10, burst=1),)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    await store.block(b, 0.05, "")
    await later(store, clock, kept.wait + 0.06)
    after = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert not after.claimed  # absorbed by the block, as a hold's reservation is


async def test_a_full_lease_set_keeps_the_claim(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("c", rate=10, burst=1),)
    cap = LeaseSet("test:{v}:c", 1, "concurrency 1")
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), Leases("busy", 30.0, (cap,)), KEPT)).granted
    refused = await store.acquire(b, 1, 0, QUEUE, guard(), Leases("x", 30.0, (cap,)), KEPT)
    assert refused.full == 0 and not refused.reserved  # a full cap keeps no slot...
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # (one kept by the tokens)
    assert kept.reserved
    await later(store, clock, kept.wait + 0.01)
    full = await store.acquire(b, 1, 0, QUEUE, guard(), Leases("y", 30.0, (cap,)), KEPT._replace(claim=kept.reserved))
    assert not full.granted and full.full == 0 and full.reserved == kept.reserved  # ...and loses none
    await store.release((cap,), ("busy",), "")
    claimed = await store.acquire(
        b, 1, 0, QUEUE, guard(), Leases("y", 30.0, (cap,)), KEPT._replace(claim=kept.reserved)
    )
    assert claimed.granted and claimed.claimed and claimed.inflight == (1,)


def tenant_bucket(name: str, rate: float, burst: float) -> BucketSpec:
    return BucketSpec(f"test:{{v}}:t:{name}", rate, burst, "tenant", name)


async def test_a_slot_the_tenants_own_bucket_binds_leaves_the_vendor_side_to_others(
    store: BucketStore, clock: ManualClock
) -> None:
    """The tenant's own bucket refuses: its slot takes from it alone, so the vendor-side
    token is not held idle until then (another tenant may use it meanwhile); the
    vendor-side token is taken when the slot is claimed."""
    glob = bucket("v", rate=10, burst=2)
    mine = (tenant_bucket("slow", rate=2, burst=1), glob)
    theirs = (tenant_bucket("other", rate=100, burst=100), glob)
    kept_mine = KEPT._replace(key="test:{v}:r:slow", tenants=1)
    kept_theirs = KEPT._replace(key="test:{v}:r:other", tenants=1)
    assert (await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine)).granted
    slot = await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine)
    assert slot.reserved and slot.binding == 0 and slot.wait == pytest.approx(0.5, abs=TOL)
    assert slot.levels[1] == pytest.approx(1.0, abs=TOL * 10)  # the vendor side: only the grant's token taken
    # The other tenant gets the vendor-side token the slot did not hold.
    assert (await store.acquire(theirs, 1, 0, QUEUE, guard(), None, kept_theirs)).granted
    await later(store, clock, slot.wait + 0.01)
    claimed = await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine._replace(claim=slot.reserved))
    assert claimed.granted and claimed.claimed
    assert claimed.levels[1] == pytest.approx(2.0 - 1, abs=TOL * 10)  # refilled to its burst, one taken now


async def test_a_tenant_slot_whose_vendor_side_is_full_at_its_claim_is_kept_on_every_bucket(
    store: BucketStore, clock: ManualClock
) -> None:
    glob = bucket("w", rate=10, burst=1)
    mine = (tenant_bucket("slow2", rate=2, burst=1), glob)
    kept_mine = KEPT._replace(key="test:{v}:r:slow2", tenants=1)
    assert (await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine)).granted
    slot = await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine)
    assert slot.reserved.endswith(":t")
    await later(store, clock, slot.wait + 0.01)
    for _ in range(3):  # the vendor side spent meanwhile (another tenant's holds)
        await store.acquire((glob,), 1, 1.0, None, guard())
    again = await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine._replace(claim=slot.reserved))
    assert not again.granted and again.reserved.endswith(":a") and again.wait > 0.1
    await later(store, clock, again.wait + 0.01)
    claimed = await store.acquire(mine, 1, 0, QUEUE, guard(), None, kept_mine._replace(claim=again.reserved))
    assert claimed.granted and claimed.claimed


async def test_a_weak_claim_is_honoured_only_once_its_slot_has_matured(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("q", rate=10, burst=1),)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    early = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim="?" + kept.reserved))
    assert early.reserved and early.reserved != kept.reserved  # not told the slot: a slot of its own
    assert early.wait == pytest.approx(kept.wait + 0.1, abs=TOL)
    await later(store, clock, kept.wait + 0.01)
    matured = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim="?" + kept.reserved))
    assert matured.granted and matured.claimed  # matured: whoever sends the claim is served


# Issue 34: a slot nobody claims serves the next requests that ask, whoever they are (SPEC §6).
async def test_a_request_holding_a_later_slot_moves_up_to_a_late_one(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("u", rate=2, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    noshow = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # its owner never comes back
    mine = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert noshow.wait == pytest.approx(0.5, abs=TOL) and mine.wait == pytest.approx(1.0, abs=TOL)
    await later(store, clock, noshow.wait + KEPT.owner + 0.05)
    # Not refused with its own later slot while the matured one stands idle: it moves up.
    moved = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=mine.reserved))
    assert moved.granted and moved.claimed


async def test_a_costly_late_slot_serves_several_cheaper_requests(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("x", rate=10, burst=5),)
    assert (await store.acquire(b, 5, 0, QUEUE, guard(), None, KEPT)).granted
    noshow = await store.acquire(b, 5, 0, QUEUE, guard(), None, KEPT)  # 5 units, never claimed
    assert noshow.reserved and noshow.wait == pytest.approx(0.5, abs=TOL)
    assert (await store.acquire(b, 5, 0, QUEUE, guard(), None, KEPT)).reserved  # below empty till 1 s
    await later(store, clock, noshow.wait + KEPT.owner + 0.02)
    # Not the whole 5-unit slot to the first cheap call: one unit each.
    cheap = [await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT) for _ in range(5)]
    assert all(r.granted for r in cheap), [(r.granted, r.claimed) for r in cheap]
    assert all(r.claimed for r in cheap)  # all five on the kept units: nothing from the bucket
    assert cheap[-1].levels[0] == pytest.approx(cheap[0].levels[0], abs=TOL * 10)
    sixth = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert not sixth.claimed  # five units, no more: the pool never gives what was not kept


async def test_a_slot_left_by_a_caller_that_moved_up_serves_the_next_at_its_time(
    store: BucketStore, clock: ManualClock
) -> None:
    b = (bucket("v", rate=2, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    noshow = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    mine = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    await later(store, clock, noshow.wait + KEPT.owner + 0.05)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=mine.reserved))).granted
    # The slot it left is nobody's: a caller without one is given it once it matures, not later.
    await later(store, clock, mine.wait - (noshow.wait + KEPT.owner + 0.05) + 0.02)
    taken = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert taken.granted and taken.claimed
    again = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=mine.reserved))
    assert not again.claimed  # the mover's old claim names nothing now


async def test_cheap_late_slots_serve_a_costlier_request_with_the_rest_from_the_bucket(
    store: BucketStore, clock: ManualClock
) -> None:
    b = (bucket("w", rate=10, burst=3),)
    assert (await store.acquire(b, 3, 0, QUEUE, guard(), None, KEPT)).granted
    first = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # never claimed
    second = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # never claimed
    assert first.reserved and second.reserved and second.wait == pytest.approx(0.2, abs=TOL)
    assert (await store.acquire(b, 2, 0, QUEUE, guard(), None, KEPT)).reserved  # 0.4 s: below empty till then
    # Both late (within burst / rate, 0.3 s); the bucket stands at -4 + 3.1 = -0.9: the rest
    # is held for (1 + 0.9) / 10 s.
    await later(store, clock, 0.2 + KEPT.owner + 0.01)
    costly = await store.acquire(b, 3, 0.5, QUEUE, guard(), None, KEPT)
    assert costly.granted and costly.claimed and costly.wait == pytest.approx(0.19, abs=TOL)
    # Two units from the slots, one from the bucket: the slots' tokens are not taken twice.
    assert costly.levels[0] == pytest.approx(10 * (0.2 + KEPT.owner + 0.01) - 4 - 1, abs=TOL * 10 + 0.02)


async def test_late_units_too_few_for_a_request_the_bucket_cannot_cover_are_left_alone(
    store: BucketStore, clock: ManualClock
) -> None:
    b = (bucket("y", rate=10, burst=3),)
    assert (await store.acquire(b, 3, 0, QUEUE, guard(), None, KEPT)).granted
    noshow = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert (await store.acquire(b, 2, 0, QUEUE, guard(), None, KEPT)).reserved  # 0.3 s: below empty till then
    await later(store, clock, noshow.wait + KEPT.owner + 0.01)
    costly = await store.acquire(b, 3, 0, QUEUE, guard(), None, KEPT)  # 1 unit late, the bucket at -0.9
    assert not costly.granted and costly.reserved  # a slot of its own; the late unit untouched
    cheap = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert cheap.granted and cheap.claimed


async def test_a_slot_its_owner_left_is_offered_to_one_later_refusal(store: BucketStore, clock: ManualClock) -> None:
    """A precise retrier sleeps until its own slot: it asks when a slot left behind matures
    only if told to (acquire.lua, "Standby"), and is told to when that gains it a second."""
    b = (bucket("sb", rate=2, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    gone = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 0.5 s; its connection closes
    assert await store.left(KEPT.key, (gone.reserved, "no-such-slot")) == 1
    near = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 1.0 s: 0.4 s to gain, not told
    assert near.hint == pytest.approx(near.wait, abs=TOL)
    await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 1.5 s
    mine = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 2.0 s
    other = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 2.5 s
    assert mine.wait == pytest.approx(2.0, abs=TOL) and other.wait == pytest.approx(2.5, abs=TOL)
    # Told the left slot's time (and the owner's head start); the next one its own: one caller
    # per slot left, no herd.
    assert mine.hint == pytest.approx(gone.wait + KEPT.owner, abs=TOL)  # (owner > standby here)
    assert mine.retry_after == mine.hint and other.hint == pytest.approx(other.wait, abs=TOL)
    moved = await back_at_its_hint(store, clock, b, mine)
    assert moved.granted and moved.claimed


async def test_a_slot_offered_to_a_caller_that_left_too_is_offered_again(
    store: BucketStore, clock: ManualClock
) -> None:
    """The caller offered a slot left behind may leave as well before its time (an SDK that
    gives up after its retries, the job dropped, its client closed): the slot is offered to
    the next refusal then, not left to stand idle (bench/quota.py giveup-fresh: a third of
    the offers were never taken, 2/s burst 1 used 76 % of the quota)."""
    b = (bucket("so", rate=2, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    gone = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 0.5 s; its connection closes
    await store.left(KEPT.key, (gone.reserved,))
    for _ in range(2):
        await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 1.0 and 1.5 s
    offered = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 2.0 s, told 0.5 s
    assert offered.hint == pytest.approx(gone.wait + KEPT.owner, abs=TOL)
    assert await store.left(KEPT.key, (offered.reserved,)) == 1  # it gives up too: both offered again
    nxt = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 2.5 s, told 0.5 s
    assert nxt.hint == pytest.approx(gone.wait + KEPT.owner, abs=TOL)
    moved = await back_at_its_hint(store, clock, b, nxt)
    assert moved.granted and moved.claimed


async def test_a_refusal_beyond_the_horizon_is_offered_a_slot_left_behind(
    store: BucketStore, clock: ManualClock
) -> None:
    """A queue filled to the horizon with slots whose owners gave up sent every later caller
    past them, to the queue's end, and the slots stood idle (bench/quota.py giveup-fresh, 2/s
    burst 1: nothing served in the last 18 s of 80). No slot is kept for a refusal beyond the
    horizon, but one left behind is offered to it."""
    b = (bucket("sh", rate=2, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    slots = [await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT) for _ in range(10)]  # 0.5 .. 5.0 s
    assert all(s.reserved for s in slots) and slots[-1].wait == pytest.approx(KEPT.horizon, abs=TOL)
    await store.left(KEPT.key, (slots[0].reserved,))
    beyond = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert not beyond.granted and beyond.wait > KEPT.horizon
    assert beyond.hint == pytest.approx(slots[0].wait + KEPT.owner, abs=TOL)
    assert beyond.retry_after == beyond.hint  # what the caller is told: the slot offered
    # Its claim names the slot offered: it claims nothing by it, but should it leave, the
    # slot is offered again.
    assert beyond.reserved == "~" + slots[0].reserved
    await store.left(KEPT.key, (beyond.reserved,))
    again = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)
    assert again.reserved == beyond.reserved and again.hint == pytest.approx(beyond.hint, abs=TOL)
    moved = await back_at_its_hint(store, clock, b, again)
    assert moved.granted and moved.claimed


async def test_an_owner_that_comes_back_keeps_the_slot_it_left(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("sc", rate=2, burst=1),)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)).granted
    kept = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 0.5 s
    await store.left(KEPT.key, (kept.reserved,))  # its job comes back on another connection
    for _ in range(2):
        await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 1.0 and 1.5 s
    standby = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT)  # 2.0 s
    assert standby.hint == pytest.approx(kept.wait + KEPT.owner, abs=TOL)
    await later(store, clock, kept.wait + 0.01)
    owner = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=kept.reserved))
    assert owner.granted and owner.claimed  # within its head start: the owner's
    await later(store, clock, KEPT.owner)
    again = await store.acquire(b, 1, 0, QUEUE, guard(), None, KEPT._replace(claim=standby.reserved))
    assert not again.granted and again.reserved == standby.reserved  # refused with its own slot
    assert again.hint == pytest.approx(again.wait, abs=TOL)


async def test_late_slots_move_no_more_than_the_burst_into_any_window(store: BucketStore, clock: ManualClock) -> None:
    """Used late, a slot moves a request from its time to now: every vendor window starting in
    between holds one more than the schedule gave it. The schedule leaves the burst free in
    every window: moves whose spans overlap carry no more than the burst together."""
    b = (bucket("t", rate=10, burst=1),)
    now = KEPT._replace(owner=0.0)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, now)).granted
    for _ in range(3):  # slots at 0.1, 0.2 and 0.3 s, nobody's
        assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, now)).reserved
    await later(store, clock, 0.25)
    first = await store.acquire(b, 1, 0, QUEUE, guard(), None, now)  # the latest matured: the shortest move
    assert first.granted and first.claimed and first.wait == pytest.approx(-0.05, abs=TOL)  # 0.2 s -> 0.25 s
    # The 0.1 s slot's move would overlap it: two in the windows starting at 0.2-0.25 s.
    second = await store.acquire(b, 1, 0, QUEUE, guard(), None, now)
    assert not second.granted and not second.claimed
    await later(store, clock, 0.07)
    third = await store.acquire(b, 1, 0, QUEUE, guard(), None, now)  # 0.3 s: after that span
    assert third.granted and third.claimed and third.wait == pytest.approx(-0.02, abs=TOL)


async def test_a_slot_claimed_late_by_its_owner_is_a_move_too(store: BucketStore, clock: ManualClock) -> None:
    b = (bucket("o", rate=10, burst=1),)
    now = KEPT._replace(owner=0.0)
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, now)).granted
    mine = await store.acquire(b, 1, 0, QUEUE, guard(), None, now)  # 0.1 s, claimed at 0.25 s
    assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, now)).reserved  # 0.2 s, nobody's
    await later(store, clock, 0.25)
    late = await store.acquire(b, 1, 0, QUEUE, guard(), None, now._replace(claim=mine.reserved))
    assert late.granted and late.claimed and late.wait == pytest.approx(-0.15, abs=TOL)
    newcomer = await store.acquire(b, 1, 0, QUEUE, guard(), None, now)
    assert not newcomer.granted and not newcomer.claimed  # the 0.2 s slot's move would overlap the claim's


async def test_a_late_slot_is_not_moved_past_a_time_its_bucket_refilled(store: BucketStore, clock: ManualClock) -> None:
    """A bucket that refilled after a slot's time spends tokens of its own: the slot's move
    would come on top of them. Burst 2 at 10/s, two slots at 0.1 and 0.2 s nobody claims;
    at 0.6 s the bucket is full again, and four callers at once got its 2 and both slots'
    (4 at once where the vendor's burst allows 2)."""
    b = (bucket("r", rate=10, burst=2),)
    kept = KEPT._replace(owner=0.0, life=2.0)
    assert [(await store.acquire(b, 1, 0, QUEUE, guard(), None, kept)).granted for _ in range(2)] == [True, True]
    slots = [await store.acquire(b, 1, 0, QUEUE, guard(), None, kept) for _ in range(2)]
    assert all(s.reserved for s in slots)
    await later(store, clock, 0.6)
    at_once = [await store.acquire(b, 1, 0, QUEUE, guard(), None, kept) for _ in range(4)]
    assert [r.granted for r in at_once] == [True, True, False, False]
    assert not any(r.claimed for r in at_once)  # the bucket's own two, no slot moved


async def test_a_late_slot_moves_no_more_than_the_bucket_lacks_of_its_burst(
    store: BucketStore, clock: ManualClock
) -> None:
    """Below empty since the slot's time, the bucket now holds half a token: a move may carry
    the burst less that (1 of a burst of 2 whose window already gets the half)."""
    b = (bucket("h", rate=10, burst=2),)
    kept = KEPT._replace(owner=0.0, life=2.0)
    for _ in range(2):
        assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, kept)).granted
    for _ in range(4):  # slots at 0.1, 0.2, 0.3 and 0.4 s
        assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, kept)).reserved
    await later(store, clock, 0.45)  # level -4 + 4.5 = 0.5: above empty only since 0.4 s
    moved = [await store.acquire(b, 1, 0, QUEUE, guard(), None, kept) for _ in range(3)]
    assert [r.claimed for r in moved] == [True, False, False]


async def test_a_bucket_a_little_above_empty_still_lets_late_slots_move_half_its_burst(
    store: BucketStore, clock: ManualClock
) -> None:
    """A bucket that rose a little above empty since the slots' time (demand about its rate,
    as a tenant's precise retriers keep it) still leaves half its burst free in any window:
    the slots move, up to that (a flooded tenant's quiet neighbour got 5/s of its 10 before)."""
    b = (bucket("m", rate=10, burst=10),)
    kept = KEPT._replace(owner=0.0, life=2.0)
    for _ in range(10):
        assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, kept)).granted
    for _ in range(4):  # slots at 0.1-0.4 s, nobody's
        assert (await store.acquire(b, 1, 0, QUEUE, guard(), None, kept)).reserved
    await later(store, clock, 0.65)  # level -4 + 6.5 = 2.5: above empty since 0.4 s, below half
    moved = [await store.acquire(b, 1, 0, QUEUE, guard(), None, kept) for _ in range(4)]
    assert all(r.granted and r.claimed for r in moved), [(r.granted, r.claimed) for r in moved]
