"""Accuracy at the edge (issue 10 item 5): a proxy configured right at a strict vendor.

The vendor counts a strict sliding window (at most 100 requests in any 1 s, on arrival);
the proxy's bucket is 95/s burst 5, so 5 + 95 x 1 s fills the window exactly and any
request that leaves later than its grant relative to the next ones makes a 101st. From a
cold start (no connection to the vendor yet), 40 workers saturating: the vendor must see
no window above 100 and answer no 429.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.pipeline import forward
from proxy.wire.pool import Pool
from proxy.wire.upstream import Origin, UpstreamConnection
from tests.conftest import client_session, eventually, vendor_policy
from tests.helpers.vendor_process import VendorProcess, vendor_process

pytestmark = [pytest.mark.slow, pytest.mark.busy]

WINDOW_LIMIT = 100
WORKERS = 40
RUN = 2.5  # seconds: the start-up window and the first steady ones


async def saturate(proxy_url: str, seconds: float) -> dict[str, int]:
    """WORKERS callers looping as fast as they are let, each deferral slept for its
    ``retry-after-ms`` (what the SDKs do); returns the statuses seen."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        while time.monotonic() < deadline:
            async with s.get(f"http://api.payments.example/w{i}", proxy=proxy_url) as r:
                await r.read()
                kind = r.headers.get("X-Quota-Action", "vendor") if r.status != 200 else "ok"
                seen[f"{r.status} {kind}"] = seen.get(f"{r.status} {kind}", 0) + 1
                pause = float(r.headers.get("retry-after-ms", 0)) / 1000 if r.status == 429 else 0.0
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))

    async with client_session() as s:
        await asyncio.gather(*(one(s, i) for i in range(WORKERS)))
    return seen


async def at_the_edge(
    vendor: VendorProcess, start_proxy: Any, redis_url: str, action: str, seconds: float
) -> tuple[dict[str, Any], dict[str, int]]:
    """A proxy at 95/s burst 5 (which fill the vendor's strict window of WINDOW_LIMIT
    exactly) saturated for ``seconds``: the vendor's stats and the statuses seen."""
    policy = vendor_policy(
        vendor.url,
        store=redis_url,
        limits="[{rate: 95, per: 1s, burst: 5}]",
        on_limit=f"{{action: {action}, max_hold: 500ms}}",
    )
    proxy = await start_proxy(policy)
    seen = await saturate(proxy.url, seconds)
    return await vendor.stats(), seen


def saturated(stats: dict[str, Any], seconds: float) -> bool:
    return stats["accepted"] >= 0.9 * (5 + 95 * seconds) - 20


@pytest.fixture
def process_vendor(vendor_ca: tuple[Any, Path], tmp_path: Path) -> Iterator[VendorProcess]:
    """Over TLS, in a process of its own (tests/helpers/vendor_process.py: in the test's loop,
    the first burst's arrivals were stamped 20 ms after the proxy wrote them)."""
    ca, ca_file = vendor_ca
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert_file, key_file = tmp_path / "vendor-cert.pem", tmp_path / "vendor-key.pem"
    cert_file.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    key_file.write_bytes(cert.private_key_pem.bytes())
    tls = (cert_file, key_file, ca_file)
    with vendor_process(tmp_path, "--rate", str(WINDOW_LIMIT), "--window", "1s", tls=tls) as vendor:
        yield vendor


@pytest.fixture
def http_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    """A strict window of WINDOW_LIMIT a second, in a process of its own (the test's loop,
    busy with the proxy and the fleet, stamped a bunch's arrivals late: 101 and 104 in a
    window where the proxy wrote 100)."""
    with vendor_process(tmp_path, "--rate", str(WINDOW_LIMIT), "--window", "1s") as vendor:
        yield vendor


@pytest.mark.parametrize("action", ["defer", "hold"])
async def test_rate_plus_burst_at_the_window_never_overruns_it_from_a_cold_start(
    process_vendor, start_proxy, redis_url, action
):
    """Over TLS, as real vendors are: a burst that must first connect (five handshakes)
    used to reach the vendor ~10 ms after its grant, together with the next grants."""
    extra = f"tls: {{upstream_ca_file: {process_vendor.ca_file}}}"
    policy = vendor_policy(
        process_vendor.url,
        store=redis_url,
        limits="[{rate: 95, per: 1s, burst: 5}]",
        on_limit=f"{{action: {action}, max_hold: 500ms}}",
        extra_top=extra,
    )
    proxy = await start_proxy(policy)
    seen = await saturate(proxy.url, RUN)
    stats = await process_vendor.stats()
    first = sorted(stats["arrivals"] + stats["rejections"])[:8]
    detail = (seen, [round((t - first[0]) * 1000, 1) for t in first])  # ms: the burst, then one per ~10.5
    assert stats["window_max"] <= WINDOW_LIMIT, (stats["window_max"], *detail)
    assert stats["rejected"] == 0, detail
    assert saturated(stats, RUN), (stats["accepted"], seen)  # saturated, not idle


@pytest.mark.parametrize("action", ["defer", "hold"])
async def test_requests_delayed_between_grant_and_write_are_not_bunched(
    http_vendor, start_proxy, redis_url, action, monkeypatch
):
    """Every request granted in the first 100 ms is delayed before it is written (its
    connection opens slowly: a cold start, a busy loop) while the later ones are not.
    They used to reach the vendor together at 100 ms, ~14 in a bunch, and the window
    after it held those and the next second's grants: ~109 of 100, and vendor 429s. Now
    the writes are paced on their own: at most a burst at once, the rest at the rate."""
    monkeypatch.setattr(forward, "warm_count", lambda vendor: 0)  # every request connects itself
    real_idle, real_open = Pool.idle, Pool.open
    loop = asyncio.get_running_loop()
    stall_until: list[float] = []

    def stalled() -> bool:
        if not stall_until:
            stall_until.append(loop.time() + 0.1)
        return loop.time() < stall_until[0]

    def idle(self: Pool, origin: Origin) -> UpstreamConnection | None:
        return None if stalled() else real_idle(self, origin)

    async def open_(self: Pool, origin: Origin, timeout: float | None) -> UpstreamConnection:
        if stalled():
            conn = await real_open(self, origin, timeout)
            await asyncio.sleep(stall_until[0] - loop.time())
            return conn
        return await real_open(self, origin, timeout)

    monkeypatch.setattr(Pool, "idle", idle)
    monkeypatch.setattr(Pool, "open", open_)
    stats, seen = await at_the_edge(http_vendor, start_proxy, redis_url, action, 1.6)
    assert stats["window_max"] <= WINDOW_LIMIT, (stats["window_max"], seen)
    assert stats["rejected"] == 0, seen
    assert saturated(stats, 1.6), (stats["accepted"], seen)


async def test_a_burst_worth_of_connections_waits_open_before_the_first_request(raw_vendor, start_proxy, monkeypatch):
    """The proxy opens its vendor's burst of connections at start and keeps them open
    (topped up when the vendor closes them); a burst's requests find them, none connects."""
    monkeypatch.setattr(forward, "_WARM_EVERY", 0.05)
    requests = 0
    conns: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        conns.append(writer)
        while True:
            await reader.readuntil(b"\r\n\r\n")
            requests += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()

    raw = await raw_vendor(serve)
    proxy = await start_proxy(vendor_policy(raw.url, limits="[{rate: 100, per: 1s, burst: 3}]"))
    deps = proxy.runtime.deps
    pool, origin = deps.upstreams.pool(deps.policy.vendors[0]), forward.origin_of(raw.url)
    # (the proxy's pool, not the vendor's accepts: a connection is accepted there before the
    # proxy has it idle)
    await eventually(lambda: raw.connections == 3 and pool.idle_count(origin) == 3, "three connections opened")
    assert requests == 0  # opened, nothing sent on them
    async with client_session() as s:

        async def call(i: int) -> int:
            async with s.get(f"http://api.payments.example/c{i}", proxy=proxy.url) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(*(call(i) for i in range(3))) == [200] * 3
        assert (raw.connections, requests) == (3, 3)  # the burst used the warm connections
        for w in conns:
            w.close()  # the vendor drops its idle connections (its keep-alive timeout)
        await eventually(
            lambda: raw.connections == 6 and pool.idle_count(origin) == 3, "three connections opened again"
        )
        assert await call(9) == 200
    assert (raw.connections, requests) == (6, 4)
