"""Sharing one quota through the proxy (SPEC §13): tenants by weight and classes by
priority, with workers that are real aiohttp clients going through one or two proxies
(memory:// alone, or two replicas on one real Redis) to a mock vendor counting a strict
window. The vendor records each request's tenant header, so shares are measured where
the quota is spent. Each figure fails on a first-come limiter (the same policy without
``share:``), as the baselines here show.
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

from tests.conftest import Vendor, vendor_policy
from tests.helpers.vendor_process import VendorProcess, vendor_process

pytestmark = [pytest.mark.slow, pytest.mark.timing]

TARGET = "http://api.payments.example/v1/charges"
VENDOR = 40  # the vendor's quota: at most 40 in any 1-s window
RATE = 36  # the policy's: 36/s burst 4, never more than 40 in a second
WEIGHTS = "weights: {default: 1, t2: 2, t5: 5}"
CLASSES = "classes: [checkout, batch], default_class: batch, min_share: 10%"


@pytest.fixture
def window_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    """The vendor in a process of its own (tests/helpers/vendor_process.py: its window is
    counted when requests arrive, not when a busy test loop reads them)."""
    with vendor_process(tmp_path, "--rate", str(VENDOR), "--window", "1s") as v:
        yield v


async def _proxies(
    start_proxy: Any, vendor: VendorProcess | Vendor, store: str, share: str | None, on_limit: str
) -> list[Any]:
    policy = vendor_policy(
        vendor.url,
        store=store,
        limits=f"[{{rate: {RATE}, per: 1s, burst: 4}}]",
        on_limit=on_limit,
        extra_vendor="" if share is None else f"share: {{{share}}}",
    )
    return [await start_proxy(policy) for _ in range(1 if store == "memory://" else 2)]


async def _flood(
    proxies: list[Any],
    tenants: dict[str, int],
    seconds: float,
    since: float = 0.0,
    stop: dict[str, float] | None = None,
) -> Counter[str]:
    """``tenants[t]`` workers per tenant, each calling without pause (a deferral: again after
    its retry-after-ms) for ``seconds`` (tenant t: ``stop[t]``); returns the outcomes of the
    calls answered from ``since`` seconds on (the first second is the fleet's start)."""
    seen: Counter[str] = Counter()
    start = time.monotonic()

    async def worker(t: str, i: int) -> None:
        end = start + (seconds if stop is None else stop.get(t, seconds))
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                async with s.get(TARGET, proxy=proxies[i % len(proxies)].url, headers={"X-Tenant-Id": t}) as r:
                    await r.read()
                    if time.monotonic() >= start + since:
                        seen[f"{t}:{r.status}"] += 1
                    assert r.status == 200 or r.headers.get("X-Quota-Action") == "defer", (r.status, dict(r.headers))
                    pause = int(r.headers["retry-after-ms"]) / 1000 if r.status == 429 else 0.0
                await asyncio.sleep(min(pause, max(end - time.monotonic(), 0)))

    await asyncio.gather(*(worker(t, i) for t, n in tenants.items() for i in range(n)))
    return seen


def _shares(seen: Counter[str]) -> dict[str, float]:
    """Each tenant's part of the calls served (the vendor refused none: asserted)."""
    served = {key.split(":")[0]: n for key, n in seen.items() if key.endswith(":200")}
    total = sum(served.values())
    return {t: n / total for t, n in served.items()}


def _store(request: pytest.FixtureRequest, which: str) -> str:
    """One replica on memory://, or two replicas on one Redis."""
    return "memory://" if which == "memory" else str(request.getfixturevalue("redis_url"))


HOLD, DEFER = "{action: hold, max_hold: 1s}", "{action: defer}"


@pytest.mark.parametrize(
    ("which", "on_limit", "share"),
    [
        # Each store and each action once (tests/limiter/test_share_store.py runs both stores
        # through every rule); the suite's serial time goes to what only a fleet shows.
        ("memory", HOLD, WEIGHTS),
        ("redis", DEFER, WEIGHTS),
        ("redis", DEFER, None),  # the same without share: each tenant gets about a third
    ],
    ids=["memory-hold", "redis-defer", "first-come"],
)
async def test_weights_divide_the_quota(
    window_vendor: VendorProcess,
    start_proxy: Any,
    request: pytest.FixtureRequest,
    which: str,
    on_limit: str,
    share: str | None,
) -> None:
    store = _store(request, which)
    proxies = await _proxies(start_proxy, window_vendor, store, share, on_limit)
    began = time.monotonic()
    n = 6 if on_limit == DEFER else 4  # (a deferred worker waits its turn: more of them keep the demand up)
    seen = await _flood(proxies, {"t1": n, "t2": n, "t5": n}, 4.5, since=1.5)
    stats = await window_vendor.stats()
    shares = _shares(seen)
    print(f"{store} {on_limit} share={share}: shares {shares}; {seen}")
    assert not [t for t in stats["rejections"] if t > began + 1.0]
    accepted = sum(1 for t in stats["arrivals"] if began + 1.5 <= t <= began + 4.5)
    assert accepted >= 0.9 * RATE * 3.0, accepted  # the quota is spent
    weighted = all(abs(shares.get(t, 0) - w / 8) <= 0.05 for t, w in (("t1", 1), ("t2", 2), ("t5", 5)))
    assert weighted == (share is not None), shares  # a first-come limiter gives each about a third


@pytest.mark.parametrize(
    ("which", "on_limit"), [("memory", HOLD), ("redis", DEFER)], ids=["memory-hold", "redis-defer"]
)
async def test_the_one_left_takes_the_whole_quota_within_a_second(
    window_vendor: VendorProcess, start_proxy: Any, request: pytest.FixtureRequest, which: str, on_limit: str
) -> None:
    store = _store(request, which)
    proxies = await _proxies(start_proxy, window_vendor, store, WEIGHTS, on_limit)
    began = time.monotonic()
    seen = await _flood(proxies, {"t1": 6, "t2": 6, "t5": 6}, 4.5, stop={"t1": 2.0, "t2": 2.0})
    arrivals = (await window_vendor.stats())["arrivals"]
    alone = sum(1 for t in arrivals if began + 3.0 <= t < began + 4.5)  # from 1 s after they stopped
    print(f"{store} {on_limit}: t5 alone {alone / 1.5:.1f}/s of {RATE}; {seen}")
    assert alone >= 0.9 * RATE * 1.5, alone


@pytest.mark.parametrize(
    ("which", "share"),
    [("redis", CLASSES), ("redis", None)],  # memory:// classes: test_share_store.py and the weights test
    ids=["redis", "first-come"],
)
async def test_checkout_goes_before_a_batch_flood(
    window_vendor: VendorProcess, start_proxy: Any, request: pytest.FixtureRequest, which: str, share: str | None
) -> None:
    store = _store(request, which)
    proxies = await _proxies(start_proxy, window_vendor, store, share, "{action: hold, max_hold: 1s}")
    began = time.monotonic()
    waits: list[float] = []
    statuses: Counter[int] = Counter()
    end = time.monotonic() + 4.0

    async def checkout() -> None:  # 20 % of the quota, paced
        async with aiohttp.ClientSession() as s:
            i = 0
            while time.monotonic() < end:
                began = time.monotonic()
                headers = {"X-Tenant-Id": "shop", "X-Quota-Priority": "checkout"} if share else {"X-Tenant-Id": "shop"}
                async with s.get(TARGET, proxy=proxies[i % len(proxies)].url, headers=headers) as r:
                    await r.read()
                    statuses[r.status] += 1
                if began > end - 3.0:
                    waits.append(time.monotonic() - began)
                i += 1
                await asyncio.sleep(max(0.0, began + 1 / (0.2 * RATE) - time.monotonic()))

    flood = asyncio.ensure_future(_flood(proxies, {"nightly": 16}, 4.0))
    await checkout()
    seen = await flood
    seen["shop:200"] = statuses[200]
    waits.sort()
    p99 = waits[int(0.99 * (len(waits) - 1))]
    shares = _shares(seen)
    print(f"{store} share={share}: checkout p99 {p99 * 1000:.0f} ms, {statuses}; shares {shares}")
    stats = await window_vendor.stats()
    assert not [t for t in stats["rejections"] if t > began + 1.0]
    if share is None:  # first come: checkout queues behind the flood's holds
        assert p99 > 0.2 or statuses[429] > 0
        return
    assert statuses[429] == 0, statuses  # none deferred
    # One token interval + 20 ms is the target on a quiet machine (bench/share.py); a noisy
    # 2-core CI box gets more, still far below the flood's holds (max_hold 1 s).
    assert p99 <= 1 / RATE + 0.12, waits[-5:]
    assert shares.get("nightly", 0) >= 0.1  # min_share, and the rest
    assert sum(1 for t in stats["arrivals"] if t >= began + 1.0) >= 0.9 * RATE * 3.0


async def test_an_unknown_priority_is_a_400_and_the_header_is_not_forwarded(vendor: Vendor, start_proxy: Any) -> None:
    proxies = await _proxies(start_proxy, vendor, "memory://", "classes: [checkout, batch]", "{action: defer}")
    async with aiohttp.ClientSession() as s:
        headers = {"X-Tenant-Id": "shop", "X-Quota-Priority": "urgent"}
        async with s.get(TARGET, proxy=proxies[0].url, headers=headers) as r:
            assert r.status == 400
            assert "X-Quota-Priority" in await r.text()
        headers["X-Quota-Priority"] = "checkout"
        async with s.get(TARGET, proxy=proxies[0].url, headers=headers) as r:
            assert r.status == 200
    assert "x-quota-priority" not in vendor.mock.requests[-1]["headers"]


async def test_held_turns_take_their_concurrency_leases_too(vendor: Vendor, start_proxy: Any) -> None:
    """A hold under a share waits for its turn, then for a lease of the vendor's concurrency
    cap: every call answered, none lost to an error, each tenant served."""
    vendor.mock.configure(None)
    policy = vendor_policy(
        vendor.url,
        limits=f"[{{rate: {RATE}, per: 1s, burst: 4}}]",
        on_limit=HOLD,
        extra_vendor=f"concurrency: 2\n            share: {{{WEIGHTS}}}",
    )
    proxies = [await start_proxy(policy)]
    seen = await _flood(proxies, {"t1": 4, "t5": 4}, 2.0)
    assert set(seen) <= {"t1:200", "t5:200", "t1:429", "t5:429"}, seen
    assert seen["t1:200"] > 0 and seen["t5:200"] > seen["t1:200"], seen


@pytest.mark.parametrize("which", ["memory", "redis"])
async def test_a_hold_joining_a_line_is_never_let_through_on_the_grant_of_the_one_before(
    vendor: Vendor, start_proxy: Any, request: pytest.FixtureRequest, which: str
) -> None:
    """A hold that joins its tenant's line without asking is told the line's last answer: it
    once could be the grant the line's first had just had, and the joiner went to the vendor
    on it, without tokens of its own (doubles at the vendor: 41 in a strict window of 40)."""
    vendor.mock.configure(None)
    store = _store(request, which)
    policy = vendor_policy(
        vendor.url,
        store=store,
        limits="[{rate: 10, per: 1s, burst: 1}]",
        on_limit=HOLD,
        extra_vendor=f"share: {{{WEIGHTS}}}",
    )
    proxies = [await start_proxy(policy) for _ in range(1 if which == "memory" else 2)]
    seen = await _flood(proxies, {"t1": 12, "t5": 4}, 2.5)
    arrivals = sorted(vendor.mock.arrivals)
    span = arrivals[-1] - arrivals[0]
    print(f"{which}: {len(arrivals)} in {span:.2f}s; {seen}")
    assert len(arrivals) <= 1 + 10 * span + 1, (len(arrivals), span)  # the bucket's most, and one for jitter
