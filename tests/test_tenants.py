"""Nested tenants, several windows, per-request on-limit choices and the pacing of holds.

Tenant buckets sit inside the vendor's global buckets and every bucket of a request is
taken in one atomic step (or none is), so: a flooding tenant cannot take another
tenant's share, a global refusal costs the tenant nothing, overrides apply, every
window binds. Rates are measured at the vendor; which tenant sent a request is told
by its path (the tenant header itself is stripped before forwarding).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time
from typing import Any

import aiohttp
import pytest

from proxy.server import ProxyServer
from tests.conftest import client_session, eventually, vendor_policy

pytestmark = [pytest.mark.slow, pytest.mark.busy]

BASE = "http://api.payments.example"


def arrivals_by_path(mock) -> dict[str, list[float]]:
    """Vendor arrival times per first path segment. The vendor is unlimited and only plain
    GETs are sent, so every recorded request was accepted, in the same order."""
    recorded, arrivals = mock.requests, list(mock.arrivals)
    assert len(recorded) == len(arrivals) and mock.rejected == 0
    out: dict[str, list[float]] = {}
    for r, at in zip(recorded, arrivals, strict=True):
        out.setdefault(r["path_qs"].split("/")[1], []).append(at)
    return out


def rate_between(times: list[float], since: float, until: float) -> float:
    """(n - 1) / (last - first) over the times in [since, until], like MockVendor.measured_rate."""
    inside = [t for t in times if since <= t <= until]
    if len(inside) < 2:
        return 0.0
    return (len(inside) - 1) / (inside[-1] - inside[0])


def held(proxies: list[ProxyServer]) -> int:
    return sum(p.runtime.handler.deps.held.get("payments", 0) for p in proxies)


async def get(s: aiohttp.ClientSession, proxy: ProxyServer, path: str, **headers: str) -> tuple[int, Any, Any]:
    async with s.get(BASE + path, proxy=proxy.url, headers=headers) as r:
        body = await r.json(content_type=None)
        return r.status, r.headers, body


# -- a flooding tenant ------------------------------------------------------------------


async def test_a_flooding_tenant_cannot_take_another_tenants_share(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits="[{rate: 30, per: 1s, burst: 10}]",
        tenant_limits="tenant_limits: {default: [{rate: 10, per: 1s, burst: 10}]}",
        on_limit="{action: hold, max_hold: 500ms}",
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    # Both tenants start with a burst of 10 that the global 30/s can serve only in turn;
    # after warmup both are paced by their own buckets alone. (3 s: the flooder's deferred
    # calls keep slots it never claims, dropped with their tenant token given back 1 s
    # after they mature: until those settle, some of the first second's tokens come
    # back after the first 1.5 s, and the flooder ran ~10.9/s over 1.5-4 s, 10.0/s over 3-6 s.)
    duration, warmup, tenant_rate = 6.0, 3.0, 10.0
    flood_refused: list[tuple[float, str]] = []
    quiet_deferred = 0
    start = time.monotonic()
    stop_at = start + duration

    async def flooder(s: aiohttp.ClientSession, i: int) -> None:
        # Never waits: as many requests as the loop can push, each refused one a chance
        # for a buggy limiter to take global tokens it should not.
        while time.monotonic() < stop_at:
            status, headers, _ = await get(
                s, proxies[i % 2], "/flood", **{"X-Tenant-Id": "flood", "X-Quota-On-Limit": "defer"}
            )
            if status != 200:
                assert status == 429 and headers["X-Quota-Action"] == "defer", status
                flood_refused.append((time.monotonic(), headers.get("X-Quota-Scope", "")))

    async def quiet(s: aiohttp.ClientSession, i: int) -> None:
        nonlocal quiet_deferred
        while time.monotonic() < stop_at:
            # Deferred, not held (a hold's reservation would shield it): honours X-Quota-Retry-After-Ms.
            status, headers, _ = await get(
                s, proxies[i % 2], "/quiet", **{"X-Tenant-Id": "quiet", "X-Quota-On-Limit": "defer"}
            )
            if status != 200:
                assert status == 429 and headers["X-Quota-Action"] == "defer", status
                quiet_deferred += 1
                await asyncio.sleep(int(headers["X-Quota-Retry-After-Ms"]) / 1000)

    async with client_session() as s:
        await asyncio.gather(*(flooder(s, i) for i in range(8)), *(quiet(s, i) for i in range(4)))

    seen = arrivals_by_path(vendor.mock)
    quiet_rate = rate_between(seen["quiet"], start + warmup, stop_at)
    flood_rate = rate_between(seen["flood"], start + warmup, stop_at)
    total_rate = vendor.mock.measured_rate(since=start + warmup, until=stop_at)
    attempts = len(flood_refused) + len(seen["flood"])
    print(
        f"flooder: {attempts / duration:.0f} attempts/s, {flood_rate:.2f}/s forwarded; quiet: {quiet_rate:.2f}/s "
        f"({quiet_deferred} deferred); vendor total {total_rate:.2f}/s"
    )
    assert attempts >= 10 * 30 * duration / 10, "the flooder did not flood"  # >= 30/s, the whole global rate
    # The quiet tenant is never starved, and gets all its bucket allows over the run (its
    # first deferred requests keep their slots behind the flooder's first ones, so some of
    # its burst may be spent after the warm-up: above the rate there, never above the bucket).
    assert quiet_rate >= 0.9 * tenant_rate, quiet_rate
    served = [t for t in seen["quiet"] if start <= t <= stop_at]
    assert 10 + tenant_rate * duration - 0.15 * tenant_rate * duration <= len(served), len(served)
    assert len(served) <= 10 + tenant_rate * (stop_at - start) + 1, len(served)
    assert flood_rate <= tenant_rate * 1.1, flood_rate
    assert total_rate <= 30 * 1.05, total_rate
    # Token-bucket bound on the flooder at any time: burst + rate x window.
    flood = seen["flood"]
    assert max(sum(1 for t in flood if a <= t < a + 1.0) for a in flood) <= 10 + tenant_rate + 1
    # In the steady part the flooder was refused by its own bucket, not by the global one.
    steady_scopes = {scope for at, scope in flood_refused if at > start + warmup}
    assert steady_scopes == {"tenant"}, steady_scopes


# -- a global refusal costs the tenant nothing ------------------------------------------


async def test_a_global_refusal_costs_the_tenant_nothing(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits="[{rate: 5, per: 1h, burst: 5}]",
        on_limit="{action: defer}",
        tenant_limits="tenant_limits: {default: [{rate: 10, per: 1h, burst: 10}], "
        "overrides: {tiny: [{rate: 1, per: 1h, burst: 1}]}}",
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    runtime = proxies[0].runtime
    cfg = runtime.policy.vendor("payments")

    async def levels(tenant: str) -> tuple[float, float]:
        _, lv = await runtime.limiter.peek(cfg, tenant)
        return lv[0], lv[1]  # (tenant, global)

    async with client_session() as s:
        # A tenant refusal costs the global bucket nothing either.
        answers = [await get(s, proxies[i % 2], f"/x{i}", **{"X-Tenant-Id": "tiny"}) for i in range(3)]
        assert [a[0] for a in answers] == [200, 429, 429]
        assert {a[1]["X-Quota-Scope"] for a in answers[1:]} == {"tenant"}
        assert await levels("tiny") == pytest.approx((0, 4), abs=0.01)

        # Tenant a empties the global bucket...
        for i in range(4):
            assert (await get(s, proxies[i % 2], f"/a{i}", **{"X-Tenant-Id": "a"}))[0] == 200
        assert await levels("a") == pytest.approx((6, 0), abs=0.01)

        # ...after which refusals are the global bucket's, and cost neither tenant a token.
        refused = [
            await get(s, proxies[i % 2], f"/r{i}", **{"X-Tenant-Id": t})
            for i, t in enumerate(["a", "b", "b", "a", "b"])
        ]
        for status, headers, body in refused:
            assert status == 429 and headers["X-Quota-Action"] == "defer"
            assert headers["X-Quota-Scope"] == "global"
            assert body["bucket"] == "global 5/1h burst 5"
        assert await levels("a") == pytest.approx((6, 0), abs=0.01)
        assert await levels("b") == pytest.approx((10, 0), abs=0.01)

        async with s.get(f"{proxies[1].admin_url}/status") as r:
            status = await r.json()
    (entry,) = status["vendors"]
    assert [b["tokens"] for b in entry["buckets"]] == [pytest.approx(0, abs=0.01)]
    assert vendor.mock.accepted == 5


# -- tenant overrides -----------------------------------------------------------------


async def test_tenant_overrides_apply(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits="[{rate: 1000, per: 1s}]",
        on_limit="{action: hold, max_hold: 1s}",
        tenant_limits="tenant_limits: {default: [{rate: 5, per: 1s, burst: 1}], "
        "overrides: {acme: [{rate: 20, per: 1s, burst: 1}]}}",
    )
    proxy = await start_proxy(policy)
    duration = 2.0
    start = time.monotonic()
    stop_at = start + duration

    async def worker(s: aiohttp.ClientSession, path: str, headers: dict[str, str]) -> None:
        while time.monotonic() < stop_at:
            status, _, _ = await get(s, proxy, path, **headers)
            assert status == 200, (path, status)  # 4 workers never queue beyond max_hold

    tenants = {"/acme": {"X-Tenant-Id": "acme"}, "/beta": {"X-Tenant-Id": "beta"}, "/nobody": {}}
    async with client_session() as s:
        await asyncio.gather(*(worker(s, p, h) for p, h in tenants.items() for _ in range(4)))

    seen = arrivals_by_path(vendor.mock)
    rates = {p: rate_between(seen[p[1:]], start + 0.2, stop_at) for p in tenants}
    print("per-tenant vendor-side rates:", {p: round(r, 2) for p, r in rates.items()})
    assert rates["/acme"] == pytest.approx(20, rel=0.1), rates
    assert rates["/beta"] == pytest.approx(5, rel=0.1), rates  # no override: the default
    assert rates["/nobody"] == pytest.approx(5, rel=0.1), rates  # no header: the default tenant


# -- several windows ----------------------------------------------------------------


async def test_per_second_and_per_minute_windows_both_bind(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        on_limit="{action: defer}",
        limits="[{rate: 10, per: 1s, burst: 10}, {rate: 15, per: 1m, burst: 15}]",
        store_timeout="2s",  # (30 calls at once on a loaded machine: not a test of the store's timeout)
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    refusals: list[tuple[float, int, str]] = []

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        status, headers, body = await get(s, proxies[i % 2], f"/w{i}")
        if status != 200:
            assert status == 429 and headers["X-Quota-Action"] == "defer"
            refusals.append((time.monotonic(), int(headers["X-Quota-Retry-After-Ms"]), body["bucket"]))
        return status

    async with client_session() as s:
        start = time.monotonic()
        # At once: the per-second window binds first (its burst is 10, the minute's is 15).
        # Each refusal keeps its caller's slot (acquire.lua, "Kept slots"): the next five
        # are 100 ms apart in the per-second window, and then the minute binds: a token
        # every 4 s, for the ones after them.
        first = await asyncio.gather(*(one(s, i) for i in range(30)))
        assert 10 <= first.count(200) <= 11, first.count(200)
        by_slot = sorted((ms, b) for _, ms, b in refusals)
        assert {b for _, b in by_slot[:4]} == {"global 10/1s burst 10"}, by_slot
        assert all(ms <= 600 for ms, _ in by_slot[:4]), by_slot
        assert {b for _, b in by_slot[5:]} == {"global 15/1m burst 15"}, by_slot
        assert all(ms >= 3000 for ms, _ in by_slot[5:]), by_slot
        # Then the per-second window refills at 10/s, but the minute has only 15 in all.
        i = 30
        while time.monotonic() < start + 2.5:
            await one(s, i)
            i += 1
            await asyncio.sleep(0.02)  # a client polling at ~50/s, far above both windows

    arrivals = list(vendor.mock.arrivals)
    late = [(ms, b) for t, ms, b in refusals if t > arrivals[-1]]
    print(
        f"forwarded {len(arrivals)} in {time.monotonic() - start:.2f}s; 15th arrival at "
        f"+{arrivals[-1] - arrivals[0]:.3f}s; {len(refusals)} refusals"
    )
    assert len(arrivals) == 15, len(arrivals)  # 15 per minute, however fast the per-second refills
    assert arrivals[14] - arrivals[0] >= 0.4, arrivals  # the 5 after the burst waited for 10/s refills
    assert late, "no request was refused after the minute's 15 were spent"
    assert {b for _, b in late} == {"global 15/1m burst 15"}, late
    assert all(ms >= 1000 for ms, _ in late), late  # a minute token is seconds away, not 100 ms


# -- per-request on-limit choices -----------------------------------------------------


async def test_x_quota_on_limit_and_max_hold_per_request(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url, store=redis_url, limits="[{rate: 2, per: 1s, burst: 1}]", on_limit="{action: hold, max_hold: 600ms}"
    )
    proxy = await start_proxy(policy)
    async with client_session() as s:
        assert (await get(s, proxy, "/r1"))[0] == 200  # the one token

        status, headers, body = await get(s, proxy, "/shed", **{"X-Quota-On-Limit": "shed"})
        assert status == 503
        assert headers["X-Quota-Action"] == "shed" and headers["X-Quota-Limiter"] == "payments"
        assert body["action"] == "shed"

        status, headers, body = await get(s, proxy, "/defer", **{"X-Quota-On-Limit": "defer"})
        assert status == 429 and headers["X-Quota-Action"] == "defer"
        assert int(headers["Retry-After"]) == 1 and int(headers["X-Quota-Retry-After-Ms"]) <= 500
        assert body.pop("retry_after_ms") == int(headers["retry-after-ms"])
        assert headers["x-should-retry"] == "true"
        message = body.pop("message")
        hint = math.ceil(int(headers["retry-after-ms"]) / 10) / 100  # in the message: rounded up to 10 ms
        assert message == f"payments is over its quota (global 2/1s burst 1); retry in {hint:.2f} s"
        assert body == {
            "error": {"type": "rate_limited", "code": "deferred", "message": message},
            "action": "defer",
            "limiter": "payments",
            "retry_after": 1,
            "scope": "global",
            "bucket": "global 2/1s burst 1",
        }

        # Asks to be held up to 10 s: capped at the vendor's 600 ms. The first waits ~0.5 s
        # and is held; the second would wait ~1 s, beyond the cap, so it is deferred.
        ask = {"X-Quota-On-Limit": "hold", "X-Quota-Max-Hold": "10s"}
        started = time.monotonic()
        first = asyncio.ensure_future(get(s, proxy, "/held", **ask))
        await eventually(lambda: held([proxy]) == 1, deadline=5, what="the first request to be held")
        status, headers, _ = await get(s, proxy, "/capped", **ask)
        assert status == 429 and headers["X-Quota-Action"] == "defer", status
        assert int(headers["X-Quota-Retry-After-Ms"]) > 600
        assert (await first)[0] == 200
        assert time.monotonic() - started >= 0.4

        # A shorter X-Quota-Max-Hold than the vendor's is honoured: ~0.5 s > 100 ms, deferred.
        status, headers, _ = await get(s, proxy, "/short", **{"X-Quota-Max-Hold": "100ms"})
        assert status == 429 and headers["X-Quota-Action"] == "defer", status

    assert [r["path_qs"] for r in vendor.mock.requests] == ["/r1", "/held"]


# -- holds leave in order, evenly paced ---------------------------------------------------


async def test_held_requests_leave_in_arrival_order_evenly_paced(vendor, redis_url, start_proxy):
    rate, n = 5.0, 11
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits=f"[{{rate: {rate:g}, per: 1s, burst: 1}}]",
        on_limit="{action: hold, max_hold: 3s}",
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    async with client_session() as s:
        assert (await get(s, proxies[0], "/o0"))[0] == 200  # takes the burst: the rest must wait
        tasks = []
        for i in range(1, n):
            tasks.append(asyncio.ensure_future(get(s, proxies[i % 2], f"/o{i}")))

            # Request i reaches the proxy and takes its place in the queue (it is held, or
            # already gone to the vendor) before request i + 1 is sent.
            def queued(i: int = i) -> bool:
                return held(proxies) + vendor.mock.accepted - 1 >= i

            await eventually(queued, deadline=5, what=f"request {i} to be held")
        answers = await asyncio.gather(*tasks)
    assert [a[0] for a in answers] == [200] * (n - 1)

    assert [r["path_qs"] for r in vendor.mock.requests] == [f"/o{i}" for i in range(n)]
    arrivals = list(vendor.mock.arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    print("vendor-side gaps (ms):", [round(g * 1000) for g in gaps])
    assert statistics.median(gaps) == pytest.approx(1 / rate, rel=0.15), gaps
    assert sum(1 for g in gaps if g < 0.5 / rate) <= 1, gaps  # no herd: at most one pair bunched by a stall
    assert arrivals[-1] - arrivals[1] == pytest.approx((n - 2) / rate, rel=0.1), gaps
