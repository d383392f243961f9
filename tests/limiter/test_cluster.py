"""redis+cluster://: the same buckets on a real three-node Redis Cluster.

Every key of one vendor carries the hash tag ``{vendor}``, so each script touches one
slot; vendors spread over the nodes.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import aiohttp
import pytest
from redis.crc import key_slot

from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketSpec
from tests.conftest import RedisServer, free_port, vendor_policy


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        pytest.fail("redis-server and redis-cli are needed for the cluster tests; refusing to skip")
    nodes: list[RedisServer] = []
    try:
        for _ in range(3):
            port = free_port()
            while port > 55535:  # Redis refuses larger ports in cluster mode
                port = free_port()
            node = RedisServer(binary, tmp_path_factory.mktemp("cluster"), port=port)
            node.start(
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    str(free_port()),
                ]
            )
            nodes.append(node)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        # Every node must agree the cluster is up before a client may route to it.
        deadline = time.monotonic() + 20
        while not all(_cluster_ok(n) for n in nodes):
            if time.monotonic() > deadline:
                pytest.fail("the test cluster did not converge")
            time.sleep(0.05)
        yield f"redis+cluster://127.0.0.1:{nodes[0].port}"
    finally:
        for node in nodes:
            node.kill()


def _cluster_ok(node: RedisServer) -> bool:
    with node.client() as c:
        info = c.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def buckets(vendor: str) -> tuple[BucketSpec, BucketSpec]:
    return (
        BucketSpec(f"t:{{{vendor}}}:t:acme:1", 0.001, 5, "tenant", "tenant"),
        BucketSpec(f"t:{{{vendor}}}:g:1", 0.001, 3, "global", "global"),
    )


async def test_buckets_of_vendors_on_every_node(cluster: str) -> None:
    store = RedisStore(cluster, timeout=1.0)
    try:
        vendors = [f"v{i}" for i in range(12)]  # enough names to land on all three nodes
        slots = {key_slot(buckets(v)[0].key.encode()) for v in vendors}
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


async def test_a_proxy_on_a_cluster_store_limits(cluster: str, vendor, start_proxy) -> None:
    proxy = await start_proxy(
        vendor_policy(vendor.url, store=cluster, limits="[{rate: 1, per: 1h, burst: 4}]", on_limit="{action: defer}")
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
