#!/usr/bin/env python3
"""Added latency: the same paced load sent to the mock vendor directly and through one proxy.

Open-loop pacing: request i is launched at t0 + i/rate whether or not earlier
ones have finished (no coordinated omission from a closed loop), over one
keep-alive connection pool. Latency is measured from the moment the request is
issued to the end of the response body. The vendor is unlimited and the proxy's
configured rate is far above the load, so nothing is held or deferred: what is
measured is the cost of the hop plus one limiter decision.

Phases, each with its own warm-up: direct to the vendor; through the proxy with
a Redis store (one EVALSHA per request); through the proxy with memory://. For
each: p50/p90/p99/max and, for the proxy phases, the difference from direct at
each percentile, plus the proxy's CPU per request at this load.

    python bench/latency.py                   # 500 req/s, 10 s per phase
    python bench/latency.py --rate 200 --duration 5 --stores redis
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from _common import (
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    loadavg,
    outcomes,
    paced,
    percentile,
    policy,
    run_main,
    table,
    watchdog,
)

PCTS = (50, 90, 99)


def summarize(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    out = {f"p{p}": percentile(s, p) * 1000 for p in PCTS}
    out["max"] = s[-1] * 1000
    out["mean"] = sum(s) / len(s) * 1000
    return out


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/latency.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rate", type=float, default=500.0, help="offered load, requests per second (default 500)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per phase (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each phase (default 2)")
    p.add_argument("--stores", default="redis,memory", help="proxy phases, comma-separated (default redis,memory)")
    p.add_argument("--path", default="/v1/ping", help="request path at the vendor (default /v1/ping)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--strict", action="store_true", help="exit 2 when a target (p50 <= 1 ms, p99 <= 5 ms added) is missed"
    )
    args = p.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if not set(stores) <= {"redis", "memory"}:
        p.error("--stores takes redis and/or memory")
    watchdog(fleet, (len(stores) + 1) * (args.duration + args.warmup + 40) + 30)
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        uvloop = None
    run = (lambda c: uvloop.run(c)) if uvloop else asyncio.run

    print(f"bench/latency.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    vendor = fleet.vendor(0)  # unlimited: the vendor never answers 429
    redis = fleet.redis() if "redis" in stores else None
    results: dict[str, Any] = {"rate": args.rate, "duration": args.duration}

    lat, errors, statuses, achieved = run(paced(vendor.url + args.path, None, args.rate, args.duration, args.warmup))
    if not lat or errors or set(statuses) != {200}:
        raise BenchError(f"direct phase: {errors} errors, statuses {statuses}")
    results["direct"] = {**summarize(lat), "n": len(lat), "achieved_rate": achieved}

    huge = max(args.rate * 100, 100000)
    for store in stores:
        url = redis.url if store == "redis" and redis is not None else "memory://"
        yaml = policy(vendor.url, [Limit(huge, "1s", huge)], store=url, action="defer", access_log=True)
        proxy = fleet.proxy(yaml, name=f"proxy-{store}")
        marks: dict[str, float] = {}

        def mark(proxy_pid: int = proxy.pid, marks: dict[str, float] = marks) -> None:
            marks["cpu0"], marks["t0"] = cpu_seconds(proxy_pid), time.perf_counter()

        try:
            lat, errors, statuses, achieved = run(
                paced(f"http://{VENDOR_HOST}{args.path}", proxy.url, args.rate, args.duration, args.warmup, mark)
            )
            cpu1 = cpu_seconds(proxy.pid)
            oc = outcomes(fetch_metrics(proxy.admin_url))
        finally:
            code = fleet.stop(proxy)
        if not lat or errors or set(statuses) != {200}:
            raise BenchError(
                f"proxy {store} phase: {errors} errors, statuses {statuses}; outcomes {oc}\n{proxy.tail()}"
            )
        if set(oc) - {"forwarded"}:
            raise BenchError(f"proxy {store} phase: the limiter bound ({oc}); the load must stay unlimited")
        summary = summarize(lat)
        results[store] = {
            **summary,
            "n": len(lat),
            "achieved_rate": achieved,
            "added": {k: summary[k] - results["direct"][k] for k in summary},
            "cpu_us_per_request": (cpu1 - marks["cpu0"]) / len(lat) * 1e6,
            "exit_code": code,
        }

    rows = []
    for name in ["direct", *stores]:
        r = results[name]
        row = [name if name == "direct" else f"proxy ({name})", r["n"], f"{r['achieved_rate']:.0f}"]
        row += [f"{r[f'p{q}']:.3f}" for q in PCTS] + [f"{r['max']:.2f}"]
        if name == "direct":
            row += ["", "", "", ""]
        else:
            row += [f"{r['added'][f'p{q}']:+.3f}" for q in PCTS] + [f"{r['cpu_us_per_request']:.0f}"]
        rows.append(row)
    print(f"offered load {args.rate:g} req/s open-loop, {args.duration:g} s measured per phase; milliseconds")
    print(table(rows, ["path", "n", "req/s", "p50", "p90", "p99", "max", "+p50", "+p90", "+p99", "proxy CPU µs/req"]))
    dump_json(args.json, results)
    missed = [
        f"{s}: added p50 {results[s]['added']['p50']:.3f} ms / p99 {results[s]['added']['p99']:.3f} ms"
        for s in stores
        if results[s]["added"]["p50"] > 1.0 or results[s]["added"]["p99"] > 5.0
    ]
    if missed:
        print("targets missed (added p50 <= 1 ms, p99 <= 5 ms): " + "; ".join(missed))
        return 2 if args.strict else 0
    print("targets met: added p50 <= 1 ms and p99 <= 5 ms")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
