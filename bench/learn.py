#!/usr/bin/env python3
"""Learned limits (SPEC §10, issue 10 item 4): a policy of 100/s against a vendor that really
allows 70/s in any sliding second and says so in its quota headers.

Starts its own redis-server (a free port, never 6379) and a mock vendor (strict sliding
1-s window, ``--quota-headers FAMILY``); the proxy replica runs in this process (its
policy built in Python with ``feedback.headers: auto``), store redis, ``on_limit: hold``.
W workers loop ``GET /v1/ping`` through it for D seconds; on a proxy defer they wait as
told, on a vendor 429 its ``Retry-After``. At ``--raise-at`` seconds the vendor raises its
limit (``POST /__mock/limit``) to ``--raise-to``.

Prints: the vendor-side rate reached against the vendor's limit, when it converged (the
first second from which every 1-s window holds >= 95 % of the vendor's limit, up to the
raise), vendor 429s, learn store calls per request (a few while settling, then ~0), the
busiest 1-s window at the vendor; then after the raise how long the fleet took to follow
(the first 1-s window at >= 95 % of min(raised limit, policy)), the rate after it and the
busiest window (never above the policy's rate + burst).

    python bench/learn.py                              # 60 s, x-ratelimit, raise to 100/s at 40 s
    python bench/learn.py --family ietf --duration 20 --raise-at 12
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import re
import sys
import time
from typing import Any

import aiohttp
from _common import ROOT, BenchError, Fleet, dump_json, http_json, loadavg, run_main, watchdog

if str(ROOT) not in sys.path:  # the checkout's proxy package: the replica runs in this process
    sys.path.insert(0, str(ROOT))

from proxy.app import Runtime
from proxy.policy import parse_policy
from proxy.server import ProxyServer

FAMILIES = ("x-ratelimit", "ietf", "openai", "shopify")
TARGET_SHARE = 0.95
TARGET_CONVERGE = 5.0
TARGET_429 = 3
_VENDOR_READY = re.compile(r"mock-vendor listening on http://([^\s]+)")


def policy_text(vendor_url: str, store: str, rate: float, burst: float) -> str:
    return f"""
version: 1
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
access_log: false
store: {{url: "{store}", timeout: 50ms}}
vendors:
  - name: bench
    hosts: [api.bench.example]
    route: /bench
    upstream: {vendor_url}
    limits: [{{rate: {rate:g}, per: 1s, burst: {burst:g}}}]
    on_limit: {{action: hold, max_hold: 500ms}}
"""


async def worker(url: str, deadline: float, counts: dict[str, int]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while time.monotonic() < deadline:
            pause = 0.0
            try:
                async with session.get(url) as r:
                    await r.read()
                    if r.status == 429 and "X-Quota-Action" in r.headers:
                        counts["deferred"] += 1
                        pause = int(r.headers["X-Quota-Retry-After-Ms"]) / 1000
                    elif r.status == 429:
                        counts["vendor_429_seen"] += 1
                        pause = float(r.headers.get("Retry-After", "1"))
                    elif r.status == 200:
                        counts["ok"] += 1
                    else:
                        counts["other"] += 1
                        pause = 0.01
            except (aiohttp.ClientError, TimeoutError):
                counts["errors"] += 1
                pause = 0.05
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))


def windows(arrivals: list[float], start: float, end: float) -> list[tuple[float, int]]:
    """(second s, arrivals in [s, s + 1)) for every arrival time s in [start, end - 1]."""
    lo, hi = bisect.bisect_left(arrivals, start), bisect.bisect_right(arrivals, end - 1.0)
    return [(arrivals[k], bisect.bisect_left(arrivals, arrivals[k] + 1.0) - k) for k in range(lo, hi)]


def converged_at(arrivals: list[float], start: float, end: float, floor: float) -> float | None:
    """Seconds after ``start`` from which every 1-s window up to ``end`` holds >= ``floor``."""
    ws = windows(arrivals, start, end)
    last_bad = max((s for s, n in ws if n < floor), default=None)
    if last_bad is None:
        return 0.0
    after = [s for s, _ in ws if s > last_bad]
    return None if not after else after[0] - start


def first_reaching(arrivals: list[float], start: float, end: float, floor: float) -> float | None:
    for s, n in windows(arrivals, start, end):
        if n >= floor:
            return s + 1.0 - start  # the window that reached it ends here
    return None


def rate(arrivals: list[float], start: float, end: float) -> float:
    lo, hi = bisect.bisect_left(arrivals, start), bisect.bisect_right(arrivals, end)
    n = hi - lo
    return 0.0 if n < 2 else (n - 1) / (arrivals[hi - 1] - arrivals[lo])


async def drive(args: argparse.Namespace, vendor_url: str, redis_url: str) -> dict[str, Any]:
    policy = parse_policy(
        policy_text(vendor_url, redis_url, args.policy_rate, args.policy_burst), "learn.yaml", base_dir=None
    )
    (v,) = policy.vendors
    v = dataclasses.replace(v, feedback=dataclasses.replace(v.feedback, headers="auto"))
    policy = dataclasses.replace(policy, vendors=(v,))
    server = ProxyServer(Runtime(policy), policy.listen, policy.admin_listen)
    await server.start()
    limiter = server.runtime.limiter
    counts = {"ok": 0, "deferred": 0, "vendor_429_seen": 0, "other": 0, "errors": 0}
    try:
        clock0 = time.monotonic()
        url = server.url + "/bench/v1/ping"
        tasks = [asyncio.ensure_future(worker(url, clock0 + args.duration, counts)) for _ in range(args.workers)]
        await asyncio.sleep(max(clock0 + args.raise_at - time.monotonic(), 0.0))
        learned_rate = limiter.learned_rate(v)
        at_raise = (limiter.learned.calls, limiter.learned.reports)
        async with (
            aiohttp.ClientSession() as s,
            s.post(vendor_url + "/__mock/limit", json={"rate": args.raise_to}) as r,
        ):
            if r.status != 200:
                raise BenchError(f"the vendor refused the limit change: {await r.text()}")
        raised = time.monotonic()
        await asyncio.gather(*tasks)
        after_rate = limiter.learned_rate(v)
        calls = (limiter.learned.calls, limiter.learned.reports)
    finally:
        await server.stop()
    return {
        "start": clock0,
        "raised": raised,
        "counts": counts,
        "learned_rate_before_raise": learned_rate,
        "learned_rate_at_end": after_rate,
        "learn_calls_at_raise": at_raise,
        "learn_calls_at_end": calls,
    }


def run(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    redis = fleet.redis()
    argv = [sys.executable, "-m", "proxy", "mock-vendor", "--listen", "127.0.0.1:0", "--rate", f"{args.vendor_rate:g}"]
    proc = fleet.start("vendor", [*argv, "--window", "1s", "--quota-headers", args.family])
    m = fleet.wait_line(proc, _VENDOR_READY)
    vendor_url = f"http://{m.group(1)}"
    try:
        out = asyncio.run(drive(args, vendor_url, redis.url))
        stats = http_json(vendor_url + "/__mock/stats")
    finally:
        fleet.stop(proc)
        fleet.stop(redis)
    arrivals, rejections = sorted(stats["arrivals"]), sorted(stats["rejections"])
    start, raised = out["start"], out["raised"]
    end = start + args.duration
    followed = min(args.raise_to, args.policy_rate)
    down_windows = windows(arrivals, start, raised)
    up_windows = windows(arrivals, raised, end)
    calls_raise, reports_raise = out["learn_calls_at_raise"]
    calls_end, reports_end = out["learn_calls_at_end"]
    settle = min(5.0, args.raise_at / 2)
    r = {
        "family": args.family,
        "policy": f"{args.policy_rate:g}/s burst {args.policy_burst:g}",
        "vendor_limit": args.vendor_rate,
        "workers": args.workers,
        "rate_reached": round(rate(arrivals, start + settle, raised), 2),
        "share_of_vendor": round(rate(arrivals, start + settle, raised) / args.vendor_rate, 4),
        "converged_after_s": converged_at(arrivals, start, raised, TARGET_SHARE * args.vendor_rate),
        "vendor_429_before_raise": bisect.bisect_left(rejections, raised),
        "busiest_window_before_raise": max((n for _, n in down_windows), default=0),
        "learned_rate_before_raise": out["learned_rate_before_raise"],
        "learn_calls_per_request": round(calls_raise / max(reports_raise, 1), 4),
        "raised_to": args.raise_to,
        "followed_after_s": first_reaching(arrivals, raised, end, TARGET_SHARE * followed),
        "rate_after_raise": round(rate(arrivals, raised + 1.0, end), 2),
        "busiest_window_after_raise": max((n for _, n in up_windows), default=0),
        "vendor_429_after_raise": len(rejections) - bisect.bisect_left(rejections, raised),
        "vendor_429_times_s": [round(t - start, 3) for t in rejections],
        "learned_rate_at_end": out["learned_rate_at_end"],
        "learn_calls_after_raise": calls_end - calls_raise,
        "requests_after_raise": reports_end - reports_raise,
        "workers_saw": out["counts"],
    }
    return r


def report(r: dict[str, Any]) -> None:
    print(
        f"family {r['family']}, policy {r['policy']}, vendor {r['vendor_limit']}/s (strict sliding 1 s), "
        f"{r['workers']} workers, hold"
    )
    conv = r["converged_after_s"]
    print(
        f"  rate reached           {r['rate_reached']:.2f}/s = {r['share_of_vendor'] * 100:.1f} % of the vendor's"
        f" (learned {r['learned_rate_before_raise']})"
    )
    print(f"  converged after        {'never' if conv is None else f'{conv:.2f} s'}")
    print(f"  vendor 429s            {r['vendor_429_before_raise']}")
    print(f"  busiest 1-s window     {r['busiest_window_before_raise']} (vendor limit {r['vendor_limit']})")
    print(f"  learn calls/request    {r['learn_calls_per_request']:.4f}")
    fol = r["followed_after_s"]
    print(f"after the raise to {r['raised_to']:g}/s:")
    print(f"  followed after         {'never' if fol is None else f'{fol:.2f} s'}")
    print(f"  rate after             {r['rate_after_raise']:.2f}/s")
    print(f"  busiest 1-s window     {r['busiest_window_after_raise']}")
    print(f"  vendor 429s            {r['vendor_429_after_raise']}")
    print(f"  (vendor 429s at, s into the run: {r['vendor_429_times_s']})")
    print(f"  learned rate at end    {r['learned_rate_at_end']}")
    print(f"  learn calls            {r['learn_calls_after_raise']} in {r['requests_after_raise']} requests")


def problems(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    out = []
    if r["share_of_vendor"] < TARGET_SHARE:
        out.append(f"rate {r['share_of_vendor'] * 100:.1f} % < 95 % of the vendor's")
    if r["converged_after_s"] is None or r["converged_after_s"] > TARGET_CONVERGE:
        out.append("not converged within 5 s")
    if r["vendor_429_before_raise"] > TARGET_429:
        out.append(f"{r['vendor_429_before_raise']} vendor 429s > {TARGET_429}")
    if r["followed_after_s"] is None or r["followed_after_s"] > 1.0 + 0.5:
        out.append("did not follow the raise within one reset period")
    if r["busiest_window_after_raise"] > args.policy_rate + args.policy_burst:
        out.append("above the policy after the raise")
    return out


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/learn.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--raise-at", type=float, default=40.0, help="seconds into the run (default 40)")
    p.add_argument("--raise-to", type=float, default=100.0, help="the vendor's limit after the raise (default 100)")
    p.add_argument("--vendor-rate", type=int, default=70)
    p.add_argument("--policy-rate", type=float, default=100.0)
    p.add_argument("--policy-burst", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--family", choices=FAMILIES, default="x-ratelimit")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    args = p.parse_args(argv)
    if not 3 <= args.raise_at <= args.duration - 2:
        p.error("--raise-at must leave 3 s before it and 2 s after it")
    watchdog(fleet, args.duration + 60)
    print(f"bench/learn.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    r = run(fleet, args)
    report(r)
    dump_json(args.json, r)
    missed = problems(r, args)
    if missed:
        print("targets missed: " + "; ".join(missed))
        return 2 if args.strict else 0
    print(
        "targets met: >= 95 % of the vendor's limit within 5 s, <= 3 vendor 429s, followed the raise within "
        "one reset period, never above the policy"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
