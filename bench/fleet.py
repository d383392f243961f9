#!/usr/bin/env python3
"""Fleet-wide rate accuracy: W workers through N proxy replicas sharing one Redis.

Starts its own redis-server (a free port, never 6379), a mock vendor that enforces
its own quota (default 120/s, above the configured rate), N proxy replicas
(store redis, access log on, metrics on) and W concurrent workers: aiohttp clients
using the replicas as their HTTP proxy (``proxy=``, absolute-form requests as with
HTTP_PROXY), spread round-robin over the replicas, each looping requests for D
seconds. A proxy defer (429 with X-Quota-Action) makes the worker sleep
X-Quota-Retry-After-Ms and retry; a vendor 429 is counted (it should not happen).

Prints the configured rate, the vendor-side steady rate (vendor arrivals from one
second after the first arrival to the end of the run), its relative error, vendor
429s, each replica's outcomes from /metrics, Redis EVALSHA+EVAL calls per
forwarded request (INFO commandstats), and each replica's CPU seconds.

    python bench/fleet.py                       # 40 workers, 2 replicas, 10 s
    python bench/fleet.py --workers 4 --replicas 1
    python bench/fleet.py --matrix              # workers {4, 40} x replicas {1, 2}, one table
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from _common import (
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    commandstats,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    fleet_parser,
    http_json,
    loadavg,
    metric_sum,
    outcome_delta,
    outcomes,
    policy,
    run_main,
    script_calls,
    table,
    unclean_exits,
    watchdog,
)

WARMUP = 1.0  # seconds after the first vendor arrival excluded from the steady rate
STEADY_AFTER = 2.0  # seconds into the run when the steady-state Redis snapshot is taken


@dataclass
class WorkerStats:
    issued: int = 0
    ok: int = 0
    deferred: int = 0
    shed: int = 0
    vendor_429: int = 0
    other: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    deferred_sleep: float = 0.0


async def worker(proxy_url: str, deadline: float, stats: WorkerStats, path: str) -> None:
    url = f"http://{VENDOR_HOST}{path}"
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            stats.issued += 1
            try:
                async with session.get(url, proxy=proxy_url) as resp:
                    await resp.read()
                    if resp.status == 200:
                        stats.ok += 1
                        continue
                    action = resp.headers.get("X-Quota-Action")
                    if resp.status == 429 and action == "defer":
                        stats.deferred += 1
                        wait_ms = float(
                            resp.headers.get("X-Quota-Retry-After-Ms")
                            or float(resp.headers.get("Retry-After", "1")) * 1000
                        )
                    elif resp.status == 503 and action == "shed":
                        stats.shed += 1
                        wait_ms = 100.0
                    elif resp.status == 429:
                        stats.vendor_429 += 1
                        wait_ms = float(resp.headers.get("Retry-After", "1")) * 1000
                    else:
                        stats.other[resp.status] = stats.other.get(resp.status, 0) + 1
                        wait_ms = 10.0
            except (aiohttp.ClientError, TimeoutError):
                stats.errors += 1
                wait_ms = 50.0
            wait = min(wait_ms / 1000.0, max(deadline - time.monotonic(), 0.0))
            stats.deferred_sleep += wait
            await asyncio.sleep(wait)


async def drive(
    replica_urls: list[str], workers: int, duration: float, path: str, snapshot: Callable[[], Any]
) -> tuple[WorkerStats, float, float, Any]:
    """Run the workers; ``snapshot`` is called (in a thread) once the fleet is in steady state."""
    stats = WorkerStats()
    start = time.monotonic()
    deadline = start + duration
    tasks = [
        asyncio.ensure_future(worker(replica_urls[i % len(replica_urls)], deadline, stats, path))
        for i in range(workers)
    ]
    await asyncio.sleep(min(STEADY_AFTER, duration / 3))
    issued = stats.issued
    mid = (issued, await asyncio.to_thread(snapshot))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), duration + 30)
    except TimeoutError:
        raise BenchError("workers did not finish within duration + 30 s") from None
    return stats, start, deadline, mid


def run_once(fleet: Fleet, args: argparse.Namespace, replicas: int, workers: int) -> dict[str, Any]:
    """One fleet: fresh redis, vendor and replicas; returns the figures."""
    redis = fleet.redis()
    vendor = fleet.vendor(args.vendor_rate, args.vendor_burst)
    limits = [Limit(args.rate, "1s", args.burst)]
    yaml = policy(
        vendor.url,
        limits,
        store=redis.url,
        store_timeout=args.store_timeout,
        action=args.action,
        max_hold=args.max_hold,
        access_log=True,
    )
    procs = [fleet.proxy(yaml, name=f"proxy{i}") for i in range(replicas)]
    try:
        http_json(vendor.url + "/__mock/reset", "POST")
        before_cmd = commandstats(redis.url)
        before_metrics = [outcomes(fetch_metrics(p.admin_url)) for p in procs]
        cpu0 = [cpu_seconds(p.pid) for p in procs]

        def snapshot() -> tuple[dict[str, int], list[dict[str, float]]]:
            return commandstats(redis.url), [outcomes(fetch_metrics(p.admin_url)) for p in procs]

        stats, start, end, (mid_issued, (mid_cmd, _mid_metrics)) = asyncio.run(
            drive([p.url for p in procs], workers, args.duration, args.path, snapshot)
        )
        cpu1 = [cpu_seconds(p.pid) for p in procs]
        after_cmd = commandstats(redis.url)
        samples = [fetch_metrics(p.admin_url) for p in procs]
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = [fleet.stop(p) for p in procs]
        fleet.stop(vendor)
        fleet.stop(redis)

    arrivals = sorted(a for a in vstats["arrivals"] if a >= start)
    if len(arrivals) < 10:
        raise BenchError(
            f"the vendor saw {len(arrivals)} requests: nothing got through\n" + "\n".join(p.tail() for p in procs)
        )
    window_start = arrivals[0] + WARMUP
    window_end = end
    steady = [a for a in arrivals if window_start <= a <= window_end]
    if window_end - window_start < 1.0:
        raise BenchError("run too short to measure a steady rate (use --duration >= 3)")
    rate = len(steady) / (window_end - window_start)
    per_replica = []
    for i, (p, s) in enumerate(zip(procs, samples, strict=True)):
        delta = outcome_delta(before_metrics[i], outcomes(s))
        per_replica.append(
            {
                "replica": p.name,
                "outcomes": {k: int(v) for k, v in sorted(delta.items()) if v},
                "store_errors": int(metric_sum(s, "ratelimit_store_errors_total")),
                "cpu_seconds": round(cpu1[i] - cpu0[i], 2),
                "exit_code": exits[i],
            }
        )
    forwarded = sum(r["outcomes"].get("forwarded", 0) + r["outcomes"].get("held", 0) for r in per_replica)
    decided = sum(sum(r["outcomes"].values()) for r in per_replica)
    scripts, delta = script_calls(before_cmd, after_cmd)
    delta.pop("info", None)
    # Steady state: from the mid-run snapshot to the end (start-up effects such as the
    # first NOSCRIPT + SCRIPT LOAD excluded).
    steady_scripts, steady_delta = script_calls(mid_cmd, after_cmd)
    steady_delta.pop("info", None)
    # Per request the workers issued in that window: each costs its EVALSHA when it arrives,
    # while a held one is counted forwarded only later (metrics are written at the end).
    steady_issued = stats.issued - mid_issued
    return {
        "replicas": replicas,
        "workers": workers,
        "duration": args.duration,
        "configured_rate": args.rate,
        "vendor_quota": args.vendor_rate,
        "vendor_rate": round(rate, 2),
        "relative_error": (rate - args.rate) / args.rate,
        "vendor_accepted": vstats["accepted"],
        "vendor_429": vstats["rejected"],
        "worker_ok": stats.ok,
        "worker_deferred": stats.deferred,
        "worker_vendor_429": stats.vendor_429,
        "worker_errors": stats.errors,
        "worker_other": stats.other,
        "forwarded": forwarded,
        "proxy_requests": decided,
        "evalsha_calls": scripts,
        "evalsha_per_forwarded": scripts / forwarded if forwarded else float("nan"),
        "evalsha_per_request": scripts / decided if decided else float("nan"),
        "redis_commands": delta,
        "steady_evalsha_per_request": steady_scripts / steady_issued if steady_issued else float("nan"),
        "steady_other_round_trips": {
            k: v for k, v in steady_delta.items() if k not in ("evalsha", "eval", "hmget", "hset", "pexpire", "time")
        },
        "per_replica": per_replica,
    }


def print_one(r: dict[str, Any]) -> None:
    print(
        f"fleet: {r['workers']} workers, {r['replicas']} replica(s), {r['duration']:g} s; "
        f"vendor quota {r['vendor_quota']:g}/s"
    )
    print(f"  configured rate          {r['configured_rate']:g}/s")
    print(f"  vendor-side steady rate  {r['vendor_rate']:.2f}/s  (arrivals from first+{WARMUP:g}s to end)")
    print(f"  relative error           {r['relative_error'] * 100:+.2f}%")
    print(f"  vendor 429s              {r['vendor_429']}  (workers saw {r['worker_vendor_429']})")
    print(
        f"  workers                  ok {r['worker_ok']}, proxy-deferred {r['worker_deferred']}, "
        f"errors {r['worker_errors']}, other {r['worker_other'] or 0}"
    )
    for rep in r["per_replica"]:
        oc = ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items()) or "none"
        print(
            f"  {rep['replica']:<8} outcomes: {oc}; store errors {rep['store_errors']}; "
            f"CPU {rep['cpu_seconds']:.2f} s; exit {rep['exit_code']}"
        )
    print(
        f"  Redis EVALSHA+EVAL       {r['evalsha_calls']} calls = {r['evalsha_per_forwarded']:.3f} per forwarded "
        f"request ({r['evalsha_per_request']:.3f} per proxied request, deferred ones included)"
    )
    print(
        f"  ... in steady state      {r['steady_evalsha_per_request']:.3f} per request the workers issued from "
        f"{STEADY_AFTER:g} s into the run to the end (= per forwarded request when none is deferred); "
        f"other round trips then: {r['steady_other_round_trips'] or 'none'}"
    )
    others = {k: v for k, v in r["redis_commands"].items() if k not in ("evalsha", "eval")}
    if others:
        print(f"  other Redis commands     {others} (whole run; hmget/hset/pexpire/time run inside the script)")


def problems(r: dict[str, Any]) -> list[str]:
    out = []
    if r["vendor_429"]:
        out.append("vendor 429s")
    if abs(r["relative_error"]) > 0.05:
        out.append("rate off by more than 5%")
    return out + unclean_exits(r["per_replica"])


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = fleet_parser("bench/fleet.py", __doc__, duration=10.0, rate=100.0, burst=10.0)
    p.add_argument("--vendor-rate", type=float, default=120.0, help="the mock vendor's own quota (default 120)")
    p.add_argument("--vendor-burst", type=float, default=None, help="the mock vendor's burst (default its rate)")
    p.add_argument(
        "--action",
        choices=["hold", "defer", "shed"],
        default="hold",
        help="the vendor's on_limit action (default hold)",
    )
    p.add_argument("--max-hold", default="500ms", help="on_limit max_hold (default 500ms)")
    p.add_argument("--store-timeout", default="50ms", help="store.timeout (default 50ms, the product default)")
    p.add_argument("--path", default="/v1/ping", help="request path at the vendor (default /v1/ping)")
    p.add_argument("--matrix", action="store_true", help="run workers {4, 40} x replicas {1, 2}; one table")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 2 when a run misses the targets (vendor 429s, error > 5%%, unclean exit)",
    )
    args = p.parse_args(argv)
    if args.duration < 3:
        p.error("--duration must be at least 3 s")
    cells = [(r, w) for w in (4, 40) for r in (1, 2)] if args.matrix else [(args.replicas, args.workers)]
    watchdog(fleet, len(cells) * (args.duration + 60) + 30)
    print(f"bench/fleet.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    results = []
    for replicas, workers in cells:
        r = run_once(fleet, args, replicas, workers)
        results.append(r)
        print_one(r)
        print(flush=True)
    if args.matrix:
        rows = [
            [
                r["workers"],
                r["replicas"],
                f"{r['configured_rate']:g}",
                f"{r['vendor_rate']:.2f}",
                f"{r['relative_error'] * 100:+.2f}%",
                r["vendor_429"],
                "/".join(
                    str(sum(rep["outcomes"].get(k, 0) for rep in r["per_replica"]))
                    for k in ("forwarded", "held", "deferred")
                ),
                f"{r['evalsha_per_forwarded']:.3f}",
                f"{r['steady_evalsha_per_request']:.3f}",
                " ".join(f"{rep['cpu_seconds']:.2f}" for rep in r["per_replica"]),
            ]
            for r in results
        ]
        print(
            table(
                rows,
                [
                    "workers",
                    "replicas",
                    "configured/s",
                    "vendor/s",
                    "error",
                    "vendor 429",
                    "fwd/held/deferred",
                    "evalsha/fwd",
                    "steady evalsha/req",
                    "CPU s per replica",
                ],
            )
        )
    dump_json(args.json, results)
    bad = [f"{r['workers']}w x {r['replicas']}r: {', '.join(problems(r))}" for r in results if problems(r)]
    if bad:
        print("targets missed: " + "; ".join(bad))
        return 2 if args.strict else 0
    print("targets met: vendor rate within ±5% of the configured rate, zero vendor 429s, clean SIGTERM exits")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
