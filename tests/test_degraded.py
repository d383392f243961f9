"""store.on_failure: local end to end (SPEC §12, degraded mode): two replicas on a Redis of
the test's own, a mock vendor, workers through both replicas; Redis killed for 10 s.

Measured on the vendor's side: no 1-second window above the quota (rate x 1 s + burst)
before, during or after the outage, and at least 40 % of the quota forwarded during it;
then the replicas go back to the shared buckets.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import socket
import time
from typing import Any

import aiohttp
import pytest

from proxy.limiter.buckets import replicas_key, state_key
from proxy.server import ProxyServer
from tests.conftest import RedisServer, client_session, eventually, metric_samples, value
from tests.helpers.faults import fault_policy

pytestmark = pytest.mark.slow

RATE, BURST = 50, 10
OUTAGE = 10.0


def local_policy(upstream: str, store: str) -> Any:
    return fault_policy(
        upstream,
        store,
        on_failure="local",
        timeout="100ms",
        cooloff="500ms",
        limits=f"[{{rate: {RATE}, per: 1s, burst: {BURST}}}]",
        on_limit="{action: hold, max_hold: 500ms}",
    )


def max_in_any_window(times: list[float], window: float) -> tuple[int, float]:
    """The most arrivals in any ``window`` seconds, and when that window began."""
    times = sorted(times)
    best, at = 0, 0.0
    for i, t in enumerate(times):
        n = bisect.bisect_right(times, t + window - 1e-9) - i
        if n > best:
            best, at = n, t
    return best, at


async def status(s: aiohttp.ClientSession, proxy: ProxyServer) -> dict[str, Any]:
    async with s.get(f"{proxy.admin_url}/status") as r:
        return dict(json.loads(await r.text()))


async def test_two_replicas_keep_serving_below_the_quota_while_redis_is_down_for_10s(
    own_redis: RedisServer, vendor: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quota_proxy.store")
    policy = local_policy(vendor.url, own_redis.url)
    proxies: list[ProxyServer] = [await start_proxy(policy), await start_proxy(policy)]
    stop = asyncio.Event()
    store_down: list[float] = []  # answers that said the store was unavailable (failing closed)

    async with client_session() as s:

        async def worker(i: int) -> None:
            while not stop.is_set():
                async with s.get(f"http://api.payments.example/w{i}", proxy=proxies[i % 2].url) as r:
                    await r.read()
                    if r.headers.get("X-Quota-Reason") == "store-unavailable":
                        store_down.append(time.monotonic())
                    if r.status == 429:
                        await asyncio.sleep(max(float(r.headers.get("retry-after-ms", "10")) / 1000, 0.01))

        def both_count_two() -> bool:
            return all(p.runtime.limiter.local.presence.replicas() == 2 for p in proxies)  # type: ignore[union-attr]

        await eventually(both_count_two, "both replicas announced and counted")
        tasks = [asyncio.ensure_future(worker(i)) for i in range(40)]
        try:
            await eventually(lambda: len(vendor.mock.arrivals) >= 2 * RATE, "traffic flowing before the outage")
            with own_redis.client() as c:
                assert c.zcard(replicas_key("quota-proxy")) == 2

            own_redis.kill()
            killed = time.monotonic()
            await eventually(
                lambda: all(p.runtime.limiter.local.current() == "local" for p in proxies),  # type: ignore[union-attr]
                "both replicas on their local shares",
            )
            seen = await status(s, proxies[0])
            assert seen["store"]["degraded"]["mode"] == "local"
            assert seen["store"]["degraded"]["share"] == 0.5
            assert [b["burst"] for b in seen["vendors"][0]["local_buckets"]] == [BURST / 2]
            async with s.get(f"{proxies[0].admin_url}/readyz") as r:
                assert r.status == 200 and json.loads(await r.text())["status"] == "degraded"
            async with s.get(f"{proxies[1].admin_url}/metrics") as r:
                samples = metric_samples(await r.text())
            assert value(samples, "ratelimit_degraded", limiter="payments") == 1
            assert value(samples, "ratelimit_degraded_share", limiter="payments") == 0.5
            assert value(samples, "ratelimit_replicas_seen") == 2

            await asyncio.sleep(max(killed + OUTAGE - time.monotonic(), 0.0))
            own_redis.start()  # same port, empty: no state, no replica set
            restarted = time.monotonic()
            await eventually(
                lambda: all(p.runtime.limiter.local.current() == "shared" for p in proxies),  # type: ignore[union-attr]
                "both replicas back on the shared buckets",
            )
            back = time.monotonic()
            await asyncio.sleep(2.0)  # on the shared buckets for a while
        finally:
            stop.set()
            await asyncio.gather(*tasks)

        for p in proxies:
            seen = await status(s, p)
            assert seen["store"]["degraded"]["mode"] == "shared" and seen["store"]["degraded"]["share"] is None
            assert seen["vendors"][0]["local_buckets"] is None
            async with s.get(f"{p.admin_url}/metrics") as r:
                samples = metric_samples(await r.text())
            assert value(samples, "ratelimit_degraded", limiter="payments") == 0
            assert value(samples, "ratelimit_degraded_grants_total", limiter="payments") > 0

    arrivals = list(vendor.mock.arrivals)
    worst, at = max_in_any_window(arrivals, 1.0)
    around, _ = max_in_any_window([t for t in arrivals if t >= killed - 1.0], 1.0)
    during = [t for t in arrivals if killed + 1.0 <= t < restarted]
    after = [t for t in arrivals if back <= t]
    rate = len(during) / (restarted - killed - 1.0)
    print(
        f"{len(arrivals)} forwarded; outage {restarted - killed:.1f}s: {rate:.1f}/s "
        f"({rate / RATE:.0%} of the quota); back on the shared buckets "
        f"{back - restarted:.1f}s after the restart; at most {worst} in any 1 s window (at {at - killed:+.1f}s from "
        f"the kill; {around} from 1 s before it on; limit {RATE}/s burst {BURST})"
    )
    # The vendor's side: no 1-second window above rate x 1 s + burst, the outage and the
    # return included (one more for the jitter of arrivals measured after a loopback hop).
    assert worst <= RATE + BURST + 1, (worst, at - killed)
    assert len(during) >= 0.4 * RATE * (restarted - killed - 1.0), len(during)
    assert not store_down  # both replicas knew their share: nothing failed closed
    assert len(after) > 0
    with own_redis.client() as c:
        assert c.exists(state_key("quota-proxy", "payments"))  # the shared buckets in use again
        assert c.zcard(replicas_key("quota-proxy")) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert sum("STORE UNAVAILABLE" in m for m in messages) == 2  # loud, once per replica
    assert sum("back on the shared buckets" in m for m in messages) == 2


async def test_a_replica_that_never_saw_the_store_fails_closed_and_is_not_ready(
    vendor: Any, start_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """No share without the replica count: started while the store is out, it defers."""
    caplog.set_level(logging.ERROR, logger="quota_proxy.store")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"  # bound, never listening: refused
        proxy = await start_proxy(local_policy(vendor.url, dead))
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{proxy.url}/v1/x", headers={"Host": "api.payments.example"}) as r:
                assert r.status == 429 and r.headers["X-Quota-Reason"] == "store-unavailable"
            async with s.get(f"{proxy.admin_url}/readyz") as r:
                assert r.status == 503
            seen = await status(s, proxy)
    assert seen["store"]["degraded"] == {
        "mode": "shared",
        "replicas_seen": 0,
        "replicas_seen_seconds_ago": None,
        "share": None,
        "mode_for_seconds": seen["store"]["degraded"]["mode_for_seconds"],
        "grace_left_seconds": None,
    }
    assert vendor.mock.accepted == 0
    assert any("never learnt from the store how many replicas" in r.getMessage() for r in caplog.records)
