#!/usr/bin/env python3
"""No herd: precise retriers through the proxy's defer answers, against a strict vendor.

Starts its own redis-server (a free port, never 6379), a mock vendor enforcing a STRICT
SLIDING WINDOW (default: at most 100 requests in any 1 s, counted on arrival; 429
beyond), N proxy replicas (store redis, ``on_limit: defer``, one global bucket, default
95/s burst 5) and W workers that behave like the OpenAI SDK: on a proxy defer (429 with
``X-Quota-Action: defer``) a worker sleeps exactly the hint (``retry-after-ms`` by
default; ``--hint-header`` picks ``X-Quota-Retry-After-Ms``, the real wait, or
``Retry-After``, whole seconds, to compare) and retries the same call; on a vendor 429
it sleeps the vendor's ``Retry-After``. Workers are spread round-robin over the replicas
and loop for D seconds.

Prints the vendor-side rate and its share of the vendor's quota, proxy deferrals per
forwarded request, per-worker completions (min, mean, min/mean), vendor 429s, the
largest count of requests the vendor saw in any one window (refused ones included) and,
when a window overran, when and how; then how deferrals fell (defers per completed call,
hints against the real wait, first defers against repeated ones, per second).

    python bench/herd.py                          # 40 workers, 2 replicas, 60 s, the issue-8 target
    python bench/herd.py --hint-header X-Quota-Retry-After-Ms --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from _common import (
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    dump_json,
    fetch_metrics,
    fleet_parser,
    http_json,
    loadavg,
    metric_sum,
    outcome_delta,
    outcomes,
    percentile,
    policy,
    run_main,
    unclean_exits,
    watchdog,
)

VENDOR_WINDOW = 1.0  # seconds: the vendor's sliding window
WARMUP = 1.0  # seconds after the first vendor arrival excluded from the rate
HINTS = ("retry-after-ms", "X-Quota-Retry-After-Ms", "Retry-After")
TARGET_SHARE = 0.90  # vendor-side rate / vendor quota
TARGET_DEFERRALS = 2.0  # proxy deferrals per forwarded request
TARGET_FAIRNESS = 0.50  # min completions / mean completions


@dataclass
class Worker:
    """What one worker did; ``defers_per_call`` counts, per completed call, the defers before it."""

    completed: int = 0
    deferred: int = 0
    repeat_defers: int = 0  # defers of a call that had been deferred already
    vendor_429: int = 0
    errors: int = 0
    other: Counter[int] = field(default_factory=Counter)
    missing_hint: int = 0
    defers_per_call: Counter[int] = field(default_factory=Counter)
    hints_ms: list[float] = field(default_factory=list)
    waits_ms: list[float] = field(default_factory=list)
    defer_times: list[float] = field(default_factory=list)


def hint_seconds(headers: Mapping[str, str], name: str) -> float | None:
    """The retry hint the worker obeys, in seconds; None when the answer lacks it."""
    raw = headers.get(name)
    if raw is None:
        return None
    value = float(raw)
    return value if name == "Retry-After" else value / 1000.0


async def worker(proxy_url: str, deadline: float, hint_header: str, stats: Worker) -> None:
    """Call the vendor through ``proxy_url`` until ``deadline``; every refused call is retried
    after exactly the hint, as the OpenAI SDK does (no jitter, no cap on the attempts)."""
    url = f"http://{VENDOR_HOST}/v1/ping"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        defers = 0  # of the call in progress
        while time.monotonic() < deadline:
            pause = 0.0
            headers: Mapping[str, str]
            try:
                async with session.get(url, proxy=proxy_url) as resp:
                    await resp.read()
                    status, headers = resp.status, resp.headers
            except (aiohttp.ClientError, TimeoutError):
                stats.errors += 1
                status, headers, pause = 0, {}, 0.05
            if status == 200:
                stats.completed += 1
                stats.defers_per_call[defers] += 1
                defers = 0
                continue
            if status == 429 and headers.get("X-Quota-Action") == "defer":
                stats.deferred += 1
                stats.repeat_defers += defers > 0
                defers += 1
                stats.defer_times.append(time.monotonic())
                stats.waits_ms.append(float(headers.get("X-Quota-Retry-After-Ms", "nan")))
                hint = hint_seconds(headers, hint_header)
                if hint is None:
                    stats.missing_hint += 1
                    hint = float(headers.get("Retry-After", "1"))
                stats.hints_ms.append(hint * 1000.0)
                pause = hint
            elif status == 429:  # the vendor's own: the SDK honours its Retry-After
                stats.vendor_429 += 1
                pause = float(headers.get("Retry-After", "1"))
            elif status:
                stats.other[status] += 1
                pause = 0.01
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))


async def drive(replica_urls: list[str], workers: int, duration: float, hint_header: str) -> tuple[list[Worker], float]:
    stats = [Worker() for _ in range(workers)]
    start = time.monotonic()
    tasks = [
        asyncio.ensure_future(worker(replica_urls[i % len(replica_urls)], start + duration, hint_header, stats[i]))
        for i in range(workers)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), duration + 30)
    except TimeoutError:
        raise BenchError("workers did not finish within duration + 30 s") from None
    return stats, start


# -- the vendor's windows -------------------------------------------------------------------


def window_counts(times: list[float], window: float) -> list[int]:
    """For each arrival (sorted), how many arrivals fall in [it, it + window)."""
    return [bisect.bisect_left(times, t + window) - i for i, t in enumerate(times)]


def overruns(
    arrived: list[float], counts: list[int], refused: list[float], limit: int, start: float
) -> list[dict[str, Any]]:
    """Episodes in which some window of the vendor held more than ``limit`` arrivals (``counts``
    from ``window_counts``): when (seconds into the run), the largest count, the 429s, and the
    arrivals per 100 ms from one second before to one second after (where the burst came from)."""
    episodes: list[dict[str, Any]] = []
    for t, n in zip(arrived, counts, strict=True):
        if n <= limit:
            continue
        if episodes and t <= episodes[-1]["_last"] + VENDOR_WINDOW:
            ep = episodes[-1]
            ep["_last"], ep["max"] = t, max(ep["max"], n)
        else:
            episodes.append({"_first": t, "_last": t, "max": n})
    for ep in episodes:
        lo, hi = ep.pop("_first"), ep.pop("_last") + VENDOR_WINDOW
        ep["from_s"], ep["to_s"] = round(lo - start, 3), round(hi - start, 3)
        ep["vendor_429"] = bisect.bisect_left(refused, hi) - bisect.bisect_left(refused, lo)
        bins = Counter(math.floor((t - lo + 1.0) * 10 + 1e-9) for t in arrived if lo - 1.0 <= t < hi + 1.0)
        ep["per_100ms_from_1s_before"] = [bins.get(i, 0) for i in range(math.ceil((hi - lo + 2.0) * 10))]
    return episodes


def per_second(times: list[float], start: float, duration: float) -> list[int]:
    bins = Counter(int(t - start) for t in times if start <= t < start + duration)
    return [bins.get(i, 0) for i in range(int(duration))]


# -- one run ----------------------------------------------------------------------------------


def run(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    redis = fleet.redis()
    limit = args.vendor_window_limit
    vendor = fleet.vendor(limit / VENDOR_WINDOW, window=f"{VENDOR_WINDOW:g}s")
    yaml = policy(vendor.url, [Limit(args.rate, "1s", args.burst)], store=redis.url, action="defer")
    procs = [fleet.proxy(yaml, name=f"proxy{i}") for i in range(args.replicas)]
    try:
        http_json(vendor.url + "/__mock/reset", "POST")
        before = [outcomes(fetch_metrics(p.admin_url)) for p in procs]
        stats, start = asyncio.run(drive([p.url for p in procs], args.workers, args.duration, args.hint_header))
        end = start + args.duration
        samples = [fetch_metrics(p.admin_url) for p in procs]
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = [fleet.stop(p) for p in procs]
        fleet.stop(vendor)
        fleet.stop(redis)

    accepted = sorted(a for a in vstats["arrivals"] if a >= start)
    refused = sorted(a for a in vstats["rejections"] if a >= start)
    if len(accepted) < 10:
        raise BenchError(f"the vendor saw {len(accepted)} requests: nothing got through\n" + procs[0].tail())
    lo = accepted[0] + WARMUP
    if end - lo < 1.0:
        raise BenchError("run too short to measure a rate (use --duration >= 5)")
    rate = sum(1 for a in accepted if lo <= a <= end) / (end - lo)
    quota = limit / VENDOR_WINDOW
    deltas = [outcome_delta(b, outcomes(s)) for b, s in zip(before, samples, strict=True)]
    forwarded = int(sum(d.get("forwarded", 0) for d in deltas))
    deferred = int(sum(d.get("deferred", 0) for d in deltas))
    completions = [w.completed for w in stats]
    mean = sum(completions) / len(completions)
    defers_per_call: Counter[int] = sum((w.defers_per_call for w in stats), Counter())
    hints = sorted(h for w in stats for h in w.hints_ms)
    waits = sorted(x for w in stats for x in w.waits_ms if x == x)
    worker_defers = sum(w.deferred for w in stats)
    repeats = sum(w.repeat_defers for w in stats)
    arrived = sorted(accepted + refused)
    counts = window_counts(arrived, VENDOR_WINDOW)
    fullest = max(range(len(arrived)), key=counts.__getitem__)
    return {
        "workers": args.workers,
        "replicas": args.replicas,
        "duration": args.duration,
        "proxy_rate": args.rate,
        "proxy_burst": args.burst,
        "hint_header": args.hint_header,
        "vendor_window_s": VENDOR_WINDOW,
        "vendor_window_limit": limit,
        "vendor_rate": round(rate, 2),
        "quota_share": rate / quota,
        "vendor_accepted": vstats["accepted"],
        "vendor_429": vstats["rejected"],
        "vendor_window_max": vstats["window_max"],
        "vendor_window_max_at_s": round(arrived[fullest] - start, 3),  # where the first fullest window starts
        "vendor_window_max_steady": max((n for t, n in zip(arrived, counts, strict=True) if t >= lo), default=0),
        "vendor_max_in_flight": vstats["max_in_flight"],
        "forwarded": forwarded,
        "deferred": deferred,
        "deferrals_per_forwarded": deferred / forwarded if forwarded else float("inf"),
        "per_replica": [
            {
                "replica": p.name,
                "outcomes": {k: int(v) for k, v in sorted(d.items()) if v},
                "store_errors": int(metric_sum(s, "ratelimit_store_errors_total")),
                "exit_code": code,
            }
            for p, d, s, code in zip(procs, deltas, samples, exits, strict=True)
        ],
        "completions": completions,
        "completions_min": min(completions),
        "completions_mean": mean,
        "fairness": min(completions) / mean if mean else 0.0,
        "worker_deferred": worker_defers,
        "repeat_defers": repeats,
        "worker_vendor_429": sum(w.vendor_429 for w in stats),
        "worker_errors": sum(w.errors for w in stats),
        "worker_other": dict(sum((w.other for w in stats), Counter())),
        "missing_hint": sum(w.missing_hint for w in stats),
        "defers_per_call": {str(k): v for k, v in sorted(defers_per_call.items())},
        "hint_ms": _spread(hints),
        "real_wait_ms": _spread(waits),
        "vendor_accepted_per_s": per_second(accepted, start, args.duration),
        "deferred_per_s": per_second(sorted(t for w in stats for t in w.defer_times), start, args.duration),
        "overruns": overruns(arrived, counts, refused, limit, start),
    }


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"p{p}": round(percentile(values, p), 1) for p in (10, 50, 90, 99)} | {"max": round(values[-1], 1)}


def report(r: dict[str, Any]) -> None:
    print(
        f"herd: {r['workers']} workers, {r['replicas']} replica(s), {r['duration']:g} s; proxy {r['proxy_rate']:g}/s "
        f"burst {r['proxy_burst']:g}, defer; vendor: at most {r['vendor_window_limit']} in any "
        f"{r['vendor_window_s']:g} s; workers obey {r['hint_header']}"
    )
    print(
        f"  vendor-side rate         {r['vendor_rate']:.2f}/s = {r['quota_share'] * 100:.1f} % of the quota "
        f"(accepted arrivals from first+{WARMUP:g}s to the end)"
    )
    print(
        f"  deferrals per forwarded  {r['deferrals_per_forwarded']:.2f}  ({r['deferred']} deferred, "
        f"{r['forwarded']} forwarded; {r['repeat_defers']} defers were of a call deferred before)"
    )
    print(
        f"  completions per worker   min {r['completions_min']}, mean {r['completions_mean']:.1f}, "
        f"min/mean {r['fairness']:.2f}"
    )
    print(f"  vendor 429s              {r['vendor_429']}  (workers saw {r['worker_vendor_429']})")
    print(
        f"  largest count in any {r['vendor_window_s']:g} s  {r['vendor_window_max']} at the vendor "
        f"(limit {r['vendor_window_limit']}; refused arrivals included; the first such window starts "
        f"{r['vendor_window_max_at_s']:.2f} s into the run); from first+{WARMUP:g}s on: "
        f"{r['vendor_window_max_steady']}; most in flight at once {r['vendor_max_in_flight']}"
    )
    print(f"  defers before a completed call   {r['defers_per_call']}")
    print(f"  hint the workers slept (ms)      {r['hint_ms']}")
    print(f"  real wait, X-Quota-Retry-After-Ms {r['real_wait_ms']}")
    if r["worker_errors"] or r["worker_other"] or r["missing_hint"]:
        print(
            f"  errors {r['worker_errors']}, other statuses {r['worker_other']}, "
            f"defers without {r['hint_header']}: {r['missing_hint']}"
        )
    for rep in r["per_replica"]:
        oc = ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items()) or "none"
        print(f"  {rep['replica']:<8} outcomes: {oc}; store errors {rep['store_errors']}; exit {rep['exit_code']}")
    for ep in r["overruns"]:
        print(
            f"  overrun {ep['from_s']:.2f}-{ep['to_s']:.2f} s: up to {ep['max']} in a window, "
            f"{ep['vendor_429']} vendor 429s; arrivals per 100 ms from 1 s before: {ep['per_100ms_from_1s_before']}"
        )


def problems(r: dict[str, Any]) -> list[str]:
    out = []
    if r["quota_share"] < TARGET_SHARE:
        out.append(f"vendor-side rate {r['quota_share'] * 100:.1f} % < {TARGET_SHARE * 100:.0f} % of the quota")
    if r["deferrals_per_forwarded"] > TARGET_DEFERRALS:
        out.append(f"{r['deferrals_per_forwarded']:.2f} deferrals per forwarded request > {TARGET_DEFERRALS:g}")
    if r["fairness"] < TARGET_FAIRNESS:
        out.append(f"a worker starved: min/mean completions {r['fairness']:.2f} < {TARGET_FAIRNESS:g}")
    if r["vendor_429"]:
        out.append(f"{r['vendor_429']} vendor 429s")
    return out + unclean_exits(r["per_replica"])


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = fleet_parser("bench/herd.py", __doc__, duration=60.0, rate=95.0, burst=5.0)
    p.add_argument(
        "--vendor-window-limit",
        type=int,
        default=100,
        help=f"requests the vendor accepts in any {VENDOR_WINDOW:g} s (default 100)",
    )
    p.add_argument("--hint-header", choices=HINTS, default=HINTS[0], help="the hint the workers sleep on a defer")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 2 when a target is missed (rate < 90%% of the quota, > 2 deferrals per forwarded request, "
        "min/mean completions < 0.5, any vendor 429, unclean exit)",
    )
    args = p.parse_args(argv)
    if args.duration < 5:
        p.error("--duration must be at least 5 s")
    if args.workers < 1 or args.replicas < 1 or args.vendor_window_limit < 1:
        p.error("--workers, --replicas and --vendor-window-limit must be at least 1")
    watchdog(fleet, args.duration + 90)
    print(f"bench/herd.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    r = run(fleet, args)
    report(r)
    dump_json(args.json, r)
    missed = problems(r)
    if missed:
        print("targets missed: " + "; ".join(missed))
        return 2 if args.strict else 0
    print(
        f"targets met: >= {TARGET_SHARE * 100:.0f} % of the quota, <= {TARGET_DEFERRALS:g} deferrals per forwarded "
        f"request, min/mean >= {TARGET_FAIRNESS:g}, zero vendor 429s, clean SIGTERM exits"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
