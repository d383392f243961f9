"""The whole quota at the edges (issue 23): small bursts, retriers that come back on the
hint or early, learned limits. Deferred callers keep their slot (acquire.lua, "Kept
slots"), so the vendor is kept at its quota rather than at two thirds of it.

Each runs two replicas on a real Redis against a mock vendor in a process of its own (a
strict sliding window, or a bucket that says its limit), with workers that are plain
aiohttp clients, each with its own connection, as SDK-using workers are. bench/herd.py
measures the same over a grid of rates, bursts and fleets.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import vendor_policy
from tests.helpers.vendor_process import VendorProcess, measured_rate, vendor_process

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.busy]

TARGET = "http://api.payments.example/v1/charges"


@pytest.fixture
def window_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    with vendor_process(tmp_path, "--rate", "20", "--window", "1s") as vendor:
        yield vendor


async def _fleet(
    proxies: list[Any], workers: int, seconds: float, early: float | None = None
) -> tuple[list[int], Counter[str], list[list[int]]]:
    """Workers calling until ``seconds`` are up: on a defer each sleeps the hint
    (``retry-after-ms``), or with ``early`` retries after min(hint, early) at most twice
    and then sleeps the last hint (an SDK's own backoff, then the job re-enqueued). Returns
    calls completed per worker, outcomes, and each deferred call's slots (when its hints
    said it would be served, in ms since the start)."""
    done = [0] * workers
    seen: Counter[str] = Counter()
    slots: list[list[int]] = []
    start = time.monotonic()

    async def worker(i: int) -> None:
        async with aiohttp.ClientSession() as s:
            tries: list[int] = []
            while time.monotonic() < start + seconds:
                async with s.get(TARGET, proxy=proxies[i % len(proxies)].url) as r:
                    await r.read()
                    if r.status == 200:
                        seen["forwarded"] += 1
                        done[i] += 1
                        if tries:
                            slots.append(tries)
                        tries = []
                        continue
                    assert r.status == 429 and r.headers["X-Quota-Action"] == "defer", r.status
                    seen["deferred"] += 1
                    hint = int(r.headers["retry-after-ms"]) / 1000
                    tries.append(round((time.monotonic() - start + hint) * 1000))
                    pause = hint if early is None or len(tries) > 2 else min(hint, early)
                await asyncio.sleep(pause)

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return done, seen, slots


async def test_precise_retriers_at_burst_one_spend_the_whole_quota(window_vendor, redis_url, start_proxy):
    """Before: 19/s burst 1, ten workers sleeping exactly retry-after-ms: 12.4/s at the vendor
    (65 %), nearly two defers per call, some calls deferred four times."""
    policy = vendor_policy(
        window_vendor.url, store=redis_url, limits="[{rate: 19, per: 1s, burst: 1}]", on_limit="{action: defer}"
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    began = time.monotonic()
    done, seen, _ = await _fleet(proxies, workers=10, seconds=5.0)
    stats = await window_vendor.stats()
    arrivals = sorted(stats["arrivals"])
    rate = measured_rate(arrivals, began + 1.0, began + 5.0)
    print(f"vendor {rate:.2f}/s; {seen}; calls per worker {done}")
    assert rate >= 0.9 * 19, rate
    assert seen["deferred"] / seen["forwarded"] <= 1.5, seen
    assert min(done) >= 0.5 * sum(done) / len(done), done
    assert stats["rejected"] == 0


async def test_early_retriers_keep_one_slot_and_lose_none(window_vendor, redis_url, start_proxy):
    """Before: an SDK that retries after its own short backoff whatever the hint took a new
    slot at each early attempt (three slots for one call), and the slots nobody claimed were
    quota nobody used. Now an early retry is told the slot it was given first."""
    policy = vendor_policy(
        window_vendor.url, store=redis_url, limits="[{rate: 5, per: 1s, burst: 1}]", on_limit="{action: defer}"
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    began = time.monotonic()
    done, seen, slots = await _fleet(proxies, workers=10, seconds=6.0, early=0.3)
    stats = await window_vendor.stats()
    rate = measured_rate(sorted(stats["arrivals"]), began + 1.0, began + 6.0)
    print(f"vendor {rate:.2f}/s; {seen}; calls per worker {done}; slots {slots[:5]}")
    assert rate >= 0.85 * 5, rate
    pushed = [s for s in slots if max(s) - min(s) > 60]  # a later slot for the same call
    assert not pushed, pushed
    assert stats["rejected"] == 0


@pytest.fixture
def advertising_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    with vendor_process(tmp_path, "--rate", "20", "--burst", "20", "--quota-headers", "x-ratelimit") as vendor:
        yield vendor


async def test_a_learned_limit_is_spent_whole(advertising_vendor, redis_url, start_proxy):
    """Before: a vendor allowing 20/s (burst 20) that says so, a policy of 100/s and
    ``feedback.headers: auto``: the learned bucket (19/s burst 1) ran the vendor at 12.3-13/s."""
    policy = vendor_policy(
        advertising_vendor.url,
        store=redis_url,
        limits="[{rate: 100, per: 1s, burst: 100}]",
        on_limit="{action: defer}",
        extra_vendor="feedback: {headers: auto}",
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    began = time.monotonic()
    done, seen, _ = await _fleet(proxies, workers=10, seconds=6.0)
    assert min(done) >= 0.5 * sum(done) / len(done), done
    stats = await advertising_vendor.stats()
    rate = measured_rate(sorted(stats["arrivals"]), began + 2.0, began + 6.0)
    late_429 = [t for t in stats["rejections"] if t > began + 1.0]
    print(f"vendor {rate:.2f}/s; {seen}; vendor 429s {stats['rejected']} ({len(late_429)} after the first second)")
    assert rate >= 0.9 * 20, rate
    assert not late_429, late_429
