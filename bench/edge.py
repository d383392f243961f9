#!/usr/bin/env python3
"""Accuracy at the edge: a proxy at rate + burst = the vendor's window, never a vendor 429.

Issue 10 item 5. A vendor that enforces a STRICT SLIDING WINDOW (default: at most 100
requests in any 1 s, counted on arrival, 429 beyond) leaves no room for error when the
proxy is configured right at it (default 95/s burst 5: 5 + 95 x 1 s = 100): a request
granted in time but sent late bunches with the ones granted after it, and one window
holds 101. This runs the matrix

    on_limit {hold, defer} x workers {4, 40} x replicas {1, 2} x load {quiet, busy}

each cell on fresh processes (its own redis-server on a free port, never 6379, a fresh
mock vendor, fresh replicas: a cold start, no pooled connection, no loaded script), for
``--seconds`` (default 60). Workers are the OpenAI SDK's loop (bench/herd.py): they call
the vendor through their replica (round-robin, ``proxy=`` as with ``HTTP_PROXY``) as fast
as they can; a proxy defer is slept exactly its ``retry-after-ms`` and retried, a vendor
429 its ``Retry-After``.

``busy``: each replica also relays a flood to a second, unlimited vendor in the same
process (bench/_loadgen.py, ``--flood-connections`` keep-alive connections per replica,
closed loop), the way a proxy shared by several vendors runs hot: its event loop has tens
of callbacks ready on every turn, so a grant waits in the socket buffer, and a held
request's timer fires late, by the loop's lag. The lag is shown: the latency of the
replica's ``/healthz`` (same event loop) polled every 20 ms.

Prints per cell: vendor 429s, the largest count in any 1 s at the vendor (refused ones
included) and where the first such window starts (``start-up``: within 2 s of the first
arrival), the vendor-side rate as a share of the vendor's quota, proxy deferrals per
forwarded request, the proxy's CPU share and the ``/healthz`` latency.

    python bench/edge.py                          # the whole matrix, 60 s per cell (~18 min)
    python bench/edge.py --seconds 20             # a quicker pass
    python bench/edge.py --only defer/40/2/busy --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from _common import (
    ROOT,
    BenchError,
    Fleet,
    Limit,
    Proc,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    http_json,
    loadavg,
    outcome_delta,
    outcomes,
    percentile,
    policy,
    run_main,
    table,
    unclean_exits,
    watchdog,
)
from herd import Worker, window_counts, worker

VENDOR_WINDOW = 1.0  # seconds: the vendor's sliding window
WARMUP = 1.0  # seconds after the first vendor arrival excluded from the rate
STARTUP = 2.0  # a fullest window starting this soon after the first arrival is "start-up"
OTHER_HOST = "api.other.example"  # the flood's vendor, unlimited
PROBE_EVERY = 0.020  # seconds between /healthz probes
ACTIONS = ("hold", "defer")
LOADS = ("quiet", "busy")


@dataclass(frozen=True)
class Cell:
    action: str
    workers: int
    replicas: int
    load: str

    @property
    def name(self) -> str:
        return f"{self.action}/{self.workers}/{self.replicas}/{self.load}"


def parse_cell(text: str) -> Cell:
    try:
        action, workers, replicas, load = text.split("/")
        cell = Cell(action, int(workers), int(replicas), load)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ACTION/WORKERS/REPLICAS/LOAD") from None
    if cell.action not in ACTIONS or cell.load not in LOADS or cell.workers < 1 or cell.replicas < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: action hold|defer, load quiet|busy, counts >= 1")
    return cell


def edge_policy(vendor_url: str, other_url: str | None, args: argparse.Namespace, action: str, store: str) -> str:
    yaml = policy(
        vendor_url,
        [Limit(args.rate, "1s", args.burst)],
        store=store,
        action=action,
        max_hold=args.max_hold,
        access_log=True,
    )
    if other_url is not None:  # vendors: is the file's last key, so a second item can follow
        yaml += (
            "  - name: other\n"
            f"    hosts: [{OTHER_HOST}]\n"
            f"    upstream: {other_url}\n"
            "    limits: [{rate: 1000000000, per: 1s}]\n"
        )
    return yaml


async def probe(admin_urls: list[str], until: float) -> list[float]:
    """Latency of each replica's /healthz every PROBE_EVERY s until ``until``: the proxy's event
    loop lag (plus a loopback round trip, and this process's own lag)."""
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < until:
            for url in admin_urls:
                t = time.perf_counter()
                try:
                    async with session.get(url + "/healthz") as resp:
                        await resp.read()
                except (aiohttp.ClientError, TimeoutError):
                    continue
                out.append(time.perf_counter() - t)
            await asyncio.sleep(PROBE_EVERY)
    return out


async def drive(replicas: list[Proc], workers: int, seconds: float) -> tuple[list[Worker], float, list[float]]:
    stats = [Worker() for _ in range(workers)]
    start = time.monotonic()
    urls = [p.url for p in replicas]
    tasks = [
        asyncio.ensure_future(worker(urls[i % len(urls)], start + seconds, "retry-after-ms", stats[i]))
        for i in range(workers)
    ]
    lag = asyncio.ensure_future(probe([p.admin_url for p in replicas], start + seconds))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), seconds + 30)
    except TimeoutError:
        raise BenchError("workers did not finish within the cell's time + 30 s") from None
    return stats, start, await lag


def flood(fleet: Fleet, replica: Proc, seconds: float, connections: int) -> Proc:
    """A closed-loop flood to the other vendor through ``replica`` for ``seconds``."""
    connect = replica.url.removeprefix("http://")
    argv = [
        sys.executable,
        str(ROOT / "bench" / "_loadgen.py"),
        "--connect",
        connect,
        "--target",
        f"http://{OTHER_HOST}/v1/flood",
        "--connections",
        str(connections),
        "--duration",
        f"{seconds:g}",
    ]
    return fleet.start(f"flood-{replica.name}", argv)


def run_cell(fleet: Fleet, cell: Cell, args: argparse.Namespace) -> dict[str, Any]:
    redis = fleet.redis()
    limit = args.vendor_window_limit
    vendor = fleet.vendor(limit / VENDOR_WINDOW, window=f"{VENDOR_WINDOW:g}s")
    other = fleet.vendor(0, name="other-vendor") if cell.load == "busy" else None
    yaml = edge_policy(vendor.url, other.url if other else None, args, cell.action, redis.url)
    procs = [fleet.proxy(yaml, name=f"proxy{i}") for i in range(cell.replicas)]
    floods: list[Proc] = []
    try:
        http_json(vendor.url + "/__mock/reset", "POST")
        before = [outcomes(fetch_metrics(p.admin_url)) for p in procs]
        cpu_before = [cpu_seconds(p.pid) for p in procs]
        # The flood starts with the workers: the cold start happens on a busy loop too.
        floods = [flood(fleet, p, args.seconds, args.flood_connections) for p in procs] if other else []
        stats, start, lags = asyncio.run(drive(procs, cell.workers, args.seconds))
        end = start + args.seconds
        cpu = [cpu_seconds(p.pid) - c for p, c in zip(procs, cpu_before, strict=True)]
        samples = [fetch_metrics(p.admin_url) for p in procs]
        vstats = http_json(vendor.url + "/__mock/stats")
        flooded = 0
        for f in floods:
            f.popen.wait(30)
            line = f.stdout.read_text().strip().splitlines()
            flooded += int(eval_json(line[-1])["requests"]) if line else 0
    finally:
        for f in floods:
            fleet.stop(f)
        exits = [fleet.stop(p) for p in procs]
        fleet.stop(vendor)
        if other is not None:
            fleet.stop(other)
        fleet.stop(redis)

    accepted = sorted(a for a in vstats["arrivals"] if a >= start)
    refused = sorted(a for a in vstats["rejections"] if a >= start)
    if len(accepted) < 10:
        raise BenchError(
            f"{cell.name}: the vendor saw {len(accepted)} requests: nothing got through\n" + procs[0].tail()
        )
    first = accepted[0]
    lo = first + WARMUP
    rate = sum(1 for a in accepted if lo <= a <= end) / max(end - lo, 1e-9)
    deltas = [outcome_delta(b, outcomes(s)) for b, s in zip(before, samples, strict=True)]
    forwarded = int(sum(d.get("forwarded", 0) + d.get("held", 0) for d in deltas))
    deferred = int(sum(d.get("deferred", 0) for d in deltas))
    arrived = sorted(accepted + refused)
    counts = window_counts(arrived, VENDOR_WINDOW)
    fullest = max(range(len(arrived)), key=counts.__getitem__)
    startup = [n for t, n in zip(arrived, counts, strict=True) if t < first + STARTUP]
    later = [n for t, n in zip(arrived, counts, strict=True) if t >= first + STARTUP]
    lags.sort()
    return {
        "cell": cell.name,
        "action": cell.action,
        "workers": cell.workers,
        "replicas": cell.replicas,
        "load": cell.load,
        "seconds": args.seconds,
        "proxy_rate": args.rate,
        "proxy_burst": args.burst,
        "max_hold": args.max_hold,
        "vendor_window_limit": limit,
        "vendor_429": vstats["rejected"],
        "window_max": counts[fullest],
        "window_max_at_s": round(arrived[fullest] - start, 3),
        "window_max_when": "start-up" if arrived[fullest] < first + STARTUP else "later",
        "window_max_startup": max(startup, default=0),
        "window_max_later": max(later, default=0),
        "windows_over": sum(1 for n in counts if n > limit),
        "vendor_rate": round(rate, 2),
        "quota_share": rate / (limit / VENDOR_WINDOW),
        "forwarded": forwarded,
        "deferred": deferred,
        "deferrals_per_forwarded": deferred / forwarded if forwarded else float("inf"),
        "worker_vendor_429": sum(w.vendor_429 for w in stats),
        "worker_errors": sum(w.errors for w in stats),
        "completions_min": min(w.completed for w in stats),
        "proxy_cpu_share": [round(c / args.seconds, 3) for c in cpu],
        "flood_per_s": round(flooded / args.seconds, 1) if floods else 0.0,
        "healthz_ms": {f"p{p}": round(percentile(lags, p) * 1000, 2) for p in (50, 99) if lags}
        | ({"max": round(lags[-1] * 1000, 2)} if lags else {}),
        "arrivals_s": [round(a - start, 4) for a in accepted],
        "rejections_s": [round(a - start, 4) for a in refused],
        "per_replica": [
            {"replica": p.name, "outcomes": {k: int(v) for k, v in sorted(d.items()) if v}, "exit_code": code}
            for p, d, code in zip(procs, deltas, exits, strict=True)
        ],
    }


def eval_json(line: str) -> dict[str, Any]:
    import json

    value = json.loads(line)
    if not isinstance(value, dict):
        raise BenchError(f"the flood printed {line!r}")
    return value


def row(r: dict[str, Any]) -> list[str]:
    lag = r["healthz_ms"]
    return [
        r["cell"],
        str(r["vendor_429"]),
        f"{r['window_max']} ({r['window_max_when']} {r['window_max_at_s']:.1f}s)",
        str(r["window_max_later"]),
        f"{r['quota_share'] * 100:.1f} %",
        f"{r['deferrals_per_forwarded']:.2f}",
        "/".join(f"{c * 100:.0f}" for c in r["proxy_cpu_share"]) + " %",
        f"{r['flood_per_s']:.0f}" if r["load"] == "busy" else "-",
        f"{lag.get('p50', 0):.1f}/{lag.get('p99', 0):.1f}/{lag.get('max', 0):.0f}",
    ]


HEADER = [
    "cell (action/workers/replicas/load)",
    "vendor 429",
    "max in any 1 s (when)",
    "after start-up",
    "of quota",
    "defers/fwd",
    "proxy CPU",
    "flood/s",
    "/healthz ms p50/p99/max",
]


def problems(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in results:
        if r["vendor_429"]:
            out.append(f"{r['cell']}: {r['vendor_429']} vendor 429s")
        if r["window_max"] > r["vendor_window_limit"]:
            out.append(f"{r['cell']}: {r['window_max']} in one window > {r['vendor_window_limit']}")
        out += [f"{r['cell']}: {m}" for m in unclean_exits(r["per_replica"])]
    return out


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/edge.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=60.0, help="seconds per cell (default 60; >= 5)")
    p.add_argument("--rate", type=float, default=95.0, help="the proxy's rate per second (default 95)")
    p.add_argument("--burst", type=float, default=5.0, help="the proxy's burst (default 5)")
    p.add_argument("--max-hold", default="500ms", help="on_limit.max_hold (default 500ms)")
    p.add_argument("--vendor-window-limit", type=int, default=100, help="requests the vendor accepts in any 1 s")
    p.add_argument("--actions", default="hold,defer", help="on_limit actions (default hold,defer)")
    p.add_argument("--workers", default="4,40", help="worker counts (default 4,40)")
    p.add_argument("--replicas", default="1,2", help="replica counts (default 1,2)")
    p.add_argument("--loads", default="quiet,busy", help="quiet and/or busy (default both)")
    p.add_argument("--only", type=parse_cell, action="append", metavar="A/W/R/L", help="just this cell (repeatable)")
    p.add_argument("--flood-connections", type=int, default=16, help="busy: flood connections per replica")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 on any vendor 429 or window above the limit")
    args = p.parse_args(argv)
    if args.seconds < 5:
        p.error("--seconds must be at least 5")
    try:
        cells = args.only or [
            Cell(a, int(w), int(r), load)
            for load in args.loads.split(",")
            for a in args.actions.split(",")
            for w in args.workers.split(",")
            for r in args.replicas.split(",")
        ]
        cells = [parse_cell(c.name) for c in cells]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        p.error(str(exc))
    watchdog(fleet, len(cells) * (args.seconds + 60) + 60)
    print(
        f"bench/edge.py: load average {loadavg()} at start (2 cores shared: figures are provisional); "
        f"proxy {args.rate:g}/s burst {args.burst:g}, max_hold {args.max_hold}; vendor: at most "
        f"{args.vendor_window_limit} in any {VENDOR_WINDOW:g} s; {len(cells)} cells x {args.seconds:g} s",
        flush=True,
    )
    results = []
    for cell in cells:
        r = run_cell(fleet, cell, args)
        results.append(r)
        print(table([row(r)], HEADER).splitlines()[-1], flush=True)
    print()
    print(table([row(r) for r in results], HEADER))
    dump_json(args.json, results)
    missed = problems(results)
    if missed:
        print("targets missed: " + "; ".join(missed))
        return 2 if args.strict else 0
    print(f"targets met: no vendor 429, no window above {args.vendor_window_limit}, clean SIGTERM exits")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
