"""redis+cluster://: the same buckets on a real three-node Redis Cluster.

Every key of one vendor carries the hash tag ``{vendor}``, so each script touches one
slot; vendors spread over the nodes. Acquires go over one pipelined connection per
primary (cluster_pipelined.py), following the cluster when a slot moves.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest
from redis.crc import key_slot

from proxy.limiter.redis_store import RedisStore
from proxy.limiter.scripts import script
from proxy.limiter.store import BucketSpec, Leases, LeaseSet, StoreUnavailable
from tests.conftest import eventually, vendor_policy
from tests.helpers.stores import LocalCluster


def buckets(vendor: str) -> tuple[BucketSpec, BucketSpec]:
    return (
        BucketSpec(f"t:{{{vendor}}}:t:acme:1", 0.001, 5, "tenant", "tenant"),
        BucketSpec(f"t:{{{vendor}}}:g:1", 0.001, 3, "global", "global"),
    )


def slot_of(vendor: str) -> int:
    return key_slot(buckets(vendor)[0].key.encode())


def vendors_on_other_nodes(cluster: LocalCluster, count: int = 24) -> dict[int, str]:
    """One vendor name per node (by port): enough names land on all three."""
    found: dict[int, str] = {}
    for i in range(count):
        found.setdefault(cluster.owner(slot_of(f"v{i}")).port, f"v{i}")
    assert len(found) == len(cluster.nodes)
    return found


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "redis-py"])
async def test_buckets_of_vendors_on_every_node(cluster_url: str, pipelined: bool) -> None:
    store = RedisStore(cluster_url, timeout=1.0, pipelined=pipelined)
    try:
        vendors = [f"v{i}" for i in range(12)]  # enough names to land on all three nodes
        slots = {slot_of(v) for v in vendors}
        assert len(slots) == len(vendors)
        for v in vendors:
            grants = [(await store.acquire(buckets(v), 1, 0)).granted for _ in range(5)]
            assert grants == [True, True, True, False, False]  # the global burst of 3 binds
            levels = await store.peek(buckets(v))
            assert levels[0] == pytest.approx(2, abs=0.1)  # the tenant paid for 3 grants only
            blocked = await store.block(buckets(v)[1:], 1.0, "")
            assert blocked.until == pytest.approx(1.0, abs=0.01)
        await store.ping()
    finally:
        await store.close()


async def test_a_proxy_on_a_cluster_store_limits(cluster_url: str, vendor, start_proxy) -> None:
    proxy = await start_proxy(
        vendor_policy(
            vendor.url, store=cluster_url, limits="[{rate: 1, per: 1h, burst: 4}]", on_limit="{action: defer}"
        )
    )
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.get("http://api.payments.example/x", proxy=proxy.url) as r:
                statuses.append(r.status)
    assert statuses == [200] * 4 + [429] * 2
    assert vendor.mock.accepted == 4


def test_every_key_of_a_vendor_shares_its_slot() -> None:
    keys = [*(b.key for b in buckets("payments")), "t:{payments}:block"]
    assert len({key_slot(k.encode()) for k in keys}) == 1


async def test_one_command_per_acquire(redis_cluster: LocalCluster, cluster_url: str) -> None:
    # What "pipelined" buys: each acquire is one EVALSHA on the vendor's node, nothing else
    # (no slot lookup, no connection check-out PING), wherever the vendor lives.
    store = RedisStore(cluster_url, timeout=1.0)
    vendors = list(vendors_on_other_nodes(redis_cluster).values())
    try:
        for v in vendors:  # connect, load the script, learn the slot map
            assert (await store.acquire(buckets(v), 1, 0)).granted
        before = redis_cluster.calls()
        results = await asyncio.gather(*(store.acquire(buckets(v), 1, 0) for v in vendors * 10))
        after = redis_cluster.calls()
    finally:
        await store.close()
    assert sum(r.granted for r in results) == 2 * len(vendors)  # the global burst of 3 binds
    ran = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    assert ran.pop("evalsha") == len(results)
    inside = set(re.findall(r"redis\.p?call\(['\"](\w+)", script("acquire")))  # what acquire.lua calls
    assert set(ran) <= {name.lower() for name in inside}


async def test_acquires_follow_a_slot_migrated_mid_test_taking_each_token_once(
    redis_cluster: LocalCluster, cluster_url: str
) -> None:
    vendor = "mover"
    bucket = (BucketSpec(f"t:{{{vendor}}}:g:1", 0.0001, 10, "global", "global"),)
    slot = key_slot(bucket[0].key.encode())
    store = RedisStore(cluster_url, timeout=1.0)
    levels: list[float] = []

    async def take(n: int) -> None:
        for _ in range(n):
            r = await store.acquire(bucket, 1, 0)
            assert r.granted
            levels.append(r.levels[0])

    try:
        await take(3)
        source = redis_cluster.owner(slot)
        target = next(n for n in redis_cluster.nodes if n is not source)
        refused_before = redis_cluster.stat(source, "evalsha", "rejected_calls")
        redis_cluster.begin_migration(slot, target)  # the source answers ASK now
        await take(3)
        redis_cluster.finish_migration(slot, target)  # and MOVED from here on
        await take(4)
        refused = await store.acquire(bucket, 1, 0)
        redirected = redis_cluster.stat(source, "evalsha", "rejected_calls") - refused_before
    finally:
        await store.close()
    # Each grant took exactly one token, in the order asked: none twice, none lost in transit.
    assert [round(x) for x in levels] == list(range(9, -1, -1))
    assert not refused.granted
    # An ASK for each call while the slot migrates (ASK is for one call), then one MOVED: the
    # store follows it and knows the new owner from then on.
    assert redirected == 3 + 1
    assert redis_cluster.owner(slot) is target


@pytest.mark.timing
async def test_a_dead_or_frozen_node_fails_its_vendors_closed_at_once(
    redis_cluster: LocalCluster, cluster_url: str
) -> None:
    timeout = 0.25
    store = RedisStore(cluster_url, timeout=timeout)
    by_node = vendors_on_other_nodes(redis_cluster)
    node = next(n for n in redis_cluster.nodes if n is not redis_cluster.nodes[0])
    doomed = by_node[node.port]
    others = [v for port, v in by_node.items() if port != node.port]
    try:
        for v in by_node.values():
            assert (await store.acquire(buckets(v), 1, 0)).granted

        ran_before = redis_cluster.stat(node, "evalsha")
        node.pause()  # frozen: connections stay open, nothing answers
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.acquire(buckets(doomed), 1, 0)
            assert time.monotonic() - started < timeout + 0.5
            for v in others:  # the other nodes' vendors are not held up by it
                assert (await store.acquire(buckets(v), 1, 0)).granted
        finally:
            node.resume()
        assert (await store.acquire(buckets(doomed), 1, 0)).granted
        # The call that got no reply may have run once the node woke up; it was never sent again.
        assert redis_cluster.stat(node, "evalsha") - ran_before <= 2

        redis_cluster.kill(node)
        try:
            for _ in range(2):  # the lost connection, then the refused one
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    await store.acquire(buckets(doomed), 1, 0)
                assert time.monotonic() - started < timeout + 0.5
            for v in others:
                assert (await store.acquire(buckets(v), 1, 0)).granted
        finally:
            redis_cluster.restart(node)
        assert (await store.acquire(buckets(doomed), 1, 0)).granted  # reconnected (its keys are gone)
    finally:
        await store.close()


async def test_a_node_that_lost_its_scripts_gets_them_again(redis_cluster: LocalCluster, cluster_url: str) -> None:
    store = RedisStore(cluster_url, timeout=1.0)
    node = redis_cluster.owner(slot_of("forgetful"))
    try:
        assert (await store.acquire(buckets("forgetful"), 1, 0)).granted
        with node.client() as c:
            c.script_flush()  # as a node restarted under the same connection would have
        loads = redis_cluster.stat(node, "script|load")
        levels = [(await store.acquire(buckets("forgetful"), 1, 0)).levels for _ in range(2)]
    finally:
        await store.close()
    assert [round(lv[1]) for lv in levels] == [1, 0]  # each grant took one token, once
    assert redis_cluster.stat(node, "script|load") - loads == 1  # on NOSCRIPT, that node only


@pytest.mark.timing
async def test_a_call_whose_keys_are_half_migrated_waits_for_them_and_never_takes_twice(
    redis_cluster: LocalCluster, cluster_url: str
) -> None:
    vendor = "halfway"
    pair = (
        BucketSpec(f"t:{{{vendor}}}:t:acme:1", 0.0001, 10, "tenant", "tenant"),
        BucketSpec(f"t:{{{vendor}}}:g:1", 0.0001, 10, "global", "global"),
    )
    slot = key_slot(pair[0].key.encode())
    store = RedisStore(cluster_url, timeout=0.5)
    try:
        assert (await store.acquire(pair, 1, 0)).granted
        source = redis_cluster.owner(slot)
        target = next(n for n in redis_cluster.nodes if n is not source)
        retried_before = redis_cluster.stat(source, "evalsha", "rejected_calls")
        redis_cluster.begin_migration(slot, target, keys=[pair[0].key])  # one key gone, one not
        # Still split at the deadline: unavailable (the last try's answer, TRYAGAIN, or none yet).
        with pytest.raises(StoreUnavailable, match=r"TRYAGAIN|TimeoutError"):
            await store.acquire(pair, 1, 0)
        retried = redis_cluster.stat(source, "evalsha", "rejected_calls") - retried_before
        # The other key follows while a call is trying again: that call goes through (ASK).
        asyncio.get_running_loop().call_later(0.05, redis_cluster.migrate, slot, target)
        during = await store.acquire(pair, 1, 0)
        redis_cluster.finish_migration(slot, target)
        after = await store.acquire(pair, 1, 0)
    finally:
        await store.close()
    assert retried > 1  # TRYAGAIN was followed by sending again, and refused each time
    assert during.granted and after.granted
    # The refused calls took nothing; the granted ones one token each.
    assert [[round(x) for x in r.levels] for r in (during, after)] == [[8, 8], [7, 7]]


async def test_leases_are_taken_and_given_back_on_the_vendors_node(
    redis_cluster: LocalCluster, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Acquire and release both go over the pipelined connection of the node that owns
    # the vendor's slot: one EVALSHA each, nothing through redis-py.
    cap = LeaseSet("t:{leased}:c", 1, "concurrency 1")
    node = redis_cluster.owner(slot_of("leased"))
    store = RedisStore(cluster_url, timeout=1.0)
    through_redis_py: list[object] = []
    monkeypatch.setattr(store.client, "evalsha", lambda *args: through_redis_py.append(args))
    try:
        ran_before = redis_cluster.stat(node, "evalsha")
        first = await store.acquire(buckets("leased"), 1, 0, leases=Leases("r1", 30.0, (cap,)))
        full = await store.acquire(buckets("leased"), 1, 0, leases=Leases("r2", 30.0, (cap,)))
        released = await store.release((cap,), ("r1",), "")
        again = await store.acquire(buckets("leased"), 1, 0, leases=Leases("r3", 30.0, (cap,)))
        ran = redis_cluster.stat(node, "evalsha") - ran_before
    finally:
        await store.close()
    assert first.granted and not full.granted and full.full == 0
    assert released == (0,)
    assert again.granted and again.inflight == (1,)
    assert ran == 4
    assert through_redis_py == []


async def test_redis_py_cluster_internals_failing_mean_the_store_is_unavailable(cluster_url: str) -> None:
    """redis-py's cluster client raised AttributeError from inside itself under load (a
    node's connection being replaced); the proxy answered 500 "internal proxy error". It is
    the store failing: StoreUnavailable, which the breaker and on_failure handle."""
    store = RedisStore(cluster_url, timeout=1.0)

    async def broken() -> None:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")

    try:
        with pytest.raises(StoreUnavailable, match="redis-py cluster client"):
            await store._call(broken)
    finally:
        await store.close()
    plain = RedisStore("redis://127.0.0.1:1/0", timeout=1.0)
    try:
        with pytest.raises(AttributeError):  # elsewhere it is a bug of ours, and says so
            await plain._call(broken)
    finally:
        await plain.close()


async def test_the_straight_path_follows_a_migrated_slot_taking_each_token_once(
    redis_cluster: LocalCluster, cluster_url: str, vendor, start_proxy, monkeypatch
) -> None:
    """The straight path (lane.py) sends its acquire to the node the map says owns the slot;
    a MOVED answer (it did not run there) sends it again where it belongs, once: the vendor
    gets exactly the burst though its slot moved, and only the refusals entered the general
    path (with the store's answer)."""
    from proxy.pipeline.handler import ProxyHandler

    general: list[str] = []
    serve = ProxyHandler.__call__

    async def counted(self: Any, request: Any, responder: Any, *args: Any, **kwargs: Any) -> None:
        general.append(request.target)
        await serve(self, request, responder, *args, **kwargs)

    monkeypatch.setattr(ProxyHandler, "__call__", counted)
    limits = "[{rate: 1, per: 1h, burst: 9}]"
    policy = vendor_policy(vendor.url, store=cluster_url, limits=limits, on_limit="{action: defer}")
    proxy = await start_proxy(policy)
    slot = key_slot(b"t:{payments}:state")
    statuses: list[int] = []
    async with aiohttp.ClientSession() as s:

        async def call() -> None:
            async with s.get("http://api.payments.example/x", proxy=proxy.url) as r:
                statuses.append(r.status)

        await call()  # connects the store, learns the slot map (the general path's)
        general.clear()
        for _ in range(2):
            await call()
        source = redis_cluster.owner(slot)
        target = next(n for n in redis_cluster.nodes if n is not source)
        refused_before = redis_cluster.stat(source, "evalsha", "rejected_calls")
        # Moved whole (midway, an acquire naming several keys is TRYAGAIN until its deadline:
        # Redis cannot tell whether a key it lacks is still on the other side), MOVED after.
        redis_cluster.begin_migration(slot, target)
        redis_cluster.finish_migration(slot, target)
        await call()  # straight to the old owner: MOVED, sent again to the new one
        redirected = redis_cluster.stat(source, "evalsha", "rejected_calls") - refused_before
        pipes = proxy.runtime.limiter.store._pipe  # (the new owner's connection opened by then)
        keys = ["t:{payments}:state"]
        await eventually(lambda: pipes.open_protocol_for(keys) is not None, "the new owner's connection open")
        for _ in range(7):
            await call()
    assert statuses == [200] * 9 + [429] * 2
    assert vendor.mock.accepted == 9  # each token taken once
    assert redirected == 1  # one MOVED: the map knew the new owner from then on
    assert len(general) == 2  # the two refused, handed over with the store's answer: the rest went straight
