"""Live policy reload and the sizing answer.

In process: a Reloader over the test proxy's Runtime, its ``load`` reading a policy
file the test rewrites. As a subprocess: SIGHUP, POST /reload and --watch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.ops.reload import Reloader
from proxy.policy import load_policy
from proxy.server import ProxyServer
from tests.conftest import ROOT, client_session, eventually, metric_samples, value

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # asserts rates or time bounds: run apart from other timed tests

POLICY = """\
version: 1
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{url: "{store}", timeout: 500ms}}
vendors:
  - name: payments
    hosts: [api.payments.example]
    upstream: {upstream}
    limits: [{{rate: {rate}, per: {per}, burst: {burst}}}]
    on_limit: {{action: {action}, max_hold: 2s}}
  - name: crm
    hosts: [api.crm.example]
    upstream: {upstream}
    limits: [{{rate: 1, per: 1h, burst: {crm_burst}}}]
    on_limit: {{action: defer}}
"""


def write(path: Path, **values: object) -> Path:
    fields = {"store": "memory://", "rate": 1, "per": "1h", "burst": 3, "action": "defer", "crm_burst": 2, **values}
    path.write_text(POLICY.format(**fields))
    return path


async def get(s: aiohttp.ClientSession, proxy: ProxyServer, host: str = "api.payments.example", **headers: str) -> int:
    async with s.get(f"http://{host}/v1/x", proxy=proxy.url, headers=headers) as r:
        await r.read()
        return r.status


async def test_changed_limits_take_effect_on_the_next_request(vendor, start_proxy, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, burst=2)
    proxy = await start_proxy(load_policy(path))
    reloader = Reloader(proxy.runtime, lambda: load_policy(path))
    async with client_session() as s:
        assert [await get(s, proxy) for _ in range(3)] == [200, 200, 429]
        write(path, upstream=vendor.url, burst=10)  # a new limit: a new, full bucket
        result = await reloader.reload("test")
        assert result.ok, result.errors
        assert [await get(s, proxy) for _ in range(10)] == [200] * 10
        assert await get(s, proxy) == 429
        samples = metric_samples(await (await s.get(f"{proxy.admin_url}/metrics")).text())
    assert value(samples, "ratelimit_config_reload_total", result="success") == 1
    assert value(samples, "ratelimit_config_reload_total", result="failure") == 0


async def test_unchanged_buckets_keep_their_state(vendor, start_proxy, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, burst=3, crm_burst=2)
    proxy = await start_proxy(load_policy(path))
    reloader = Reloader(proxy.runtime, lambda: load_policy(path))
    async with client_session() as s:
        assert [await get(s, proxy) for _ in range(2)] == [200, 200]
        write(path, upstream=vendor.url, burst=3, crm_burst=5)  # only crm changes
        assert (await reloader.reload("test")).ok
        # payments still has the one token it had left, not a refilled bucket
        assert [await get(s, proxy) for _ in range(2)] == [200, 429]
        assert [await get(s, proxy, "api.crm.example") for _ in range(6)] == [200] * 5 + [429]


async def test_an_invalid_policy_is_refused_and_the_old_one_keeps_serving(vendor, start_proxy, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, burst=2)
    proxy = await start_proxy(load_policy(path))
    reloader = Reloader(proxy.runtime, lambda: load_policy(path))
    before = proxy.runtime.handler.deps
    path.write_text(path.read_text().replace("per: 1h", 'per: "1x"').replace("name: crm", "nme: crm"))
    result = await reloader.reload("test")
    assert not result.ok
    assert any(f"{path}:9: vendors[0].limits[0].per" in e and "is not a duration" in e for e in result.errors)
    assert any('unknown key "nme"' in e for e in result.errors)
    assert proxy.runtime.handler.deps is before
    async with client_session() as s:
        assert [await get(s, proxy) for _ in range(3)] == [200, 200, 429]
        samples = metric_samples(await (await s.get(f"{proxy.admin_url}/metrics")).text())
    assert value(samples, "ratelimit_config_reload_total", result="failure") == 1


async def test_reload_under_load_drops_nothing_and_counts_each_request_once(vendor, start_proxy, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, rate=40, per="1s", burst=5, action="hold")
    proxy = await start_proxy(load_policy(path))
    reloader = Reloader(proxy.runtime, lambda: load_policy(path))
    statuses: list[int] = []
    stop = asyncio.Event()

    async def worker(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            statuses.append(await get(s, proxy))

    async with client_session() as s:
        workers = [asyncio.ensure_future(worker(s)) for _ in range(20)]
        await eventually(lambda: vendor.mock.accepted >= 10, "traffic to flow")
        for i in range(6):  # alternate limits while requests are held and in flight
            write(path, upstream=vendor.url, rate=40 + 10 * (i % 2), per="1s", burst=5, action="hold")
            assert (await reloader.reload(f"reload {i}")).ok
            target = vendor.mock.accepted + 5
            await eventually(lambda t=target: vendor.mock.accepted >= t, "traffic after the reload")  # type: ignore[misc]
        stop.set()
        await asyncio.gather(*workers)
        samples = metric_samples(await (await s.get(f"{proxy.admin_url}/metrics")).text())
    assert set(statuses) <= {200, 429}
    sent = sum(
        value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome=o)
        for o in ("forwarded", "held")
    )
    deferred = value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="deferred")
    assert sent == vendor.mock.accepted == statuses.count(200)
    assert deferred == statuses.count(429)
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="error") == 0


async def test_sizing_by_littles_law(vendor, start_proxy, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, rate=100, per="1s", burst=100)
    proxy = await start_proxy(load_policy(path))
    slowest = 0.0  # the longest round trip the worker timed
    async with client_session() as s:
        for _ in range(20):
            started = time.monotonic()
            async with s.get("http://api.payments.example/delay/200", proxy=proxy.url) as r:
                assert r.status == 200
            slowest = max(slowest, time.monotonic() - started)
        async with s.get(f"{proxy.admin_url}/status") as r:
            status = await r.json()
        samples = metric_samples(await (await s.get(f"{proxy.admin_url}/metrics")).text())
    sizing = status["vendors"][0]["sizing"]
    assert sizing["configured_rate_per_second"] == 100
    # Each upstream exchange (the vendor's 200 ms and more) lies inside a round trip the worker timed:
    # their average lies between, in seconds and not a sum, however loaded the machine.
    latency = sizing["upstream_latency_seconds"]  # rounded to 0.1 ms
    assert 0.2 <= latency <= slowest + 0.05, (latency, slowest)
    assert 100 * latency - 0.01 <= sizing["recommended_concurrency"] < 100 * latency + 1.01  # ceil(100/s x latency)
    assert value(samples, "ratelimit_recommended_concurrency", limiter="payments") == sizing["recommended_concurrency"]
    crm = status["vendors"][1]
    assert crm["sizing"]["recommended_concurrency"] is None  # no latency observed yet
    assert crm["limits"] == [{"rate": 1.0, "per": 3600.0, "burst": 2.0, "rate_per_second": 1 / 3600}]


# -- the running process: SIGHUP, POST /reload, --watch -----------------------------------


class Running:
    def __init__(self, path: Path, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "run", "-c", str(path), "--log-level", "info", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + self.proc.stderr.read() if self.proc.stderr else line
        self.admin = line.split("(admin ")[1].split(",")[0]
        self.url = line.split("listening on ")[1].split(" ")[0]

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=15)
        assert self.proc.returncode == 0
        return err


async def burst_of(admin: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{admin}/status") as r:
        return float((await r.json())["vendors"][0]["limits"][0]["burst"])


async def test_sighup_and_post_reload_in_a_running_proxy(vendor, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, burst=2)
    running = Running(path)
    try:
        assert await burst_of(running.admin) == 2
        write(path, upstream=vendor.url, burst=7)
        running.proc.send_signal(signal.SIGHUP)
        await eventually(lambda: _burst_is(running.admin, 7), "SIGHUP to apply the new policy")
        path.write_text(textwrap.dedent(path.read_text()).replace("version: 1", "version: 2"))
        async with aiohttp.ClientSession() as s, s.post(f"{running.admin}/reload") as r:
            assert r.status == 400
            body = await r.json()
        assert body["result"] == "failure"
        assert body["errors"] == [f"{path}:1: version: unsupported version 2 (expected 1)"] or body["errors"][
            0
        ].startswith(f"{path}:1: version")
        assert await burst_of(running.admin) == 7  # still the last good policy
        write(path, upstream=vendor.url, burst=9)
        async with aiohttp.ClientSession() as s, s.post(f"{running.admin}/reload") as r:
            assert r.status == 200
            assert (await r.json())["result"] == "success"
        assert await burst_of(running.admin) == 9
    finally:
        err = running.stop()
    assert "policy reloaded (SIGHUP)" in err
    assert "refused; the running policy keeps serving" in err


async def test_watch_reloads_when_the_file_changes(vendor, tmp_path) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url, burst=2)
    running = Running(path, "--watch")
    try:
        started = time.monotonic()
        write(path, upstream=vendor.url, burst=4)
        await eventually(lambda: _burst_is(running.admin, 4), "--watch to pick the change up", deadline=10)
        assert time.monotonic() - started < 10
    finally:
        err = running.stop()
    assert "policy reloaded (file changed)" in err


async def _burst_is(admin: str, burst: float) -> bool:
    return await burst_of(admin) == burst


@pytest.mark.parametrize("field", ["listen"])
async def test_listener_changes_wait_for_a_restart(vendor, start_proxy, tmp_path, field: str) -> None:
    path = write(tmp_path / "p.yaml", upstream=vendor.url)
    proxy = await start_proxy(load_policy(path))
    path.write_text(path.read_text().replace("listen: 127.0.0.1:0", "listen: 127.0.0.1:1", 1))
    result = await Reloader(proxy.runtime, lambda: load_policy(path)).reload("test")
    assert result.ok
    assert any("restart" in note for note in result.notes)
    assert str(proxy.runtime.policy.listen) == "127.0.0.1:0"
    async with client_session() as s:
        assert await get(s, proxy) == 200
