"""Learned limits end to end (SPEC §10, issue 10 item 4): a policy of 100/s against a
vendor that really allows 70/s in any sliding second and says so in its quota headers.

One proxy replica on the test Redis, hold mode, workers saturating. The fleet must come
down to the vendor's limit from its headers (not from a sawtooth of 429s) and follow the
vendor back up when it raises its limit, never above the policy.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.policy import Policy
from proxy.server import ProxyServer
from tests.conftest import ProxyFactory, Vendor, metric_samples, vendor_policy
from tests.helpers.vendor_process import VendorProcess, measured_rate, vendor_process

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # asserts rates or time bounds: run apart from other timed tests

POLICY_RATE = 100.0
VENDOR_RATE = 70
RAISED_RATE = 110
LEARNED = 68.99 / 1.01  # what a vendor allowing 70 in any second teaches (learning.learned_values)
WORKERS = 12


def learning_policy(upstream: str, redis_url: str, burst: int = 10) -> Policy:
    policy = vendor_policy(
        upstream,
        limits=f"[{{rate: {POLICY_RATE:g}, per: 1s, burst: {burst}}}]",
        store=redis_url,
        on_limit="{action: hold, max_hold: 500ms}",
    )
    (vendor,) = policy.vendors
    auto = dataclasses.replace(vendor, feedback=dataclasses.replace(vendor.feedback, headers="auto"))
    return dataclasses.replace(policy, vendors=(auto,))


@asynccontextmanager
async def saturating(proxy: ProxyServer, workers: int = WORKERS) -> AsyncIterator[list[int]]:
    """Workers looping requests through the proxy; yields the statuses seen so far."""
    statuses: list[int] = []
    stop = asyncio.Event()

    async def worker(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.get(proxy.url + "/payments/v1/ping") as r:
                await r.read()
                statuses.append(r.status)
                if r.status == 429 and "X-Quota-Action" in r.headers:  # a proxy defer: wait as told
                    await asyncio.sleep(int(r.headers["X-Quota-Retry-After-Ms"]) / 1000)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=workers)) as session:
        tasks = [asyncio.ensure_future(worker(session)) for _ in range(workers)]
        try:
            yield statuses
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)


def busiest_second(arrivals: list[float], since: float, until: float) -> int:
    """The most arrivals in any 1-second window starting in [since, until]."""
    i = bisect.bisect_left(arrivals, since)
    hi = bisect.bisect_right(arrivals, until)
    return max((bisect.bisect_left(arrivals, arrivals[k] + 1.0) - k for k in range(i, hi)), default=0)


async def until(clock_start: float, seconds: float) -> None:
    await asyncio.sleep(max(clock_start + seconds - time.monotonic(), 0.0))


async def learn_status(session: aiohttp.ClientSession, proxy: ProxyServer) -> dict[str, Any]:
    async with session.get(proxy.admin_url + "/status") as r:
        learned: dict[str, Any] = (await r.json())["vendors"][0]["learned"]
        return learned


async def learned_rate(session: aiohttp.ClientSession, proxy: ProxyServer) -> float | None:
    async with session.get(proxy.admin_url + "/metrics") as r:
        samples = metric_samples(await r.text())
    return samples.get(("ratelimit_learned_rate", frozenset({"limiter": "payments"}.items())))


@pytest.mark.parametrize("family", ["x-ratelimit", "ietf"])
async def test_the_fleet_comes_down_to_the_vendors_limit_and_follows_it_back_up(
    start_proxy: ProxyFactory, redis_url: str, family: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The vendor in a process of its own (tests/helpers/vendor_process.py): rates measured
    over 0.8 s read its arrival times, which one in the test's loop stamped late by the
    loop's other work (101.05/s once, against the 101 allowed, under the parallel suite)."""
    caplog.set_level(logging.INFO, logger="quota_proxy.limiter")
    with vendor_process(tmp_path, "--rate", str(VENDOR_RATE), "--window", "1s", "--quota-headers", family) as mock:
        await _follows(mock, start_proxy, redis_url, family, caplog)


async def _follows(
    mock: VendorProcess, start_proxy: ProxyFactory, redis_url: str, family: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await start_proxy(learning_policy(mock.url, redis_url))
    start = time.monotonic()
    async with saturating(proxy), aiohttp.ClientSession() as admin:
        # Converged within 5 s: measured from 1.5 s to 4.5 s (a 1.5-s window read 66.3/s for
        # the learned 68/s once, on a machine another test process kept busy: one 30 ms stall
        # is 2 requests of 102; of 204 it is 1 %).
        await until(start, 1.5)
        early = await learn_status(admin, proxy)
        early_at = time.monotonic()
        await until(start, 4.5)
        stats = await mock.stats()
        down = measured_rate(sorted(stats["arrivals"]), start + 1.5, start + 4.5)
        rejected_down = stats["rejected"]
        learned = await learned_rate(admin, proxy)
        status_at = time.monotonic()
        status = await learn_status(admin, proxy)
        # The vendor raises its limit to what the policy can grant in a second (100/s + burst
        # 10): the proxy follows within one reset period (the vendor's 1-s window), never above
        # the policy, and the learned limit is cleared.
        raised = time.monotonic()
        await mock.set_limit(RAISED_RATE)
        await until(raised, 1.8)
        stats = await mock.stats()
        up = measured_rate(sorted(stats["arrivals"]), raised + 1.0, raised + 1.8)
        cleared = await learned_rate(admin, proxy)
    stats = await mock.stats()
    arrivals = sorted(stats["arrivals"])
    # 95 % of the learned rate: a loaded machine's stalls cost a few requests of 205 (it read
    # 65.7/s once for the learned 68.31/s, under the parallel suite).
    assert down >= 0.95 * LEARNED, f"{down:.1f}/s at the vendor after converging"
    assert down <= VENDOR_RATE + 0.5
    assert rejected_down <= 3, f"{rejected_down} vendor 429s while coming down"
    assert learned == pytest.approx(LEARNED)  # (70 + 1 - burst 2 - 0.01) per 1.01 s: at most 70 in a window
    (bucket,) = status["buckets"]
    assert (bucket["learned"], bucket["rate_per_second"], bucket["burst"], bucket["vendor_limit"]) == (
        True,
        pytest.approx(68.99 / 1.01),
        2.0,
        70,
    )
    assert bucket["source"] == ("X-RateLimit" if family == "x-ratelimit" else "RateLimit 'default'")
    # Learn calls: a few while settling, then none per request at a steady limit.
    assert early["store_calls"] <= 20
    # Every answer between the two snapshots was a report (at most the workers' requests in
    # flight at either end aside); timed by the snapshots themselves, which a loaded machine
    # delays (a fixed ">= 90" failed at 31-69 on a loaded machine, with the calls still <= 2).
    steady_reports = status["reports"] - early["reports"]
    answered = sum(early_at <= t <= status_at for t in arrivals)
    assert steady_reports >= max(answered - 2 * WORKERS, 30), (steady_reports, answered)
    assert status["store_calls"] - early["store_calls"] <= 2, (early, status)
    assert busiest_second(arrivals, start - 1.0, raised - 1.0) <= VENDOR_RATE  # cold start included
    assert up >= 0.95 * POLICY_RATE, f"{up:.1f}/s at the vendor one window after it raised its limit"
    assert up <= POLICY_RATE + 1
    assert stats["rejected"] == rejected_down  # and no vendor 429 on the way up
    assert busiest_second(arrivals, raised, raised + 1.2) <= POLICY_RATE + 10  # the policy's rate + burst
    assert cleared is None  # the gauge is gone: the policy applies again
    messages = [r.getMessage() for r in caplog.records]
    assert sum("now refills at 68.31/s, burst 2" in m for m in messages) == 1
    assert sum("learned limit on global 100/1s burst 10 is cleared" in m for m in messages) == 1


async def test_without_auto_the_headers_teach_nothing(
    vendor: Vendor, start_proxy: ProxyFactory, redis_url: str
) -> None:
    mock = vendor.mock
    mock.configure(VENDOR_RATE, window=1.0)
    policy = learning_policy(vendor.url, redis_url)
    (v,) = policy.vendors
    proxy = await start_proxy(
        dataclasses.replace(policy, vendors=(dataclasses.replace(v, feedback=v.feedback.__class__()),))
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.get(proxy.url + "/payments/v1/ping") as r:
                assert r.status == 200 and r.headers["X-RateLimit-Limit"] == "70"
    assert proxy.runtime.limiter.learned_rate(v) is None
    assert proxy.runtime.limiter.learned.reports == 0
