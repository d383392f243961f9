"""A store that lost its state restarts the buckets owing, never full (SPEC §12, issue 9).

Holds are reservations: a bucket's level goes below zero and the held requests leave
when their tokens mature. If Redis loses the keys (restarted without persistence,
FLUSHALL, a key deleted or evicted, a failover to a replica that lags), a bucket that
read full again would grant a whole burst and more while the reservations granted
before still go out. The vendor's state hash (its global buckets, a grant counter and
the time of the last loss) lets the next acquire notice, in the same round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from proxy.clock import SystemClock
from proxy.limiter import Breaker, Limiter
from proxy.limiter.buckets import buckets_for, state_key
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketSpec, StateGuard
from proxy.policy.model import Limit, OnLimit, TenantLimits, Vendor
from tests.conftest import RedisServer, client_session, vendor_policy

PREFIX = "qp-lost"
TOL = 0.05


def payments(rate: float = 50, burst: float = 10, max_hold: float = 3.0, tenant: bool = False) -> Vendor:
    return Vendor(
        name="payments",
        hosts=("api.payments.example",),
        limits=(Limit(rate, 1.0, burst),),
        tenant_limits=TenantLimits(default=(Limit(1000, 1.0, 1000),) if tenant else ()),
        on_limit=OnLimit("hold", max_hold),
    )


Make = Callable[[str], RedisStore]


@pytest.fixture
async def stores() -> AsyncIterator[Make]:
    made: list[RedisStore] = []

    def make(url: str) -> RedisStore:
        s = RedisStore(url, timeout=5.0)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


def limiter_on(store: RedisStore) -> Limiter:
    return Limiter(store, SystemClock(), key_prefix=PREFIX, breaker=Breaker(SystemClock(), 3, 1.0))


async def reserve_ahead(limiter: Limiter, v: Vendor, seconds: float) -> int:
    """Take the burst and reservations reaching ``seconds`` ahead; returns how many were granted."""
    granted = 0
    while True:
        r = await limiter.acquire(v, "default", seconds)
        if not r.granted:
            return granted
        granted += 1


async def test_after_flushall_the_buckets_owe_the_reservations_granted_before(redis_url, stores):
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=50, burst=10, max_hold=3.0)
    began = time.monotonic()
    granted = await reserve_ahead(limiter, v, 3.0)
    # The burst, then 3 s of reservations at 50/s, plus what refilled while the loop ran
    # (tens of ms on a quiet machine, more on a loaded one).
    assert 10 + 150 - 2 <= granted <= 10 + 150 + 50 * (time.monotonic() - began) + 2
    await store.client.flushall()

    after = await limiter.acquire(v, "default", 0)
    assert after.lost
    assert not after.granted  # read full, it would have granted at once
    # What may still be outstanding: up to 3 s of reservations, at 50/s.
    assert after.wait == pytest.approx(3.0, abs=0.1)
    assert after.levels[-1] == pytest.approx(-150, abs=5)
    # The loss is noticed once: the next caller sees an ordinary (owing) bucket.
    again = await limiter.acquire(v, "default", 0)
    assert not again.lost and not again.granted


async def test_a_deleted_state_key_is_a_loss_too(redis_url, stores):
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=50, burst=10, max_hold=1.0)
    await reserve_ahead(limiter, v, 1.0)
    assert await store.client.delete(state_key(PREFIX, "payments")) == 1  # e.g. evicted
    after = await limiter.acquire(v, "default", 0)
    assert after.lost and not after.granted
    assert after.wait == pytest.approx(1.0, abs=0.1)


async def test_a_replica_that_lags_is_a_loss(redis_url, stores):
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=50, burst=10, max_hold=1.0)
    await reserve_ahead(limiter, v, 1.0)
    # A failover to a replica that missed the last writes: the counter went backwards, and the
    # buckets hold an older, fuller level.
    key = state_key(PREFIX, "payments")
    await store.client.hset(key, mapping={"seq": "3", "g:50/1/10:t": "10", "g:50/1/10:ts": "0"})
    after = await limiter.acquire(v, "default", 0)
    assert after.lost and not after.granted
    assert after.wait == pytest.approx(1.0, abs=0.1)


async def test_tenant_buckets_untouched_since_the_loss_owe_as_well(redis_url, stores):
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=10, burst=1, max_hold=1.0, tenant=True)
    assert (await limiter.acquire(v, "default", 0)).granted
    assert (await limiter.acquire(v, "default", 1.0)).granted  # a hold: a reservation outstanding
    await store.client.flushall()
    after = await limiter.acquire(v, "default", 0)
    assert after.lost and not after.granted
    assert after.levels[0] < 0 and after.levels[1] < 0  # tenant and global alike


async def test_a_fresh_store_is_not_a_loss(redis_url, stores):
    """A fleet that never saw state starts with full buckets, as before."""
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=50, burst=10, max_hold=1.0)
    results = [await limiter.acquire(v, "default", 0) for _ in range(10)]
    assert all(r.granted and not r.lost for r in results)
    assert [r.seq for r in results] == list(range(1, 11))


async def test_idle_keys_that_expired_when_full_are_not_a_loss(redis_url, stores):
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=1000, burst=5, max_hold=1.0, tenant=True)
    for _ in range(5):
        assert (await limiter.acquire(v, "default", 0)).granted
    tenant_key = limiter.buckets(v, "default").all[0].key
    assert await store.client.pttl(tenant_key) > 0
    await store.client.delete(tenant_key)  # as if it had expired, full again
    r = await limiter.acquire(v, "default", 0)
    assert r.granted and not r.lost


async def test_a_state_that_expired_idle_is_not_a_loss(redis_url, stores):
    """The state lives until its buckets are full again (plus the hold window): missing
    after that, nothing was outstanding, so nothing is owed."""
    store = stores(redis_url)
    limiter, v = limiter_on(store), payments(rate=1000, burst=5, max_hold=0.1)
    first = await limiter.acquire(v, "default", 0)
    assert first.granted and 0 < first.ttl <= 1.2
    await asyncio.sleep(first.ttl + 0.05)
    assert await store.client.exists(state_key(PREFIX, "payments")) == 0  # expired by itself
    again = await limiter.acquire(v, "default", 0)
    assert again.granted and not again.lost


async def test_without_a_guard_the_store_behaves_as_before(redis_url, stores):
    store = stores(redis_url)
    b = (BucketSpec("t:{v}:plain", 10, 2, "global", "plain"),)
    assert all([(await store.acquire(b, 1, 0)).granted for _ in range(2)])
    await store.client.flushall()
    r = await store.acquire(b, 1, 0)
    assert r.granted and r.seq == 0 and not r.lost


async def test_a_guard_on_a_fresh_key_space_counts_from_one(redis_url, stores):
    store = stores(redis_url)
    v = payments()
    b = buckets_for(PREFIX, v, "default")
    guard = StateGuard(state_key(PREFIX, "payments"), 0, 1.0)
    r = await store.acquire(b.all, 1, 0, None, guard)
    assert r.granted and r.seq == 1 and not r.lost


# -- the defect as a fleet saw it ---------------------------------------------------------


def max_in_any_window(arrivals: list[float], window: float) -> int:
    arrivals = sorted(arrivals)
    best, j = 0, 0
    for i, t in enumerate(arrivals):
        while arrivals[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["flushall", "restart"])
async def test_a_fleet_holding_reservations_never_overshoots_when_redis_loses_its_keys(
    vendor, own_redis: RedisServer, start_proxy, loss: str
):
    """Before: 79 requests in one second after a DEL, 104 after a kill-and-restart, against
    50/s burst 10 with 3 s holds. Now every one-second window stays within rate + burst."""
    policy = vendor_policy(
        vendor.url,
        store=own_redis.url,
        limits="[{rate: 50, per: 1s, burst: 10}]",
        on_limit="{action: hold, max_hold: 3s}",
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    stop = asyncio.Event()

    async with client_session() as s:

        async def worker(i: int) -> None:
            while not stop.is_set():
                async with s.get(f"http://api.payments.example/w{i}", proxy=proxies[i % 2].url) as r:
                    await r.read()
                    if r.status != 200:
                        await asyncio.sleep(0.05)

        tasks = [asyncio.ensure_future(worker(i)) for i in range(120)]
        await asyncio.sleep(1.5)  # reservations now reach ~3 s ahead
        if loss == "flushall":
            with own_redis.client() as c:
                c.flushall()
        else:
            own_redis.kill()
            own_redis.start()
        await asyncio.sleep(4.0)
        stop.set()
        await asyncio.gather(*tasks)

    arrivals = list(vendor.mock.arrivals)
    worst = max_in_any_window(arrivals, 1.0)
    print(f"{loss}: {len(arrivals)} forwarded, at most {worst} in any 1 s window (limit 50/s burst 10)")
    assert worst <= 50 + 10 + 1, worst


@pytest.mark.slow
@pytest.mark.parametrize("action", ["defer", "hold"])
async def test_after_a_loss_the_buckets_restart_empty_whatever_the_action(
    vendor, own_redis: RedisServer, start_proxy, action
):
    """Issue 23, item 5: 10/s burst 10, six workers, FLUSHALL under load. In defer mode the
    buckets came back full: 12 requests reached the vendor in the first 250 ms after the
    loss and 19 in the first second (8 in hold mode, whose reservations were owed). A
    bucket untouched since a loss restarts from below empty and refills from there: the
    vendor's busiest second after the loss holds at most that second's refill (+1)."""
    on_limit = "{action: defer, max_hold: 0s}" if action == "defer" else "{action: hold, max_hold: 500ms}"
    policy = vendor_policy(
        vendor.url, store=own_redis.url, limits="[{rate: 10, per: 1s, burst: 10}]", on_limit=on_limit
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    stop = asyncio.Event()

    async with client_session() as s:

        async def worker(i: int) -> None:
            while not stop.is_set():
                async with s.get(f"http://api.payments.example/w{i}", proxy=proxies[i % 2].url) as r:
                    await r.read()
                    if r.status != 200:
                        assert r.status == 429 and r.headers["X-Quota-Action"] == "defer", r.status
                        await asyncio.sleep(int(r.headers["retry-after-ms"]) / 1000)

        tasks = [asyncio.ensure_future(worker(i)) for i in range(6)]
        await asyncio.sleep(2.0)  # past the first burst: the buckets at their pace
        with own_redis.client() as c:
            c.flushall()
        lost_at = time.monotonic()
        await asyncio.sleep(2.5)
        stop.set()
        await asyncio.gather(*tasks)

    after = [t for t in vendor.mock.arrivals if t >= lost_at]
    first_quarter = sum(1 for t in after if t < lost_at + 0.25)
    worst = max_in_any_window(after, 1.0)
    print(f"{action}: {first_quarter} in the first 250 ms after the loss, at most {worst} in any 1 s after it")
    assert first_quarter <= 2.5 + 1, first_quarter
    assert worst <= 10 + 1, worst
    assert len(after) >= 15  # and it goes on serving at its pace
