"""The mock vendor: its quota, its special paths, its control surface and its command line."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web

from proxy.cli import main
from proxy.devtools.mockvendor import MOCK_VENDOR_KEY, MockVendor
from proxy.limiter.quota_headers import read_quota

ROOT = Path(__file__).resolve().parents[1]


class HandClock:
    """A clock that only moves when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def pattern(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


@pytest.fixture
def clock() -> HandClock:
    return HandClock()


@pytest.fixture
async def limited(aiohttp_client, clock):
    """A vendor at 10/s with a burst of 3, on a clock the test moves."""
    vendor = MockVendor(rate=10, burst=3, clock=clock)
    client = await aiohttp_client(vendor.app())
    return vendor, client


@pytest.fixture
async def unlimited(aiohttp_client):
    vendor = MockVendor(rate=None)
    client = await aiohttp_client(vendor.app())
    return vendor, client


# -- quota ---------------------------------------------------------------------------------


async def test_burst_then_429_with_retry_after(limited):
    vendor, client = limited
    remaining = []
    for i in range(3):
        resp = await client.get(f"/v1/things?i={i}")
        assert resp.status == 200
        assert resp.headers["X-RateLimit-Limit"] == "10"
        remaining.append(int(resp.headers["X-RateLimit-Remaining"]))
        body = await resp.json()
        assert body == {"ok": True, "method": "GET", "path": "/v1/things", "n": i + 1}
    assert remaining == [2, 1, 0]

    resp = await client.post("/v1/things", data=b"x")
    assert resp.status == 429
    assert await resp.json() == {"error": "rate_limited"}
    assert resp.headers["Retry-After"] == "1"  # 0.1 s to the next token, rounded up to a whole second
    assert resp.headers["X-RateLimit-Limit"] == "10"
    assert resp.headers["X-RateLimit-Remaining"] == "0"
    assert "X-Quota-Action" not in resp.headers
    assert (vendor.accepted, vendor.rejected) == (3, 1)
    assert list(vendor.arrivals) == [1000.0] * 3


async def test_retry_after_is_the_ceiling_of_the_real_wait(aiohttp_client, clock):
    vendor = MockVendor(rate=0.4, burst=1, clock=clock)  # one token every 2.5 s
    client = await aiohttp_client(vendor.app())
    assert (await client.get("/")).status == 200
    waits = []
    for step in (0.0, 0.4, 1.0, 1.0):
        clock.advance(step)
        resp = await client.get("/")
        assert resp.status == 429
        waits.append(int(resp.headers["Retry-After"]))
    # Real waits: 2.5, 2.1, 1.1, 0.1 seconds.
    assert waits == [3, 3, 2, 1]
    clock.advance(0.1)
    assert (await client.get("/")).status == 200


async def test_bucket_refills_at_the_rate_and_caps_at_burst(limited, clock):
    vendor, client = limited
    for _ in range(3):
        assert (await client.get("/")).status == 200
    assert (await client.get("/")).status == 429

    clock.advance(0.05)  # half a token
    assert (await client.get("/")).status == 429
    clock.advance(0.05)  # one whole token
    resp = await client.get("/")
    assert resp.status == 200
    assert resp.headers["X-RateLimit-Remaining"] == "0"
    assert (await client.get("/")).status == 429

    clock.advance(0.25)  # 2.5 tokens: remaining reports the whole ones left after this request
    resp = await client.get("/")
    assert resp.headers["X-RateLimit-Remaining"] == "1"

    clock.advance(60)  # a long idle refills to the burst, not beyond
    statuses = [(await client.get("/")).status for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    assert vendor.accepted == 3 + 1 + 1 + 3


async def test_pacing_at_exactly_the_rate_is_never_refused(aiohttp_client, clock):
    vendor = MockVendor(rate=30, burst=1, clock=clock)
    client = await aiohttp_client(vendor.app())
    for _ in range(300):
        assert (await client.get("/")).status == 200
        clock.advance(1 / 30)
    assert vendor.rejected == 0
    assert vendor.measured_rate() == pytest.approx(30)


async def test_unlimited_vendor_never_refuses_and_sends_no_quota_headers(unlimited):
    vendor, client = unlimited
    for _ in range(50):
        resp = await client.get("/x")
        assert resp.status == 200
        assert "X-RateLimit-Limit" not in resp.headers
        assert "X-RateLimit-Remaining" not in resp.headers
    assert (vendor.accepted, vendor.rejected) == (50, 0)


def test_bad_quotas_are_refused():
    with pytest.raises(ValueError, match="rate"):
        MockVendor(rate=0)
    with pytest.raises(ValueError, match="burst"):
        MockVendor(rate=5, burst=0.5)
    assert MockVendor(rate=0.5).burst == 1.0  # a bucket must hold at least one request


# -- sliding window ------------------------------------------------------------------------


@pytest.fixture
async def windowed(aiohttp_client, clock):
    """A vendor accepting at most 5 requests in any 1 s, on a clock the test moves."""
    vendor = MockVendor(rate=5, window=1.0, clock=clock)
    client = await aiohttp_client(vendor.app())
    return vendor, client


async def test_a_window_accepts_its_limit_at_once_then_nothing_until_the_oldest_leaves(windowed, clock):
    vendor, client = windowed
    remaining = []
    for _ in range(5):  # no pacing: a window, unlike a bucket, takes its whole limit at once
        resp = await client.get("/v1/x")
        assert (resp.status, resp.headers["X-RateLimit-Limit"]) == (200, "5")
        remaining.append(int(resp.headers["X-RateLimit-Remaining"]))
        clock.advance(0.1)
    assert remaining == [4, 3, 2, 1, 0]
    clock.advance(0.2)  # t = 0.7: the five arrived in [0, 0.4]
    resp = await client.get("/v1/x")
    assert resp.status == 429
    assert await resp.json() == {"error": "rate_limited"}
    assert (resp.headers["Retry-After"], resp.headers["X-RateLimit-Remaining"]) == ("1", "0")  # 0.3 s, rounded up
    clock.advance(0.3 - 1e-6)
    assert (await client.get("/v1/x")).status == 429  # [0, 1) still holds five
    clock.advance(1e-6)  # t = 1.0: the first arrival is out of (0, 1]
    resp = await client.get("/v1/x")
    assert (resp.status, resp.headers["X-RateLimit-Remaining"]) == (200, "0")
    assert (await client.get("/v1/x")).status == 429
    clock.advance(0.1)  # t = 1.1: the second one left; refused requests took no place
    assert (await client.get("/v1/x")).status == 200

    stats = vendor.stats()
    assert (stats["accepted"], stats["rejected"]) == (7, 3)
    assert stats["rejections"] == pytest.approx([1000.7, 1000.999999, 1001.0])
    assert (stats["window"], stats["window_limit"], stats["burst"], stats["tokens"]) == (1.0, 5, None, None)
    assert stats["window_max"] == 8  # (0.1, 1.1]: 4 accepted before, 3 refused, 1 accepted: 8 arrived


async def test_no_window_ever_holds_more_than_the_limit_and_window_max_counts_every_arrival(aiohttp_client):
    rng = random.Random(7)
    clock = HandClock()
    vendor = MockVendor(rate=20, window=0.5, clock=clock)  # at most 10 in any 0.5 s
    client = await aiohttp_client(vendor.app())
    times, statuses = [], []
    for _ in range(400):
        clock.advance(rng.choice([0.0, 0.001, 0.01, 0.03, 0.1]))
        times.append(clock.now)
        statuses.append((await client.get("/")).status)
    accepted = [t for t, status in zip(times, statuses, strict=True) if status == 200]
    refused = [t for t, status in zip(times, statuses, strict=True) if status == 429]
    assert accepted and refused and vendor.window_limit == 10

    def most_in_a_window(arrivals: list[float]) -> int:  # every window that holds the most starts at an arrival
        return max(sum(1 for t in arrivals if start <= t < start + 0.5) for start in arrivals)

    assert most_in_a_window(accepted) == 10
    for t in refused:  # refused only when full: ten accepted in (t - 0.5, t]
        assert sum(1 for a in accepted if t - 0.5 < a <= t) == 10
    assert vendor.stats()["window_max"] == most_in_a_window(times) > 10
    assert list(vendor.arrivals) == accepted and list(vendor.rejections) == refused


async def test_scripted_answers_take_no_place_in_the_window(windowed, clock):
    vendor, client = windowed
    vendor.script(status=500, count=2)
    assert [(await client.get("/")).status for _ in range(2)] == [500, 500]
    resp = await client.get("/")
    assert (resp.status, resp.headers["X-RateLimit-Remaining"]) == (200, "4")
    vendor.script(status=503)
    resp = await client.get("/")
    assert (resp.status, resp.headers["X-RateLimit-Remaining"]) == (503, "4")  # what is left, nothing taken


async def test_config_switches_between_bucket_and_window(limited, clock):
    vendor, client = limited
    resp = await client.post("/__mock/config", json={"rate": 100, "window": 1})
    assert await resp.json() == {"ok": True, "rate": 100, "burst": None}
    assert (vendor.window, vendor.window_limit, vendor.burst) == (1.0, 100, None)
    assert [(await client.get("/")).status for _ in range(101)] == [200] * 100 + [429]
    await client.post("/__mock/config", json={"rate": 3})  # the window stays, with the new rate
    assert (vendor.window, vendor.window_limit) == (1.0, 3)
    assert (await client.post("/__mock/config", json={"burst": 2})).status == 400  # a window has no burst
    await client.post("/__mock/config", json={"window": None})  # back to a bucket, burst = rate
    assert (vendor.window, vendor.window_limit, vendor.burst) == (None, None, 3)
    assert vendor.stats()["window_max"] is None
    resp = await client.post("/__mock/config", json={"rate": 2, "window": 0.25})
    assert resp.status == 400 and "at least 1 request" in (await resp.json())["detail"]
    assert (vendor.rate, vendor.burst, vendor.window) == (3, 3, None)  # a refused config changes nothing


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="a window needs a rate"):
        MockVendor(rate=None, window=1.0)
    with pytest.raises(ValueError, match="no burst"):
        MockVendor(rate=5, burst=5, window=1.0)
    with pytest.raises(ValueError, match="at least 1 request"):
        MockVendor(rate=0.5, window=1.0)
    for window in (0, -1, float("inf"), True):
        with pytest.raises(ValueError, match="window must be a positive number"):
            MockVendor(rate=5, window=window)
    assert MockVendor(rate=2.5, window=2.0).window_limit == 5


# -- in flight -----------------------------------------------------------------------------


async def test_in_flight_counts_the_requests_being_handled_at_once(unlimited):
    vendor, client = unlimited
    release = asyncio.Event()

    async def held_body() -> AsyncIterator[bytes]:
        yield b"x"
        await release.wait()
        yield b"y"

    responses = [await client.post("/echo", data=held_body()) for _ in range(3)]
    for resp in responses:  # the echo of the first chunk: each handler is running
        assert await resp.content.readexactly(1) == b"x"
    stats = await (await client.get("/__mock/stats")).json()  # control requests are not counted
    assert (stats["in_flight"], stats["max_in_flight"]) == (3, 3)

    release.set()
    for resp in responses:
        assert await resp.content.read() == b"y"
        resp.release()
    await client.get("/v1/one-more")
    assert (vendor.in_flight, vendor.max_in_flight) == (0, 3)
    vendor.reset()
    assert vendor.stats()["max_in_flight"] == 0


async def test_a_delay_is_in_flight_while_it_waits(unlimited):
    vendor, client = unlimited
    task = asyncio.ensure_future(client.get("/delay/300"))
    deadline = time.monotonic() + 5
    while vendor.in_flight == 0 and not task.done():
        assert time.monotonic() < deadline, "the delayed request never reached the vendor"
        await asyncio.sleep(0.005)
    assert (vendor.in_flight, task.done()) == (1, False)
    assert (await task).status == 200
    assert (vendor.in_flight, vendor.max_in_flight) == (0, 1)


# -- special paths -------------------------------------------------------------------------


async def test_echo_streams_5_mb_back_unchanged(unlimited):
    vendor, client = unlimited
    data = random.Random(7).randbytes(5 * 1024 * 1024 + 123)
    first_chunk_seen = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield data[:100_000]
        # Only continue once the echo of the first chunk reached us: a vendor that buffered
        # the whole body before answering would deadlock here (and the timeout would fail).
        await first_chunk_seen.wait()
        view = memoryview(data)
        for start in range(100_000, len(data), 70_001):
            yield bytes(view[start : start + 70_001])

    async with asyncio.timeout(30):
        resp = await client.post("/echo", data=body(), headers={"Content-Type": "application/x-test"})
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "application/x-test"
        assert "X-Request-Content-Length" not in resp.headers  # chunked request
        digest = hashlib.sha256()
        received = 0
        async for chunk in resp.content.iter_any():
            digest.update(chunk)
            received += len(chunk)
            if received >= 100_000:
                first_chunk_seen.set()
    assert received == len(data)
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert vendor.accepted == 1


async def test_echo_reports_the_request_content_length(unlimited):
    _, client = unlimited
    data = os.urandom(300_000)
    resp = await client.put("/echo", data=io.BytesIO(data))
    assert resp.status == 200
    assert resp.headers["X-Request-Content-Length"] == str(len(data))
    assert resp.headers["Content-Length"] == str(len(data))
    assert await resp.read() == data


@pytest.mark.parametrize("n", [0, 1, 255, 65_536, 200_017])
async def test_bytes_returns_n_bytes_of_the_pattern(unlimited, n):
    _, client = unlimited
    resp = await client.get(f"/bytes/{n}")
    assert resp.status == 200
    assert resp.headers["Content-Length"] == str(n)
    assert resp.headers["Content-Type"] == "application/octet-stream"
    assert await resp.read() == pattern(n)


async def test_bytes_head_has_length_but_no_body(unlimited):
    _, client = unlimited
    resp = await client.head("/bytes/1000")
    assert resp.status == 200
    assert resp.headers["Content-Length"] == "1000"
    assert await resp.read() == b""


async def test_bytes_rejects_a_bad_count(unlimited):
    _, client = unlimited
    resp = await client.get("/bytes/-3")
    assert resp.status == 400
    assert (await resp.json())["error"] == "bad_request"


async def test_sha256_hashes_the_body(unlimited):
    _, client = unlimited
    data = os.urandom(3 * 1024 * 1024 + 5)
    for method in ("POST", "PUT"):
        resp = await client.request(method, "/sha256", data=io.BytesIO(data))
        assert resp.status == 200
        assert await resp.json() == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    resp = await client.get("/sha256")
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST, PUT"


async def test_sha256_honours_expect_100_continue(unlimited):
    _, client = unlimited
    data = b"a" * 10_000
    async with asyncio.timeout(10):
        resp = await client.post("/sha256", data=data, expect100=True)
    assert resp.status == 200
    assert await resp.json() == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": 10_000}


async def test_delay_waits_before_answering(unlimited):
    _, client = unlimited
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.get("/delay/120")
    elapsed = loop.time() - started
    assert resp.status == 200
    assert (await resp.json())["delay_ms"] == 120
    assert elapsed >= 0.12
    assert (await client.get("/delay/soon")).status == 400


async def test_status_answers_the_code_with_quota_headers(limited):
    vendor, client = limited
    resp = await client.get("/status/503")
    assert resp.status == 503
    assert resp.headers["X-RateLimit-Limit"] == "10"
    assert resp.headers["X-RateLimit-Remaining"] == "2"
    assert (await resp.json())["status"] == 503
    resp = await client.delete("/status/204")
    assert resp.status == 204
    assert resp.headers["X-RateLimit-Remaining"] == "1"
    assert (await client.get("/status/99")).status == 400  # took the last token
    assert (await client.get("/status/503")).status == 429  # the quota still applies
    assert (vendor.accepted, vendor.rejected) == (3, 1)


# -- scripts -------------------------------------------------------------------------------


async def test_scripted_429_with_retry_after(limited):
    vendor, client = limited
    resp = await client.post("/__mock/script", json={"status": 429, "retry_after": "2", "remaining": None, "count": 2})
    assert resp.status == 200
    for _ in range(2):
        resp = await client.get("/v1/x")
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "2"
        assert resp.headers["X-RateLimit-Remaining"] == "3"  # scripted answers take no token
        assert await resp.json() == {"error": "rate_limited"}
    resp = await client.get("/v1/x")
    assert resp.status == 200
    assert resp.headers["X-RateLimit-Remaining"] == "2"
    assert (vendor.accepted, vendor.rejected) == (1, 2)


async def test_scripted_429_without_retry_after(limited):
    vendor, client = limited
    vendor.script(status=429, retry_after=None)
    resp = await client.get("/v1/x")
    assert resp.status == 429
    assert "Retry-After" not in resp.headers
    assert resp.headers["X-RateLimit-Limit"] == "10"
    assert (await client.get("/v1/x")).status == 200


async def test_scripted_remaining_and_queue_order(unlimited):
    vendor, client = unlimited
    await client.post("/__mock/script", json={"status": 200, "remaining": 3})
    await client.post("/__mock/script", json={"status": 503, "retry_after": 7})
    resp = await client.get("/a")
    assert resp.status == 200
    assert resp.headers["X-RateLimit-Remaining"] == "3"
    assert (await resp.json())["scripted"] is True
    resp = await client.get("/b")
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "7"
    resp = await client.get("/c")
    assert resp.status == 200
    assert "X-RateLimit-Remaining" not in resp.headers
    assert vendor.accepted == 3


async def test_script_rejects_bad_input(unlimited):
    _, client = unlimited
    for body in ({"status": "429"}, {"count": 0}, {"status": 700}, [1]):
        resp = await client.post("/__mock/script", json=body)
        assert resp.status == 400, body
    resp = await client.post("/__mock/script", data=b"{nope")
    assert resp.status == 400
    assert (await client.get("/")).status == 200  # nothing was scripted


# -- control endpoints ---------------------------------------------------------------------


async def test_stats_and_reset(limited, clock):
    vendor, client = limited
    for _ in range(3):
        await client.get("/")
        clock.advance(0.01)
    assert (await client.get("/")).status == 429

    stats = await (await client.get("/__mock/stats")).json()
    assert stats["accepted"] == 3
    assert stats["rejected"] == 1
    assert stats["arrivals"] == pytest.approx([1000.0, 1000.01, 1000.02])
    assert (stats["rate"], stats["burst"]) == (10, 3)
    assert vendor.stats()["accepted"] == 3  # control requests are neither counted nor recorded
    assert len(vendor.requests) == 4

    resp = await client.post("/__mock/reset")
    assert resp.status == 200
    stats = await (await client.get("/__mock/stats")).json()
    assert (stats["accepted"], stats["rejected"], stats["arrivals"]) == (0, 0, [])
    assert vendor.requests == []
    statuses = [(await client.get("/")).status for _ in range(4)]
    assert statuses == [200, 200, 200, 429]  # the bucket was refilled


async def test_python_reset_clears_pending_scripts(limited):
    vendor, client = limited
    vendor.script(status=500, count=5)
    assert vendor.stats()["scripted"] == 5
    vendor.reset()
    assert vendor.stats()["scripted"] == 0
    assert (await client.get("/")).status == 200


async def test_config_changes_the_quota(limited, clock):
    vendor, client = limited
    resp = await client.post("/__mock/config", json={"rate": 2, "burst": 1})
    assert await resp.json() == {"ok": True, "rate": 2, "burst": 1}
    resp = await client.get("/")
    assert (resp.status, resp.headers["X-RateLimit-Limit"]) == (200, "2")
    resp = await client.get("/")
    assert (resp.status, resp.headers["Retry-After"]) == (429, "1")

    await client.post("/__mock/config", json={"rate": 0})
    assert vendor.rate is None
    assert all([(await client.get("/")).status == 200 for _ in range(20)])

    await client.post("/__mock/config", json={"rate": 5})
    assert (vendor.rate, vendor.burst) == (5, 5)  # burst follows the rate
    assert (await client.post("/__mock/config", json={"rate": 5, "burst": 0})).status == 400
    assert (await client.post("/__mock/config", json={"rte": 5})).status == 400


async def test_control_endpoints_check_method_and_name(unlimited):
    _, client = unlimited
    resp = await client.get("/__mock/reset")
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST"
    assert (await client.get("/__mock/nothing")).status == 404


async def test_recorded_requests_keep_lower_cased_headers(unlimited):
    vendor, client = unlimited
    await client.post("/v1/pay?x=1&y=2", data=b"{}", headers={"X-Tenant-Id": "acme", "Idempotency-Key": "k1"})
    await client.get("/v1/other")
    recorded = await (await client.get("/__mock/requests")).json()
    assert recorded == vendor.requests
    assert [(r["method"], r["path_qs"]) for r in recorded] == [
        ("POST", "/v1/pay?x=1&y=2"),
        ("GET", "/v1/other"),
    ]
    headers = recorded[0]["headers"]
    assert headers["x-tenant-id"] == "acme"
    assert headers["idempotency-key"] == "k1"
    assert all(name == name.lower() for name in headers)


async def test_recording_is_bounded(aiohttp_client):
    vendor = MockVendor(rate=None, max_recorded=5)
    client = await aiohttp_client(vendor.app())
    for i in range(8):
        await client.get(f"/r/{i}")
    assert [r["path_qs"] for r in vendor.requests] == [f"/r/{i}" for i in range(3, 8)]


def test_measured_rate_uses_the_inter_arrival_span(clock):
    vendor = MockVendor(rate=None, clock=clock)
    assert vendor.measured_rate() == 0.0
    vendor.arrivals.extend([0.0, 0.0, 0.0])  # an initial burst
    vendor.arrivals.extend(1.0 + i * 0.1 for i in range(51))  # then 10/s for 5 s
    assert vendor.measured_rate(since=1.0) == pytest.approx(10.0)
    assert vendor.measured_rate(since=2.0, until=3.0) == pytest.approx(10.0)
    assert vendor.measured_rate(since=0.0, until=0.5) == float("inf")
    assert vendor.measured_rate(since=9.0) == 0.0


async def test_app_exposes_the_vendor():
    vendor = MockVendor(rate=3)
    app = vendor.app()
    assert isinstance(app, web.Application)
    assert app[MOCK_VENDOR_KEY] is vendor


# -- command line --------------------------------------------------------------------------


def test_main_rejects_bad_arguments(capsys):
    for argv in (["--listen", "nowhere"], ["--rate", "-1"], ["--burst", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["mock-vendor", *argv])
        assert exc.value.code == 2, argv
    assert "HOST:PORT" in capsys.readouterr().err


def test_main_rejects_bad_windows(capsys):
    for argv, problem in (
        (["--window", "1x"], '"1x" is not a duration'),
        (["--window", "0"], "the window must be longer than 0"),
        (["--rate", "0", "--window", "1s"], "--window needs a --rate"),
        (["--burst", "5", "--window", "1s"], "not --burst"),
        (["--rate", "2", "--window", "100ms"], "--rate x --window must be at least 1 request"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["mock-vendor", *argv])
        assert exc.value.code == 2, argv
        assert problem in capsys.readouterr().err, argv


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the mock vendor printed nothing in time"
    return proc.stdout.readline()


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read()


@contextmanager
def _serving(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``quota-proxy mock-vendor ARGS`` on a free port: the process and its ready line; killed
    if the test leaves it running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "mock-vendor", "--listen", "127.0.0.1:0", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, _readline(proc, timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes the pipes


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_command_serves_and_exits_cleanly_on_signal(sig):
    with _serving("--rate", "5") as (proc, line):
        match = re.fullmatch(r"mock-vendor listening on http://127\.0\.0\.1:(\d+) \(rate 5/s, burst 5\)\n", line)
        assert match, line
        port = int(match.group(1))
        assert port > 0
        base = f"http://127.0.0.1:{port}"

        started = time.monotonic()
        statuses = [_get(f"{base}/v1/x")[0] for _ in range(10)]
        elapsed = time.monotonic() - started
        assert statuses[:5] == [200] * 5  # the burst
        assert set(statuses) <= {200, 429}
        # The quota holds on the real server: the burst plus what refilled meanwhile, no more.
        assert statuses.count(200) <= 5 + 5 * elapsed + 1
        status, _, body = _get(f"{base}/bytes/1000")
        assert status in (200, 429)
        if status == 200:
            assert body == pattern(1000)
        stats = json.loads(_get(f"{base}/__mock/stats")[2])
        assert stats["accepted"] >= 5
        assert stats["rate"] == 5

        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert out == ""  # exactly one line, already read


def test_the_command_serves_a_sliding_window():
    with _serving("--rate", "50", "--window", "1m") as (proc, line):
        match = re.fullmatch(
            r"mock-vendor listening on http://127\.0\.0\.1:(\d+) "
            r"\(rate 50/s, sliding window 60s: at most 3000 requests in any window\)\n",
            line,
        )
        assert match, line
        base = f"http://127.0.0.1:{match.group(1)}"
        status, headers, _ = _get(f"{base}/v1/x")
        assert (status, headers["X-RateLimit-Limit"], headers["X-RateLimit-Remaining"]) == (200, "3000", "2999")
        stats = json.loads(_get(f"{base}/__mock/stats")[2])
        assert (stats["window"], stats["window_limit"], stats["window_max"], stats["burst"]) == (60, 3000, 1, None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


# -- quota header families and limit changes (SPEC §10, learned limits) --------------------


@pytest.mark.parametrize(
    ("family", "first", "later"),
    [
        ("x-ratelimit", (70, 69, 1, None), (70, 68, 1, None)),
        ("ietf", (70, 69, 1, 1), (70, 68, 1, 1)),
        ("openai", (4200, 69, 1, 60), (4200, 68, 0.6, 60)),
        ("shopify", (70, 69, None, None), (70, 68, None, None)),
    ],
)
async def test_each_family_tells_the_quota_as_the_proxy_reads_it(aiohttp_client, clock, family, first, later):
    # What the mock vendor sends, read back by the proxy's own parser: limit, remaining,
    # reset (when the oldest request counted leaves the window) and window.
    vendor = MockVendor(rate=70, clock=clock, window=1.0, quota_headers=family)
    client = await aiohttp_client(vendor.app())
    seen = []
    for _ in range(2):
        resp = await client.get("/v1/x")
        assert resp.status == 200
        (r,) = read_quota(resp.headers, time.time())
        seen.append((r.limit, r.remaining, r.reset, r.window))
        clock.advance(0.4)
    assert seen == [first, later]


async def test_no_quota_headers_at_all(aiohttp_client, clock):
    vendor = MockVendor(rate=70, clock=clock, window=1.0, quota_headers="none")
    client = await aiohttp_client(vendor.app())
    resp = await client.get("/v1/x")
    assert resp.status == 200 and read_quota(resp.headers, time.time()) == ()
    with pytest.raises(ValueError, match="quota_headers must be one of"):
        MockVendor(rate=1, quota_headers="github")


async def test_a_lower_limit_keeps_what_the_window_counted(aiohttp_client, clock):
    vendor = MockVendor(rate=5, clock=clock, window=1.0)
    client = await aiohttp_client(vendor.app())
    assert [(await client.get("/v1/x")).status for _ in range(4)] == [200] * 4
    resp = await client.post("/__mock/limit", json={"rate": 3})
    assert await resp.json() == {"ok": True, "rate": 3, "burst": None, "window": 1}
    resp = await client.get("/v1/x")
    assert (resp.status, resp.headers["X-RateLimit-Limit"]) == (429, "3")  # 4 counted, 3 allowed
    clock.advance(1.0)
    assert [(await client.get("/v1/x")).status for _ in range(4)] == [200, 200, 200, 429]
    vendor.set_limit(8)  # raised: 3 counted, 5 more at once
    assert [(await client.get("/v1/x")).status for _ in range(6)] == [200] * 5 + [429]


async def test_a_bucket_keeps_its_tokens_through_a_limit_change(limited, clock):
    vendor, client = limited
    await client.get("/v1/x")  # 2 of 3 left
    vendor.set_limit(1)  # burst 1: at most 1 left
    assert vendor.tokens() == 1
    vendor.set_limit(20, burst=30)
    assert vendor.tokens() == 1  # never refilled by the change itself
    clock.advance(0.5)
    assert vendor.tokens() == 11


async def test_limit_control_checks_its_input(unlimited, limited):
    _, client = unlimited
    resp = await client.post("/__mock/limit", json={"rate": 3})
    assert resp.status == 400 and "unlimited vendor" in (await resp.json())["detail"]
    _, client = limited
    for body in ({}, {"rate": "fast"}, {"rate": 3, "window": 1}, {"rate": -1}):
        resp = await client.post("/__mock/limit", json=body)
        assert resp.status == 400, body
    assert (await client.get("/__mock/limit")).status == 405


def test_main_rejects_bad_limit_changes(capsys):
    for argv, problem in (
        (["--limit-at", "10s"], "expected DURATION=RATE"),
        (["--limit-at", "soon=70"], "'soon=70'"),
        (["--limit-at", "1s=-5"], "expected DURATION=RATE"),
        (["--rate", "0", "--limit-at", "1s=5"], "--limit-at needs a --rate"),
        (["--quota-headers", "github"], "invalid choice"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["mock-vendor", *argv])
        assert exc.value.code == 2, argv
        assert problem in capsys.readouterr().err, argv


def test_the_command_changes_its_limit_on_schedule():
    with _serving("--rate", "70", "--window", "1s", "--quota-headers", "ietf", "--limit-at", "200ms=100") as (
        proc,
        line,
    ):
        base = "http://127.0.0.1:" + re.search(r":(\d+) ", line).group(1)  # type: ignore[union-attr]
        _, before, _ = _get(f"{base}/v1/x")
        assert _readline(proc, timeout=20) == "mock-vendor: limit now 100/s\n"
        _, after, _ = _get(f"{base}/v1/x")
        assert (before["RateLimit-Policy"], after["RateLimit-Policy"]) == ('"default";q=70;w=1', '"default";q=100;w=1')
        assert (before["RateLimit"], after["RateLimit"]) == ('"default";r=69;t=1', '"default";r=98;t=1')
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
