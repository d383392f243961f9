#!/usr/bin/env python3
"""The whole quota at the edges (issue 23): retriers, learned limits, caps, state loss.

Four parts, each a grid of runs against real processes (redis-server on a free port, the
mock vendor, two proxy replicas on ``redis://`` unless said otherwise), each printing a
table and checking issue 23's targets:

- ``retriers``: workers in defer mode against a vendor enforcing a STRICT SLIDING WINDOW
  of rate + burst in any 1 s, at rates 2, 20 and 95/s, bursts 1, 2 and 5, 10 and 40
  workers, three kinds of worker: ``precise`` (sleep exactly ``retry-after-ms``, retry:
  the OpenAI SDK), ``early`` (retry after min(hint, 1 s) at most twice, then re-enqueue:
  the job comes back after the last hint, on a new connection to the other replica;
  Stripe's SDK under a queue), ``noshow`` (as precise, but a fifth of refused calls are
  dropped: the worker moves on to its next call at once), and, asked for with ``--kinds``
  (issue 34), ``giveup`` (OpenAI's and Anthropic's SDKs: retry twice on the hint, then
  raise; and a third of deferred jobs never come back, cancelled or timed out: the job
  dropped, the next one at once on the same client) and ``giveup-fresh`` (the same with a
  client per job: the connection that held the slot closes). Each call
  has a path of its own. Targets: vendor side >= 90 % of the configured rate (from first + 1 s), no vendor
  429 after the first second, <= 1.5 proxy deferrals per forwarded request for precise
  retriers, no worker below half the mean completions.
- ``learned``: a vendor (token bucket) that says its limit in X-RateLimit-* headers, a
  policy far above it with ``feedback.headers: auto``, 10 precise retriers: >= 90 % of the
  vendor's limit (5, 20, 100/s) with no vendor 429 after the first second.
- ``sequential``: one worker calling one request after another, 200 times, through a
  ``concurrency: 1`` vendor (memory:// with one replica; redis:// with one and two): 0
  refusals.
- ``loss``: 10/s burst 10, six precise retriers, FLUSHALL (and a restart without
  persistence) under load, in hold and defer mode, requests on the straight path and on
  the general one (``X-Quota-On-Limit`` sends them there): the vendor's busiest second
  after the loss holds at most that second's refill + 1.

    python bench/quota.py                       # every part (about 25 minutes)
    python bench/quota.py --parts retriers --quick   # one cell per rate
    python bench/quota.py --parts learned,sequential,loss
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _common import (
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    dump_json,
    fetch_metrics,
    http_json,
    loadavg,
    outcome_delta,
    outcomes,
    policy,
    run_main,
    table,
    watchdog,
)

WARMUP = 1.0  # seconds from the vendor's first arrival left out of the rate
TARGET_SHARE = 0.90
TARGET_DEFERRALS = 1.5
TARGET_FAIRNESS = 0.5
KINDS = ("precise", "early", "noshow")
MORE_KINDS = ("giveup", "giveup-fresh")  # issue 34: SDKs that give up (--kinds to run them)
RATES = (2.0, 20.0, 95.0)
BURSTS = (1.0, 2.0, 5.0)
FLEETS = (10, 40)


def max_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    return max((bisect.bisect_left(times, t + window) - i for i, t in enumerate(times)), default=0)


def cell_seconds(rate: float, workers: int, floor: float) -> float:
    """Long enough for every worker to complete a few calls: 4 x workers / rate, at least ``floor``."""
    return max(floor, 4.0 * workers / rate)


@dataclass
class Worker:
    completed: int = 0
    deferred: int = 0
    other: Counter[int] = field(default_factory=Counter)
    given_up: int = 0


async def retrier(kind: str, i: int, urls: list[str], deadline: float, stats: Worker, rng: random.Random) -> None:
    """One worker of ``kind`` (see the module's doc), on replica ``i % len(urls)``."""
    home = i % len(urls)
    calls = 0
    timeout = aiohttp.ClientTimeout(total=30)
    session = aiohttp.ClientSession(timeout=timeout)
    try:
        while time.monotonic() < deadline:
            calls += 1
            url = f"http://{VENDOR_HOST}/v1/ping/{i}-{calls}"
            tries = 0
            replica = home
            while time.monotonic() < deadline:
                async with session.get(url, proxy=urls[replica]) as r:
                    await r.read()
                    status, headers = r.status, r.headers
                if status == 200:
                    stats.completed += 1
                    break
                if status != 429 or headers.get("X-Quota-Action") != "defer":
                    stats.other[status] += 1
                    await asyncio.sleep(0.05)
                    continue
                stats.deferred += 1
                tries += 1
                hint = int(headers["retry-after-ms"]) / 1000
                if kind == "noshow" and rng.random() < 0.2:
                    break  # dropped: the next call at once
                if kind.startswith("giveup") and (tries > 2 or rng.random() < 1 / 3):
                    stats.given_up += 1
                    if kind == "giveup-fresh":  # a client per job: its connection goes with it
                        await session.close()
                        session = aiohttp.ClientSession(timeout=timeout)
                    break  # the SDK raised after its two retries: the job dropped, the next at once
                if kind == "early" and tries <= 2:
                    pause = min(hint, 1.0)
                elif kind == "early":  # re-enqueued: back after the last hint, elsewhere
                    pause = hint
                    await session.close()
                    session = aiohttp.ClientSession(timeout=timeout)
                    replica = (replica + 1) % len(urls)
                    tries = 0
                else:
                    pause = hint
                await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
    finally:
        await session.close()


async def drive(kind: str, urls: list[str], workers: int, seconds: float, seed: int) -> tuple[list[Worker], float]:
    stats = [Worker() for _ in range(workers)]
    start = time.monotonic()
    rng = random.Random(seed)
    await asyncio.wait_for(
        asyncio.gather(*(retrier(kind, i, urls, start + seconds, stats[i], rng) for i in range(workers))),
        seconds + 60,
    )
    return stats, start


def replicas(fleet: Fleet, yaml: str, count: int, tree: Path | None = None) -> list[Any]:
    return [fleet.proxy(yaml, name=f"proxy{i}-{time.monotonic_ns()}", tree=tree) for i in range(count)]


def stop(fleet: Fleet, procs: list[Any]) -> list[int]:
    return [fleet.stop(p) for p in procs]


def run_retriers(
    fleet: Fleet, kind: str, rate: float, burst: float, workers: int, floor: float, tree: Path | None = None
) -> dict[str, Any]:
    redis = fleet.redis(name=f"redis-{time.monotonic_ns()}")
    limit = math.ceil(rate + burst)
    vendor = fleet.vendor(limit, window="1s", name=f"vendor-{time.monotonic_ns()}")
    yaml = policy(vendor.url, [Limit(rate, "1s", burst)], store=redis.url, action="defer", access_log=False)
    procs = replicas(fleet, yaml, 2, tree)
    seconds = cell_seconds(rate, workers, floor)
    try:
        before = [outcomes(fetch_metrics(p.admin_url)) for p in procs]
        stats, start = asyncio.run(drive(kind, [p.url for p in procs], workers, seconds, seed=int(rate * 100 + burst)))
        after = [outcomes(fetch_metrics(p.admin_url)) for p in procs]
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = stop(fleet, procs)
        fleet.stop(vendor)
        fleet.stop(redis)
    accepted = sorted(a for a in vstats["arrivals"] if a >= start)
    refused = [a for a in vstats["rejections"] if a >= start]
    if len(accepted) < 3:
        raise BenchError(f"{kind} {rate:g}/{burst:g}/{workers}: the vendor saw {len(accepted)} requests")
    lo, end = accepted[0] + WARMUP, start + seconds
    vendor_rate = sum(1 for a in accepted if lo <= a <= end) / (end - lo)
    deltas = [outcome_delta(b, a) for b, a in zip(before, after, strict=True)]
    forwarded = sum(d.get("forwarded", 0) for d in deltas)
    deferred = sum(d.get("deferred", 0) for d in deltas)
    done = [w.completed for w in stats]
    mean = sum(done) / len(done)
    return {
        "kind": kind,
        "rate": rate,
        "burst": burst,
        "workers": workers,
        "seconds": seconds,
        "vendor_limit": limit,
        "vendor_rate": vendor_rate,
        "share": vendor_rate / rate,
        "vendor_429_late": sum(1 for a in refused if a > accepted[0] + WARMUP),
        "vendor_429": len(refused),
        "deferrals_per_forwarded": deferred / forwarded if forwarded else math.inf,
        "fairness": min(done) / mean if mean else 0.0,
        "completions_min_mean": (min(done), round(mean, 1)),
        "other": dict(sum((w.other for w in stats), Counter())),
        "given_up": sum(w.given_up for w in stats),
        "exits": exits,
        "vendor_per_s": [sum(1 for a in accepted if start + i <= a < start + i + 1) for i in range(int(seconds))],
        "vendor_429_at_s": [round(a - start, 3) for a in refused],
    }


def retriers_problems(r: dict[str, Any]) -> list[str]:
    out = []
    if r["share"] < TARGET_SHARE:
        out.append(f"{r['share'] * 100:.1f} % of the rate")
    if r["vendor_429_late"]:
        out.append(f"{r['vendor_429_late']} vendor 429s after the first second")
    if r["kind"] == "precise" and r["deferrals_per_forwarded"] > TARGET_DEFERRALS:
        out.append(f"{r['deferrals_per_forwarded']:.2f} deferrals per forwarded")
    if r["fairness"] < TARGET_FAIRNESS:
        out.append(f"min/mean {r['fairness']:.2f}")
    if any(r["exits"]):
        out.append("a replica did not exit 0")
    return out


def run_learned(fleet: Fleet, limit: float, floor: float) -> dict[str, Any]:
    redis = fleet.redis(name=f"redis-{time.monotonic_ns()}")
    vendor = fleet.vendor(limit, limit, name=f"vendor-{time.monotonic_ns()}")  # says so: x-ratelimit headers
    yaml = policy(
        vendor.url,
        [Limit(limit * 5, "1s", limit * 5)],
        store=redis.url,
        action="defer",
        access_log=False,
        vendor_extra=["feedback: {headers: auto}"],
    )
    procs = replicas(fleet, yaml, 2)
    seconds = max(floor, 8.0)
    try:
        stats, start = asyncio.run(drive("precise", [p.url for p in procs], 10, seconds, seed=int(limit)))
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = stop(fleet, procs)
        fleet.stop(vendor)
        fleet.stop(redis)
    accepted = sorted(a for a in vstats["arrivals"] if a >= start)
    lo, end = start + 2.0, start + seconds  # learning takes the first answers
    vendor_rate = sum(1 for a in accepted if lo <= a <= end) / (end - lo)
    late = [a for a in vstats["rejections"] if a > start + 1.0]
    done = [w.completed for w in stats]
    return {
        "limit": limit,
        "vendor_rate": vendor_rate,
        "share": vendor_rate / limit,
        "vendor_429": len(vstats["rejections"]),
        "vendor_429_late": len(late),
        "fairness": min(done) / (sum(done) / len(done)) if sum(done) else 0.0,
        "exits": exits,
    }


async def sequential(urls: list[str], count: int) -> list[tuple[int, int]]:
    refused = []
    async with aiohttp.ClientSession() as s:
        for i in range(count):
            async with s.get(f"http://{VENDOR_HOST}/v1/seq/{i}", proxy=urls[i % len(urls)]) as r:
                await r.read()
                if r.status != 200:
                    refused.append((i, r.status))
    return refused


def run_sequential(fleet: Fleet, store: str, count: int) -> dict[str, Any]:
    redis = fleet.redis(name=f"redis-{time.monotonic_ns()}") if store != "memory" else None
    vendor = fleet.vendor(0, name=f"vendor-{time.monotonic_ns()}")
    url = redis.url if redis is not None else "memory://"
    yaml = policy(vendor.url, [Limit(100000, "1s")], store=url, action="defer", vendor_extra=["concurrency: 1"])
    procs = replicas(fleet, yaml, 1 if store == "memory" else int(store[-1]))
    try:
        refused = asyncio.run(sequential([p.url for p in procs], 200))
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = stop(fleet, procs)
        fleet.stop(vendor)
        if redis is not None:
            fleet.stop(redis)
    return {"store": store, "refused": len(refused), "accepted": vstats["accepted"], "exits": exits}


def run_loss(fleet: Fleet, action: str, path: str, how: str) -> dict[str, Any]:
    redis = fleet.redis(name=f"redis-{time.monotonic_ns()}")
    vendor = fleet.vendor(0, name=f"vendor-{time.monotonic_ns()}")  # unlimited: it only counts
    yaml = policy(
        vendor.url,
        [Limit(10, "1s", 10)],
        store=redis.url,
        action=action,
        max_hold="0s" if action == "defer" else "500ms",
        access_log=False,
    )
    procs = replicas(fleet, yaml, 2)
    headers = {"X-Quota-On-Limit": action} if path == "general" else {}
    restarted: list[Any] = []

    async def load() -> float:
        stop_at = time.monotonic() + 5.0

        async def worker(i: int) -> None:
            async with aiohttp.ClientSession() as s:
                while time.monotonic() < stop_at:
                    url = f"http://{VENDOR_HOST}/v1/w{i}"
                    async with s.get(url, proxy=procs[i % 2].url, headers=headers) as r:
                        await r.read()
                        if r.status != 200:
                            hint = int(r.headers.get("retry-after-ms", "50")) / 1000
                            await asyncio.sleep(min(hint, max(stop_at - time.monotonic(), 0.0)))

        async def lose() -> float:
            await asyncio.sleep(2.0)
            at = time.monotonic()
            if how == "flushall":
                import redis as sync_redis

                client = sync_redis.Redis.from_url(redis.url)
                client.flushall()
                client.close()
            else:  # killed and started again, without persistence, on its port
                port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
                await asyncio.to_thread(fleet.stop, redis)
                restarted.append(await asyncio.to_thread(fleet.redis, f"redis-{time.monotonic_ns()}", None, port))
            return at

        lost, *_ = await asyncio.gather(lose(), *(worker(i) for i in range(6)))
        return lost

    try:
        lost_at = asyncio.run(load())
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = stop(fleet, procs)
        fleet.stop(vendor)
        for r in [redis, *restarted]:
            fleet.stop(r)
    after = [a for a in vstats["arrivals"] if a >= lost_at]
    return {
        "action": action,
        "path": path,
        "loss": how,
        "first_quarter": sum(1 for a in after if a < lost_at + 0.25),
        "busiest_second": max_in_window(after, 1.0),
        "after": len(after),
        "exits": exits,
    }


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="bench/quota.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="retriers,learned,sequential,loss", help="which parts (comma-separated)")
    p.add_argument("--kinds", default=",".join(KINDS), help="retriers: worker kinds")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="retriers: rates per second")
    p.add_argument("--bursts", default=",".join(f"{b:g}" for b in BURSTS), help="retriers: bursts")
    p.add_argument("--fleets", default=",".join(map(str, FLEETS)), help="retriers: workers per run")
    p.add_argument("--seconds", type=float, default=8.0, help="the shortest run (longer where rate is low)")
    p.add_argument("--quick", action="store_true", help="retriers: burst 1 and 10 workers only")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    p.add_argument("--tree", type=Path, help="retriers: run the proxies from this checkout (a git worktree)")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    kinds = args.kinds.split(",")
    rates = [float(x) for x in args.rates.split(",")]
    bursts = [1.0] if args.quick else [float(x) for x in args.bursts.split(",")]
    fleets = [10] if args.quick else [int(x) for x in args.fleets.split(",")]
    budget = 600.0
    if "retriers" in parts:
        budget += sum(cell_seconds(r, w, args.seconds) + 15 for r in rates for w in fleets) * len(kinds) * len(bursts)
    watchdog(fleet, budget)
    print(f"bench/quota.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    report: dict[str, Any] = {}
    missed: list[str] = []

    if "retriers" in parts:
        rows, results = [], []
        for kind in kinds:
            for rate in rates:
                for burst in bursts:
                    for workers in fleets:
                        r = run_retriers(fleet, kind, rate, burst, workers, args.seconds, args.tree)
                        results.append(r)
                        bad = retriers_problems(r)
                        missed += [f"retriers {kind} {rate:g}/s burst {burst:g} x{workers}: {b}" for b in bad]
                        rows.append(
                            [
                                kind,
                                f"{rate:g}",
                                f"{burst:g}",
                                workers,
                                f"{r['seconds']:.0f}",
                                f"{r['vendor_rate']:.2f}",
                                f"{r['share'] * 100:.1f}",
                                r["vendor_429_late"],
                                f"{r['deferrals_per_forwarded']:.2f}",
                                f"{r['fairness']:.2f}",
                                r["given_up"],
                                "ok" if not bad else "; ".join(bad),
                            ]
                        )
                        print(f"  {' '.join(map(str, rows[-1]))}", flush=True)
        print("retriers (strict window of rate + burst in any 1 s, 2 replicas, defer):")
        header = [
            "kind",
            "rate",
            "burst",
            "workers",
            "s",
            "vendor/s",
            "% rate",
            "429 late",
            "defer/fwd",
            "min/mean",
            "gave up",
        ]
        header.append("")
        print(table(rows, header))
        report["retriers"] = results

    if "learned" in parts:
        rows, results = [], []
        for limit in (5.0, 20.0, 100.0):
            r = run_learned(fleet, limit, args.seconds)
            results.append(r)
            bad = []
            if r["share"] < TARGET_SHARE:
                bad.append(f"{r['share'] * 100:.1f} % of the vendor's limit")
            if r["vendor_429_late"]:
                bad.append(f"{r['vendor_429_late']} vendor 429s after the first second")
            missed += [f"learned {limit:g}/s: {b}" for b in bad]
            verdict = "ok" if not bad else "; ".join(bad)
            rows.append([f"{limit:g}", f"{r['vendor_rate']:.2f}", f"{r['share'] * 100:.1f}", r["vendor_429"], verdict])
        print("learned limits (vendor says X-RateLimit-Limit, policy 5x above, 10 precise retriers, 2 replicas):")
        print(table(rows, ["vendor limit", "vendor/s", "% limit", "vendor 429", ""]))
        report["learned"] = results

    if "sequential" in parts:
        rows, results = [], []
        for store in ("memory", "redis1", "redis2"):
            r = run_sequential(fleet, store, 200)
            results.append(r)
            if r["refused"]:
                missed.append(f"sequential {store}: {r['refused']} refusals")
            rows.append([store, r["accepted"], r["refused"]])
        print("sequential worker under concurrency: 1, 200 requests:")
        print(table(rows, ["store/replicas", "forwarded", "refused"]))
        report["sequential"] = results

    if "loss" in parts:
        rows, results = [], []
        for action in ("hold", "defer"):
            for path in ("straight", "general"):
                for how in ("flushall", "restart"):
                    r = run_loss(fleet, action, path, how)
                    results.append(r)
                    if r["busiest_second"] > 10 + 1:
                        missed.append(f"loss {action} {path} {how}: {r['busiest_second']} in a second")
                    rows.append([action, path, how, r["first_quarter"], r["busiest_second"], r["after"]])
        print("state loss at 10/s burst 10, 6 precise retriers, 2 replicas (refill of a second: 10):")
        print(table(rows, ["action", "path", "loss", "first 250 ms", "busiest 1 s", "forwarded after"]))
        report["loss"] = results

    dump_json(args.json, report)
    if missed:
        print("targets missed:\n  " + "\n  ".join(missed))
        return 2 if args.strict else 0
    print("targets met")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
