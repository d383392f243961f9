#!/usr/bin/env python3
"""Store faults, slowloris and a soak: what the proxy does when things go wrong (issue 9).

Starts its own redis-server (a free port, never 6379), an unlimited mock vendor and proxy
replicas, all on 127.0.0.1, and runs three parts (``--only`` picks some):

1. faults: 2 replicas (one global bucket, default 50/s burst 10, ``on_limit: hold``) and 40
   workers through them (absolute-form requests, as with ``HTTP_PROXY``; a worker sleeps the
   ``retry-after-ms`` hint of any 429). After a warm-up, one store fault: Redis killed and
   restarted empty on the same port (``kill``), ``FLUSHALL`` (``flush``), Redis frozen with
   SIGSTOP then SIGCONT (``pause``); each with ``on_failure: closed`` and ``local``. Prints
   the requests the vendor received during the fault (and their share of the quota), the
   largest count in any 1-second window at the vendor around the recovery and over the whole
   run against the limit (rate x 1 s + burst), and what the workers were told.
2. slowloris: N raw sockets each sending a partial request head, a header line every few
   seconds, never finishing, against one replica started with a soft limit of 1,024 open
   files (``--replica-nofile``), while 10 workers keep calling through it: the replica's
   fds and RSS, the workers' success rate and ``/healthz`` latency, before and during.
3. soak: one replica at ~200 req/s (open loop) for ``--soak-minutes``: RSS per minute and
   its slope, fds and Redis keys at start and end.

    python bench/faults.py --quick                  # a smoke run of everything, ~3 minutes
    python bench/faults.py                          # the full run: 10-minute soak, ~15 minutes
    python bench/faults.py --only faults --modes local --faults kill
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import resource
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from _common import (
    LOOPBACK,
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    Proc,
    dump_json,
    fd_count,
    fd_limit,
    fetch_metrics,
    http_json,
    loadavg,
    metric_sum,
    outcomes,
    paced,
    percentile,
    policy,
    run_main,
    status_kb,
    watchdog,
)

FAULTS = ("kill", "flush", "pause")
MODES = ("closed", "local")
PARTS = ("faults", "slowloris", "soak")
AROUND = (-1.0, 5.0)  # seconds around the recovery where a 1-second window may start
JITTER = 1  # an arrival measured after a loopback hop may slip into the next window
TARGET_LOCAL_SHARE = 0.40  # of the quota, forwarded while Redis is killed, with on_failure: local
TARGET_SLOWLORIS_SUCCESS = 0.99
TARGET_HEALTHZ_MAX = 1.0  # seconds
TARGET_RSS_SLOPE = 0.5  # MB per minute over the soak


@dataclass
class Timings:
    warmup: float
    outage: float  # Redis killed for this long
    pause: float  # Redis frozen for this long
    after: float
    slow_hold: float  # slowloris sockets held open this long
    soak_minutes: float


FULL = Timings(warmup=3.0, outage=10.0, pause=5.0, after=5.0, slow_hold=30.0, soak_minutes=10.0)
QUICK = Timings(warmup=2.0, outage=4.0, pause=3.0, after=3.0, slow_hold=8.0, soak_minutes=1.0)


# -- the vendor's windows ------------------------------------------------------------------


def max_window(times: list[float], window: float = 1.0, starts: tuple[float, float] | None = None) -> int:
    """The most arrivals in any [t, t + window) with t an arrival (within ``starts`` if given)."""
    best = 0
    for i, t in enumerate(times):
        if starts is not None and not starts[0] <= t <= starts[1]:
            continue
        best = max(best, bisect.bisect_left(times, t + window) - i)
    return best


def count_in(times: list[float], lo: float, hi: float) -> int:
    return bisect.bisect_left(times, hi) - bisect.bisect_left(times, lo)


# -- part 1: store faults --------------------------------------------------------------------


@dataclass
class Answers:
    """What the workers were told, by time (time.monotonic(), as the vendor's arrivals)."""

    log: list[tuple[float, str]] = field(default_factory=list)

    def kinds(self, lo: float, hi: float) -> dict[str, int]:
        return dict(Counter(kind for t, kind in self.log if lo <= t < hi))


def kind_of(status: int, headers: Any) -> str:
    if status == 200:
        return "forwarded"
    if status == 429 and headers.get("X-Quota-Reason") == "store-unavailable":
        return "store-unavailable"
    if status == 429 and headers.get("X-Quota-Action"):
        return "deferred"
    return f"status {status}"


async def workers_loop(urls: list[str], n: int, stop: asyncio.Event, answers: Answers) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as s:

        async def one(i: int) -> None:
            while not stop.is_set():
                pause = 0.0
                try:
                    async with s.get(f"http://{VENDOR_HOST}/w{i}", proxy=urls[i % len(urls)]) as r:
                        await r.read()
                        kind = kind_of(r.status, r.headers)
                        if r.status == 429:
                            pause = float(r.headers.get("retry-after-ms", "100")) / 1000
                except (aiohttp.ClientError, TimeoutError):
                    kind, pause = "error", 0.05
                answers.log.append((time.monotonic(), kind))
                if pause:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), pause)

        await asyncio.gather(*(one(i) for i in range(n)))


async def degraded_modes(admin_urls: list[str]) -> list[str | None]:
    """Each replica's /status store.degraded.mode (None without on_failure: local)."""
    out: list[str | None] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        for url in admin_urls:
            async with s.get(url + "/status") as r:
                degraded = (await r.json())["store"]["degraded"]
                out.append(None if degraded is None else degraded["mode"])
    return out


async def replicas_seen(admin_urls: list[str], n: int, deadline: float) -> None:
    """Wait until every replica counts ``n`` replicas (on_failure: local announces itself)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while True:
            seen = []
            for url in admin_urls:
                async with s.get(url + "/status") as r:
                    seen.append((await r.json())["store"]["degraded"]["replicas_seen"])
            if all(x == n for x in seen):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"replicas never counted each other: {seen}")
            await asyncio.sleep(0.2)


def fault_run(fleet: Fleet, args: argparse.Namespace, t: Timings, fault: str, mode: str) -> dict[str, Any]:
    redis = fleet.redis(name=f"redis-{fault}-{mode}")
    port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
    vendor = fleet.vendor(0, name=f"vendor-{fault}-{mode}")
    yaml = policy(
        vendor.url,
        [Limit(args.rate, "1s", args.burst)],
        store=redis.url,
        store_timeout="100ms",
        action="hold",
        max_hold=f"{args.max_hold:g}s",
        access_log=False,
        on_failure=mode,
        cooloff="500ms",
    )
    procs = [fleet.proxy(yaml, name=f"proxy{i}-{fault}-{mode}") for i in range(2)]
    box = {"redis": redis}
    try:
        marks = asyncio.run(drive_fault(fleet, box, port, procs, args, t, fault, mode))
        vstats = http_json(vendor.url + "/__mock/stats")
        samples = [fetch_metrics(p.admin_url) for p in procs]
    finally:
        current = box["redis"]
        if current.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(current.pid, signal.SIGCONT)
        exits = [fleet.stop(p) for p in procs]
        fleet.stop(vendor)
        fleet.stop(current)
    arrivals = sorted(vstats["arrivals"])
    if len(arrivals) < 10:
        raise BenchError(f"{fault}/{mode}: the vendor saw {len(arrivals)} requests\n" + procs[0].tail())
    start, fault_at, recovered, end = marks["start"], marks["fault"], marks["recovered"], marks["end"]
    fault_end = recovered if fault != "flush" else fault_at + 1.0
    holds_out = fault_at + args.max_hold  # holds granted before the fault have left by then
    during = count_in(arrivals, fault_at, fault_end)
    after_holds = count_in(arrivals, holds_out, fault_end)
    span = max(fault_end - holds_out, 0.0)
    first_after = next((a - recovered for a in arrivals if a >= recovered), None)
    limit = args.rate + args.burst
    answers: Answers = marks["answers"]
    return {
        "fault": fault,
        "on_failure": mode,
        "fault_seconds": round(fault_end - fault_at, 2),
        "forwarded_during_fault": during,
        "forwarded_after_holds": after_holds,
        "share_of_quota_after_holds": (after_holds / (span * args.rate)) if span > 0 else None,
        "max_window_around_recovery": max_window(arrivals, 1.0, (recovered + AROUND[0], recovered + AROUND[1])),
        "max_window_run": max_window(arrivals, 1.0),
        "limit_per_window": limit,
        "first_forward_after_recovery_s": None if first_after is None else round(first_after, 3),
        "forwarded_total": len(arrivals),
        "run_seconds": round(end - start, 1),
        "answers_during_fault": answers.kinds(fault_at, fault_end),
        "answers_after": answers.kinds(fault_end, end),
        "modes_mid_fault": marks["modes"],
        "per_replica": [
            {
                "replica": p.name,
                "outcomes": {k: int(v) for k, v in sorted(outcomes(s).items()) if v},
                "store_errors": int(metric_sum(s, "ratelimit_store_errors_total")),
                "state_lost": int(metric_sum(s, "ratelimit_store_state_lost_total")),
                "degraded_grants": int(metric_sum(s, "ratelimit_degraded_grants_total")),
                "exit_code": code,
            }
            for p, s, code in zip(procs, samples, exits, strict=True)
        ],
    }


async def drive_fault(
    fleet: Fleet,
    box: dict[str, Proc],
    port: int,
    procs: list[Proc],
    args: argparse.Namespace,
    t: Timings,
    fault: str,
    mode: str,
) -> dict[str, Any]:
    admin_urls = [p.admin_url for p in procs]
    if mode == "local":
        await replicas_seen(admin_urls, len(procs), time.monotonic() + 10)
    answers, stop = Answers(), asyncio.Event()
    load = asyncio.ensure_future(workers_loop([p.url for p in procs], args.workers, stop, answers))
    start = time.monotonic()
    modes: list[str | None] = []
    try:
        await asyncio.sleep(t.warmup)
        redis = box["redis"]
        fault_at = time.monotonic()
        if fault == "kill":
            fleet.kill(redis)
            await asyncio.sleep(t.outage / 2)
            modes = await degraded_modes(admin_urls)
            await asyncio.sleep(max(fault_at + t.outage - time.monotonic(), 0.0))
            box["redis"] = await asyncio.to_thread(fleet.redis, f"redis-{fault}-{mode}-restarted", None, port)
        elif fault == "pause":
            os.kill(redis.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(t.pause / 2)
                modes = await degraded_modes(admin_urls)
                await asyncio.sleep(max(fault_at + t.pause - time.monotonic(), 0.0))
            finally:
                os.kill(redis.pid, signal.SIGCONT)
        else:
            import redis as sync_redis

            client = sync_redis.Redis.from_url(redis.url, socket_timeout=2)
            try:
                await asyncio.to_thread(client.flushall)
            finally:
                client.close()
            modes = await degraded_modes(admin_urls)
        recovered = time.monotonic()
        await asyncio.sleep(t.after)
    finally:
        stop.set()
        await asyncio.wait_for(load, 30)
    return {
        "start": start,
        "fault": fault_at,
        "recovered": recovered,
        "end": time.monotonic(),
        "answers": answers,
        "modes": modes,
    }


def report_fault(r: dict[str, Any]) -> None:
    share = r["share_of_quota_after_holds"]
    share_text = "" if share is None else f" = {share * 100:.0f} % of the quota from fault + max_hold"
    first = r["first_forward_after_recovery_s"]
    print(
        f"  {r['fault']:<5} {r['on_failure']:<6} fault {r['fault_seconds']:>5.1f}s: forwarded during it "
        f"{r['forwarded_during_fault']:>4} ({r['forwarded_after_holds']} after the earlier holds{share_text}); "
        f"max per 1 s window around the recovery {r['max_window_around_recovery']}, whole run "
        f"{r['max_window_run']} (limit {r['limit_per_window']:g}); first forward after the recovery "
        f"{'-' if first is None else f'{first:.2f}s'}"
    )
    print(f"        answers during the fault {r['answers_during_fault']}; modes mid-fault {r['modes_mid_fault']}")
    for rep in r["per_replica"]:
        print(
            f"        {rep['replica']:<18} store errors {rep['store_errors']}, state lost {rep['state_lost']}, "
            f"local grants {rep['degraded_grants']}, exit {rep['exit_code']}"
        )


def fault_problems(r: dict[str, Any]) -> list[str]:
    out = []
    name = f"{r['fault']}/{r['on_failure']}"
    if r["max_window_run"] > r["limit_per_window"] + JITTER:
        out.append(f"{name}: {r['max_window_run']} in a 1 s window > {r['limit_per_window']:g} (+{JITTER})")
    share = r["share_of_quota_after_holds"]
    if r["fault"] == "kill" and r["on_failure"] == "local" and share is not None and share < TARGET_LOCAL_SHARE:
        out.append(f"{name}: {share * 100:.0f} % of the quota during the outage < {TARGET_LOCAL_SHARE * 100:.0f} %")
    if r["fault"] != "flush" and r["on_failure"] == "closed" and r["forwarded_after_holds"]:
        out.append(f"{name}: {r['forwarded_after_holds']} forwarded while failing closed")
    if any(rep["exit_code"] != 0 for rep in r["per_replica"]):
        out.append(f"{name}: a replica did not exit 0 on SIGTERM")
    return out


# -- part 2: slowloris -------------------------------------------------------------------------

PARTIAL_HEAD = f"GET http://{VENDOR_HOST}/v1/slow HTTP/1.1\r\nHost: {VENDOR_HOST}\r\n".encode()


@dataclass
class Slow:
    opened: int = 0
    failed: int = 0
    closed_by_replica: list[float] = field(default_factory=list)  # seconds after opening


async def slow_socket(host: str, port: int, every: float, stop: asyncio.Event, slow: Slow) -> None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
    except (OSError, TimeoutError):
        slow.failed += 1
        return
    slow.opened += 1
    opened = time.monotonic()
    try:
        writer.write(PARTIAL_HEAD)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1024), every) == b"":
                    slow.closed_by_replica.append(time.monotonic() - opened)
                    return
            writer.write(b"X-Slow: 1\r\n")  # one more header line, never the blank one
            await writer.drain()
    except (OSError, ConnectionError):
        slow.closed_by_replica.append(time.monotonic() - opened)
    finally:
        writer.close()


async def probe_phase(proxy: Proc, seconds: float, workers: int) -> dict[str, Any]:
    """Workers calling through the replica and /healthz probed twice a second for ``seconds``:
    success rate, /healthz latencies, the replica's fds and RSS."""
    stop = asyncio.Event()
    calls: Counter[str] = Counter()
    healthz: list[float] = []
    healthz_failed = 0
    fds: list[int] = []
    rss: list[int] = []
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:

        async def worker(i: int) -> None:
            while not stop.is_set():
                try:
                    async with s.get(f"http://{VENDOR_HOST}/w{i}", proxy=proxy.url) as r:
                        await r.read()
                        calls["ok" if r.status == 200 else f"status {r.status}"] += 1
                except (aiohttp.ClientError, TimeoutError) as exc:
                    calls[type(exc).__name__] += 1
                    await asyncio.sleep(0.1)

        async def watch() -> None:
            nonlocal healthz_failed
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    async with s.get(proxy.admin_url + "/healthz") as r:
                        await r.read()
                        healthz.append(time.monotonic() - t0)
                except (aiohttp.ClientError, TimeoutError):
                    healthz_failed += 1
                with contextlib.suppress(OSError, BenchError):
                    fds.append(fd_count(proxy.pid))
                    rss.append(status_kb(proxy.pid, "VmRSS"))
                await asyncio.sleep(max(0.5 - (time.monotonic() - t0), 0.0))

        tasks = [asyncio.ensure_future(worker(i)) for i in range(workers)] + [asyncio.ensure_future(watch())]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
    total = sum(calls.values())
    healthz.sort()
    return {
        "calls": dict(calls),
        "success_rate": calls["ok"] / total if total else 0.0,
        "healthz_p50_ms": round(percentile(healthz, 50) * 1000, 1) if healthz else None,
        "healthz_max_ms": round(healthz[-1] * 1000, 1) if healthz else None,
        "healthz_failed": healthz_failed,
        "fds_max": max(fds, default=0),
        "rss_max_mb": round(max(rss, default=0) / 1024, 1),
    }


def slowloris(fleet: Fleet, args: argparse.Namespace, t: Timings) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.slowloris + 200:  # our own sockets, not the replica's
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.slowloris + 1000), hard))
    redis = fleet.redis(name="redis-slowloris")
    vendor = fleet.vendor(0, name="vendor-slowloris")
    yaml = policy(vendor.url, [Limit(100000, "1s")], store=redis.url, access_log=False)
    proxy = fleet.proxy(yaml, name="proxy-slowloris", nofile=args.replica_nofile)
    try:
        result = asyncio.run(drive_slowloris(proxy, args, t))
        result["replica_fd_limit"] = fd_limit(proxy.pid)
    finally:
        result_exit = fleet.stop(proxy)
        fleet.stop(vendor)
        fleet.stop(redis)
    result["exit_code"] = result_exit
    result["sockets"] = args.slowloris
    return result


async def drive_slowloris(proxy: Proc, args: argparse.Namespace, t: Timings) -> dict[str, Any]:
    base_fds, base_rss = fd_count(proxy.pid), status_kb(proxy.pid, "VmRSS")
    before = await probe_phase(proxy, 3.0, args.slowloris_workers)
    stop, slow = asyncio.Event(), Slow()
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    sem = asyncio.Semaphore(100)

    async def opener() -> None:
        async with sem:
            task = asyncio.ensure_future(slow_socket(host, int(port), 5.0, stop, slow))
        await task

    sockets = [asyncio.ensure_future(opener()) for _ in range(args.slowloris)]
    await asyncio.sleep(2.0)  # let them connect
    during = await probe_phase(proxy, t.slow_hold, args.slowloris_workers)
    still_open = slow.opened - len(slow.closed_by_replica)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*sockets, return_exceptions=True), 30)
    await asyncio.sleep(1.0)
    after = await probe_phase(proxy, 3.0, args.slowloris_workers)
    closed = sorted(slow.closed_by_replica)
    return {
        "baseline_fds": base_fds,
        "baseline_rss_mb": round(base_rss / 1024, 1),
        "before": before,
        "during": during,
        "after": after,
        "opened": slow.opened,
        "connect_failed": slow.failed,
        "closed_by_replica_while_held": len(closed),
        "still_open_at_end_of_hold": still_open,
        "closed_after_s_p50": round(percentile(closed, 50), 1) if closed else None,
        "hold_seconds": t.slow_hold,
    }


def report_slowloris(r: dict[str, Any]) -> None:
    print(
        f"  {r['sockets']} slow sockets against one replica (fd limit {r['replica_fd_limit']}; partial head, "
        f"a header line every 5 s, held {r['hold_seconds']:g} s): {r['opened']} connected, "
        f"{r['connect_failed']} failed to connect, {r['closed_by_replica_while_held']} closed by the replica "
        f"(median after {r['closed_after_s_p50']} s), {r['still_open_at_end_of_hold']} still open at the end"
    )
    print(f"  replica at rest: {r['baseline_fds']} fds, RSS {r['baseline_rss_mb']} MB")
    for phase in ("before", "during", "after"):
        p = r[phase]
        print(
            f"  {phase:<6} workers {p['success_rate'] * 100:6.2f} % ok {p['calls']}; /healthz p50 "
            f"{p['healthz_p50_ms']} ms, max {p['healthz_max_ms']} ms, failed {p['healthz_failed']}; "
            f"replica fds max {p['fds_max']}, RSS max {p['rss_max_mb']} MB"
        )


def slowloris_problems(r: dict[str, Any]) -> list[str]:
    out = []
    during = r["during"]
    if during["success_rate"] < TARGET_SLOWLORIS_SUCCESS:
        out.append(
            f"slowloris: workers {during['success_rate'] * 100:.1f} % ok < {TARGET_SLOWLORIS_SUCCESS * 100:.0f} %"
        )
    if during["healthz_failed"] or (during["healthz_max_ms"] or 0) > TARGET_HEALTHZ_MAX * 1000:
        out.append(f"slowloris: /healthz max {during['healthz_max_ms']} ms, {during['healthz_failed']} failed")
    if r["exit_code"] != 0:
        out.append("slowloris: the replica did not exit 0 on SIGTERM")
    return out


# -- part 3: soak --------------------------------------------------------------------------------


def soak(fleet: Fleet, args: argparse.Namespace, t: Timings) -> dict[str, Any]:
    minutes = args.soak_minutes if args.soak_minutes is not None else t.soak_minutes
    redis = fleet.redis(name="redis-soak")
    vendor = fleet.vendor(0, name="vendor-soak")
    yaml = policy(
        vendor.url,
        [Limit(args.soak_rate * 5, "1s"), Limit(args.soak_rate * 600, "1m")],
        store=redis.url,
        tenant_limits=[Limit(args.soak_rate * 5, "1s")],
        access_log=True,
    )
    proxy = fleet.proxy(yaml, name="proxy-soak")
    samples: list[tuple[float, int, int, int]] = []  # (t, rss kB, fds, redis keys)
    done = threading.Event()
    import redis as sync_redis

    client = sync_redis.Redis.from_url(redis.url, socket_timeout=2)

    def sample() -> None:
        while True:
            with contextlib.suppress(OSError, BenchError, sync_redis.RedisError):
                samples.append(
                    (time.monotonic(), status_kb(proxy.pid, "VmRSS"), fd_count(proxy.pid), int(client.dbsize()))
                )
            if done.wait(5.0):
                return

    sampler = threading.Thread(target=sample, name="soak-sampler", daemon=True)
    try:
        started = [0.0]
        latencies, errors, statuses, achieved = asyncio.run(
            paced(
                f"http://{VENDOR_HOST}/v1/soak",
                proxy.url,
                args.soak_rate,
                minutes * 60,
                5.0,
                on_measure_start=lambda: (started.__setitem__(0, time.monotonic()), sampler.start()),
            )
        )
        done.set()
        sampler.join(10)
        final = (time.monotonic(), status_kb(proxy.pid, "VmRSS"), fd_count(proxy.pid), int(client.dbsize()))
        samples.append(final)
    finally:
        done.set()
        client.close()
        code = fleet.stop(proxy)
        fleet.stop(vendor)
        fleet.stop(redis)
    t0 = started[0]
    per_minute = []
    for m in range(int(minutes) + 1):
        near = min(samples, key=lambda s: abs(s[0] - (t0 + m * 60)))
        per_minute.append(round(near[1] / 1024, 1))
    warm = [s for s in samples if s[0] >= t0 + min(60.0, minutes * 30)]  # the first minute is warm-up
    slope = _slope([(s[0] - t0) / 60 for s in warm], [s[1] / 1024 for s in warm]) if len(warm) > 2 else None
    latencies.sort()
    return {
        "minutes": minutes,
        "rate": args.soak_rate,
        "achieved_rate": round(achieved, 1),
        "requests": len(latencies),
        "errors": errors,
        "statuses": {str(k): v for k, v in statuses.items()},
        "p50_ms": round(percentile(latencies, 50) * 1000, 2) if latencies else None,
        "p99_ms": round(percentile(latencies, 99) * 1000, 2) if latencies else None,
        "rss_mb_per_minute": per_minute,
        "rss_slope_mb_per_min": None if slope is None else round(slope, 3),
        "rss_start_mb": round(samples[0][1] / 1024, 1),
        "rss_end_mb": round(samples[-1][1] / 1024, 1),
        "fds_start": samples[0][2],
        "fds_end": samples[-1][2],
        "redis_keys_start": samples[0][3],
        "redis_keys_end": samples[-1][3],
        "exit_code": code,
    }


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def report_soak(r: dict[str, Any]) -> None:
    print(
        f"  {r['minutes']:g} min at {r['rate']:g} req/s (achieved {r['achieved_rate']}): {r['requests']} requests, "
        f"{r['errors']} errors, statuses {r['statuses']}; p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
    )
    print(f"  RSS per minute (MB)  {r['rss_mb_per_minute']}")
    print(
        f"  RSS {r['rss_start_mb']} -> {r['rss_end_mb']} MB, slope {r['rss_slope_mb_per_min']} MB/min after the "
        f"first minute; fds {r['fds_start']} -> {r['fds_end']}; Redis keys {r['redis_keys_start']} -> "
        f"{r['redis_keys_end']}; exit {r['exit_code']}"
    )


def soak_problems(r: dict[str, Any]) -> list[str]:
    out = []
    slope = r["rss_slope_mb_per_min"]
    if slope is not None and slope > TARGET_RSS_SLOPE:
        out.append(f"soak: RSS grows {slope:.2f} MB/min > {TARGET_RSS_SLOPE:g}")
    if r["fds_end"] > r["fds_start"] + 10:
        out.append(f"soak: fds {r['fds_start']} -> {r['fds_end']}")
    if r["errors"]:
        out.append(f"soak: {r['errors']} errors")
    if r["exit_code"] != 0:
        out.append("soak: the replica did not exit 0 on SIGTERM")
    return out


# -- main --------------------------------------------------------------------------------------


def _csv(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return items

    return parse


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/faults.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (shorter faults, 8 s slowloris, 1 min soak)")
    p.add_argument(
        "--only", type=_csv(PARTS), default=list(PARTS), help="parts to run (default all: faults,slowloris,soak)"
    )
    p.add_argument("--faults", type=_csv(FAULTS), default=list(FAULTS), help="store faults (default kill,flush,pause)")
    p.add_argument("--modes", type=_csv(MODES), default=list(MODES), help="on_failure modes (default closed,local)")
    p.add_argument("--rate", type=float, default=50.0, help="the global limit, per second (default 50)")
    p.add_argument("--burst", type=float, default=10.0, help="its burst (default 10)")
    p.add_argument("--max-hold", type=float, default=1.0, help="on_limit max_hold, seconds (default 1)")
    p.add_argument("--workers", type=int, default=40, help="workers through the 2 replicas (default 40)")
    p.add_argument("--slowloris", type=int, default=1100, help="slow sockets (default 1100; --quick 300)")
    p.add_argument("--slowloris-workers", type=int, default=10, help="workers calling meanwhile (default 10)")
    p.add_argument("--replica-nofile", type=int, default=1024, help="the slowloris replica's open-file limit")
    p.add_argument("--soak-minutes", type=float, default=None, help="soak length (default 10; --quick 1)")
    p.add_argument("--soak-rate", type=float, default=200.0, help="soak requests per second (default 200)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 2 when a target is missed (a vendor window above rate + burst (+1), < 40%% of the quota "
        "with local during the kill, a forward while failing closed, slowloris < 99%% ok or /healthz > 1 s, "
        "soak RSS slope > 0.5 MB/min, unclean exits)",
    )
    args = p.parse_args(argv)
    t = QUICK if args.quick else FULL
    if args.quick and "--slowloris" not in (argv or sys.argv):
        args.slowloris = 300
    minutes = args.soak_minutes if args.soak_minutes is not None else t.soak_minutes
    per_fault = 12 + t.warmup + max(t.outage, t.pause) + t.after
    budget = 60 + len(args.faults) * len(args.modes) * per_fault * ("faults" in args.only)
    budget += (t.slow_hold + 60) * ("slowloris" in args.only) + (minutes * 60 + 60) * ("soak" in args.only)
    watchdog(fleet, budget)
    print(f"bench/faults.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    results: dict[str, Any] = {"quick": args.quick}
    missed: list[str] = []
    if "faults" in args.only:
        print(
            f"store faults: 2 replicas, {args.workers} workers, limit {args.rate:g}/s burst {args.burst:g}, hold up "
            f"to {args.max_hold:g}s; kill {t.outage:g}s, pause {t.pause:g}s; vendor at {LOOPBACK}"
        )
        results["faults"] = []
        for fault in args.faults:
            for mode in args.modes:
                r = fault_run(fleet, args, t, fault, mode)
                report_fault(r)
                results["faults"].append(r)
                missed += fault_problems(r)
    if "slowloris" in args.only:
        print("slowloris:")
        r = slowloris(fleet, args, t)
        report_slowloris(r)
        results["slowloris"] = r
        missed += slowloris_problems(r)
    if "soak" in args.only:
        print("soak:")
        r = soak(fleet, args, t)
        report_soak(r)
        results["soak"] = r
        missed += soak_problems(r)
    dump_json(args.json, results)
    if missed:
        print("targets missed: " + "; ".join(missed))
        return 2 if args.strict else 0
    print("targets met")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
