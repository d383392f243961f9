"""The Lua scripts against a real redis-server, through RedisStore and a raw client.

What only Redis can show: atomicity when many connections race, Redis TIME as
the only clock, recovery from a flushed script cache, TTLs and hash tags on
every key, block announcements on the vendor's channel, and bounded failure
when Redis is gone or frozen.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from proxy.clock import SystemClock
from proxy.limiter import Breaker, Limiter, StoreUnavailable
from proxy.limiter.buckets import block_channel, buckets_for, global_buckets
from proxy.limiter.redis_store import RedisStore, close_pubsub
from proxy.limiter.scripts import script
from proxy.limiter.store import BucketSpec
from proxy.policy.model import Limit, TenantLimits, Vendor
from tests.conftest import RedisServer, free_port

PREFIX = "qp-lua"
EPOCH = 1700000000  # the scripts' time origin, seconds
NEGLIGIBLE = 0.001  # tokens per second: no refill to speak of within a test


def bucket(key: str, rate: float, burst: float, scope: str = "global", vendor: str = "v") -> BucketSpec:
    return BucketSpec(f"{PREFIX}:{{{vendor}}}:{key}", rate, burst, scope, key)  # type: ignore[arg-type]


def payments(
    limits: tuple[Limit, ...] = (Limit(10, 1, 5), Limit(600, 60, 600)),
    tenant: tuple[Limit, ...] = (Limit(2, 1, 2), Limit(60, 60, 60)),
    name: str = "payments",
) -> Vendor:
    return Vendor(name=name, hosts=(f"api.{name}.example",), limits=limits, tenant_limits=TenantLimits(default=tenant))


StoreFactory = Callable[..., RedisStore]


@pytest.fixture
async def stores() -> AsyncIterator[StoreFactory]:
    """RedisStore instances (each with its own connection pool), closed after the test."""
    made: list[RedisStore] = []

    def make(url: str, timeout: float = 5.0) -> RedisStore:
        s = RedisStore(url, timeout)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


async def redis_now_ms(client: aioredis.Redis | RedisCluster) -> float:
    sec, usec = await client.time()
    return (sec - EPOCH) * 1000 + usec / 1000


async def wait_for(condition: Callable[[], Any], what: str, deadline: float = 5.0) -> None:
    end = time.monotonic() + deadline
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- atomicity ---------------------------------------------------------------------


async def test_200_racing_acquires_take_exactly_the_burst(redis_url: str, stores: StoreFactory) -> None:
    pool = [stores(redis_url) for _ in range(8)]
    b = (bucket("contended", rate=NEGLIGIBLE, burst=10),)
    results = await asyncio.gather(*(pool[i % len(pool)].acquire(b, 1, 0) for i in range(200)))
    granted = [r for r in results if r.granted]
    assert len(granted) == 10
    # Each grant saw the bucket one token lower than the previous: the takes were serialised.
    assert sorted(round(r.levels[0]) for r in granted) == list(range(10))
    assert all(r.wait > 0 for r in results if not r.granted)
    (level,) = await pool[0].peek(b)
    assert level == pytest.approx(0, abs=0.05)


async def test_racing_tenants_take_all_or_nothing_across_tenant_and_global_buckets(
    redis_url: str, stores: StoreFactory
) -> None:
    pool = [stores(redis_url) for _ in range(8)]
    glob = bucket("g", rate=NEGLIGIBLE, burst=10)
    tenants = {t: bucket(f"t:{t}", rate=NEGLIGIBLE, burst=4, scope="tenant") for t in ("a", "b", "c", "d")}
    names = list(tenants)
    calls = [(names[i % 4], pool[i % len(pool)]) for i in range(200)]
    results = await asyncio.gather(*(s.acquire((tenants[t], glob), 1, 0) for t, s in calls))

    per_tenant = {t: 0 for t in names}
    for (t, _), r in zip(calls, results, strict=True):
        per_tenant[t] += r.granted
    assert sum(per_tenant.values()) == 10  # the global bucket binds: 4 tenants x 4 > 10
    assert all(n <= 4 for n in per_tenant.values()), per_tenant
    # A refusal took nothing: each tenant paid exactly for its grants, not for its refusals.
    for t, spec in tenants.items():
        (level,) = await pool[0].peek((spec,))
        assert level == pytest.approx(4 - per_tenant[t], abs=0.05), (t, per_tenant)
    (g,) = await pool[0].peek((glob,))
    assert g == pytest.approx(0, abs=0.05)
    assert sorted(round(r.levels[1]) for r in results if r.granted) == list(range(10))


async def test_a_refusal_writes_nothing(redis_url: str, stores: StoreFactory) -> None:
    store = stores(redis_url)
    raw = store.client
    tenant = bucket("t:x", rate=NEGLIGIBLE, burst=5, scope="tenant")
    glob = bucket("g:x", rate=NEGLIGIBLE, burst=1)
    assert (await store.acquire((tenant, glob), 1, 0)).granted
    before = {k: (await raw.hgetall(k), await raw.pttl(k)) for k in (tenant.key, glob.key)}
    for _ in range(5):
        assert not (await store.acquire((tenant, glob), 1, 0)).granted
    after = {k: (await raw.hgetall(k), await raw.pttl(k)) for k in (tenant.key, glob.key)}
    for k in before:
        assert after[k][0] == before[k][0]  # t and ts untouched
        assert after[k][1] <= before[k][1]  # TTL only ran down, never refreshed
    fresh = bucket("t:never", rate=1, burst=1, scope="tenant")
    assert not (await store.acquire((fresh, glob), 1, 0)).granted
    assert await raw.exists(fresh.key) == 0  # not even created


# -- the clock ---------------------------------------------------------------------


async def test_the_clock_is_redis_time_never_the_replicas(
    own_redis: RedisServer, stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This replica's wall clock runs an hour fast; the script must not care, because
    no timestamp crosses the wire and the script reads TIME itself."""
    skew = 3600.0
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    store = stores(own_redis.url)
    raw = store.client
    await raw.config_set("slowlog-log-slower-than", 0)  # log every command with its arguments
    await raw.slowlog_reset()

    b = bucket("clock", rate=10, burst=100)
    # State written against Redis TIME: empty 500 ms ago. Refill must be measured on the same clock.
    now = await redis_now_ms(raw)
    await raw.hset(b.key, mapping={"t": "0", "ts": f"{now - 500:.3f}"})
    r = await store.acquire((b,), 1, 0)
    assert r.granted
    assert r.levels[0] == pytest.approx(4.0, abs=1.0)  # 0.5 s x 10/s, minus the one taken

    stamp = await raw.hget(b.key, "ts")
    assert stamp is not None
    ts = float(stamp)
    server_now = await redis_now_ms(raw)
    assert server_now - 1000 < ts <= server_now  # stamped with Redis TIME...
    local_now = (time.time() - EPOCH) * 1000
    assert abs(ts - local_now) > (skew - 60) * 1000  # ...not with this process's clock

    evalshas = [e for e in await raw.slowlog_get(128) if e["command"].split()[0].upper() == b"EVALSHA"]
    assert evalshas, "the acquire never reached Redis as EVALSHA"
    for entry in evalshas:
        _, _sha, nkeys, *rest = entry["command"].split(b" ")
        argv = rest[int(nkeys) :]
        # ARGV is cost, max_wait, the queue flag, seq seen, the debt window, the bucket count,
        # lease id and lease life, the claim and how slots are kept, the share and its member,
        # then rate, burst and field per bucket: durations, rates, counts and names, nothing
        # that could be a time.
        assert argv[2:4] == [b"", b""] and argv[6] == b"" and argv[8:12] == [b""] * 4 and argv[14] == b""
        assert [float(x) for x in argv[:2] + argv[4:6] + argv[7:8] + argv[12:14]] == [
            1.0,
            0.0,
            0.0,
            1.0,
            0.0,
            pytest.approx(10 / 1000),
            100.0,
        ]


# -- the script cache --------------------------------------------------------------


async def test_noscript_is_recovered_by_reloading(own_redis: RedisServer, stores: StoreFactory) -> None:
    store = stores(own_redis.url)
    raw = store.client
    shas = {name: hashlib.sha1(script(name).encode()).hexdigest() for name in ("acquire", "feedback", "peek")}
    b = (bucket("ns", rate=NEGLIGIBLE, burst=100),)
    assert (await store.acquire(b, 1, 0)).granted
    await raw.script_flush()
    assert await raw.script_exists(*shas.values()) == [False, False, False]

    r = await store.acquire(b, 1, 0)
    assert r.granted and round(r.levels[0]) == 98  # state survived, script came back
    assert await store.peek(b) == (pytest.approx(98, abs=0.01),)
    assert (await store.drain(b)).levels == (0,)
    assert await raw.script_exists(*shas.values()) == [True, True, True]

    # Many requests meeting an empty script cache at once all recover.
    await raw.script_flush()
    c = (bucket("ns2", rate=NEGLIGIBLE, burst=100),)
    results = await asyncio.gather(*(store.acquire(c, 1, 0) for _ in range(30)))
    assert all(r.granted for r in results)
    assert (await store.peek(c))[0] == pytest.approx(70, abs=0.01)


# -- keys --------------------------------------------------------------------------


async def test_every_key_has_a_ttl_and_one_vendor_shares_one_hash_tag(redis_url: str, stores: StoreFactory) -> None:
    store = stores(redis_url)
    raw = store.client
    pay, crm = payments(), payments(name="crm")
    for tenant in ("acme", "globex"):
        assert (await store.acquire(buckets_for(PREFIX, pay, tenant).all, 1, 0)).granted
    assert (await store.acquire(buckets_for(PREFIX, crm, "acme").all, 1, 0)).granted

    keys = sorted([k.decode() async for k in raw.scan_iter(match=f"{PREFIX}:*")])
    pay_keys = [k for k in keys if "{payments}" in k]
    crm_keys = [k for k in keys if "{crm}" in k]
    # The vendor's state hash (both global windows live in it), two tenants with two windows each.
    assert len(pay_keys) == 1 + 2 * 2
    assert len(crm_keys) == 1 + 2
    assert set(pay_keys) | set(crm_keys) == set(keys)
    for k in keys:
        assert await raw.pttl(k) > 0, k
    assert len({key_slot(k.encode()) for k in pay_keys}) == 1  # one cluster slot: one script may touch all
    assert len({key_slot(k.encode()) for k in crm_keys}) == 1
    assert "acme" in "".join(pay_keys) and "globex" in "".join(pay_keys)


async def test_ttls_outlive_reservations_and_blocks(redis_url: str, stores: StoreFactory) -> None:
    store = stores(redis_url)
    raw = store.client
    b = bucket("ttl", rate=10, burst=5)
    for _ in range(5):
        assert (await store.acquire((b,), 1, 0)).granted
    # Empty: refills to burst in 0.5 s; the key lives that long plus a second.
    assert 1400 < await raw.pttl(b.key) <= 1500
    for _ in range(3):
        assert (await store.acquire((b,), 1, 1.0)).granted  # reservations: the level goes to -3
    assert 1700 < await raw.pttl(b.key) <= 1800
    # A vendor block must not vanish before it ends (and the refill after it).
    await store.block((b,), 30.0, "")
    assert 30_000 + 500 < await raw.pttl(b.key) <= 30_000 + 500 + 1000 + 50
    d = bucket("ttl-drain", rate=10, burst=5)
    await store.drain((d,))
    assert 1000 < await raw.pttl(d.key) <= 1500
    p = bucket("ttl-peek", rate=10, burst=5)
    assert await store.peek((p,)) == (5,)
    assert await raw.exists(p.key) == 0  # peeking creates nothing


# -- block announcements -----------------------------------------------------------


async def test_block_publishes_on_the_vendors_channel(redis_url: str, stores: StoreFactory) -> None:
    store = stores(redis_url)
    vendor = payments()
    channel = block_channel(PREFIX, "payments")
    assert "{payments}" in channel
    listener = aioredis.from_url(redis_url)
    pubsub = listener.pubsub()
    try:
        await pubsub.subscribe(channel)
        assert (await pubsub.get_message(timeout=2.0))["type"] == "subscribe"
        result = await store.block(global_buckets(PREFIX, vendor), 2.5, channel)
        assert result.until == pytest.approx(2.5, abs=0.01)
        msg = await pubsub.get_message(timeout=2.0)
        assert msg is not None and msg["type"] == "message"
        assert msg["channel"].decode() == channel
        assert float(msg["data"]) == pytest.approx(2500, abs=10)  # milliseconds
        await store.drain(global_buckets(PREFIX, vendor))  # a drain is not announced
        assert await pubsub.get_message(timeout=0.2) is None
    finally:
        await close_pubsub(pubsub)
        await listener.aclose()


async def test_another_replica_learns_of_the_block(redis_url: str, stores: StoreFactory) -> None:
    clock = SystemClock()
    a = Limiter(stores(redis_url), clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))
    b = Limiter(stores(redis_url), clock, key_prefix=PREFIX, breaker=Breaker(clock, 3, 1.0))
    raw = aioredis.from_url(redis_url)
    watcher = asyncio.ensure_future(b.watch_blocks())
    try:
        await wait_for(lambda: raw.pubsub_numpat(), "the replica's block subscription")
        vendor = payments()
        mark = b.mark("payments")
        assert await a.block(vendor, 3.0) == pytest.approx(3.0, abs=0.01)
        await wait_for(lambda: b.blocked_for("payments") > 0, "the block announcement")
        assert 2.0 < b.blocked_for("payments") <= 3.0
        assert b.blocked_since("payments", mark) > 2.0  # b's held requests will not go out during it
        assert b.blocked_for("crm") == 0
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher
        await raw.aclose()


# -- failure is bounded ------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
async def test_a_closed_store_refuses_and_opens_no_connection(redis_url: str, pipelined: bool) -> None:
    """A task that outlives its proxy (a refund, a learn, a release in flight at the stop) gets
    StoreUnavailable from the closed store: redis-py would open a new connection, never closed."""
    store = RedisStore(redis_url, timeout=1.0, pipelined=pipelined)
    b = global_buckets(PREFIX, payments())
    await store.peek(b)
    await store.close()
    client = store.client
    assert isinstance(client, aioredis.Redis)
    pool = client.connection_pool
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.peek(b)
    with pytest.raises(StoreUnavailable, match="closed"):
        await store.refund(b, 1.0)
    connections = [*pool._available_connections, *pool._in_use_connections]
    assert not [c for c in connections if c.is_connected], connections


async def test_a_command_in_flight_at_the_close_leaves_no_connection_open(redis_url: str) -> None:
    """redis-py reconnects for a command that was in flight when the client closed: the close
    waits for it (within the store's timeout) and closes again."""
    store = RedisStore(redis_url, timeout=1.0, pipelined=False)
    client = store.client
    assert isinstance(client, aioredis.Redis)
    await store.peek(global_buckets(PREFIX, payments()))
    started, go_on = asyncio.Event(), asyncio.Event()

    async def late_ping() -> object:
        started.set()
        await go_on.wait()  # until the close has begun
        return await client.ping()

    in_flight = asyncio.ensure_future(store._call(late_ping))
    await started.wait()
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)  # (the close's first step: the client closed)
    go_on.set()
    await closing
    assert await in_flight  # (its ping went through: redis-py reconnected for it)
    pool = client.connection_pool
    connections = [*pool._available_connections, *pool._in_use_connections]
    assert not [c for c in connections if c.is_connected], connections


async def test_a_dead_port_raises_store_unavailable_promptly(stores: StoreFactory) -> None:
    store = stores(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    b = (bucket("dead", rate=1, burst=1),)
    for call in (
        lambda: store.acquire(b, 1, 0),
        lambda: store.peek(b),
        store.ping,
        lambda: store.block(b, 1.0, "x"),
        lambda: store.drain(b),
    ):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(call(), timeout=5.0)
        assert time.monotonic() - started < 1.0


async def test_a_frozen_redis_raises_within_the_timeout_and_recovers(
    own_redis: RedisServer, stores: StoreFactory
) -> None:
    timeout = 0.15
    store = stores(own_redis.url, timeout=timeout)
    b = (bucket("frozen", rate=NEGLIGIBLE, burst=100),)
    assert (await store.acquire(b, 1, 0)).granted
    own_redis.pause()  # accepts connections, answers nothing
    try:
        for _ in range(4):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(store.acquire(b, 1, 0), timeout=5.0)
            elapsed = time.monotonic() - started
            assert timeout * 0.9 <= elapsed < timeout + 0.75, elapsed
    finally:
        own_redis.resume()
    # Back: the same store answers again, and answers correctly (no reply read from a stale call).
    await wait_for(lambda: _granted(store, b), "Redis answering again")
    for _ in range(3):
        r = await store.acquire(b, 1, 0)
        assert r.granted and r.wait == 0
        (level,) = await store.peek(b)
        assert level == pytest.approx(r.levels[0], abs=0.01)


async def _granted(store: RedisStore, b: tuple[BucketSpec, ...]) -> bool:
    try:
        return (await store.acquire(b, 1, 0)).granted
    except StoreUnavailable:
        return False
