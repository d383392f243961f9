"""The seed's verification, literally: a worker fleet behind several replicas sharing Redis.

(a) the aggregate rate holds under scaling (4, then 40 workers, 2 replicas);
(b) atomicity under contention (200 concurrent requests, a 10-token bucket);
(c) a vendor 429 stops every replica for its Retry-After, then traffic refills from empty;
(d) deferral does not starve: workers that honour Retry-After all finish.

Every rate is measured at the vendor (MockVendor's arrival times). The workers,
both replicas and the vendor share this test's event loop, and the machine may be
busy with other suites: bounds leave room for scheduling noise, but an unthrottled
proxy (hundreds of requests a second) fails every one of them.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.devtools.mockvendor import MockVendor
from proxy.server import ProxyServer
from tests.conftest import client_session, eventually, make_policy, vendor_policy

pytestmark = pytest.mark.slow

TARGET = "http://api.payments.example/v1/charges"


# -- helpers ---------------------------------------------------------------------------


def is_proxy_defer(status: int, headers: Any) -> bool:
    return status == 429 and headers.get("X-Quota-Action") == "defer"


def retry_after_ms(headers: Any) -> int:
    """The proxy's precise wait; checked against the whole-second Retry-After on the way."""
    ms = int(headers["X-Quota-Retry-After-Ms"])
    seconds = int(headers["Retry-After"])
    assert ms >= 1
    assert seconds >= 1
    assert seconds * 1000 >= ms, (seconds, ms)
    return ms


def count_between(arrivals: list[float], lo: float, hi: float) -> int:
    """Arrivals in [lo, hi)."""
    return bisect.bisect_left(arrivals, hi) - bisect.bisect_left(arrivals, lo)


async def replicas(start_proxy, policy, n: int = 2) -> list[ProxyServer]:
    return [await start_proxy(policy) for _ in range(n)]


@dataclass
class Tally:
    forwarded: int = 0
    deferred: int = 0
    vendor_429: int = 0
    unexpected: list[int] = field(default_factory=list)


async def paced_worker(s: aiohttp.ClientSession, proxy_url: str, stop_at: float, tally: Tally) -> None:
    """Send back to back until ``stop_at``; on a proxy defer, wait X-Quota-Retry-After-Ms."""
    while time.monotonic() < stop_at:
        async with s.get(TARGET, proxy=proxy_url) as r:
            await r.read()
            if r.status == 200:
                tally.forwarded += 1
            elif is_proxy_defer(r.status, r.headers):
                tally.deferred += 1
                await asyncio.sleep(retry_after_ms(r.headers) / 1000)
            elif r.status == 429:
                tally.vendor_429 += 1
            else:
                tally.unexpected.append(r.status)


# -- (a) the aggregate rate holds under scaling ----------------------------------------

RATE = 50.0
VENDOR_RATE = 60.0  # the vendor's own quota, above the configured one: any excess shows as 429s


async def test_aggregate_rate_holds_with_4_then_40_workers_through_2_replicas(vendor, redis_url, start_proxy):
    vendor.mock.configure(VENDOR_RATE, 30)
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits=f"[{{rate: {RATE:g}, per: 1s, burst: 5}}]",
        on_limit="{action: hold, max_hold: 500ms}",
    )
    proxies = await replicas(start_proxy, policy)
    duration, warmup = 3.5, 0.5
    results: dict[int, tuple[float, Tally, int, int]] = {}
    async with client_session() as s:
        for workers in (4, 40):
            tally = Tally()
            accepted0, rejected0 = vendor.mock.accepted, vendor.mock.rejected
            start = time.monotonic()
            stop_at = start + duration
            await asyncio.gather(*(paced_worker(s, proxies[i % 2].url, stop_at, tally) for i in range(workers)))
            rate = vendor.mock.measured_rate(since=start + warmup, until=stop_at)
            results[workers] = (rate, tally, vendor.mock.accepted - accepted0, vendor.mock.rejected - rejected0)

    for workers, (rate, tally, accepted, rejected) in results.items():
        summary = f"{workers} workers: vendor-side {rate:.2f}/s for {RATE:g}/s configured, {tally}"
        print(summary, f"vendor 429s: {rejected}")
        assert abs(rate - RATE) <= 0.05 * RATE, summary
        assert rejected == 0, summary  # the vendor, enforcing 60/s, never had to refuse
        assert tally.vendor_429 == 0 and tally.unexpected == [], summary
        assert tally.forwarded == accepted, summary  # every 200 the workers saw came from the vendor
    # 40 workers want far more than 50/s: the excess was deferred (and waited), not forwarded.
    assert results[40][1].deferred > 0, results[40]


# -- (b) atomicity under contention ----------------------------------------------------


async def test_200_concurrent_requests_against_a_10_token_bucket_forward_exactly_10(vendor, redis_url, start_proxy):
    # 200 clients, 2 replicas and the vendor share one event loop here, so a store call
    # can wait far longer for the loop than for Redis: a generous store timeout keeps
    # every request in the contest for the bucket (store failures have their own tests).
    policy = make_policy(
        """
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        store: {url: "$store", timeout: 3s}
        vendors:
          - name: payments
            hosts: [api.payments.example]
            upstream: $upstream
            limits: [{rate: 10, per: 1h, burst: 10}]
            tenant_limits: {default: [{rate: 100, per: 1h, burst: 100}]}
            on_limit: {action: defer}
        """,
        store=redis_url,
        upstream=vendor.url,
    )
    proxies = await replicas(start_proxy, policy)
    go = asyncio.Event()

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[str, int, Any]:
        tenant = f"t{i % 2}"
        await go.wait()
        async with s.get(f"{TARGET}?i={i}", proxy=proxies[(i // 2) % 2].url, headers={"X-Tenant-Id": tenant}) as r:
            await r.read()
            return tenant, r.status, r.headers

    async with client_session() as s:
        tasks = [asyncio.ensure_future(one(s, i)) for i in range(200)]
        go.set()
        answers = await asyncio.gather(*tasks)

    ok = [a for a in answers if a[1] == 200]
    deferred = [a for a in answers if is_proxy_defer(a[1], a[2])]
    assert len(ok) == 10, sorted({a[1] for a in answers})
    assert len(deferred) == 190
    assert vendor.mock.accepted == 10 and vendor.mock.rejected == 0
    assert len(vendor.mock.requests) == 10  # nothing else reached the vendor
    # Every refusal is the bucket's own, not a store failure standing in for one.
    reasons = [a[2].get("X-Quota-Reason") for a in deferred if "X-Quota-Reason" in a[2]]
    assert reasons == [], f"{len(reasons)} of the 190 deferrals were X-Quota-Reason: {set(reasons)}"
    for _, _, headers in deferred:
        assert headers["X-Quota-Limiter"] == "payments"
        assert retry_after_ms(headers) >= 300_000  # one token of 10/h is ~6 minutes away
    # A refusal takes nothing from any bucket: each tenant lost exactly what it forwarded.
    runtime = proxies[0].runtime
    vendor_cfg = runtime.policy.vendor("payments")
    for tenant in ("t0", "t1"):
        _, levels = await runtime.limiter.peek(vendor_cfg, tenant)
        sent = sum(1 for a in ok if a[0] == tenant)
        assert levels[0] == pytest.approx(100 - sent, abs=0.1), (tenant, levels)
        assert levels[1] == pytest.approx(0, abs=0.1), (tenant, levels)


# -- (c) a vendor 429 stops every replica ----------------------------------------------


class TimedMockVendor(MockVendor):
    """A MockVendor that also notes when it answered 429."""

    def __init__(self) -> None:
        super().__init__(rate=None)
        self.rejected_at: list[float] = []

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        response = await super().handle(request)
        if response.status == 429:
            self.rejected_at.append(time.monotonic())
        return response


@dataclass
class Event:
    at: float
    replica: int
    status: int
    action: str | None
    retry_after: str | None
    retry_after_ms: int | None


async def test_a_vendor_429_stops_every_replica_for_its_retry_after(aiohttp_server, redis_url, start_proxy):
    rate, block = 20.0, 2.0
    mock = TimedMockVendor()
    server = await aiohttp_server(mock.app())
    upstream = str(server.make_url("")).rstrip("/")
    policy = vendor_policy(
        upstream,
        store=redis_url,
        limits=f"[{{rate: {rate:g}, per: 1s, burst: 20}}]",
        on_limit="{action: hold, max_hold: 500ms}",
    )
    proxies = await replicas(start_proxy, policy)
    events: list[Event] = []
    stop = asyncio.Event()

    async def worker(s: aiohttp.ClientSession, replica: int) -> None:
        while not stop.is_set():
            async with s.get(TARGET, proxy=proxies[replica].url) as r:
                await r.read()
                ms = r.headers.get("X-Quota-Retry-After-Ms")
                events.append(
                    Event(
                        time.monotonic(),
                        replica,
                        r.status,
                        r.headers.get("X-Quota-Action"),
                        r.headers.get("Retry-After"),
                        int(ms) if ms else None,
                    )
                )
                if is_proxy_defer(r.status, r.headers):
                    await asyncio.sleep(retry_after_ms(r.headers) / 1000)

    async with client_session() as s:
        tasks = [asyncio.ensure_future(worker(s, i % 2)) for i in range(8)]
        try:
            await eventually(lambda: mock.accepted >= 40, deadline=10, what="steady traffic before the 429")
            mock.script(status=429, retry_after="2", count=1)
            await eventually(lambda: bool(mock.rejected_at), deadline=5, what="the scripted vendor 429")
            t429 = mock.rejected_at[0]
            await eventually(lambda: time.monotonic() > t429 + block + 1.2, deadline=10, what="traffic after the block")
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    arrivals = list(mock.arrivals)
    grace = 0.25  # requests already on their way when the vendor answered 429
    in_flight = count_between(arrivals, t429, t429 + grace)
    during = [a - t429 for a in arrivals if t429 + grace <= a < t429 + block]
    after = [a for a in arrivals if a >= t429 + grace]
    print(
        f"vendor 429 at t0; in flight after it: {in_flight}; first arrival after the block: "
        f"t0+{(after[0] - t429) if after else float('nan'):.3f}s; "
        f"proxy defers during the block: {sum(1 for e in events if e.action == 'defer' and e.at < t429 + block)}"
    )
    assert mock.rejected == 1 and len(mock.rejected_at) == 1
    assert in_flight <= 3, in_flight
    assert during == [], f"reached the vendor during its Retry-After (s after the 429): {during}"

    # The worker that drew the vendor's 429 got it as the vendor's: no X-Quota-Action.
    passed = [e for e in events if e.status == 429 and e.action is None]
    assert len(passed) == 1 and passed[0].retry_after == "2", passed

    # Every replica knew: both deferred workers during the block, telling the truth about its end.
    defers = [e for e in events if e.action == "defer" and t429 < e.at < t429 + block]
    assert {e.replica for e in defers} == {0, 1}, defers
    for e in defers:
        assert e.retry_after is not None and int(e.retry_after) >= 1
        assert e.retry_after_ms is not None
        assert e.at + e.retry_after_ms / 1000 >= t429 + block - 0.02, (e, t429)
    assert all(e.status in (200, 429) for e in events), {e.status for e in events}

    # Traffic resumed, refilling from empty: a full bucket would let 20 through at once.
    assert after, "traffic never resumed"
    first = after[0]
    assert t429 + block <= first <= t429 + block + 0.6, first - t429
    burst_window = count_between(arrivals, first, first + 0.5)
    assert burst_window <= rate * 0.5 + 3, f"{burst_window} requests in the 0.5s after the block"
    assert count_between(arrivals, first, first + 1.0) >= 10, "traffic did not resume at the rate"


# -- (d) deferral does not starve ------------------------------------------------------


async def test_deferred_workers_that_honour_retry_after_all_finish(vendor, redis_url, start_proxy):
    rate, burst, workers, needed = 30.0, 5, 30, 3
    vendor.mock.configure(rate * 1.2, 10)
    policy = vendor_policy(
        vendor.url, store=redis_url, limits=f"[{{rate: {rate:g}, per: 1s, burst: {burst}}}]", on_limit="{action: defer}"
    )
    proxies = await replicas(start_proxy, policy)
    refusals = [0] * workers
    finished: list[float] = [0.0] * workers
    ideal = (workers * needed - burst) / rate
    bound = 2 * ideal + 2.0  # generous for a busy machine, but finite: nobody is refused forever

    async def worker(s: aiohttp.ClientSession, i: int) -> None:
        done = 0
        while done < needed:
            async with s.get(TARGET, proxy=proxies[(i + done + refusals[i]) % 2].url) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                else:
                    assert is_proxy_defer(r.status, r.headers), (r.status, dict(r.headers))
                    refusals[i] += 1
                    await asyncio.sleep(retry_after_ms(r.headers) / 1000)
        finished[i] = time.monotonic()

    start = time.monotonic()
    async with client_session() as s:
        await asyncio.wait_for(asyncio.gather(*(worker(s, i) for i in range(workers))), timeout=bound)
    elapsed = max(finished) - start

    print(
        f"{workers}x{needed} at {rate:g}/s: {elapsed:.2f}s (ideal {ideal:.2f}s), refusals per worker "
        f"max {max(refusals)} total {sum(refusals)}"
    )
    assert all(f > 0 for f in finished)
    assert elapsed <= bound, f"{elapsed:.2f}s for {workers}x{needed} requests at {rate:g}/s"
    assert vendor.mock.accepted == workers * needed
    assert vendor.mock.rejected == 0
    arrivals = list(vendor.mock.arrivals)
    # Never more than the buckets allow: burst + rate x window, in any one-second window.
    worst = max(count_between(arrivals, a, a + 1.0) for a in arrivals)
    assert worst <= burst + rate + 2, worst
    steady = vendor.mock.measured_rate(since=arrivals[0] + 0.5)
    assert steady <= rate * 1.05, steady


async def test_a_deferred_worker_that_waits_retry_after_is_not_refused_again(vendor, redis_url, start_proxy):
    """With no other demand, waiting X-Quota-Retry-After-Ms is always enough, on any replica."""
    policy = vendor_policy(
        vendor.url, store=redis_url, limits="[{rate: 5, per: 1s, burst: 1}]", on_limit="{action: defer}"
    )
    proxies = await replicas(start_proxy, policy)
    async with client_session() as s:
        async with s.get(TARGET, proxy=proxies[0].url) as r:
            assert r.status == 200
        for cycle in range(5):
            async with s.get(TARGET, proxy=proxies[cycle % 2].url) as r:
                assert is_proxy_defer(r.status, r.headers), r.status
                wait = retry_after_ms(r.headers)
                assert wait <= 200, wait  # one token of 5/s is at most 200 ms away
            await asyncio.sleep(wait / 1000)
            async with s.get(TARGET, proxy=proxies[(cycle + 1) % 2].url) as r:
                assert r.status == 200, (cycle, r.status, r.headers.get("X-Quota-Retry-After-Ms"))
    assert vendor.mock.accepted == 6
