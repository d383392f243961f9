#!/usr/bin/env python3
"""One port from 1 and from 2 worker processes (``run --workers N``, SPEC §11), same run.

Rounds interleave 1 and 2 workers (each a fresh ``quota-proxy run --workers N`` on the
Redis store, access log and metrics on, a limit that never binds); every figure is the
median over rounds. Per measurement: a warm-up, then ``--duration`` seconds of closed-loop
keep-alive load with absolute-form requests (bench/throughput.py's generator):

- CPU per request: utime+stime of the supervisor and every worker (/proc) over the
  window, divided by requests completed (the supervisor's part shown apart: it relays the
  workers' access logs);
- req/s;
- balance: each worker's open connections (its /status entry, sampled mid-window) and
  requests served in the window; reported as the smallest worker's share of an even split
  (100% = perfectly even).

The generator, vendor and Redis are pinned to ``--load-cpu`` (default 0); the proxy may
run anywhere (``--proxy-cpu`` pins it). On a 2-core machine the second worker then shares
core 0 with the generator, which limits req/s. ``--proxy-cpu 1`` puts both workers on one
core: what two interpreters time-sharing one core cost (cache, switches), not contention.

    python bench/workers.py
    python bench/workers.py --proxy-cpu 0-1 --rounds 3 --duration 4
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import threading
import time
from typing import Any

from _common import (
    BenchError,
    Fleet,
    Proc,
    cpu_seconds,
    dump_json,
    http_json,
    loadavg,
    require_pinning,
    run_main,
    table,
    watchdog,
)
from throughput import generate, product_policy

_READY = re.compile(r"quota-proxy listening on http://(\S+) \(admin http://([^\s,]+)")


def start(fleet: Fleet, workers: int, vendor: Proc, redis: Proc, cpus: str | None, tag: str) -> Proc:
    cfg = fleet.workdir / f"workers-{tag}.yaml"
    # store timeout 250ms: on a shared 2-core machine a starved worker's 50ms store calls time
    # out and defer (429), which would end the measurement rather than slow it
    cfg.write_text(product_policy("redis", vendor.url, redis.url, store_timeout="250ms"))
    argv = [sys.executable, "-m", "proxy", "run", "-c", str(cfg), "--workers", str(workers), "--log-level", "warning"]
    proc = fleet.start(f"proxy-{tag}", argv, cpus=cpus)
    m = fleet.wait_line(proc, _READY, timeout=30)
    proc.url, proc.admin_url = f"http://{m.group(1)}", f"http://{m.group(2)}"
    return proc


def workers_of(proc: Proc) -> list[dict[str, Any]]:
    """/status's ``workers`` list; one process (``--workers 1``) has none: made up alike."""
    doc = http_json(proc.admin_url + "/status")
    if "workers" in doc:
        return list(doc["workers"])
    requests = sum(sum(v["requests_by_mode"].values()) for v in doc["vendors"])
    return [{"pid": proc.pid, "requests": requests, "connections_open": doc["connections"]["open"]}]


def measure(
    fleet: Fleet, args: argparse.Namespace, workers: int, vendor: Proc, redis: Proc, tag: str, connections: int
) -> dict[str, Any]:
    proxy = start(fleet, workers, vendor, redis, args.proxy_cpu, tag)
    try:
        generate(fleet, args.generator, proxy.url, connections, args.warmup, args.load_cpu)
        before = workers_of(proxy)
        pids = {proxy.pid, *(w["pid"] for w in before)}  # the supervisor, and each worker once
        mid: list[list[dict[str, Any]]] = []
        sampler = threading.Timer(args.duration / 2, lambda: mid.append(workers_of(proxy)))
        cpu0, own0, t0 = sum(cpu_seconds(p) for p in pids), cpu_seconds(proxy.pid), time.monotonic()
        sampler.start()
        load, _ = generate(fleet, args.generator, proxy.url, connections, args.duration, args.load_cpu)
        cpu1, own1, t1 = sum(cpu_seconds(p) for p in pids), cpu_seconds(proxy.pid), time.monotonic()
        sampler.join()
        after = workers_of(proxy)
    finally:
        code = fleet.stop(proxy)
    done = int(load["requests"])
    if done <= 0 or load["non2xx"] > 0.01 * done or load["errors"] > 0.01 * done:
        raise BenchError(f"{workers} worker(s): {load}\n{proxy.tail()}")
    served = [a["requests"] - b["requests"] for a, b in zip(after, before, strict=True)]
    connections = [w["connections_open"] for w in mid[0]] if mid else []
    return {
        "workers": workers,
        "connections": connections,
        "requests": done,
        "rps": done / load["elapsed"],
        "proxy_cores": (cpu1 - cpu0) / (t1 - t0),
        "cpu_us_per_request": (cpu1 - cpu0) / done * 1e6,
        # the supervisor's part (relaying the workers' logs); with one worker, the whole process
        "supervisor_us_per_request": (own1 - own0) / done * 1e6 if workers > 1 else None,
        "requests_per_worker": served,
        "connections_per_worker": connections,
        "requests_balance": _balance(served),
        "connections_balance": _balance(connections),
        "exit_code": code,
    }


def _balance(counts: list[int]) -> float | None:
    """The smallest share against an even split: 1.0 = even, 0.5 = one worker has half its share."""
    if len(counts) < 2 or sum(counts) == 0:
        return None
    return min(counts) / (sum(counts) / len(counts))


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/workers.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of 1 and 2 workers (default 3)")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per run (default 4)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds of load first (default 2)")
    p.add_argument("--connections", type=int, default=50, help="keep-alive connections (default 50)")
    p.add_argument("--generator", choices=["auto", "wrk", "python"], default="auto")
    p.add_argument(
        "--proxy-cpu", help="taskset CPU list for the proxy and its workers (default: any CPU, the load's too)"
    )
    p.add_argument("--load-cpu", default="0", help="taskset CPU list for generator, vendor, redis (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "python"
    require_pinning()
    watchdog(fleet, args.rounds * 2 * (args.duration + args.warmup + 30) + 30)
    print(f"bench/workers.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    print(
        f"generator {args.generator}, {args.connections} connections; proxy on CPU {args.proxy_cpu or 'any'}, "
        f"generator/vendor/redis on CPU {args.load_cpu}; {args.rounds} rounds of {args.duration:g}s"
    )
    vendor = fleet.vendor(0, cpus=args.load_cpu)
    redis = fleet.redis(cpus=args.load_cpu)
    # "1h": one worker at half the connections, the load each of two workers gets: a
    # process's CPU per request grows as its load falls (fewer requests per wake-up and per
    # batched Redis write), which is not contention between workers.
    half = max(1, args.connections // 2)
    setups = {"1": (1, args.connections), "2": (2, args.connections), "1h": (1, half)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
    for r in range(args.rounds):
        names = list(setups)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            workers, connections = setups[name]
            runs[name].append(measure(fleet, args, workers, vendor, redis, f"{name}-{r}", connections))
            time.sleep(0.2)

    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return statistics.median(values) if values else None

    rows = []
    for workers in setups:
        cpu, rps = med(workers, "cpu_us_per_request"), med(workers, "rps")
        own = med(workers, "supervisor_us_per_request")
        cores = med(workers, "proxy_cores")
        conn_b, req_b = med(workers, "connections_balance"), med(workers, "requests_balance")
        rows.append(
            [
                f"{setups[workers][0]} ({setups[workers][1]} conns)",
                f"{cpu:.0f}" if cpu is not None else "-",
                "-" if own is None else f"{own:.0f}",
                f"{rps:.0f}" if rps is not None else "-",
                "-" if cores is None else f"{cores:.2f}",
                "-" if conn_b is None else f"{conn_b * 100:.0f}%",
                "-" if req_b is None else f"{req_b * 100:.0f}%",
                "; ".join("/".join(map(str, r["connections_per_worker"])) for r in runs[workers]),
                "; ".join("/".join(map(str, r["requests_per_worker"])) for r in runs[workers]),
            ]
        )
    print(
        table(
            rows,
            [
                "workers",
                "CPU µs/req",
                "of which supervisor",
                "req/s",
                "proxy cores busy",
                "conn balance",
                "req balance",
                "conns per worker",
                "reqs per worker",
            ],
        )
    )
    one, two, one_half = med("1", "cpu_us_per_request"), med("2", "cpu_us_per_request"), med("1h", "cpu_us_per_request")
    if one and two:
        print(f"CPU per request, 2 workers against 1: {(two / one - 1) * 100:+.1f}% (target within 10%)")
    if one and one_half:
        print(
            f"CPU per request, 1 worker at {half} connections against {args.connections}: "
            f"{(one_half / one - 1) * 100:+.1f}% (the load per process alone)"
        )
    if one_half and two:
        print(
            f"CPU per request, 2 workers against 1 at the same load per worker ({half} connections each): "
            f"{(two / one_half - 1) * 100:+.1f}% (contention between workers; target within 10%)"
        )
    balance = med("2", "connections_balance")
    if balance is not None:
        print(f"connections balance, 2 workers: smallest share {balance * 100:.0f}% of even (target >= 80%)")
    dump_json(args.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
