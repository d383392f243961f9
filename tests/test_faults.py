"""Store failures end to end: an in-process proxy on a Redis of the test's own, a mock vendor.

Redis killed, restarted on the same port, frozen with SIGSTOP; failing open; a
worker hanging up in the middle of a hold. The assertions are about what the
vendor receives and what the workers are told, measured on the vendor's side.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import AcquireResult, BlockResult, BucketSpec, Leases, LeaseSet, Reserve, ShareAsk, StateGuard
from proxy.server import ProxyServer
from tests.conftest import RedisServer, Samples, eventually, metric_samples, value
from tests.helpers.faults import fault_policy

pytestmark = pytest.mark.slow


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float
    started: float
    """time.monotonic() when the request was sent"""

    @property
    def finished(self) -> float:
        return self.started + self.seconds

    @property
    def store_down(self) -> bool:
        return self.status == 429 and self.headers.get("X-Quota-Reason") == "store-unavailable"


async def call(session: aiohttp.ClientSession, proxy: ProxyServer, path: str = "/v1/x", **headers: str) -> Answer:
    started = time.monotonic()
    async with session.get(f"{proxy.url}/payments{path}", headers=headers) as r:
        body = await r.read()
        return Answer(r.status, dict(r.headers), body, time.monotonic() - started, started)


async def admin(session: aiohttp.ClientSession, proxy: ProxyServer, path: str) -> tuple[int, str]:
    async with session.get(f"{proxy.admin_url}{path}") as r:
        return r.status, await r.text()


async def scrape(session: aiohttp.ClientSession, proxy: ProxyServer) -> Samples:
    _, text = await admin(session, proxy, "/metrics")
    return metric_samples(text)


def assert_store_down_answer(a: Answer, min_retry_after: float = 1.0) -> None:
    assert a.store_down, (a.status, a.headers, a.body)
    assert a.headers["X-Quota-Action"] == "defer"
    assert a.headers["X-Quota-Limiter"] == "payments"
    assert int(a.headers["Retry-After"]) >= max(1, math.ceil(min_retry_after - 1e-9))


class CountingStore:
    """A RedisStore that counts the calls the proxy makes to it."""

    def __init__(self, inner: RedisStore) -> None:
        self.inner = inner
        self.acquires = 0

    async def acquire(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None = None,
        guard: StateGuard | None = None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        self.acquires += 1
        return await self.inner.acquire(buckets, cost, max_wait, queue, guard, leases, reserve, share, costs)

    def straight(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None,
        guard: StateGuard,
        sets: tuple[LeaseSet, ...] = (),
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
    ) -> None:
        return None  # every acquire through ``acquire``, counted

    def release_then(
        self,
        sets: tuple[LeaseSet, ...],
        lease_ids: tuple[str, ...],
        channel: str,
        then: Callable[[tuple[int, ...] | None, BaseException | None], None],
    ) -> bool:
        return self.inner.release_then(sets, lease_ids, channel, then)

    async def block(self, buckets: tuple[BucketSpec, ...], seconds: float, channel: str) -> BlockResult:
        return await self.inner.block(buckets, seconds, channel)

    async def drain(self, buckets: tuple[BucketSpec, ...]) -> BlockResult:
        return await self.inner.drain(buckets)

    async def peek(self, buckets: tuple[BucketSpec, ...]) -> tuple[float, ...]:
        return await self.inner.peek(buckets)

    async def refund(self, buckets: tuple[BucketSpec, ...], cost: float) -> tuple[float, ...]:
        return await self.inner.refund(buckets, cost)

    async def watch(self, pattern: str, on_message: Callable[[str, str], None]) -> None:
        await self.inner.watch(pattern, on_message)

    async def publish(self, channel: str, data: str) -> None:
        await self.inner.publish(channel, data)

    async def announce(self, key: str, member: str, stale: float, leave: bool = False) -> int:
        return await self.inner.announce(key, member, stale, leave)

    async def ping(self, probes: tuple[str, ...] = ()) -> None:
        await self.inner.ping(probes)

    async def close(self) -> None:
        await self.inner.close()


@dataclass
class Workers:
    """Worker loops hammering the proxy, recording every answer."""

    session: aiohttp.ClientSession
    proxy: ProxyServer
    n: int
    answers: list[Answer] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    tasks: list[asyncio.Future[None]] = field(default_factory=list)

    def start(self) -> None:
        self.done = [0] * self.n
        self.tasks = [asyncio.ensure_future(self._loop(i)) for i in range(self.n)]

    async def _loop(self, i: int) -> None:
        while True:
            self.answers.append(await call(self.session, self.proxy))
            self.done[i] += 1
            await asyncio.sleep(0.01)

    async def all_finished_one_more(self) -> None:
        """Every request in flight now has been answered."""
        marks = list(self.done)
        await eventually(
            lambda: all(d > m for d, m in zip(self.done, marks, strict=True)), "every worker finished a request"
        )

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# -- Redis killed and restarted ------------------------------------------------------


async def test_redis_killed_mid_run_defers_everything_then_recovers_on_restart(
    own_redis: RedisServer, vendor: Any, start_proxy: Any
) -> None:
    # A killed Redis refuses connections at once: the timeout is not what bounds this test.
    proxy = await start_proxy(fault_policy(vendor.url, own_redis.url, timeout="500ms"))
    async with aiohttp.ClientSession() as s:
        assert (await call(s, proxy)).status == 200
        # A busy moment first: the store's connection pool grows to serve it, as in production.
        crowd = await asyncio.gather(*(call(s, proxy) for _ in range(16)))
        assert all(a.status == 200 for a in crowd), [(a.status, a.body[:150], round(a.seconds, 3)) for a in crowd]
        workers = Workers(s, proxy, n=4)
        workers.start()
        try:
            await eventually(lambda: vendor.mock.accepted >= 40, "traffic flowing before the outage")
            status, _ = await admin(s, proxy, "/readyz")
            assert status == 200
            errors_before = value(await scrape(s, proxy), "ratelimit_store_errors_total")

            own_redis.kill()
            await eventually(lambda: any(a.store_down for a in workers.answers), "a worker deferred")
            await workers.all_finished_one_more()  # requests granted before the kill have landed
            forwarded_before = vendor.mock.accepted
            recorded_before = len(vendor.mock.requests)
            mark = len(workers.answers)
            await eventually(lambda: len(workers.answers) >= mark + 60, "workers answered during the outage")

            outage = workers.answers[mark:]
            assert vendor.mock.accepted == forwarded_before  # nothing forwarded
            assert len(vendor.mock.requests) == recorded_before  # not even a refused attempt reached it
            for a in outage:
                assert_store_down_answer(a)
                assert a.seconds < 1.0  # deferred promptly, never stuck
            status, _ = await admin(s, proxy, "/healthz")
            assert status == 200  # the proxy is alive
            status, body = await admin(s, proxy, "/readyz")
            assert status == 503, body
            samples = await scrape(s, proxy)
            assert value(samples, "ratelimit_store_errors_total") > errors_before
            assert value(
                samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="deferred"
            ) >= len(outage)

            own_redis.start()  # same port, empty
            restarted = len(workers.answers)
            took = await eventually(
                lambda: any(a.status == 200 for a in workers.answers[restarted:]), "traffic resuming after the restart"
            )
            assert took < 5.0
            recovered_at = next(a.finished for a in workers.answers[restarted:] if a.status == 200)
            status, body = await admin(s, proxy, "/readyz")
            assert status == 200, body
            # Recovery under load: a crowd again, on top of the workers.
            crowd = await asyncio.gather(*(call(s, proxy) for _ in range(16)))
            workers.answers.extend(crowd)
            n = len(workers.answers)
            await eventually(lambda: len(workers.answers) >= n + 20, "traffic after recovery")
            assert vendor.mock.accepted > forwarded_before
            # Once the store has answered again, it keeps answering: no request sent after
            # the recovery is refused as store-unavailable (stale pooled connections, a re-tripped breaker).
            after = [a for a in workers.answers[restarted:] if a.started > recovered_at]
            bad = [(round(a.started - recovered_at, 3), a.status, a.body[:120]) for a in after if a.status != 200]
            assert not bad, f"{len(bad)} of {len(after)} requests after the recovery were refused: {bad[:5]}"
            _, body = await admin(s, proxy, "/status")
            assert json.loads(body)["store"]["breaker"] == "closed"
        finally:
            await workers.stop()


# -- Redis frozen ----------------------------------------------------------------------


async def test_frozen_redis_fails_closed_promptly_and_the_breaker_spares_it(
    own_redis: RedisServer, vendor: Any, start_proxy: Any
) -> None:
    cooloff, failures, timeout = 1.5, 3, 0.1
    store = CountingStore(RedisStore(own_redis.url, timeout))
    proxy = await start_proxy(
        fault_policy(vendor.url, own_redis.url, timeout="100ms", failures=failures, cooloff="1500ms"), store=store
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            assert (await call(s, proxy)).status == 200
        forwarded = vendor.mock.accepted
        recorded = len(vendor.mock.requests)
        calls_before = store.acquires

        own_redis.pause()
        try:
            paused_at = time.monotonic()
            answers: list[Answer] = []
            # A crowd at once: none may hang on the frozen store.
            answers += await asyncio.gather(*(call(s, proxy) for _ in range(10)))
            # Then a steady trickle for more than two cool-offs, so the breaker must probe.
            while time.monotonic() - paused_at < 2 * cooloff + 0.6:
                answers.append(await call(s, proxy))
                await asyncio.sleep(0.02)
            outage = time.monotonic() - paused_at
            status, body = await admin(s, proxy, "/readyz")
            assert status == 503, body
            calls = store.acquires - calls_before
        finally:
            own_redis.resume()

        assert vendor.mock.accepted == forwarded
        assert len(vendor.mock.requests) == recorded
        for a in answers:
            assert a.store_down, (a.status, a.headers)
            assert a.seconds < 1.0, a.seconds  # bounded by store.timeout, not by Redis
        # The breaker: the crowd (all let through while closed) plus one probe per cool-off,
        # not one store call per request.
        assert len(answers) > 60
        assert calls >= 10 + 1, calls  # it did probe
        assert calls <= 10 + math.ceil(outage / cooloff) + 1, calls

        took = await eventually(lambda: _status_is(s, proxy, 200), "recovery after SIGCONT")
        assert took < cooloff + 3.0
        status, _ = await admin(s, proxy, "/readyz")
        assert status == 200
        assert vendor.mock.accepted > forwarded
        # Issue 2, item 6: a store-unavailable deferral asks for at least the breaker's cool-off.
        short = sorted({int(a.headers["Retry-After"]) for a in answers if int(a.headers["Retry-After"]) < cooloff})
        assert not short, f"Retry-After {short} s is shorter than the breaker's {cooloff} s cool-off"


async def _status_is(s: aiohttp.ClientSession, proxy: ProxyServer, status: int) -> bool:
    return (await call(s, proxy)).status == status


# -- failing open ----------------------------------------------------------------------


async def test_fail_open_forwards_during_the_outage_and_counts_it(
    own_redis: RedisServer, vendor: Any, start_proxy: Any
) -> None:
    proxy = await start_proxy(
        fault_policy(vendor.url, own_redis.url, on_failure="open", limits="[{rate: 5, per: 1m, burst: 5}]")
    )
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            assert (await call(s, proxy)).status == 200
        own_redis.kill()
        forwarded = vendor.mock.accepted
        answers = [await call(s, proxy) for _ in range(20)]
        assert [a.status for a in answers] == [200] * 20  # far beyond the burst of 5: unlimited, as asked
        assert all("X-Quota-Action" not in a.headers for a in answers)
        assert vendor.mock.accepted == forwarded + 20
        samples = await scrape(s, proxy)
        assert value(samples, "ratelimit_fail_open_total", limiter="payments") == 20
        assert (
            value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="forwarded") == 22
        )
        assert value(samples, "ratelimit_store_errors_total") >= 3
        status, _ = await admin(s, proxy, "/readyz")
        assert status == 503

        # Back: limits apply again. A fresh Redis lost the buckets, which restart empty, not
        # full (SPEC §12): the store's answers are defers now, not unlimited forwards.
        own_redis.start()

        async def limited_again() -> bool:
            before = value(await scrape(s, proxy), "ratelimit_fail_open_total", limiter="payments")
            a = await call(s, proxy)
            after = value(await scrape(s, proxy), "ratelimit_fail_open_total", limiter="payments")
            return after == before and a.status == 429 and a.headers.get("X-Quota-Action") == "defer"

        await eventually(limited_again, "the store deciding again")
        later = [await call(s, proxy) for _ in range(8)]
        assert sum(a.status == 200 for a in later) == 0  # 5 a minute, from empty: 12 s to the first
        refused = [a for a in later if a.status == 429]
        assert refused and all(
            a.headers["X-Quota-Action"] == "defer" and "X-Quota-Reason" not in a.headers for a in refused
        )


# -- a worker hanging up during a hold --------------------------------------------------


async def test_client_disconnect_during_a_hold_leaves_accounting_sane(
    own_redis: RedisServer, vendor: Any, start_proxy: Any
) -> None:
    interval = 0.5
    proxy = await start_proxy(
        fault_policy(
            vendor.url,
            own_redis.url,
            timeout="1s",
            limits="[{rate: 2, per: 1s, burst: 1}]",
            on_limit="{action: hold, max_hold: 3s}",
        )
    )
    async with aiohttp.ClientSession() as s:

        async def held_now() -> int:
            _, body = await admin(s, proxy, "/status")
            (entry,) = json.loads(body)["vendors"]
            return int(entry["held_now"])

        assert (await call(s, proxy, "/v1/first")).status == 200

        _, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
        writer.write(b"GET /payments/v1/cancelled HTTP/1.1\r\nHost: proxy\r\n\r\n")
        await writer.drain()
        await eventually(lambda: _eq(held_now(), 1), "the request being held")
        writer.close()  # the worker gives up
        await writer.wait_closed()

        await eventually(lambda: _eq(held_now(), 0), "the hold released")

        async def counted() -> bool:
            return (
                value(
                    await scrape(s, proxy),
                    "ratelimit_requests_total",
                    limiter="payments",
                    tenant="default",
                    outcome="error",
                )
                == 1
            )

        await eventually(counted, "the abandoned request counted once, as an error")
        samples = await scrape(s, proxy)
        assert value(samples, "ratelimit_held_requests", limiter="payments") == 0

        later = await asyncio.gather(*(call(s, proxy, f"/v1/later{i}") for i in range(3)))
        assert [a.status for a in later] == [200, 200, 200]
        seen = [r["path_qs"] for r in vendor.mock.requests]
        assert "/v1/cancelled" not in seen  # never reached the vendor, though its slot came and went
        assert seen[0] == "/v1/first"
        arrivals = list(vendor.mock.arrivals)
        assert len(arrivals) == 4
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert all(g >= interval - 0.15 for g in gaps), gaps  # paced, not a herd
        assert arrivals[-1] - arrivals[0] < 3 * interval + 2.0  # and not stuck
        assert await held_now() == 0
        samples = await scrape(s, proxy)
        assert value(samples, "ratelimit_held_requests", limiter="payments") == 0
        assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="error") == 1
        assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="held") >= 2
        assert value(samples, "ratelimit_hold_seconds_count", limiter="payments") >= 2


async def _eq(x: Awaitable[int], expected: int) -> bool:
    return await x == expected


# -- replicas keep hearing each other's blocks across a Redis restart ------------------------


async def test_block_announcements_survive_a_redis_restart(
    own_redis: RedisServer, vendor: Any, start_proxy: Any
) -> None:
    policy = fault_policy(vendor.url, own_redis.url, timeout="500ms")
    a = await start_proxy(policy)
    b = await start_proxy(policy)
    async with aiohttp.ClientSession() as s:

        async def b_blocked() -> bool:
            _, body = await admin(s, b, "/status")
            return float(json.loads(body)["vendors"][0]["blocked_for_seconds"]) > 0

        async def b_subscribed() -> bool:
            with own_redis.client() as c:
                return sum(int(client["psub"]) > 0 for client in c.client_list()) >= 2  # both replicas watch

        await eventually(b_subscribed, "both replicas watching for blocks")
        own_redis.kill()
        assert (await call(s, a)).store_down
        own_redis.start()
        await eventually(b_subscribed, "both replicas watching again after the restart")
        await eventually(lambda: _status_is(s, a, 200), "a forwarding again")

        vendor.mock.script(status=429, retry_after="4")
        answer = await call(s, a)
        assert answer.status == 429 and "X-Quota-Action" not in answer.headers  # the vendor's own 429
        await eventually(b_blocked, "replica b learning of a's block")
        _, body = await admin(s, b, "/status")
        assert 2.0 < float(json.loads(body)["vendors"][0]["blocked_for_seconds"]) <= 4.0
        deferred = await call(s, b)
        assert deferred.status == 429 and deferred.headers["X-Quota-Action"] == "defer"
        assert int(deferred.headers["Retry-After"]) >= 3
