"""A held request that never goes out gives its tokens back (SPEC §6 holds, issue 9).

A hold is a reservation: its tokens were taken when it was granted. Workers that give
up while held (their client timed out) used nothing, and neither did a held request
that a vendor block stops at the end of its hold; without a refund, 50 workers that
gave up left the bucket 47 tokens short and the next worker was told to wait 48 s.
Real clients, a real Redis: each worker's own timeout ends its request while it is held.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.server import ProxyServer
from tests.conftest import eventually, vendor_policy

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

VENDOR_URL = "http://api.payments.example"
GIVING_UP = 20


def held(proxy: ProxyServer) -> int:
    return proxy.runtime.handler.deps.held.get("payments", 0)


async def levels(proxy: ProxyServer, tenant: str | None = None) -> tuple[float, ...]:
    runtime = proxy.runtime
    return (await runtime.limiter.peek(runtime.policy.vendor("payments"), tenant))[1]


async def test_workers_that_give_up_while_held_leave_the_bucket_as_they_found_it(
    vendor, redis_url, start_proxy
) -> None:
    proxy = await start_proxy(
        vendor_policy(
            vendor.url,
            store=redis_url,
            limits="[{rate: 2, per: 1s, burst: 1}]",
            on_limit="{action: hold, max_hold: 30s}",
        )
    )
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/first", proxy=proxy.url) as r:
        assert r.status == 200  # took the burst: whoever comes next is held

    async def give_up(i: int) -> None:
        # Each worker waits at most 300 ms, then goes away: its hold is 0.5 s .. 10 s long.
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(TimeoutError):
                async with s.get(f"{VENDOR_URL}/impatient/{i}", proxy=proxy.url) as r:
                    await r.read()

    await asyncio.gather(*(give_up(i) for i in range(GIVING_UP)))
    await eventually(lambda: held(proxy) == 0, "the held requests ended with their workers")
    # Every reservation is given back: the bucket is where refill alone would have put it
    # (refill alone takes 10 s to cover 20 reservations at 2/s).
    await eventually(lambda: _at_least(proxy, -0.01), "the abandoned reservations refunded", deadline=3.0)
    (level,) = await levels(proxy)
    assert level <= 1.0  # never above the burst

    # The next worker waits for the refill, not behind 20 requests that never went out.
    headers = {"X-Quota-On-Limit": "defer"}
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/next", proxy=proxy.url, headers=headers) as r:
        if r.status == 429:
            assert int(r.headers["X-Quota-Retry-After-Ms"]) <= 500, r.headers
        else:
            assert r.status == 200
    paths = [r["path_qs"] for r in vendor.mock.requests]
    assert not [p for p in paths if p.startswith("/impatient")], paths  # none of them went out


async def _at_least(proxy: ProxyServer, floor: float) -> bool:
    (level,) = await levels(proxy)
    return level >= floor


async def test_a_hold_after_a_vendor_block_gives_nothing_back(vendor, redis_url, start_proxy) -> None:
    """A vendor block restarts the vendor's buckets from empty at its end, absorbing the
    reservations of held requests (feedback.lua): giving them back would put a burst at the
    block's edge (SPEC §6). So a hold stopped by a block, or abandoned after one began,
    refunds nothing."""
    proxy = await start_proxy(
        vendor_policy(
            vendor.url,
            store=redis_url,
            limits="[{rate: 2, per: 1s, burst: 1}]",
            tenant_limits="tenant_limits: {default: [{rate: 10, per: 1h, burst: 10}]}",
            on_limit="{action: hold, max_hold: 2s}",
        )
    )
    acme = {"X-Tenant-Id": "acme"}
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{VENDOR_URL}/first", proxy=proxy.url, headers=acme) as r:
            assert r.status == 200
        held_request = asyncio.ensure_future(s.get(f"{VENDOR_URL}/held", proxy=proxy.url, headers=acme))
        await eventually(lambda: held(proxy) == 1, "the second request held")
        # Another replica saw the vendor's 429 (its announcement arrives like this one).
        proxy.runtime.limiter.note_block("payments", 5.0)
        async with await held_request as r:
            assert r.status == 429
            assert "vendor block" in (await r.json())["message"]
    assert [r["path_qs"] for r in vendor.mock.requests] == ["/first"]
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("refund-")]
    assert (await levels(proxy, "acme"))[0] == pytest.approx(8, abs=0.01)
