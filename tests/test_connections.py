"""Workers' connections are bounded (issue 9, defect 3): a request head must arrive whole
within ``connections.head_timeout`` (else 408 where a status can be written, and close), a
kept-alive connection idle for ``idle_timeout`` is closed, at most ``connections.max`` are
open (beyond: 503 ``Connection: close`` with the SPEC §5 body; far beyond: reset), and the
admin listener keeps answering while the proxy port is flooded. Raw sockets on loopback,
bounded in count and time; each wait is bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.policy import Connections
from proxy.server import ProxyServer
from proxy.wire.connections import EVICT_AFTER, TURNED_AWAY_MAX
from proxy.wire.fdlimit import RESERVED
from tests.conftest import HttpsVendor, Vendor, eventually, metric_samples, value, vendor_policy
from tests.helpers.cli import cli, server_process
from tests.helpers.intercept import intercept_policy, new_proxy_ca, upstream_of
from tests.helpers.policies import payments_policy

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

HEAD = 0.5  # connections.head_timeout in these tests
IDLE = 0.7  # connections.idle_timeout
SLACK = 2.5  # how late a timeout may fire on a loaded machine
CONNECTIONS = f"connections: {{max: $max, head_timeout: {int(HEAD * 1000)}ms, idle_timeout: {int(IDLE * 1000)}ms}}"


def policy(upstream: str, *, max_connections: int = 100, on_limit: str = "{action: hold, max_hold: 3s}") -> Any:
    return vendor_policy(upstream, extra_top=CONNECTIONS.replace("$max", str(max_connections)), on_limit=on_limit)


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@asynccontextmanager
async def raw(proxy: ProxyServer) -> AsyncIterator[Stream]:
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    try:
        yield reader, writer
    finally:
        writer.close()


async def until_closed(reader: asyncio.StreamReader, deadline: float = HEAD + SLACK + 2) -> bytes:
    """Everything the proxy sends until it closes the connection (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(), deadline)
    except ConnectionResetError:
        return b""


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
    """One request on a kept-alive connection, and its whole answer (Content-Length bodies)."""
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), 10)


def parse(answer: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split(" ")[1]), headers, json.loads(body) if body else None


GET = b"GET /payments/v1/x HTTP/1.1\r\nHost: proxy\r\n\r\n"
PARTIAL = b"GET /payments/v1/x HTTP/1.1\r\nHost: proxy\r\nX-Slow: "


async def scrape(proxy: ProxyServer) -> dict[Any, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        return metric_samples(await r.text())


# -- the request-head timeout ---------------------------------------------------------------------


async def assert_408_at_head_timeout(reader: asyncio.StreamReader, started: float) -> None:
    answer = await until_closed(reader)
    elapsed = time.monotonic() - started
    status, headers, body = parse(answer)
    assert status == 408, answer
    assert headers["connection"] == "close"
    assert body["error"] == {"type": "bad_request", "code": "request_timeout", "message": body["message"]}
    assert HEAD * 0.9 <= elapsed <= HEAD + SLACK, elapsed


async def test_a_partial_first_head_gets_408_and_is_closed_at_head_timeout(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(policy(vendor.url))
    async with raw(proxy) as (reader, writer):
        started = time.monotonic()
        writer.write(PARTIAL)
        await assert_408_at_head_timeout(reader, started)
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_connections_closed_total", reason="head_timeout") == 1


async def test_a_head_dribbled_byte_by_byte_is_cut_at_head_timeout(vendor: Vendor, start_proxy: Any) -> None:
    """Slowloris: every byte arriving in time does not extend the head's deadline."""
    proxy = await start_proxy(policy(vendor.url))
    async with raw(proxy) as (reader, writer):
        started = time.monotonic()
        writer.write(PARTIAL)

        async def dribble() -> None:
            while not writer.is_closing():
                writer.write(b"x")
                await asyncio.sleep(0.05)

        dribbling = asyncio.ensure_future(dribble())
        try:
            await assert_408_at_head_timeout(reader, started)
        finally:
            dribbling.cancel()


async def test_a_partial_head_after_a_kept_alive_request_gets_408(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(policy(vendor.url))
    async with raw(proxy) as (reader, writer):
        assert parse(await exchange(reader, writer, GET))[0] == 200
        started = time.monotonic()
        writer.write(PARTIAL)  # the next request's head, never finished
        await assert_408_at_head_timeout(reader, started)


async def test_a_partial_connect_head_gets_408(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(policy(vendor.url))
    async with raw(proxy) as (reader, writer):
        started = time.monotonic()
        writer.write(b"CONNECT api.payments.example:443 HTTP/1.1\r\nHost: api.payments")
        await assert_408_at_head_timeout(reader, started)


async def test_a_silent_new_connection_is_closed_at_head_timeout_without_an_answer(
    vendor: Vendor, start_proxy: Any
) -> None:
    """Nothing was asked, so nothing is answered: a client that opened a connection ahead
    of its request must not read a 408 as the answer to it."""
    proxy = await start_proxy(policy(vendor.url))
    async with raw(proxy) as (reader, _):
        started = time.monotonic()
        assert await until_closed(reader) == b""
        assert HEAD * 0.9 <= time.monotonic() - started <= HEAD + SLACK


async def test_the_head_timeout_never_cuts_a_request_being_served(vendor: Vendor, start_proxy: Any) -> None:
    """A hold, a slow vendor and a slow upload all take longer than the head timeout."""
    proxy = await start_proxy(
        vendor_policy(
            vendor.url,
            limits="[{rate: 1, per: 1s, burst: 1}]",
            on_limit="{action: hold, max_hold: 3s}",
            extra_top=CONNECTIONS.replace("$max", "100"),
        )
    )
    async with raw(proxy) as (reader, writer):
        assert parse(await exchange(reader, writer, GET))[0] == 200
        started = time.monotonic()
        assert parse(await exchange(reader, writer, GET))[0] == 200  # held about 1 s for its token
        assert time.monotonic() - started > HEAD
        slow = f"GET /payments/delay/{int(HEAD * 2000)} HTTP/1.1\r\nHost: proxy\r\n\r\n".encode()
        assert parse(await exchange(reader, writer, slow))[0] == 200  # the vendor takes twice HEAD
    async with raw(proxy) as (reader, writer):
        writer.write(b"POST /payments/v1/upload HTTP/1.1\r\nHost: proxy\r\nContent-Length: 10\r\n\r\nhello")
        await asyncio.sleep(HEAD * 2)  # the body's second half comes after the head timeout
        assert parse(await exchange(reader, writer, b"world"))[0] == 200


# -- the idle keep-alive timeout --------------------------------------------------------------------


async def test_an_idle_keep_alive_connection_is_closed_at_idle_timeout(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(policy(vendor.url))
    async with raw(proxy) as (reader, writer):
        assert parse(await exchange(reader, writer, GET))[0] == 200
        answered = time.monotonic()
        assert await until_closed(reader, IDLE + SLACK + 2) == b""  # closed, nothing written
        assert IDLE * 0.9 <= time.monotonic() - answered <= IDLE + SLACK


# -- the cap on open connections ---------------------------------------------------------------------


async def test_beyond_max_connections_a_new_one_gets_503_connection_close(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(policy(vendor.url, max_connections=3))
    async with AsyncExitStack() as stack, aiohttp.ClientSession() as s:
        # Three connections each serving a request (a slow vendor): none waits for a head,
        # so none gives way to a newcomer.
        silent = [await stack.enter_async_context(raw(proxy)) for _ in range(3)]
        for _, writer in silent:
            writer.write(b"GET /payments/delay/8000 HTTP/1.1\r\nHost: proxy\r\n\r\n")

        async def counted() -> bool:
            return value(await scrape(proxy), "ratelimit_connections_open") == 3

        await eventually(counted, "three connections counted open")
        assert value(await scrape(proxy), "ratelimit_connections_max") == 3

        for method, data in (("GET", None), ("POST", b"x" * 200_000)):  # a client still sending is told too
            async with s.request(method, f"{proxy.url}/payments/v1/x", data=data) as r:
                body = await r.json()
                assert r.status == 503, body
                assert r.headers["Connection"] == "close"
                assert r.headers["x-should-retry"] == "true" and r.headers["Retry-After"] == "1"
                assert body["error"]["type"] == "proxy_error" and body["error"]["code"] == "too_many_connections"
                assert "3" in body["message"]
        samples = await scrape(proxy)
        assert value(samples, "ratelimit_connections_closed_total", reason="over_cap") == 2

        _, writer = silent[0]
        writer.close()
        await eventually(lambda: _open_below(proxy, 3), "a slot freed")
        for _, writer in silent[1:]:
            writer.close()
        async with s.get(f"{proxy.url}/payments/v1/x") as r:
            assert r.status == 200
        vendor.mock.release_delays()  # the proxy's stop would hear the three answers out


async def test_at_the_cap_a_connection_stalled_in_its_head_gives_way_to_a_new_one(
    vendor: Vendor, start_proxy: Any
) -> None:
    """A slowloris that fills the cap does not lock workers out until its heads time out:
    a new connection takes the place of the one that has waited longest for its head."""
    text = CONNECTIONS.replace("$max", "3").replace(f"head_timeout: {int(HEAD * 1000)}ms", "head_timeout: 30s")
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=text))
    async with AsyncExitStack() as stack:
        stalled = [await stack.enter_async_context(raw(proxy)) for _ in range(3)]
        for _, writer in stalled:
            writer.write(PARTIAL)  # heads that never end

        async def counted() -> bool:
            return value(await scrape(proxy), "ratelimit_connections_open") == 3

        await eventually(counted, "three connections counted open")
        await asyncio.sleep(EVICT_AFTER + 0.1)  # a real wait: the threshold is time itself
        for _ in range(3):  # each new worker connection, kept open, takes a stalled one's place
            reader, writer = await stack.enter_async_context(raw(proxy))
            assert parse(await exchange(reader, writer, GET))[0] == 200
        answers = await asyncio.gather(*(until_closed(reader, 5) for reader, _ in stalled))
        assert [parse(a)[0] for a in answers] == [408, 408, 408]
        assert value(await scrape(proxy), "ratelimit_connections_closed_total", reason="evicted") == 3


async def _open_below(proxy: ProxyServer, n: int) -> bool:
    return value(await scrape(proxy), "ratelimit_connections_open") < n


async def test_far_beyond_the_cap_connections_are_reset_unanswered(vendor: Vendor, start_proxy: Any) -> None:
    """While the turned-away connections waiting for their answer are at their own bound,
    more are closed at once, nothing read: a flood costs the proxy no time and no memory."""
    proxy = await start_proxy(policy(vendor.url, max_connections=1))
    async with AsyncExitStack() as stack:
        streams = [await stack.enter_async_context(raw(proxy)) for _ in range(1 + TURNED_AWAY_MAX + 5)]
        closed = await asyncio.gather(
            *(until_closed(reader, 0.5) for reader, _ in streams[-5:]), return_exceptions=True
        )
        assert closed == [b""] * 5, closed
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_connections_closed_total", reason="ceiling") >= 5


# -- inside an intercepted CONNECT --------------------------------------------------------------------


async def test_inside_an_intercepted_connect_heads_and_idle_time_out_too(
    tmp_path: Any, https_vendor: HttpsVendor, start_proxy: Any
) -> None:
    ca = new_proxy_ca(tmp_path)
    intercepting = intercept_policy(ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    connections = Connections(max=100, head_timeout=HEAD, idle_timeout=IDLE)
    proxy = await start_proxy(dataclasses.replace(intercepting, connections=connections))

    async def tunnel() -> Stream:
        reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
        writer.write(b"CONNECT api.payments.example:443 HTTP/1.1\r\nHost: api.payments.example:443\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
        await asyncio.wait_for(writer.start_tls(ca.trust(), server_hostname="api.payments.example"), 5)
        return reader, writer

    reader, writer = await tunnel()
    try:
        started = time.monotonic()
        writer.write(b"GET /v1/x HTTP/1.1\r\nHost: api.payments.example\r\nX-Slow: ")
        await assert_408_at_head_timeout(reader, started)
    finally:
        writer.close()

    reader, writer = await tunnel()
    try:
        request = b"GET /v1/x HTTP/1.1\r\nHost: api.payments.example\r\n\r\n"
        assert parse(await exchange(reader, writer, request))[0] == 200
        answered = time.monotonic()
        assert await until_closed(reader, IDLE + SLACK + 2) == b""
        assert IDLE * 0.9 <= time.monotonic() - answered <= IDLE + SLACK
    finally:
        writer.close()


# -- a real process at its file-descriptor limit ------------------------------------------------------


def limited(hard: int, soft: int, *args: str) -> list[str]:
    """``quota-proxy ARGS`` under ``ulimit -Hn hard -Sn soft``."""
    return ["bash", "-c", f'ulimit -Sn {soft} && ulimit -Hn {hard} && exec "$@"', "limited", *cli(*args)]


def flood_policy(tmp_path: Path, upstream: str) -> Path:
    return payments_policy(tmp_path / "flood.yaml", upstream, top="connections: {head_timeout: 2s}")


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line")


async def test_healthz_and_a_kept_alive_worker_keep_working_while_the_proxy_port_is_flooded(
    tmp_path: Path, vendor: Vendor
) -> None:
    """1,030 silent connections used to stop everything on a process at 1,024 descriptors;
    here 300 on one at 256, which cannot raise its limit."""
    with server_process(limited(256, 256, "run", "-c", str(flood_policy(tmp_path, vendor.url))), tmp_path) as proc:
        ready = await asyncio.to_thread(proc.wait_ready)
        assert open_files_limit(proc.pid) == (256, 256)
        capacity = (256 - RESERVED - TURNED_AWAY_MAX) // 2
        assert f"connections.max 4096 lowered to {capacity}: the file-descriptor limit (256)" in proc.stderr()
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), trust_env=False) as worker,
            aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=3)) as probe,
            AsyncExitStack() as flood,
        ):
            async with worker.get(f"{ready.url}/payments/v1/before") as r:
                assert r.status == 200  # its connection stays open (keep-alive)
            host, port = ready.host, ready.port
            for _ in range(300):
                _, writer = await asyncio.open_connection(host, port)
                flood.callback(writer.close)
            for path in ("/healthz", "/readyz"):
                async with probe.get(f"{ready.admin_url}{path}") as r:
                    assert r.status == 200, path
            async with probe.get(f"{ready.admin_url}/status") as r:
                connections = (await r.json())["connections"]
            assert connections["open"] == connections["max"] == capacity
            async with worker.get(f"{ready.url}/payments/v1/during") as r:
                assert r.status == 200  # the worker already connected is served as before

            async def new_worker_served() -> bool:
                try:
                    async with probe.get(f"{ready.url}/payments/v1/after") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            # The flood's connections say nothing: closed at head_timeout, the cap frees.
            await eventually(new_worker_served, "a new worker served again", deadline=2 + SLACK + 5)
        assert proc.terminate_and_wait() == 0


async def test_the_file_descriptor_limit_is_raised_to_the_hard_limit_at_start(tmp_path: Path, vendor: Vendor) -> None:
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    soft = hard // 2
    with server_process(limited(hard, soft, "run", "-c", str(flood_policy(tmp_path, vendor.url))), tmp_path) as proc:
        await asyncio.to_thread(proc.wait_ready)
        assert open_files_limit(proc.pid) == (hard, hard)
        log = proc.stderr()
        assert f"file-descriptor limit raised from {soft} to {hard} (the hard limit: {hard})" in log
        assert f"lowered to {(hard - RESERVED - TURNED_AWAY_MAX) // 2}:" in log  # 4096 needs twice that
        assert proc.terminate_and_wait() == 0
