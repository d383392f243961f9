"""Reserved quota that nobody claims (issue 34; SPEC §6): a deferred caller that never comes
back leaves its slot to the next requests that ask, whoever they are: callers holding a
later slot of their own move up, and a costly slot serves several cheaper calls.

A real Redis, the proxy in process, a mock vendor in a process of its own counting a strict
window (rate + burst in any 1 s), and workers that are plain aiohttp clients, each on its
own connection. bench/quota.py (``--parts noshow`` and the ``giveup`` retriers) measures the
same over the issue's grid.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import vendor_policy
from tests.helpers.vendor_process import VendorProcess, measured_rate, vendor_process

pytestmark = [pytest.mark.slow, pytest.mark.timing]

HOST = "http://api.payments.example"
FILES = "endpoints: [{name: files, match: {path: '/v1/files*'}, cost: 5}]"


@pytest.fixture
def window_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    with vendor_process(tmp_path, "--rate", "20", "--window", "1s") as vendor:  # 10/s + burst 10
        yield vendor


async def _burst(proxy: str, path: str, calls: int, shed: bool) -> int:
    """``calls`` at once, each on a connection of its own; the deferred ones never return.
    Returns how many were deferred."""
    headers = {"X-Quota-On-Limit": "shed"} if shed else {}

    async def one(i: int) -> int:
        async with aiohttp.ClientSession() as s, s.get(f"{HOST}{path}/{i}", proxy=proxy, headers=headers) as r:
            await r.read()
            assert r.status in (200, 429, 503), r.status
            return int(r.status == 429 and r.headers.get("X-Quota-Action") == "defer")

    return sum(await asyncio.gather(*(one(i) for i in range(calls))))


async def _precise(proxy: str, workers: int, seconds: float) -> int:
    """Workers that sleep exactly ``retry-after-ms`` and repeat their own URL on their own
    connection, for ``seconds``. Returns the calls served."""
    served = 0
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        nonlocal served
        calls = 0
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                calls += 1
                while time.monotonic() < deadline:
                    async with s.get(f"{HOST}/v1/ping/{i}-{calls}", proxy=proxy) as r:
                        await r.read()
                        if r.status == 200:
                            served += 1
                            break
                        assert r.status == 429 and r.headers["X-Quota-Action"] == "defer", r.status
                        hint = int(r.headers["retry-after-ms"]) / 1000
                    await asyncio.sleep(min(hint, max(deadline - time.monotonic(), 0.0)))

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return served


SECONDS = 9.0  # per run; the first 0.5 s of refill is the first kept slot's, so <= 17/18 at best


async def _run(start_proxy: Any, vendor: VendorProcess, redis: str, path: str, calls: int) -> float:
    """One row of the issue's table: a burst whose deferred calls never come back, then ten
    precise workers for ``SECONDS``. Returns their calls served per second."""
    policy = vendor_policy(
        vendor.url,
        store=redis,
        limits="[{rate: 10, per: 1s, burst: 10}]",
        on_limit="{action: defer}",
        extra_vendor=FILES,
    )
    proxy = await start_proxy(policy)
    deferred = await _burst(proxy.url, path, calls, shed=False)
    assert deferred == calls - (2 if path == "/v1/files" else 10), deferred
    return await _precise(proxy.url, workers=10, seconds=SECONDS) / SECONDS


@pytest.mark.parametrize(
    ("path", "calls"),
    [("/v1/files", 20), ("/v1/ping/burst", 40)],
    ids=["20 x cost 5, 9 s of quota kept", "40 x cost 1, 3 s of quota kept"],
)
async def test_a_burst_nobody_claims_serves_the_workers_after_it(window_vendor, redis_url, start_proxy, path, calls):
    """Issue 34's table. Before: 20 x cost 5, 18 deferred that never come back, left 2.5/s to
    the workers after it; 40 x cost 1 (30 deferred) left 7.7/s; against 9.3/s when the burst
    was shed. The shed run spends the whole quota, 10/s (bench/noshow.py: 10.00 every run): the
    target, >= 90 % of it, is taken against the quota itself."""
    served = await _run(start_proxy, window_vendor, redis_url, path, calls)
    rejected = (await window_vendor.stats())["rejected"]
    print(f"served per second {served:.2f}; vendor 429s {rejected}")
    assert served >= 0.9 * 10, served
    assert rejected == 0


@pytest.fixture
def strict_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    with vendor_process(tmp_path, "--rate", "24", "--window", "1s") as vendor:  # 19/s + burst 5
        yield vendor


async def test_sustained_overload_where_a_third_never_return_spends_the_quota(strict_vendor, redis_url, start_proxy):
    """Two replicas, 30 workers at 19/s burst 5, each job on a connection of its own (an SDK
    client per job); a third of deferred jobs are given up (dropped, the connection closed,
    the next job at once): the quota is spent and the strict window never overrun. (At burst 1
    this passes alone, 30 runs of 30, but in the whole suite on a loaded machine, the two
    replicas and the thirty workers on one event loop, a vendor 429 reached a worker in 2 runs
    of 5: issue 34 stays open on it.)"""
    policy = vendor_policy(
        strict_vendor.url, store=redis_url, limits="[{rate: 19, per: 1s, burst: 5}]", on_limit="{action: defer}"
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    rng = random.Random(34)
    given_up = 0
    began = time.monotonic()
    deadline = began + 7.0

    async def worker(i: int) -> None:
        nonlocal given_up
        calls = 0
        while time.monotonic() < deadline:
            calls += 1
            async with aiohttp.ClientSession() as s:
                while time.monotonic() < deadline:
                    async with s.get(f"{HOST}/v1/charges/{i}-{calls}", proxy=proxies[i % 2].url) as r:
                        await r.read()
                        if r.status == 200:
                            break
                        assert r.status == 429 and r.headers.get("X-Quota-Action") == "defer", (
                            f"{r.status} {time.monotonic() - began:.3f} s in: {dict(r.headers)}"
                        )
                        hint = int(r.headers["retry-after-ms"]) / 1000
                    if rng.random() < 1 / 3:
                        given_up += 1
                        break  # never back: the next job at once
                    await asyncio.sleep(min(hint, max(deadline - time.monotonic(), 0.0)))

    await asyncio.gather(*(worker(i) for i in range(30)))
    stats = await strict_vendor.stats()
    rate = measured_rate(sorted(stats["arrivals"]), began + 1.0, deadline)
    late_429 = [t for t in stats["rejections"] if t > began + 1.0]
    print(f"vendor {rate:.2f}/s; {given_up} jobs given up; vendor 429s {stats['rejected']}")
    assert given_up >= 30, given_up  # the case at hand: many slots left behind
    assert rate >= 0.9 * 19, rate
    assert not late_429, late_429
