#!/usr/bin/env python3
"""Sharing one quota (SPEC §13, issue 27): weights, work conservation, priority classes, CPU.

Every scenario runs on fresh processes: its own redis-server (a free port, never 6379),
a mock vendor enforcing a STRICT SLIDING WINDOW (``--vendor-window-limit`` requests in
any 1 s, counted on arrival, 429 beyond; default rate + burst, the most the proxy may
ever let through in 1 s, so any vendor 429 is the proxy's fault) and 2 proxy replicas
sharing the Redis store, ``limits: [{rate: --rate, per: 1s, burst: --burst}]`` (the
"quota", default 100/s burst 20). The vendor (this script's ``_vendor`` role: the mock
vendor of proxy/devtools/mockvendor.py that also logs, per tenant, when each request
arrived) tells tenants apart by the path, ``/v1/<tenant>/ping``: the proxy strips the
tenant header before forwarding. Workers are asyncio + aiohttp clients using a replica
as their HTTP proxy (``proxy=``, as with ``HTTP_PROXY``; round-robin over the
replicas); a proxy refusal (429 with ``X-Quota-Action``) is retried after exactly its
``retry-after-ms`` (the retry hint: the caller's turn under its share; issue 27 says
"workers honouring retry-after-ms"), a vendor 429 after its ``Retry-After``.

  A  weights 1:2:5 (tenants t1, t2, t5; ``share: {weights: {default: 1, t2: 2, t5: 5}}``),
     each tenant demanding 3x the quota (--workers workers per tenant, each paced to at
     most 3 x rate / workers requests a second), in hold mode (max_hold 1s) and in defer
     mode: each tenant's vendor-side rate as % of the quota against its weight's fraction
     of what was used, the deviation in points of the quota (target within 5), the worst
     10-s window (SPEC §13's wording), the quota used (target >= 95 %) and vendor 429s
     after the first second (target 0).
  B  work-conserving: A's three tenants in hold mode, then t1 and t2 stop; how long until
     t5 alone gets >= 95 % of the quota in a 1-s window at the vendor (target <= 1 s).
  C  classes (``classes: [checkout, batch], default_class: batch, min_share: 10%``): a
     checkout tenant sends 20 % of the quota open-loop with ``X-Quota-Priority: checkout``
     while batch floods at 5x, hold mode (max_hold 1s): checkout's wait p50/p99 (target
     <= one token interval + 20 ms), checkout requests deferred (target 0), batch's share
     (target >= min_share) and checkout + batch (target >= 95 % of the quota).
  D  CPU: one replica with ``share:`` and one with the same policy without it, same run,
     interleaved rounds, closed-loop load from bench/_loadgen.py (three tenants), with a
     limit that never binds and with one that binds (hold); median CPU per request of
     each and the ratio (target <= 1.1x).

A and C (and B) also run without ``share:``, first come first served, so the tables show
what ``share`` changes. If this build's policy loader rejects ``share:`` (``python -m
proxy check``), only those baselines run.

    python bench/share.py                       # 60 s per run (~15 min)
    python bench/share.py --seconds 15          # a quick pass
    python bench/share.py --only A,C --no-baseline
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _common import (
    LOOPBACK,
    ROOT,
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    Proc,
    commandstats,
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
    script_calls,
    unclean_exits,
    wait_cpu,
    watchdog,
)
from herd import overruns, window_counts

VENDOR_WINDOW = 1.0  # seconds: the vendor's sliding window
WARMUP = 1.0  # seconds after a run's first vendor arrival left out of its rates
FAIR_WINDOW = 10.0  # SPEC §13: "over any 10-s window"
WEIGHTS = {"t1": 1, "t2": 2, "t5": 5}
DEMAND = 3.0  # A, B: each tenant's demand, x the quota
CHECKOUT_SHARE = 0.20  # C: checkout's open-loop rate, x the quota
BATCH_DEMAND = 5.0  # C: batch's demand, x the quota
MIN_SHARE = 0.10  # C: share.min_share
MAX_HOLD = "1s"
TARGET_DEV_PP = 5.0  # A: |deviation| in points of the quota
TARGET_USED = 0.95  # A, C: vendor-side rate / quota
TARGET_SWITCH_S = 1.0  # B
TARGET_EXTRA_WAIT_S = 0.020  # C: checkout p99 <= 1/rate + this
TARGET_CPU_RATIO = 1.10  # D
HUGE = 1_000_000_000
D_TENANTS = ("t1", "t2", "t5")
HINT_HEADERS = ("retry-after-ms", "X-Quota-Retry-After-Ms", "Retry-After")
HINTS = list(HINT_HEADERS)  # the workers' order of preference; --hint-header puts one first

_VENDOR_READY = re.compile(r"mock-vendor listening on http://([^\s]+)")

SHARE_WEIGHTS = ["share:", "  weights: {default: 1, t2: 2, t5: 5}"]
SHARE_CLASSES = ["share:", "  classes: [checkout, batch]", "  default_class: batch", f"  min_share: {MIN_SHARE:.0%}"]
SHARE_BOTH = [*SHARE_WEIGHTS, *SHARE_CLASSES[1:]]


def target_url(tenant: str) -> str:
    return f"http://{VENDOR_HOST}/v1/{tenant}/ping"


# -- the vendor: MockVendor plus a per-tenant log (a child process: ``share.py _vendor``) ------


def serve_vendor(argv: list[str]) -> int:
    """``share.py _vendor --rate R --window W``: the mock vendor (strict sliding window) that
    also records, per tenant (``/v1/<tenant>/...``), the arrival time of every request it
    accepted and refused: ``GET /__share/log``; ``POST /__share/reset`` clears it and the
    vendor (``/__mock/reset``)."""
    from aiohttp import web

    from proxy.devtools.mockvendor import MockVendor
    from proxy.devtools.mockvendor_serve import serve

    p = argparse.ArgumentParser(prog="bench/share.py _vendor")
    p.add_argument("--listen", default=f"{LOOPBACK}:0")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--window", type=float, default=VENDOR_WINDOW)
    args = p.parse_args(argv)

    class TenantVendor(MockVendor):
        def __init__(self) -> None:
            super().__init__(args.rate, window=args.window)
            self.ok: dict[str, list[float]] = {}
            self.refused: dict[str, list[float]] = {}

        async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
            path = request.path
            if path == "/__share/log":
                return web.json_response({"accepted": self.ok, "rejected": self.refused})
            if path == "/__share/reset":
                self.ok.clear()
                self.refused.clear()
                self.reset()
                return web.json_response({"ok": True})
            if path.startswith("/__"):
                return await super().handle(request)
            parts = path.split("/")
            tenant = parts[2] if len(parts) > 3 else "?"
            accepted, rejected = self.accepted, self.rejected
            # A plain GET is answered without suspending: the counters moved for this request only.
            response = await super().handle(request)
            if self.accepted > accepted:
                self.ok.setdefault(tenant, []).append(self.arrivals[-1])
            elif self.rejected > rejected:
                self.refused.setdefault(tenant, []).append(self.rejections[-1])
            return response

    host, _, port = args.listen.rpartition(":")
    return serve(TenantVendor(), host, int(port))


def start_vendor(fleet: Fleet, limit: int, cpus: str | None = None) -> Proc:
    argv = [sys.executable, str(Path(__file__).resolve()), "_vendor", "--rate", f"{limit / VENDOR_WINDOW:g}"]
    argv += ["--window", f"{VENDOR_WINDOW:g}"]
    proc = fleet.start("vendor", argv, cpus=cpus)
    proc.url = "http://" + fleet.wait_line(proc, _VENDOR_READY).group(1)
    return proc


# -- workers ---------------------------------------------------------------------------------


@dataclass
class Tally:
    """What one tenant's workers saw. ``latencies``: (job start, seconds from the job's first
    send to its 200, retries included) per completed job."""

    ok: int = 0
    deferred: int = 0
    vendor_429: int = 0
    errors: int = 0
    abandoned: int = 0
    other: Counter[str] = field(default_factory=Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)
    hints_ms: list[float] = field(default_factory=list)
    defer_times: list[float] = field(default_factory=list)


def hint_seconds(headers: Mapping[str, str]) -> float:
    for name in HINTS:
        raw = headers.get(name)
        if raw is not None:
            with contextlib.suppress(ValueError):
                return max(float(raw) * (1.0 if name == "Retry-After" else 1e-3), 0.0)
    return 1.0


async def job(
    session: aiohttp.ClientSession, proxy: str, tenant: str, extra: Mapping[str, str], tally: Tally, deadline: float
) -> None:
    """One call, retried until it is answered 200 (abandoned if the next try would be past ``deadline``)."""
    url = target_url(tenant)
    headers = {"X-Tenant-Id": tenant, **extra}
    t0 = time.monotonic()
    while True:
        pause = 0.05
        try:
            async with session.get(url, proxy=proxy, headers=headers) as resp:
                await resp.read()
                status, answer = resp.status, resp.headers
        except (aiohttp.ClientError, TimeoutError):
            tally.errors += 1
            status, answer = 0, None
        if status == 200:
            tally.ok += 1
            tally.latencies.append((t0, time.monotonic() - t0))
            return
        if answer is not None and status == 429 and answer.get("X-Quota-Action"):
            tally.deferred += 1
            tally.defer_times.append(time.monotonic())
            pause = hint_seconds(answer)
            tally.hints_ms.append(pause * 1000.0)
            reason = answer.get("X-Quota-Reason")
            if reason:
                tally.other[f"429 {reason}"] += 1
        elif answer is not None and status == 429:  # the vendor's own
            tally.vendor_429 += 1
            pause = hint_seconds(answer)
        elif status:
            tally.other[str(status)] += 1
        if time.monotonic() + pause >= deadline:
            tally.abandoned += 1
            return
        await asyncio.sleep(pause)


async def closed_worker(
    session: aiohttp.ClientSession,
    proxy: str,
    tenant: str,
    extra: Mapping[str, str],
    interval: float,
    first: float,
    stop: float,
    tally: Tally,
) -> None:
    """Calls one after the other, at most one every ``interval`` s (no credit for lost time:
    a worker held back by the proxy goes again at once, not in a burst), until ``stop``."""
    due = first
    while True:
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        if time.monotonic() >= stop:
            return
        await job(session, proxy, tenant, extra, tally, stop)
        due = max(due + interval, time.monotonic())


async def open_loop(
    session: aiohttp.ClientSession,
    proxies: Sequence[str],
    tenant: str,
    extra: Mapping[str, str],
    rate: float,
    start: float,
    stop: float,
    tally: Tally,
) -> None:
    """Call i starts at ``start + i / rate`` whatever happened to the earlier ones."""
    tasks: set[asyncio.Future[None]] = set()
    i = 0
    while True:
        due = start + i / rate
        if due >= stop:
            break
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        task = asyncio.ensure_future(job(session, proxies[i % len(proxies)], tenant, extra, tally, stop))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.wait(tasks, timeout=15)


@dataclass
class Group:
    """One tenant's load: ``workers`` closed-loop workers paced to ``demand`` calls a second in
    all, or (``workers == 0``) an open loop at ``demand`` calls a second; from ``start`` to
    ``stop`` seconds into the run."""

    tenant: str
    demand: float
    workers: int
    stop: float
    extra: dict[str, str] = field(default_factory=dict)
    start: float = 0.0


async def drive(proxies: Sequence[str], groups: Sequence[Group], seconds: float) -> tuple[dict[str, Tally], float]:
    tallies = {g.tenant: Tally() for g in groups}
    timeout = aiohttp.ClientTimeout(total=15)
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(g.workers, 16) + 8), timeout=timeout)
        for g in groups
    ]
    t0 = time.monotonic()
    tasks: list[asyncio.Future[None]] = []
    try:
        for g, session in zip(groups, sessions, strict=True):
            begin, end = t0 + g.start, t0 + g.stop
            if g.workers == 0:
                tasks.append(
                    asyncio.ensure_future(
                        open_loop(session, proxies, g.tenant, g.extra, g.demand, begin, end, tallies[g.tenant])
                    )
                )
                continue
            interval = g.workers / g.demand
            for i in range(g.workers):
                first = begin + interval * i / g.workers  # spread the first calls over one interval
                proxy = proxies[i % len(proxies)]
                tasks.append(
                    asyncio.ensure_future(
                        closed_worker(session, proxy, g.tenant, g.extra, interval, first, end, tallies[g.tenant])
                    )
                )
        done, pending = await asyncio.wait(tasks, timeout=seconds + 30)
        if pending:
            raise BenchError(f"{len(pending)} workers did not finish within the run's time + 30 s")
        for t in done:
            t.result()  # a worker's crash is the run's
    finally:
        for t in tasks:
            t.cancel()
        for s in sessions:
            await s.close()
    return tallies, t0


async def idle_latency(proxies: Sequence[str], probe: Group, calls: int = 20, gap: float = 0.05) -> list[float]:
    """``calls`` of ``probe``'s tenant one at a time, ``gap`` s apart (well inside the quota, so
    nothing waits for a token), through the replicas in turn: sorted latencies, seconds."""
    tally = Tally()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        for i in range(calls):
            await job(session, proxies[i % len(proxies)], probe.tenant, probe.extra, tally, time.monotonic() + 10)
            await asyncio.sleep(gap)
    await asyncio.sleep(0.5)  # the bucket refills before the load
    return sorted(lat for _, lat in tally.latencies[calls // 2 :])  # the first half warms the pools


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- one run: fresh Redis, vendor and replicas ----------------------------------------------


@dataclass
class Run:
    """What a run measured: the vendor's per-tenant logs (seconds on this script's clock),
    the workers' tallies, the replicas' outcome deltas and exit codes."""

    start: float
    seconds: float
    accepted: dict[str, list[float]]
    rejected: dict[str, list[float]]
    tallies: dict[str, Tally]
    outcomes: dict[str, float]
    class_counts: dict[str, float]
    exits: list[int | None]
    window_max: int | None
    idle: list[float] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.seconds

    def first_arrival(self) -> float:
        firsts = [v[0] for v in self.accepted.values() if v]
        if not firsts:
            raise BenchError("the vendor accepted nothing: nothing got through")
        return min(firsts)

    def count(self, tenant: str, lo: float, hi: float) -> int:
        times = self.accepted.get(tenant, [])
        return bisect.bisect_left(times, hi) - bisect.bisect_left(times, lo)

    def vendor_429(self, after: float = -math.inf) -> int:
        return sum(1 for v in self.rejected.values() for t in v if t >= after)


def class_counts(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """ratelimit_class_requests_total by "class outcome" (SPEC §13; absent before the feature)."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "ratelimit_class_requests_total":
            key = f"{labels.get('class', '?')} {labels.get('outcome', '?')}"
            out[key] = out.get(key, 0.0) + value
    return out


def run_once(
    fleet: Fleet,
    args: argparse.Namespace,
    *,
    action: str,
    share: list[str] | None,
    groups: Sequence[Group],
    seconds: float,
    probe: Group | None = None,
) -> Run:
    """``probe``: before the load, that tenant's calls one at a time through the idle proxy
    (the hop's own latency, ``Run.idle``)."""
    redis = fleet.redis()
    vendor = start_vendor(fleet, args.vendor_window_limit)
    yaml = policy(
        vendor.url,
        [Limit(args.rate, "1s", args.burst)],
        store=redis.url,
        store_timeout=args.store_timeout,
        action=action,
        max_hold=MAX_HOLD,
        vendor_extra=share or (),
    )
    procs: list[Proc] = []
    try:
        procs = [fleet.proxy(yaml, name=f"proxy{i}") for i in range(args.replicas)]
        idle = run_async(idle_latency([p.url for p in procs], probe)) if probe is not None else []
        http_json(vendor.url + "/__share/reset", "POST")
        before = [fetch_metrics(p.admin_url) for p in procs]
        tallies, start = run_async(drive([p.url for p in procs], groups, seconds))
        after = [fetch_metrics(p.admin_url) for p in procs]
        log = http_json(vendor.url + "/__share/log")
        vstats = http_json(vendor.url + "/__mock/stats")
    finally:
        exits = [fleet.stop(p) for p in procs]
        fleet.stop(vendor)
        fleet.stop(redis)
    total: dict[str, float] = {}
    classes: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for k, v in outcome_delta(outcomes(b), outcomes(a)).items():
            total[k] = total.get(k, 0.0) + v
        cb, ca = class_counts(b), class_counts(a)
        for k in ca:
            classes[k] = classes.get(k, 0.0) + ca[k] - cb.get(k, 0.0)
    return Run(
        start=start,
        seconds=seconds,
        accepted={k: sorted(v) for k, v in log["accepted"].items()},
        rejected={k: sorted(v) for k, v in log["rejected"].items()},
        tallies=tallies,
        outcomes={k: v for k, v in total.items() if v},
        class_counts={k: v for k, v in classes.items() if v},
        exits=exits,
        window_max=vstats.get("window_max"),
        idle=idle,
    )


def overrun_windows(run: Run, limit: int) -> list[dict[str, Any]]:
    """herd.py's overrun episodes (a 1-s window at the vendor holding more than ``limit``
    arrivals, refused ones included), each with the tenants of its fullest window."""
    arrived = sorted(t for v in (*run.accepted.values(), *run.rejected.values()) for t in v)
    refused = sorted(t for v in run.rejected.values() for t in v)
    counts = window_counts(arrived, VENDOR_WINDOW)
    episodes = overruns(arrived, counts, refused, limit, run.start)
    for ep in episodes:
        lo, hi = run.start + ep["from_s"], run.start + ep["to_s"]
        fullest = max((i for i, t in enumerate(arrived) if lo <= t < hi), key=counts.__getitem__, default=None)
        if fullest is not None:
            w0 = arrived[fullest]
            ep["fullest_at_s"] = round(w0 - run.start, 3)
            ep["fullest_by_tenant"] = {
                t: run.count(t, w0, w0 + VENDOR_WINDOW)
                + sum(1 for x in run.rejected.get(t, []) if w0 <= x < w0 + VENDOR_WINDOW)
                for t in sorted(set(run.accepted) | set(run.rejected))
            }
    return episodes


def common_figures(run: Run, quota: float, limit: int) -> dict[str, Any]:
    first = run.first_arrival()
    forwarded = run.outcomes.get("forwarded", 0.0) + run.outcomes.get("held", 0.0)
    return {
        "vendor_429": run.vendor_429(),
        "vendor_429_after_1s": run.vendor_429(first + 1.0),
        "vendor_window_max": run.window_max,
        "vendor_limit": limit,
        "vendor_per_second": [
            sum(run.count(t, run.start + i, run.start + i + 1) for t in run.accepted) for i in range(int(run.seconds))
        ],
        "vendor_overruns": overrun_windows(run, limit),
        "proxy_outcomes": {k: int(v) for k, v in sorted(run.outcomes.items())},
        "defers_per_forwarded": run.outcomes.get("deferred", 0.0) / forwarded if forwarded else None,
        "class_requests": {k: int(v) for k, v in sorted(run.class_counts.items())},
        "worker": {
            t: {
                "ok": x.ok,
                "deferred": x.deferred,
                "deferred_from_2s": sum(1 for t in x.defer_times if t >= run.start + 2.0),
                "vendor_429": x.vendor_429,
                "errors": x.errors,
                "abandoned": x.abandoned,
                "other": dict(x.other),
                "hint_ms": {f"p{q}": round(percentile(sorted(x.hints_ms), q), 1) for q in (10, 50, 90)}
                if x.hints_ms
                else {},
            }
            for t, x in run.tallies.items()
        },
        "replica_exits": run.exits,
        "quota": quota,
    }


# -- A: weights ------------------------------------------------------------------------------


def scenario_a(fleet: Fleet, args: argparse.Namespace, action: str, share: bool) -> dict[str, Any]:
    q = args.rate
    groups = [Group(t, DEMAND * q, args.workers, args.seconds) for t in WEIGHTS]
    run = run_once(
        fleet, args, action=action, share=SHARE_WEIGHTS if share else None, groups=groups, seconds=args.seconds
    )
    lo, hi = run.first_arrival() + WARMUP, run.end
    span = hi - lo
    if span < 2.0:
        raise BenchError("run too short to measure (use --seconds >= 5)")
    w_total = sum(WEIGHTS.values())
    counts = {t: run.count(t, lo, hi) for t in WEIGHTS}
    used = sum(counts.values()) / span / q
    tenants = {}
    for t, w in WEIGHTS.items():
        pct = counts[t] / span / q * 100
        target = w / w_total * used * 100
        tenants[t] = {
            "pct_of_quota": round(pct, 2),
            "target_pct_of_quota": round(target, 2),
            "deviation_pp": round(pct - target, 2),
            "fraction_of_accepted": round(counts[t] / max(sum(counts.values()), 1), 4),
            "target_fraction": w / w_total,
        }
    # SPEC §13: every 10-s window (1-s steps) within the measured span
    worst = None
    s = lo
    while s + FAIR_WINDOW <= hi + 1e-9:
        n = {t: run.count(t, s, s + FAIR_WINDOW) for t in WEIGHTS}
        all_n = sum(n.values())
        for t, w in WEIGHTS.items():
            dev = (n[t] - w / w_total * all_n) / (FAIR_WINDOW * q) * 100
            if worst is None or abs(dev) > abs(worst[0]):
                worst = (dev, t, s - run.start)
        s += 1.0
    return {
        "scenario": "A",
        "action": action,
        "share": share,
        "seconds": args.seconds,
        "tenants": tenants,
        "used": round(used, 4),
        "worst_10s": None
        if worst is None
        else {"deviation_pp": round(worst[0], 2), "tenant": worst[1], "at_s": worst[2]},
        **common_figures(run, q, args.vendor_window_limit),
    }


# -- B: work-conserving ----------------------------------------------------------------------


def scenario_b(fleet: Fleet, args: argparse.Namespace, share: bool) -> dict[str, Any]:
    q = args.rate
    both = max(args.seconds / 2, 4.0)
    alone = max(args.seconds - both, 4.0)
    seconds = both + alone
    groups = [Group(t, DEMAND * q, args.workers, seconds if t == "t5" else both) for t in WEIGHTS]
    run = run_once(fleet, args, action="hold", share=SHARE_WEIGHTS if share else None, groups=groups, seconds=seconds)
    stop = run.start + both
    need = math.ceil(TARGET_USED * q * VENDOR_WINDOW)
    switch = None
    s = stop
    while s + VENDOR_WINDOW <= run.end:
        if run.count("t5", s, s + VENDOR_WINDOW) >= need:
            switch = s - stop
            break
        s += 0.010
    others_last = max((v[-1] for t, v in run.accepted.items() if t != "t5" and v), default=None)
    # once t1 and t2 have nothing waiting any more (their last held call has left)
    t5_after_others = (
        run.count("t5", others_last, others_last + VENDOR_WINDOW) / (VENDOR_WINDOW * q)
        if others_last is not None and others_last + VENDOR_WINDOW <= run.end
        else None
    )
    lo = run.first_arrival() + WARMUP
    before_rate = run.count("t5", lo, stop) / max(stop - lo, 1e-9)
    after_rate = run.count("t5", stop + 1.0, run.end) / max(run.end - stop - 1.0, 1e-9)
    bins = [
        run.count("t5", stop + k * 0.1, stop + (k + 1) * 0.1)
        for k in range(-5, int(min(alone, 3.0) * 10))
        if stop + (k + 1) * 0.1 <= run.end
    ]
    return {
        "scenario": "B",
        "action": "hold",
        "share": share,
        "seconds_all_three": both,
        "seconds_t5_alone": alone,
        "switch_s": None if switch is None else round(switch, 3),
        "others_last_arrival_after_stop_s": None if others_last is None else round(others_last - stop, 3),
        "t5_pct_in_1s_after_others_last": None if t5_after_others is None else round(t5_after_others * 100, 2),
        "t5_pct_before_stop": round(before_rate / q * 100, 2),
        "t5_pct_after_first_second_alone": round(after_rate / q * 100, 2),
        "t5_per_100ms_from_0_5s_before_stop": bins,
        **common_figures(run, q, args.vendor_window_limit),
    }


# -- C: classes ------------------------------------------------------------------------------


def scenario_c(fleet: Fleet, args: argparse.Namespace, share: bool) -> dict[str, Any]:
    q = args.rate
    batch_workers = max(1, round(args.workers * BATCH_DEMAND / DEMAND))
    groups = [
        Group("checkout", CHECKOUT_SHARE * q, 0, args.seconds, {"X-Quota-Priority": "checkout"}),
        Group("batch", BATCH_DEMAND * q, batch_workers, args.seconds),
    ]
    run = run_once(
        fleet,
        args,
        action="hold",
        share=SHARE_CLASSES if share else None,
        groups=groups,
        seconds=args.seconds,
        probe=groups[0],
    )
    first = run.first_arrival()
    lo, hi = first + WARMUP, run.end
    span = hi - lo
    checkout = run.tallies["checkout"]
    waits = sorted(lat for t0, lat in checkout.latencies if t0 >= run.start + WARMUP)
    interval = 1.0 / q
    batch = run.count("batch", lo, hi) / span / q
    co = run.count("checkout", lo, hi) / span / q
    return {
        "scenario": "C",
        "action": "hold",
        "share": share,
        "seconds": args.seconds,
        "batch_workers": batch_workers,
        "token_interval_ms": round(interval * 1000, 2),
        "target_wait_ms": round((interval + TARGET_EXTRA_WAIT_S) * 1000, 2),
        "checkout_wait_ms": {
            "p50": round(percentile(waits, 50) * 1000, 2) if waits else None,
            "p99": round(percentile(waits, 99) * 1000, 2) if waits else None,
            "max": round(waits[-1] * 1000, 2) if waits else None,
            "n": len(waits),
        },
        "checkout_idle_ms": {
            "p50": round(percentile(run.idle, 50) * 1000, 2) if run.idle else None,
            "max": round(run.idle[-1] * 1000, 2) if run.idle else None,
        },
        "checkout_deferred": checkout.deferred,
        "checkout_pct_of_quota": round(co * 100, 2),
        "batch_pct_of_quota": round(batch * 100, 2),
        "used": round(co + batch, 4),
        **common_figures(run, q, args.vendor_window_limit),
    }


# -- D: CPU per request ------------------------------------------------------------------------


def loadgens(fleet: Fleet, proxy: Proc, connections: int, seconds: float, cpus: str | None) -> tuple[int, int, int]:
    """Closed-loop load on ``proxy`` from one bench/_loadgen.py per tenant of ``D_TENANTS``:
    (requests answered, of them non-2xx, socket errors)."""
    procs = []
    for t in D_TENANTS:
        argv = [sys.executable, str(ROOT / "bench" / "_loadgen.py"), "--connect", proxy.url.removeprefix("http://")]
        argv += ["--target", target_url(t), "--connections", str(connections), "--duration", f"{seconds:g}"]
        argv += ["--header", f"X-Tenant-Id: {t}"]
        procs.append(fleet.start(f"loadgen-{t}", argv, cpus=cpus))
    done = non2xx = errors = 0
    try:
        for p in procs:
            wait_cpu(p, seconds + 20)
            if p.popen.returncode != 0:
                raise BenchError(f"the load generator exited {p.popen.returncode}:\n{p.tail()}")
            try:
                out = json.loads(p.stdout.read_text().strip().splitlines()[-1])
            except (ValueError, IndexError):
                raise BenchError(f"cannot read the load generator's output:\n{p.tail()}") from None
            done += int(out["requests"])
            non2xx += int(out["non2xx"])
            errors += int(out["errors"])
    finally:
        for p in procs:
            fleet.stop(p)
    return done, non2xx, errors


def scenario_d(fleet: Fleet, args: argparse.Namespace, share_ok: bool) -> dict[str, Any]:
    pin = not args.no_pin
    proxy_cpu, load_cpu = ("1", "0") if pin else (None, None)
    redis = fleet.redis(cpus=load_cpu)
    vendor = fleet.vendor(0, cpus=load_cpu)  # unlimited
    loads = {"free": Limit(HUGE, "1s", HUGE), "binding": Limit(args.d_rate, "1s", max(args.d_rate / 10, 1))}
    variants = ["share", "plain"] if share_ok else ["plain"]
    procs: dict[tuple[str, str], Proc] = {}
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        db = 0
        for load, limit in loads.items():
            for variant in variants:
                db += 1
                yaml = policy(
                    vendor.url,
                    [limit],
                    store=redis.url.rsplit("/", 1)[0] + f"/{db}",  # own keys per proxy
                    store_timeout=args.store_timeout,
                    action="hold",
                    max_hold=MAX_HOLD,
                    vendor_extra=SHARE_BOTH if variant == "share" else (),
                )
                proc = fleet.proxy(yaml, name=f"proxy-{load}-{variant}", cpus=proxy_cpu)
                procs[load, variant] = proc
                samples[load, variant] = []
                loadgens(fleet, proc, args.d_connections, 1.0, load_cpu)  # warm-up
        for r in range(args.d_rounds):
            order = list(procs)
            if r % 2:
                order.reverse()
            for key in order:
                proc = procs[key]
                cmd0 = commandstats(redis.url)
                cpu0 = cpu_seconds(proc.pid)
                t0 = time.monotonic()
                done, non2xx, errors = loadgens(fleet, proc, args.d_connections, args.d_seconds, load_cpu)
                cpu = cpu_seconds(proc.pid) - cpu0
                wall = time.monotonic() - t0
                scripts, delta = script_calls(cmd0, commandstats(redis.url))
                calls = sum(v for k, v in delta.items() if k not in ("info", "hello"))
                if done == 0:
                    raise BenchError(f"D {key}: no request answered\n{proc.tail()}")
                samples[key].append(
                    {
                        "cpu_us_per_request": cpu / done * 1e6,
                        "rps": done / args.d_seconds,
                        "proxy_core": cpu / wall,
                        "non2xx": non2xx,
                        "errors": errors,
                        "scripts_per_request": scripts / done,
                        "redis_calls_per_request": calls / done,
                        "redis_commands": {k: round(v / done, 3) for k, v in sorted(delta.items())},
                    }
                )
    finally:
        exits = {f"{k[0]}/{k[1]}": fleet.stop(p) for k, p in procs.items()}
        fleet.stop(vendor)
        fleet.stop(redis)
    out: dict[str, Any] = {"scenario": "D", "pinned": pin, "rounds": args.d_rounds, "seconds": args.d_seconds}
    for load, limit in loads.items():
        label = "never binds" if limit.rate >= HUGE else f"{limit.rate:g}/s burst {limit.burst:g}, hold"
        row: dict[str, Any] = {"limit": limit.yaml(), "label": label}
        for variant in variants:
            rounds = samples[load, variant]
            row[variant] = {
                "cpu_us_per_request": round(statistics.median(s["cpu_us_per_request"] for s in rounds), 1),
                "rps": round(statistics.median(s["rps"] for s in rounds), 1),
                "proxy_core": round(statistics.median(s["proxy_core"] for s in rounds), 3),
                "non2xx": sum(int(s["non2xx"]) for s in rounds),
                "scripts_per_request": round(statistics.median(s["scripts_per_request"] for s in rounds), 3),
                "redis_calls_per_request": round(statistics.median(s["redis_calls_per_request"] for s in rounds), 3),
                "errors": sum(int(s["errors"]) for s in rounds),
                "rounds_cpu_us": [round(s["cpu_us_per_request"], 1) for s in rounds],
                "redis_commands_per_request_last_round": rounds[-1]["redis_commands"],
            }
        if "share" in row:
            row["ratio"] = round(row["share"]["cpu_us_per_request"] / row["plain"]["cpu_us_per_request"], 3)
            # each round's share/plain, measured minutes apart at most: the noise of the box cancels more
            paired = [
                a["cpu_us_per_request"] / b["cpu_us_per_request"]
                for a, b in zip(samples[load, "share"], samples[load, "plain"], strict=True)
            ]
            row["ratio_paired_median"] = round(statistics.median(paired), 3)
        out[load] = row
    out["replica_exits"] = exits
    return out


# -- the tables ------------------------------------------------------------------------------


def ltable(rows: list[list[str]], header: list[str]) -> str:
    """``table`` with the first column (the row names) aligned left."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def _f(x: float | None, fmt: str = "{:.1f}", unit: str = "") -> str:
    return "-" if x is None else fmt.format(x) + unit


def _by(results: list[dict[str, Any]], scenario: str, share: bool, action: str | None = None) -> dict[str, Any] | None:
    for r in results:
        if r["scenario"] == scenario and r["share"] == share and (action is None or r["action"] == action):
            return r
    return None


def _vendor_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """The rows every scenario's table ends with: what the vendor refused and its fullest 1 s."""
    return [
        ["vendor 429 after 1st s (all)", "0", *(f"{r['vendor_429_after_1s']} ({r['vendor_429']})" for r in runs)],
        [
            "most in any 1 s at the vendor",
            f"<= {runs[0]['vendor_limit']}",
            *(str(r["vendor_window_max"]) for r in runs),
        ],
    ]


def table_a(results: list[dict[str, Any]]) -> str | None:
    found = [(a, s, _by(results, "A", s, a)) for a in ("hold", "defer") for s in (True, False)]
    cols = [(a, s) for a, s, r in found if r is not None]
    runs = [r for _, _, r in found if r is not None]
    if not runs:
        return None
    header = ["A: weights 1:2:5, demand 3x each", "target", *(f"{a} {'share' if s else 'FCFS'}" for a, s in cols)]
    rows = []
    w_total = sum(WEIGHTS.values())
    for t, w in WEIGHTS.items():
        cells = []
        for r in runs:
            x = r["tenants"][t]
            cells.append(f"{x['pct_of_quota']:.1f} % ({x['deviation_pp']:+.1f} pp)")
        rows.append(
            [f"{t} (weight {w}): % of quota (dev.)", f"{w / w_total * 100:.1f} % ±{TARGET_DEV_PP:g} pp", *cells]
        )
    rows.append(
        [
            "worst 10-s window dev. (tenant)",
            f"±{TARGET_DEV_PP:g} pp",
            *(
                "-"
                if r["worst_10s"] is None
                else f"{r['worst_10s']['deviation_pp']:+.1f} pp ({r['worst_10s']['tenant']})"
                for r in runs
            ),
        ]
    )
    rows.append(["quota used", f">= {TARGET_USED:.0%}", *(f"{r['used'] * 100:.1f} %" for r in runs)])
    rows += _vendor_rows(runs)
    rows.append(["proxy defers / forwarded", "", *(_f(r["defers_per_forwarded"], "{:.2f}") for r in runs)])
    return ltable(rows, header)


def table_b(results: list[dict[str, Any]]) -> str | None:
    found = [(s, _by(results, "B", s)) for s in (True, False)]
    runs = [(s, r) for s, r in found if r is not None]
    if not runs:
        return None
    header = ["B: t1, t2 stop; t5 alone (hold)", "target", *("share" if s else "FCFS" for s, _ in runs)]
    rows = [
        [
            "until t5 >= 95 % of quota in a 1-s window",
            f"<= {TARGET_SWITCH_S:g} s",
            *(_f(r["switch_s"], "{:.2f}", " s") if r["switch_s"] is not None else "never" for _, r in runs),
        ],
        ["t5 before the stop", "62.5 % (share)", *(f"{r['t5_pct_before_stop']:.1f} %" for _, r in runs)],
        [
            "t5 alone, from 1 s after the stop",
            f">= {TARGET_USED:.0%}",
            *(f"{r['t5_pct_after_first_second_alone']:.1f} %" for _, r in runs),
        ],
        [
            "t1/t2's last (held) call reached the vendor",
            "",
            *(_f(r["others_last_arrival_after_stop_s"], "{:.2f}", " s after the stop") for _, r in runs),
        ],
        [
            "t5 in the 1 s after that",
            f">= {TARGET_USED:.0%}",
            *(_f(r["t5_pct_in_1s_after_others_last"], "{:.1f}", " %") for _, r in runs),
        ],
        *_vendor_rows([r for _, r in runs]),
    ]
    return ltable(rows, header)


def table_c(results: list[dict[str, Any]]) -> str | None:
    found = [(s, _by(results, "C", s)) for s in (True, False)]
    runs = [(s, r) for s, r in found if r is not None]
    if not runs:
        return None
    r0 = runs[0][1]
    header = ["C: checkout 20 % vs batch 5x (hold)", "target", *("share" if s else "FCFS" for s, _ in runs)]
    rows = [
        [
            f"checkout wait p50 / p99 (token interval {r0['token_interval_ms']:g} ms)",
            f"<= {r0['target_wait_ms']:g} ms",
            *(f"{_f(r['checkout_wait_ms']['p50'])} / {_f(r['checkout_wait_ms']['p99'])} ms" for _, r in runs),
        ],
        ["checkout wait max", "", *(f"{_f(r['checkout_wait_ms']['max'])} ms" for _, r in runs)],
        [
            "checkout alone through the idle proxy p50 / max",
            "",
            *(f"{_f(r['checkout_idle_ms']['p50'])} / {_f(r['checkout_idle_ms']['max'])} ms" for _, r in runs),
        ],
        ["checkout requests deferred", "0", *(str(r["checkout_deferred"]) for _, r in runs)],
        ["checkout: % of quota", f"{CHECKOUT_SHARE:.0%}", *(f"{r['checkout_pct_of_quota']:.1f} %" for _, r in runs)],
        ["batch: % of quota", f">= {MIN_SHARE:.0%}", *(f"{r['batch_pct_of_quota']:.1f} %" for _, r in runs)],
        ["checkout + batch", f">= {TARGET_USED:.0%}", *(f"{r['used'] * 100:.1f} %" for _, r in runs)],
        *_vendor_rows([r for _, r in runs]),
    ]
    return ltable(rows, header)


def table_d(results: list[dict[str, Any]]) -> str | None:
    r = next((x for x in results if x["scenario"] == "D"), None)
    if r is None:
        return None
    header = [
        "D: proxy CPU per request (medians)",
        "share µs/req",
        "plain µs/req",
        f"share/plain (per round) <= {TARGET_CPU_RATIO:g}",
        "req/s share/plain",
        "non-2xx share/plain",
        "EVALSHA/req (Redis commands/req) share / plain",
    ]
    rows = []
    for load in ("free", "binding"):
        x = r[load]
        share = x.get("share")
        rows.append(
            [
                f"{load}: {x['label']}",
                f"{share['cpu_us_per_request']:.0f}" if share else "-",
                f"{x['plain']['cpu_us_per_request']:.0f}",
                f"{x['ratio']:.3f} ({x['ratio_paired_median']:.3f})" if "ratio" in x else "-",
                f"{share['rps']:.0f} / {x['plain']['rps']:.0f}" if share else f"- / {x['plain']['rps']:.0f}",
                f"{share['non2xx']} / {x['plain']['non2xx']}" if share else f"- / {x['plain']['non2xx']}",
                " / ".join(
                    f"{v['scripts_per_request']:.2f} ({v['redis_calls_per_request']:.1f})" if v else "-"
                    for v in (share, x["plain"])
                ),
            ]
        )
    return ltable(rows, header)


def progress(r: dict[str, Any]) -> str:
    name = f"{r['scenario']} {r.get('action', '')} {'share' if r.get('share') else 'FCFS'}".replace("  ", " ")
    if r["scenario"] == "A":
        parts = ", ".join(f"{t} {x['pct_of_quota']:.1f} %" for t, x in r["tenants"].items())
        return f"{name}: {parts}; used {r['used'] * 100:.1f} %; vendor 429 {r['vendor_429']}"
    if r["scenario"] == "B":
        return f"{name}: t5 >= 95 % after {r['switch_s']} s; vendor 429 {r['vendor_429']}"
    if r["scenario"] == "C":
        w = r["checkout_wait_ms"]
        return (
            f"{name}: checkout p50/p99 {w['p50']}/{w['p99']} ms, deferred {r['checkout_deferred']}; "
            f"batch {r['batch_pct_of_quota']:.1f} %, used {r['used'] * 100:.1f} %; vendor 429 {r['vendor_429']}"
        )
    loads = []
    for load in ("free", "binding"):
        x = r[load]
        share = f"share {x['share']['cpu_us_per_request']:.0f}, x{x['ratio']:.3f}; " if "share" in x else ""
        loads.append(f"{load} ({x['label']}): {share}plain {x['plain']['cpu_us_per_request']:.0f} µs/req")
    return "D: " + "; ".join(loads)


def problems(results: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in results:
        codes = r.get("replica_exits") or []
        codes = list(codes.values()) if isinstance(codes, dict) else codes
        out += [f"{r['scenario']}: {m}" for m in unclean_exits({"exit_code": c} for c in codes)]
        if not r.get("share", r["scenario"] == "D"):
            continue  # the FCFS baselines are there for comparison, not held to §13's targets
        tag = f"{r['scenario']} {r.get('action', '')}".strip()
        if r["scenario"] in "ABC" and r["vendor_429_after_1s"]:
            out.append(f"{tag}: {r['vendor_429_after_1s']} vendor 429s after the first second")
        if r["scenario"] == "A":
            for t, x in r["tenants"].items():
                if abs(x["deviation_pp"]) > TARGET_DEV_PP:
                    out.append(f"{tag}: {t} {x['deviation_pp']:+.1f} pp from its share")
            if r["used"] < TARGET_USED:
                out.append(f"{tag}: {r['used'] * 100:.1f} % of the quota used")
        elif r["scenario"] == "B":
            if r["switch_s"] is None or r["switch_s"] > TARGET_SWITCH_S:
                out.append(f"{tag}: t5 alone reached 95 % of the quota after {r['switch_s']} s")
        elif r["scenario"] == "C":
            p99 = r["checkout_wait_ms"]["p99"]
            if p99 is None or p99 > r["target_wait_ms"]:
                out.append(f"{tag}: checkout p99 wait {p99} ms > {r['target_wait_ms']:g} ms")
            if r["checkout_deferred"]:
                out.append(f"{tag}: {r['checkout_deferred']} checkout requests deferred")
            if r["batch_pct_of_quota"] < MIN_SHARE * 100:
                out.append(f"{tag}: batch got {r['batch_pct_of_quota']:.1f} % < min_share")
            if r["used"] < TARGET_USED:
                out.append(f"{tag}: checkout + batch used {r['used'] * 100:.1f} % of the quota")
        elif r["scenario"] == "D":
            for load in ("free", "binding"):
                ratio = r[load].get("ratio")
                if ratio is not None and ratio > TARGET_CPU_RATIO:
                    out.append(f"D {load}: CPU per request x{ratio:.2f} with share")
    return out


# -- main --------------------------------------------------------------------------------------


def share_support(fleet: Fleet) -> tuple[bool, str]:
    """Whether this build's loader accepts ``share:`` (``python -m proxy check``), and why not."""
    yaml = policy(
        "http://127.0.0.1:9", [Limit(100, "1s", 20)], store="redis://127.0.0.1:6399/0", vendor_extra=SHARE_BOTH
    )
    path = fleet.workdir / "share-check.yaml"
    path.write_text(yaml)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "check", "-c", str(path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, "`proxy check` did not answer within 60 s"
    if done.returncode == 0:
        return True, ""
    why = (done.stderr or done.stdout).strip().splitlines()
    return False, why[0] if why else f"`proxy check` exited {done.returncode}"


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/share.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=60.0, help="seconds per run of A, B, C (default 60; >= 5)")
    p.add_argument("--rate", type=float, default=100.0, help="the quota: limits' rate per second (default 100)")
    p.add_argument("--burst", type=float, default=20.0, help="limits' burst (default 20)")
    p.add_argument(
        "--vendor-window-limit", type=int, help="requests the vendor accepts in any 1 s (default rate + burst)"
    )
    p.add_argument("--replicas", type=int, default=2, help="proxy replicas sharing Redis (default 2)")
    p.add_argument("--workers", type=int, default=30, help="workers per tenant (default 30; batch in C gets 5/3 of it)")
    p.add_argument(
        "--hint-header",
        choices=HINT_HEADERS,
        default=HINT_HEADERS[0],
        help="the proxy's retry hint the workers sleep on a defer (default retry-after-ms, the caller's turn; "
        "X-Quota-Retry-After-Ms: the real wait, when the quota next has a token)",
    )
    p.add_argument("--store-timeout", default="250ms", help="store.timeout (default 250ms: a busy 2-core box)")
    p.add_argument("--only", default="A,B,C,D", help="scenarios to run (default A,B,C,D)")
    p.add_argument("--no-baseline", action="store_true", help="skip the runs without share:")
    p.add_argument("--no-share", action="store_true", help="run only the baselines without share:")
    p.add_argument("--d-rounds", type=int, default=5, help="D: interleaved rounds (default 5)")
    p.add_argument("--d-seconds", type=float, default=5.0, help="D: seconds per measurement (default 5)")
    p.add_argument("--d-rate", type=float, default=500.0, help="D: the binding load's limit per second (default 500)")
    p.add_argument("--d-connections", type=int, default=8, help="D: connections per tenant (3 tenants; default 8)")
    p.add_argument("--no-pin", action="store_true", help="D: do not pin the proxy to CPU 1 and the load to CPU 0")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when a share target is missed")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # stop the children by PID on a kill too, as on Ctrl-C
    if args.seconds < 5:
        p.error("--seconds must be at least 5")
    HINTS.remove(args.hint_header)
    HINTS.insert(0, args.hint_header)
    if args.vendor_window_limit is None:
        args.vendor_window_limit = math.floor(args.rate + args.burst)
    only = {s.strip().upper() for s in args.only.split(",") if s.strip()}
    if not only <= set("ABCD"):
        p.error("--only takes A, B, C and/or D")
    if not args.no_pin and "D" in only:
        import shutil

        if shutil.which("taskset") is None:
            args.no_pin = True

    supported, why = share_support(fleet) if not args.no_share else (False, "--no-share")
    variants = ([True] if supported else []) + ([] if args.no_baseline else [False])
    if not variants:
        raise BenchError(f"this build rejects share: ({why}) and --no-baseline leaves nothing to run")
    plan: list[tuple[str, str, bool]] = []
    for s in "ABC":
        if s in only:
            for action in ("hold", "defer") if s == "A" else ("hold",):
                plan += [(s, action, v) for v in variants]
    runs = len(plan)
    budget = runs * (args.seconds + 45) + (args.d_rounds * 4 * (args.d_seconds + 8) + 90 if "D" in only else 0) + 60
    watchdog(fleet, budget)
    print(
        f"bench/share.py: load average {loadavg()} at start (2 cores shared: figures are provisional); "
        f"quota {args.rate:g}/s burst {args.burst:g}, {args.replicas} replicas on one Redis, max_hold {MAX_HOLD}; "
        f"vendor: at most {args.vendor_window_limit} in any {VENDOR_WINDOW:g} s; {args.workers} workers per tenant; "
        f"{runs} runs x {args.seconds:g} s" + (" + D" if "D" in only else ""),
        flush=True,
    )
    if not supported:
        print(f"bench/share.py: this build rejects share: ({why}); only the FCFS baselines run", flush=True)
    results: list[dict[str, Any]] = []
    for s, action, share in plan:
        if s == "A":
            r = scenario_a(fleet, args, action, share)
        elif s == "B":
            r = scenario_b(fleet, args, share)
        else:
            r = scenario_c(fleet, args, share)
        results.append(r)
        print("  " + progress(r), flush=True)
    if "D" in only:
        r = scenario_d(fleet, args, supported)
        r["share"] = supported
        results.append(r)
        print("  " + progress(r), flush=True)
    print()
    for t in (table_a(results), table_b(results), table_c(results), table_d(results)):
        if t:
            print(t)
            print()
    dump_json(args.json, {"share_supported": supported, "why_not": why, "args": vars(args), "results": results})
    if not supported:
        print(f"share: not measured: this build rejects it ({why})")
        return 0
    missed = problems(results)
    if missed:
        print("targets missed: " + "; ".join(missed))
        return 2 if args.strict else 0
    print("targets met")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vendor":
        sys.exit(serve_vendor(sys.argv[2:]))
    sys.exit(run_main(main))
