"""``quota-proxy run --workers 2`` (SPEC §11): one port, two real worker processes, one
admin port, a real redis-server (the session fixture) and the loopback mock vendor.

Every request opens its own connection, so the kernel's SO_REUSEPORT hashing spreads
them over both workers; /status's ``workers`` list says which process served how many.
Every wait is a poll on an observable event (/status, /readyz, the vendor's record).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.cli import parse_args
from proxy.ops.workers import BACKOFF_FIRST, BACKOFF_MAX, STABLE_AFTER, next_delay, usable_cpus
from proxy.ops.workers_admin import MetricsView, merge_status
from proxy.policy.model import Policy
from tests.conftest import Vendor, eventually, make_policy, metric_samples, value, vendor_policy
from tests.helpers.cli import ProxyProcess, Ready, cli, run_cli, write_policy

Start = Callable[..., Awaitable[tuple[ProxyProcess, Ready]]]
TOKEN = "workers-admin-token-0123456789"


def policy_file(path: Path, upstream: str, store: str, *, vendors: str = "payments", drain: str = "5s") -> Path:
    """Each name in ``vendors`` a vendor at route /NAME: burst 30, one token an hour (so
    exactly 30 requests of a vendor are forwarded, fleet-wide), the rest deferred."""
    entries = "".join(
        f"""
          - name: {name}
            hosts: [api.{name}.example]
            route: /{name}
            upstream: {upstream}
            limits: [{{rate: 1, per: 1h, burst: 30}}]
            on_limit: {{action: defer}}"""
        for name in vendors.split()
    )
    return write_policy(
        path,
        f"""
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        drain_timeout: {drain}
        store:
          url: {store}
        vendors:{entries}
        """,
    )


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """``await start(policy, *flags)``: ``quota-proxy run -c POLICY --workers 2 FLAGS``, ready."""
    processes: list[ProxyProcess] = []

    async def start_proxy(policy: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[ProxyProcess, Ready]:
        # TMPDIR: the supervisor's socket directory in the test's own, even when a test kills it.
        env = {"TMPDIR": str(tmp_path), **(env or {})}
        process = ProxyProcess(cli("run", "-c", str(policy), "--workers", "2", *flags), tmp_path, env=env)
        processes.append(process)
        return process, await asyncio.to_thread(process.wait_ready)

    yield start_proxy
    for process in processes:
        await asyncio.to_thread(process.close)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request: each one is hashed onto a worker afresh."""
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as s:
        yield s


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def send(session: aiohttp.ClientSession, url: str, n: int) -> list[int]:
    async def one(i: int) -> int:
        async with session.get(f"{url}/v1/item/{i}") as response:
            await response.read()
            return response.status

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_two_workers_share_the_port_the_limit_and_the_metrics(
    tmp_path: Path, vendor: Vendor, redis_url: str, start: Start, session: aiohttp.ClientSession
) -> None:
    process, ready = await start(policy_file(tmp_path / "p.yaml", vendor.url, redis_url))
    status = await get_json(session, f"{ready.admin_url}/status")
    workers = status["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and process.pid not in pids, "two worker processes besides the supervisor"
    assert all(w["state"] == "ready" and w["restarts"] == 0 for w in workers)

    codes = await send(session, f"{ready.url}/payments", 60)
    # One bucket in Redis for both processes: 30 forwarded fleet-wide, not 30 per worker.
    assert sorted(codes) == [200] * 30 + [429] * 30
    assert len(vendor.mock.requests) == 30

    status = await get_json(session, f"{ready.admin_url}/status")
    served = [w["requests"] for w in status["workers"]]
    assert sum(served) == 60 and min(served) > 0, f"both workers served requests: {served}"
    (payments,) = status["vendors"]
    assert payments["requests_by_mode"]["plain"] == 60
    assert payments["tokens_available"] is not None and payments["tokens_available"] < 1

    async with session.get(f"{ready.admin_url}/metrics") as response:
        samples = metric_samples(await response.text())
    total = value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="forwarded")
    deferred = value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="deferred")
    assert (total, deferred) == (30, 30), "the two workers' counters, added up"
    assert value(samples, "http_client_responses_total", limiter="payments", code="200") == 30
    assert value(samples, "ratelimit_workers_running") == 2
    assert value(samples, "http_client_request_duration_seconds_count", limiter="payments") == 30

    def access_lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in process.stderr().splitlines() if line.startswith("{")]

    # The workers' access logs reach the supervisor's stderr whole: one JSON object a line.
    await eventually(lambda: len(access_lines()) == 60, "an access-log line per request")
    assert sorted(line["status"] for line in access_lines()) == [200] * 30 + [429] * 30
    # Each says which worker served it, as the workers' other log lines do.
    by_worker = Counter(line["worker"] for line in access_lines())
    assert by_worker == {w["index"]: w["requests"] for w in status["workers"]}
    assert await asyncio.to_thread(process.terminate_and_wait) == 0


async def test_sighup_reaches_both_workers_a_killed_worker_comes_back_a_killed_supervisor_takes_them(
    tmp_path: Path, vendor: Vendor, redis_url: str, start: Start, session: aiohttp.ClientSession
) -> None:
    path = policy_file(tmp_path / "p.yaml", vendor.url, redis_url)
    process, ready = await start(path, env={"QUOTA_PROXY_ADMIN_TOKEN": TOKEN})
    session.headers["Authorization"] = f"Bearer {TOKEN}"  # the supervisor hands it on to the workers

    async def workers() -> list[dict[str, Any]]:
        body = await get_json(session, f"{ready.admin_url}/status")
        return list(body["workers"])

    # A bad policy is refused by the supervisor: every worker keeps the running one.
    path.write_text(path.read_text().replace("burst: 30", "burst: 0"))
    async with session.post(f"{ready.admin_url}/reload") as response:
        assert response.status == 400
        assert "burst must be at least 1" in "\n".join((await response.json())["errors"])
    assert [w["vendors"] for w in await workers()] == [["payments"], ["payments"]]

    policy_file(path, vendor.url, redis_url, vendors="payments search")
    process.send_signal(signal.SIGHUP)

    async def both_reloaded() -> bool:
        return [w["vendors"] for w in await workers()] == [["payments", "search"]] * 2

    await eventually(both_reloaded, "SIGHUP reloads both workers")
    codes = await send(session, f"{ready.url}/search", 20)
    assert codes == [200] * 20, "the new vendor's route is served"

    async def forwarded(vendor_name: str) -> float:
        async with session.get(f"{ready.admin_url}/metrics") as response:
            samples = metric_samples(await response.text())
        return value(samples, "ratelimit_requests_total", limiter=vendor_name, tenant="default", outcome="forwarded")

    assert await forwarded("search") == 20
    before = await workers()
    victim = before[1]["pid"]
    os.kill(victim, signal.SIGKILL)

    async def restarted() -> bool:
        now = (await workers())[1]
        return bool(now["pid"] != victim and now["state"] == "ready")

    await eventually(restarted, "the killed worker is replaced")
    after = await workers()
    assert after[1]["restarts"] == 1
    async with session.get(f"{ready.admin_url}/metrics") as response:
        samples = metric_samples(await response.text())
    restarts = [value(samples, "ratelimit_worker_restarts_total", worker=w) for w in ("0", "1")]
    assert restarts == [0, 1]
    assert (after[0]["pid"], after[0]["restarts"]) == (before[0]["pid"], 0), "the other worker served on"
    assert after[1]["vendors"] == ["payments", "search"], "the new worker starts on the reloaded policy"
    assert f"worker 1 (pid {victim}) was killed by SIGKILL" in process.stderr()
    async with session.get(f"{ready.admin_url}/readyz") as response:
        assert response.status == 200
    assert await send(session, f"{ready.url}/search", 10) == [200] * 10
    # The killed worker's counts, as last scraped, stay in the sum: the counter never went down.
    assert await forwarded("search") == 30

    # A killed supervisor takes its workers with it: none is left serving the port.
    pids = [w["pid"] for w in await workers()]
    process.send_signal(signal.SIGKILL)
    assert await asyncio.to_thread(process.wait, 10) == -signal.SIGKILL

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await eventually(lambda: all(gone(pid) for pid in pids), "the workers stop with their supervisor")


async def test_a_restarted_worker_runs_the_fleets_policy_not_the_files_unreloaded_edit(
    tmp_path: Path, vendor: Vendor, redis_url: str, start: Start, session: aiohttp.ClientSession
) -> None:
    # Workers load the policy the supervisor checked (its copy), never the file behind its
    # back: a worker restarted while the file holds an edit nobody reloaded (or a half-written
    # one) serves what the others serve, and a reload still takes the file's new text.
    path = policy_file(tmp_path / "p.yaml", vendor.url, redis_url)
    _, ready = await start(path)

    async def workers() -> list[dict[str, Any]]:
        body = await get_json(session, f"{ready.admin_url}/status")
        return list(body["workers"])

    async def kill_and_wait(index: int) -> dict[str, Any]:
        victim = (await workers())[index]["pid"]
        os.kill(victim, signal.SIGKILL)

        async def restarted() -> bool:
            now = (await workers())[index]
            return bool(now["pid"] != victim and now["state"] == "ready")

        await eventually(restarted, f"worker {index} is replaced")
        return (await workers())[index]

    path.write_text(path.read_text().replace("burst: 30", "burst: 0"))  # invalid, not reloaded
    assert (await kill_and_wait(1))["vendors"] == ["payments"], "it came back, on the running policy"
    policy_file(path, vendor.url, redis_url, vendors="payments search")  # valid, not reloaded
    assert (await kill_and_wait(0))["vendors"] == ["payments"]
    assert [w["vendors"] for w in await workers()] == [["payments"], ["payments"]]

    async with session.post(f"{ready.admin_url}/reload") as response:
        assert response.status == 200, await response.text()
    assert [w["vendors"] for w in await workers()] == [["payments", "search"]] * 2
    assert (await kill_and_wait(1))["vendors"] == ["payments", "search"]
    assert await send(session, f"{ready.url}/search", 10) == [200] * 10

    # A /tmp cleaner that took the copy (the supervisor's directory is under TMPDIR) does not
    # keep a worker from coming back weeks later.
    (copy,) = tmp_path.glob("quota-proxy-*/policy.yaml")
    assert copy.stat().st_mode & 0o777 == 0o600, "the policy may hold secrets"
    copy.unlink()
    assert (await kill_and_wait(0))["vendors"] == ["payments", "search"]
    assert copy.stat().st_mode & 0o777 == 0o600


@pytest.mark.long  # (asserts outcomes only: runs beside the timed tests)
async def test_a_reload_one_worker_fails_is_undone_in_every_worker(
    tmp_path: Path, vendor: Vendor, redis_url: str, start: Start, session: aiohttp.ClientSession
) -> None:
    # Worker 1 is frozen (SIGSTOP): it cannot answer the reload in time. The answer says the
    # reload failed, and it did, everywhere: worker 0, which took it, goes back, and worker 1
    # reads the restored copy once it runs again. Nobody is left on the other policy.
    path = policy_file(tmp_path / "p.yaml", vendor.url, redis_url)
    process, ready = await start(path)

    async def vendors() -> list[list[str]]:
        body = await get_json(session, f"{ready.admin_url}/status")
        return [w.get("vendors") for w in body["workers"]]

    frozen = (await get_json(session, f"{ready.admin_url}/status"))["workers"][1]["pid"]
    policy_file(path, vendor.url, redis_url, vendors="payments search")
    os.kill(frozen, signal.SIGSTOP)
    try:
        async with session.post(f"{ready.admin_url}/reload") as response:
            assert response.status == 400
            assert "worker 1: TimeoutError" in "\n".join((await response.json())["errors"])
    finally:
        os.kill(frozen, signal.SIGCONT)

    async def both_on_the_old_policy() -> bool:
        return await vendors() == [["payments"], ["payments"]]

    await eventually(both_on_the_old_policy, "every worker runs the policy the failed reload left")
    assert "policy reload (POST /reload) refused" in process.stderr()
    async with session.post(f"{ready.admin_url}/reload") as response:
        assert response.status == 200, await response.text()
    assert await vendors() == [["payments", "search"]] * 2


async def test_watch_reloads_and_sigterm_drains_every_worker_then_exits_0(
    tmp_path: Path, vendor: Vendor, redis_url: str, start: Start, session: aiohttp.ClientSession
) -> None:
    path = policy_file(tmp_path / "p.yaml", vendor.url, redis_url)
    process, ready = await start(path, "--watch")
    policy_file(path, vendor.url, redis_url, vendors="payments search")

    async def watched() -> bool:
        workers = (await get_json(session, f"{ready.admin_url}/status"))["workers"]
        return [w["vendors"] for w in workers] == [["payments", "search"]] * 2

    await eventually(watched, "--watch reloads both workers when the file changes")
    pids = [w["pid"] for w in (await get_json(session, f"{ready.admin_url}/status"))["workers"]]

    async def slow(i: int) -> int:
        async with session.get(f"{ready.url}/payments/delay/1200?i={i}") as response:
            await response.read()
            return response.status

    # 16 connections: the kernel's hash leaves one worker without any once in 2^15 runs.
    in_flight = [asyncio.ensure_future(slow(i)) for i in range(16)]
    await eventually(lambda: len(vendor.mock.requests) == 16, "sixteen slow requests reach the vendor")
    status = await get_json(session, f"{ready.admin_url}/status")
    assert all(w["connections_open"] > 0 for w in status["workers"]), "both workers hold some"
    process.send_signal(signal.SIGTERM)

    async def draining() -> bool:
        async with session.get(f"{ready.admin_url}/readyz") as response:
            return response.status == 503

    await eventually(draining, "/readyz turns 503 while the workers drain")
    assert [await r for r in in_flight] == [200] * 16, "in-flight requests finish"
    assert await asyncio.to_thread(process.wait, 10) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "draining: 2 workers finish in-flight requests" in process.stderr()


def test_memory_store_with_two_workers_is_refused(tmp_path: Path) -> None:
    path = policy_file(tmp_path / "p.yaml", "http://127.0.0.1:9", "memory://")
    result = run_cli("run", "-c", str(path), "--workers", "2")
    assert result.returncode == 2
    assert result.stderr == (
        "quota-proxy: --workers 2: 2 workers need a shared store: memory:// buckets live in one process"
        " and would not be shared (use redis://, or one worker)\n"
    )
    # The file's workers on Redis, the store overridden with memory:// from the command line.
    shared = policy_file(tmp_path / "shared.yaml", "http://127.0.0.1:9", "redis://127.0.0.1:1/0")
    shared.write_text(shared.read_text().replace("drain_timeout:", "workers: 2\ndrain_timeout:"))
    result = run_cli("run", "-c", str(shared), "--store", "memory://")
    assert (result.returncode, result.stderr) == (
        2,
        "quota-proxy: workers: 2 workers need a shared store: memory:// buckets live in one process"
        " and would not be shared (use redis://, or one worker)\n",
    )
    path.write_text(path.read_text().replace("drain_timeout:", "workers: 3\ndrain_timeout:"))
    for command in ("run", "check"):
        result = run_cli(command, "-c", str(path))
        assert result.returncode == 2, command
        assert "workers: 3 workers need a shared store: memory://" in result.stderr
        assert len(result.stderr.splitlines()) == 1


async def test_auto_on_memory_is_one_process_and_one_worker_has_no_supervisor(
    tmp_path: Path, vendor: Vendor, session: aiohttp.ClientSession
) -> None:
    """``auto`` on memory:// (the image's baked-in example) is one process, as is ``--workers 1``:
    no supervisor, no ``workers`` list, the single process serving as before."""
    path = policy_file(tmp_path / "p.yaml", vendor.url, "memory://")
    for flag in ("auto", "1"):
        process = ProxyProcess(cli("run", "-c", str(path), "--workers", flag, "--log-level", "debug"), tmp_path)
        try:
            ready = await asyncio.to_thread(process.wait_ready)
            status = await get_json(session, f"{ready.admin_url}/status")
            assert "workers" not in status
            assert await send(session, f"{ready.url}/payments", 3) == [200] * 3
            assert await asyncio.to_thread(process.terminate_and_wait) == 0
            assert "worker 0 started" not in process.stderr()
            if flag == "auto" and usable_cpus() > 1:
                assert "workers: auto is 1 with store memory://" in process.stderr()
        finally:
            process.close()


def test_a_crash_loop_backs_off_and_a_worker_that_lived_starts_over() -> None:
    delays = [BACKOFF_FIRST]
    for _ in range(10):
        delays.append(next_delay(delays[-1], lived=0.5))
    assert delays[:4] == [BACKOFF_FIRST, 2 * BACKOFF_FIRST, 4 * BACKOFF_FIRST, 8 * BACKOFF_FIRST]
    assert delays[-1] == BACKOFF_MAX
    assert next_delay(BACKOFF_MAX, lived=STABLE_AFTER) == BACKOFF_FIRST
    assert next_delay(0, lived=0.1) == BACKOFF_FIRST


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = policy_file(tmp_path / "p.yaml", "http://127.0.0.1:9", redis_url)
        result = run_cli("run", "-c", str(path), "--workers", "2", "--listen", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert result.stderr == f"quota-proxy: cannot listen on 127.0.0.1:{port} (listen): address already in use\n"


def test_workers_flag_and_key_parse() -> None:
    assert parse_args(["run", "--workers", "auto"]).workers == "auto"
    assert parse_args(["run", "--workers", "4"]).workers == 4
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["run", "--workers", bad])
        assert exit_info.value.code == 2
    text = (
        "version: 1\nstore: {url: 'redis://127.0.0.1:1/0'}\nworkers: $w\n"
        "vendors: [{name: a, hosts: [a.example], limits: [{rate: 1}]}]\n"
    )
    assert make_policy(text, w="auto").workers == "auto"
    assert make_policy(text, w=3).workers == 3
    assert Policy().workers == 1
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_metrics_merge_sums_counters_and_per_process_gauges_and_counters_survive_a_restart() -> None:
    def text(forwarded: int, held: int, tokens: float, created: float) -> str:
        return (
            "# HELP ratelimit_requests_total Requests.\n# TYPE ratelimit_requests_total counter\n"
            f'ratelimit_requests_total{{limiter="a",outcome="forwarded"}} {forwarded}\n'
            f'ratelimit_requests_created{{limiter="a",outcome="forwarded"}} {created}\n'
            "# HELP ratelimit_held_requests Held.\n# TYPE ratelimit_held_requests gauge\n"
            f'ratelimit_held_requests{{limiter="a"}} {held}\n'
            "# HELP ratelimit_tokens_available Tokens.\n# TYPE ratelimit_tokens_available gauge\n"
            f'ratelimit_tokens_available{{limiter="a"}} {tokens}\n'
            "# HELP ratelimit_config_reload_total Reloads.\n# TYPE ratelimit_config_reload_total counter\n"
            'ratelimit_config_reload_total{result="success"} 1\n'
        )

    def samples(metrics: list[Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in metrics for s in family.samples}

    forwarded = ("ratelimit_requests_total", (("limiter", "a"), ("outcome", "forwarded")))
    held = ("ratelimit_held_requests", (("limiter", "a"),))
    tokens = ("ratelimit_tokens_available", (("limiter", "a"),))
    view = MetricsView()
    merged = samples(view.collect([(0, 100, text(3, 1, 5.0, 100.0)), (1, 200, text(4, 2, 7.0, 90.0))]))
    assert merged == {forwarded: 7, held: 3, tokens: 7.0}, (
        "reloads are the supervisor's own count, not the workers'; no _created series"
    )
    # Worker 1 replaced (pid 201, its counts start over): its last counts stay in the sum, its
    # gauges do not, so the counter never goes down.
    merged = samples(view.collect([(0, 100, text(5, 0, 6.0, 100.0)), (1, 201, text(1, 1, 6.0, 95.0))]))
    assert merged == {forwarded: 5 + 4 + 1, held: 1, tokens: 6.0}
    merged = samples(view.collect([(0, 100, text(6, 0, 6.0, 100.0)), (1, 201, text(2, 0, 6.0, 95.0))]))
    assert merged[forwarded] == 6 + 4 + 2
    # Worker 1 silent (restarting): its counts as last seen stay in, until a new process answers.
    merged = samples(view.collect([(0, 100, text(7, 0, 6.0, 100.0))]))
    assert merged[forwarded] == 7 + 4 + 2
    merged = samples(view.collect([(0, 100, text(7, 0, 6.0, 100.0)), (1, 202, text(0, 0, 6.0, 95.0))]))
    assert merged[forwarded] == 7 + 4 + 2


def test_status_merge_sums_per_process_counts() -> None:
    def doc(plain: int, held: int, breaker: str) -> dict[str, Any]:
        return {
            "store": {"breaker": breaker},
            "connections": {"open": 2, "max": 100},
            "vendors": [
                {
                    "name": "a",
                    "requests_by_mode": {"plain": plain, "intercept": 0, "tunnel": 0},
                    "held_now": held,
                    "breaker": breaker,
                    "blocked_for_seconds": 0,
                    "learned": None,
                    "concurrency": {"cap": None, "inflight": None, "held_for_slot": 1},
                    "recent": {"window_seconds": 10, "forwarded_per_second": 1.5, "vendor_429_last_minute": 1},
                }
            ],
        }

    merged = merge_status([doc(3, 1, "closed"), doc(4, 0, "open")])
    (vendor,) = merged["vendors"]
    assert vendor["requests_by_mode"] == {"plain": 7, "intercept": 0, "tunnel": 0}
    assert (vendor["held_now"], vendor["concurrency"]["held_for_slot"]) == (1, 2)
    assert vendor["recent"] == {"window_seconds": 10, "forwarded_per_second": 3.0, "vendor_429_last_minute": 2}
    assert vendor["breaker"] == merged["store"]["breaker"] == "open"
    assert merged["connections"] == {"open": 4, "max": 200}


def shape(doc: Any) -> Any:
    """A JSON document's structure: keys and value types, not values (None matches anything)."""
    if isinstance(doc, dict):
        return {k: shape(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [shape(v) for v in doc]
    return "number" if isinstance(doc, int | float) and not isinstance(doc, bool) else type(doc).__name__


async def test_merged_status_keeps_the_shape_of_one_process_status(
    vendor: Vendor, start_proxy: Any, session: aiohttp.ClientSession
) -> None:
    """What the live page and other readers of /status rely on: the supervisor's document is
    a real worker's, key for key, with the per-process counts added up."""
    policy = vendor_policy(
        vendor.url,
        extra_vendor="concurrency: 4\n            partition: {header: X-Api-Key}\n            connect: tunnel",
    )
    server = await start_proxy(policy)
    assert await send(session, f"{server.url}/payments", 3) == [200] * 3
    doc = await get_json(session, f"{server.admin_url}/status")
    merged = merge_status([doc, doc])
    assert shape(merged) == shape(doc)
    (one,), (two,) = doc["vendors"], merged["vendors"]
    assert two["requests_by_mode"] == {mode: 2 * n for mode, n in one["requests_by_mode"].items()}
    assert one["requests_by_mode"]["plain"] == 3
    assert two["tunnels"] == {**one["tunnels"], "open": 2 * one["tunnels"]["open"]}
    assert two["concurrency"] == {**one["concurrency"], "held_for_slot": 2 * one["concurrency"]["held_for_slot"]}
    assert two["partitions"] == one["partitions"], "the same partitions seen by both: not counted twice"
    for key in ("buckets", "limits", "tokens_available", "breaker", "learned", "sizing"):
        assert two[key] == one[key], key
    assert merged["connections"]["max"] == 2 * doc["connections"]["max"]


async def test_the_supervisor_merges_refusals_and_the_history(
    tmp_path: Path, vendor: Vendor, redis_url: str, start: Start, session: aiohttp.ClientSession
) -> None:
    """The live page's fields through one admin port: refusals by reason and tenant, and
    /status/history, each worker's added up."""
    _, ready = await start(policy_file(tmp_path / "p.yaml", vendor.url, redis_url))

    async def one(i: int) -> int:
        headers = {"X-Tenant-Id": "batch" if i % 3 else "web"}
        async with session.get(f"{ready.url}/payments/v1/item/{i}", headers=headers) as response:
            await response.read()
            return response.status

    codes = await asyncio.gather(*(one(i) for i in range(60)))
    assert sorted(codes) == [200] * 30 + [429] * 30
    status = await get_json(session, f"{ready.admin_url}/status")
    served = [w["requests"] for w in status["workers"]]
    assert min(served) > 0, f"both workers served requests: {served}"
    (payments,) = status["vendors"]
    refusals = payments["refusals"]
    assert refusals["by_reason"]["global"] == {"deferred": 30, "shed": 0}
    assert sum(counts["deferred"] + counts["shed"] for counts in refusals["by_reason"].values()) == 30
    top = {t["tenant"]: t["refused"] for t in refusals["top_tenants"]}
    assert set(top) <= {"batch", "web"} and sum(top.values()) == 30

    async def counted() -> bool:  # a second has to end to be in the series, and the forwarded
        # ones (a vendor round trip longer) may end a second after the deferrals
        (past,) = (await get_json(session, f"{ready.admin_url}/status/history"))["vendors"]
        return sum(past["series"]["deferred"]) == 30 and sum(past["series"]["forwarded"]) >= 30

    await eventually(counted, "the deferrals and the forwarded requests in the merged history")
    history = await get_json(session, f"{ready.admin_url}/status/history")
    (past,) = history["vendors"]
    assert sum(past["series"]["forwarded"]) == 30 and len(past["series"]["forwarded"]) == history["seconds"]
    assert past["gauges"]["held_now"][-1] == 0 and past["events"] == []
