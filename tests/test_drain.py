"""SIGTERM drains (SPEC §3): stop accepting, finish in-flight requests (bounded), exit 0.

``python -m proxy run`` is a real subprocess; the vendor is the in-process mock (the
``vendor`` fixture), so the test sees exactly when a request reaches it. Every wait is
a poll against a deadline on an event (a request recorded by the vendor, a held
request counted by /status, a refused connection), never a blind sleep.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers.cli import EXAMPLE, ProxyProcess, Ready, cli, write_policy

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # asserts rates or time bounds: run apart from other timed tests

POLL = 0.01
# What a client sees of a request cut at the bound: the connection closed under it.
CUT_OFF = ("ServerDisconnectedError", "ClientOSError")


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Poll ``predicate`` until it holds; returns the monotonic time it first did."""
    deadline = time.monotonic() + timeout
    while True:
        if await predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}")
        await asyncio.sleep(POLL)


async def refused(host: str, port: int) -> bool:
    """True when nothing accepts connections on host:port any more."""
    try:
        _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def readyz(session: aiohttp.ClientSession, ready: Ready) -> int | None:
    """/readyz's status, or None when the admin listener is gone."""
    try:
        async with session.get(f"{ready.admin_url}/readyz") as response:
            await response.read()
            return response.status
    except aiohttp.ClientConnectionError:
        return None


async def fetch(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as response:
        return response.status, await response.json()


def drain_policy(tmp_path: Path, upstream: str, *, drain: str, limits: str = "[{rate: 1000, per: 1s}]") -> Path:
    return write_policy(
        tmp_path / "drain.yaml",
        f"""
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        drain_timeout: {drain}
        vendors:
          - name: payments
            hosts: [api.payments.example]
            route: /payments
            upstream: {upstream}
            limits: {limits}
            on_limit: {{action: hold, max_hold: 3s}}
            timeouts: {{connect: 2s, read: 30s}}
    """,
    )


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Callable[[Path], Awaitable[tuple[ProxyProcess, Ready]]]]:
    """``await start(policy)``: ``quota-proxy run`` as a subprocess, once its ready line is out."""
    processes: list[ProxyProcess] = []

    async def start_proxy(policy: Path) -> tuple[ProxyProcess, Ready]:
        process = ProxyProcess(cli("run", "-c", str(policy)), tmp_path)
        processes.append(process)
        ready = await asyncio.to_thread(process.wait_ready)
        return process, ready

    yield start_proxy
    for process in processes:
        await asyncio.to_thread(process.close)


async def exit_status(process: ProxyProcess, timeout: float) -> int:
    return await asyncio.to_thread(process.wait, timeout)


async def test_sigterm_finishes_the_in_flight_request_and_stops_accepting(tmp_path, vendor, session, start) -> None:
    drain_timeout = 5.0
    process, ready = await start(drain_policy(tmp_path, vendor.url, drain=f"{drain_timeout:g}s"))
    assert await readyz(session, ready) == 200

    in_flight = asyncio.ensure_future(fetch(session, f"{ready.url}/payments/delay/1500"))

    async def reached_vendor() -> bool:
        return any(r["path_qs"] == "/delay/1500" for r in vendor.mock.requests)

    await until(reached_vendor, 10, "the slow request reaches the vendor")
    sigterm_at = time.monotonic()
    process.send_signal(signal.SIGTERM)

    async def not_ready() -> bool:
        return await readyz(session, ready) in (503, None)

    await until(not_ready, 2, "/readyz turns 503 (or the admin listener goes) during the drain")
    assert not in_flight.done(), "the drain was observed while the request was still in flight"

    async def proxy_refuses() -> bool:
        return await refused(ready.host, ready.port)

    await until(proxy_refuses, 2, "the proxy listener refuses new connections")
    assert not in_flight.done(), "new connections were refused while the request was still in flight"

    status, body = await asyncio.wait_for(in_flight, timeout=10)
    assert status == 200
    assert body["delay_ms"] == 1500
    completed_at = time.monotonic()

    assert await exit_status(process, drain_timeout + 5) == 0
    exited_at = time.monotonic()
    # Nothing was left after the slow request: the process does not sit out the whole bound.
    assert exited_at - sigterm_at < drain_timeout, exited_at - sigterm_at
    assert exited_at >= completed_at
    log = process.stderr()
    assert "draining: finishing in-flight requests" in log
    (access,) = [line for line in log.splitlines() if '"path":"/payments/delay/1500"' in line]
    assert '"status":200' in access
    assert '"outcome":"forwarded"' in access


async def test_a_request_held_at_sigterm_still_completes(tmp_path, vendor, session, start) -> None:
    drain_timeout = 5.0
    # One token a second, burst 1: the first request takes the token, the second is held ~1s.
    policy = drain_policy(tmp_path, vendor.url, drain=f"{drain_timeout:g}s", limits="[{rate: 1, per: 1s, burst: 1}]")
    process, ready = await start(policy)

    status, _ = await fetch(session, f"{ready.url}/payments/v1/first")
    assert status == 200
    held = asyncio.ensure_future(fetch(session, f"{ready.url}/payments/v1/held"))

    async def is_held() -> bool:
        async with session.get(f"{ready.admin_url}/status") as response:
            body = await response.json()
        return bool(body["vendors"][0]["held_now"] == 1)

    await until(is_held, 5, "/status counts the second request as held")
    assert [r["path_qs"] for r in vendor.mock.requests] == ["/v1/first"]
    sigterm_at = time.monotonic()
    process.send_signal(signal.SIGTERM)

    status, body = await asyncio.wait_for(held, timeout=10)
    assert status == 200
    assert body["path"] == "/v1/held"
    assert [r["path_qs"] for r in vendor.mock.requests] == ["/v1/first", "/v1/held"]
    # The vendor (same process, same clock) saw the held request leave after SIGTERM.
    assert vendor.mock.arrivals[-1] >= sigterm_at

    assert await exit_status(process, drain_timeout + 5) == 0
    assert time.monotonic() - sigterm_at < drain_timeout


async def test_a_vendor_slower_than_drain_timeout_is_cut_off_at_the_bound(tmp_path, vendor, session, start) -> None:
    drain_timeout = 2.0
    vendor_delay_ms = 8000
    process, ready = await start(drain_policy(tmp_path, vendor.url, drain=f"{drain_timeout:g}s"))

    async def outcome() -> int | str:
        try:
            # POST: aiohttp would retry a GET once on a dropped connection and report the retry.
            async with session.post(f"{ready.url}/payments/delay/{vendor_delay_ms}") as response:
                await response.read()
                status: int = response.status
                return status
        except (aiohttp.ClientError, TimeoutError) as exc:
            return type(exc).__name__

    in_flight = asyncio.ensure_future(outcome())

    async def reached_vendor() -> bool:
        return any(r["path_qs"] == f"/delay/{vendor_delay_ms}" for r in vendor.mock.requests)

    await until(reached_vendor, 10, "the slow request reaches the vendor")
    sigterm_at = time.monotonic()
    process.send_signal(signal.SIGTERM)

    result = await asyncio.wait_for(in_flight, timeout=vendor_delay_ms / 1000)
    cut_after = time.monotonic() - sigterm_at
    assert result in CUT_OFF or (isinstance(result, int) and result >= 500), result
    # Cut at the bound: not before it, and not at a second bound or when the vendor answers (8 s).
    assert drain_timeout - 0.2 <= cut_after < 2 * drain_timeout, cut_after

    assert await exit_status(process, vendor_delay_ms / 1000) == 0
    exited_after = time.monotonic() - sigterm_at
    assert exited_after < cut_after + 3.0, (cut_after, exited_after)  # not waiting for the vendor (8 s)
    log = process.stderr()
    assert f"draining: finishing in-flight requests (at most {drain_timeout:.1f}s)" in log
    assert '"outcome":"error"' in log


async def test_sigterm_on_an_idle_proxy_exits_0_at_once(tmp_path, session, start) -> None:
    process, ready = await start(example_on_free_ports(tmp_path))
    assert await readyz(session, ready) == 200
    sigterm_at = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert await exit_status(process, 10) == 0
    assert time.monotonic() - sigterm_at < 5.0, "an idle proxy has nothing to wait for (drain_timeout is 10 s)"
    assert await refused(ready.host, ready.port)
    assert await refused(ready.admin_host, ready.admin_port)


def example_on_free_ports(tmp_path: Path) -> Path:
    """The shipped example (drain_timeout 10s by default) on free ports."""
    text = EXAMPLE.read_text()
    for line in ("listen: 127.0.0.1:8080", "admin_listen: 127.0.0.1:9090"):
        assert line in text
    text = text.replace("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0")
    text = text.replace("admin_listen: 127.0.0.1:9090", "admin_listen: 127.0.0.1:0")
    path = tmp_path / "example.yaml"
    path.write_text(text)
    return path
