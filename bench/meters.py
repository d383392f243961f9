#!/usr/bin/env python3
"""Meters (issue 35, SPEC §14): does a worker fleet stay inside a vendor's token quota, by the vendor's own count?

Every part starts its own redis-server (a free port, never 6379), a mock vendor that counts
tokens as the LLM vendors do (``mock-vendor --tokens-per-minute`` or ``--input-/--output-
tokens-per-minute``, ``--token-window 10s``: a STRICT sliding window, a call admitted by the
vendor's own estimate at arrival, the estimate replaced by the answer's usage once produced;
no request quota) and 2 replicas sharing the Redis (``--replicas``). Workers are asyncio tasks
with an aiohttp session each, using their replica as HTTP proxy (round-robin, ``proxy=`` as with
``HTTP_PROXY``). A call has a prompt of 100-8,000 characters, a completion cap of 16-2,000 and
asks the mock (``X-Mock-Output-Tokens``) for an answer of 5-100 % of its cap; every other call
is streamed (``stream_options: {include_usage: true}``). No call is retried behind the bench's
back: a proxy defer (a 429 with ``X-Quota-Action``) is counted and slept for its
``retry-after-ms``, a vendor 429 (without it) counted with its time and slept for its
``Retry-After``.

Parts (``--parts``, default all):

    a  OpenAI shape, 40 workers for ``--seconds`` (30), a ``tokens`` meter (``estimate: openai``,
       ``settle: openai``) with rate x window + burst = the vendor's window and burst = the
       costliest call's estimate; ``on_limit`` a row each (``--actions``): hold with ``max_hold``
       30s (``--max-hold``: the fleet's whole queue is held), hold with ``max_hold`` 2s (longer
       waits deferred) and defer. Targets: no vendor 429 after the first window, >= 90 % of the
       vendor's tokens used after it.
    d  a's peers: the same fleet through a proxy without the meter, requests only: ``worst``
       (the request limit that can never overrun the window: the window's tokens / the costliest
       estimate) and ``mean`` (the window's tokens / the mean estimate). No target.
    b  200 calls at once through the replicas (each on its own connection, hold), their estimates
       10x the window's tokens, each retried on defers until ``--b-seconds``: the vendor's fullest
       window (``tokens_window_max``) <= its limit, no vendor 429.
    c  Anthropic shape (``/v1/messages``), 40 workers, meters ``input_tokens`` and
       ``output_tokens``, hold: each meter's fullest window <= its limit, no vendor 429 after the
       first window, the binding one >= 90 % used.
    g  Shopify's GraphQL shape (``POST /admin/api/2025-01/graphql.json``), 40 workers, hold: the
       shop's bucket of ``--g-points`` (2,000) points restoring ``--g-restore`` (100) a second;
       a query requests 10-100 points (``X-Mock-Query-Cost``) and uses 10-100 % of them
       (``X-Mock-Actual-Cost``); a ``points`` meter of the shop's rate and size, ``estimate:
       {fixed: 100}`` (the most a query requests), ``settle: {json:
       /extensions/cost/actualQueryCost}``, ``feedback.headers: auto`` (throttleStatus).
       Targets: no THROTTLED answer, >= 90 % of the restore rate used once the first full
       bucket is spent.
    s  a's fleet (hold) in three tenants (``X-Tenant-Id``: t1, t2, t5; a third of the workers
       each) under ``share: {weights: {default: 1, t2: 2, t5: 5}}``, and the same without it
       (first come, the baseline): each tenant's part of the tokens its answers used after the
       first window and by the deadline, while every tenant asks (the calls still held at the
       deadline drain after it, a third each, when fewer tenants ask: shown apart, "with the
       drain"). Target (share): each within 5 points of its weight's (1/8, 2/8, 5/8).

"Used" is the rate at which the vendor's ``tokens_accepted`` (what the admitted calls hold: their
usage once answered) grew from the end of the first window to the end of the run (the
least-squares slope of its samples, every 0.5 s), over the window's tokens / the window.

    python bench/meters.py                           # everything, ~5 min
    python bench/meters.py --parts a --seconds 60 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from _common import (
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    Proc,
    dump_json,
    fetch_metrics,
    http_json,
    loadavg,
    outcome_delta,
    outcomes,
    policy,
    run_main,
    table,
    unclean_exits,
    watchdog,
)

ASK = "X-Mock-Output-Tokens"
OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"
FILLER = "Summarise the quarterly report for the board in plain words, please. "
PARTS = ("a", "d", "b", "c", "s", "g")
GRAPHQL_PATH = "/admin/api/2025-01/graphql.json"
TENANTS = (("t1", 1), ("t2", 2), ("t5", 5))  # part s: the tenants and their weights
REQUESTS = Limit(1000, "1s", 100)  # the metered rows' request bucket: never the one that binds
SAMPLE_EVERY = 0.5  # seconds between the vendor's counts, from the end of the first window


@dataclass(frozen=True)
class Mix:
    """What a call looks like: uniform prompt characters, completion cap and share of it used."""

    prompt: tuple[int, int] = (100, 8000)
    cap: tuple[int, int] = (16, 2000)
    used: tuple[float, float] = (0.05, 1.0)

    @property
    def costliest(self) -> int:
        """The largest estimate a call can have: ceil(prompt / 4) + cap."""
        return math.ceil(self.prompt[1] / 4) + self.cap[1]

    @property
    def mean(self) -> float:
        return (self.prompt[0] + self.prompt[1]) / 8 + (self.cap[0] + self.cap[1]) / 2


@dataclass
class Call:
    prompt: int
    cap: int
    output: int
    stream: bool

    def openai(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": text(self.prompt)}],
            "max_tokens": self.cap,
        }
        if self.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body

    def anthropic(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "claude-sonnet-5-5",
            "max_tokens": self.cap,
            "messages": [{"role": "user", "content": text(self.prompt)}],
        }
        if self.stream:
            body["stream"] = True
        return body


def text(chars: int) -> str:
    return (FILLER * (chars // len(FILLER) + 1))[:chars]


def draw(rng: random.Random, mix: Mix, stream: bool) -> Call:
    cap = rng.randint(*mix.cap)
    output = max(1, round(cap * rng.uniform(*mix.used)))
    return Call(rng.randint(*mix.prompt), cap, output, stream)


@dataclass
class Tally:
    done: int = 0
    done_in_time: int = 0  # answered before the deadline (a held call may be answered after it)
    streamed: int = 0
    defers: int = 0
    vendor_429: list[float] = field(default_factory=list)  # seconds into the run
    errors: int = 0
    unfinished: int = 0  # calls still deferred at the deadline
    usage: dict[str, int] = field(default_factory=dict)  # what the answers said they used
    # part s: tokens used after the first window, answered by the deadline (every tenant still
    # asking: what §13 divides) and after it (the fleet's last calls draining, a third each)
    by_tenant: dict[str, int] = field(default_factory=dict)
    by_tenant_drain: dict[str, int] = field(default_factory=dict)


def usage_of(shape: str, stream: bool, body: bytes) -> dict[str, int]:
    """The answer's usage as the worker reads it (a stream: its usage events)."""
    if not stream:
        usage = json.loads(body)["usage"]
        if shape == "openai":
            return {"tokens": int(usage["total_tokens"])}
        return {"input_tokens": int(usage["input_tokens"]), "output_tokens": int(usage["output_tokens"])}
    got: dict[str, int] = {}
    for line in body.decode().splitlines():
        if not line.startswith("data: {") or '"usage"' not in line:
            continue
        event = json.loads(line[6:])
        if shape == "openai":
            if event.get("usage"):
                got["tokens"] = int(event["usage"]["total_tokens"])
        elif event.get("type") == "message_start":
            got["input_tokens"] = int(event["message"]["usage"]["input_tokens"])
        elif event.get("type") == "message_delta":
            got["output_tokens"] = int(event["usage"]["output_tokens"])
    return got


async def one_call(
    session: aiohttp.ClientSession,
    proxy: str,
    shape: str,
    call: Call,
    tally: Tally,
    t0: float,
    deadline: float,
    tenant: str | None = None,
    since: float = 0.0,
) -> bool:
    """One call until it is answered (or, deferred past ``deadline``, given up: False); as
    ``tenant``, whose tokens answered ``since`` seconds in and later are tallied apart."""
    path = OPENAI_PATH if shape == "openai" else ANTHROPIC_PATH
    body = call.openai() if shape == "openai" else call.anthropic()
    headers = {ASK: str(call.output)}
    if shape == "anthropic":
        headers |= {"x-api-key": "sk-ant-mock", "anthropic-version": "2023-06-01"}
    else:
        headers["Authorization"] = "Bearer sk-mock"
    if tenant is not None:
        headers["X-Tenant-Id"] = tenant
    url = f"http://{VENDOR_HOST}{path}"
    while True:
        try:
            async with session.post(url, json=body, headers=headers, proxy=proxy) as r:
                raw = await r.read()
                status, told = r.status, r.headers
        except (aiohttp.ClientError, TimeoutError):
            tally.errors += 1
            return True
        if status == 200:
            tally.done += 1
            tally.done_in_time += time.monotonic() <= deadline
            tally.streamed += call.stream
            used = usage_of(shape, call.stream, raw)
            for k, v in used.items():
                tally.usage[k] = tally.usage.get(k, 0) + v
            now = time.monotonic()
            if tenant is not None and now >= t0 + since:
                into = tally.by_tenant if now <= deadline else tally.by_tenant_drain
                into[tenant] = into.get(tenant, 0) + sum(used.values())
            return True
        if status == 429 and told.get("X-Quota-Action"):
            tally.defers += 1
            wait = int(told.get("retry-after-ms", "100")) / 1000
        elif status == 429:
            tally.vendor_429.append(time.monotonic() - t0)
            wait = float(told.get("Retry-After", "1"))
        else:
            tally.errors += 1
            return True
        if time.monotonic() + wait >= deadline:
            tally.unfinished += 1  # the worker stops: a new call would wait as long
            return False
        await asyncio.sleep(wait)


@dataclass
class Setup:
    """One part's processes."""

    redis: Proc
    vendor: Proc
    replicas: list[Proc]


def start(fleet: Fleet, vendor_flags: Sequence[str], yaml_for: Callable[[str, str], str], replicas: int) -> Setup:
    tag = time.monotonic_ns()
    redis = fleet.redis(name=f"redis-{tag}")
    vendor = fleet.vendor(0, name=f"vendor-{tag}", extra=vendor_flags)
    yaml = yaml_for(vendor.url, redis.url)
    procs = [fleet.proxy(yaml, name=f"proxy-{tag}-{i}") for i in range(replicas)]
    return Setup(redis, vendor, procs)


def stop(fleet: Fleet, setup: Setup) -> list[int | None]:
    codes = [fleet.stop(p) for p in setup.replicas]
    fleet.stop(setup.vendor)
    fleet.stop(setup.redis)
    return codes


def windows(stats: dict[str, Any], shape: str) -> dict[str, dict[str, Any]]:
    return dict(stats["token_windows"][shape])


def meter_yaml(meters: dict[str, tuple[Limit, str]]) -> list[str]:
    lines = ["meters:"]
    for name, (limit, preset) in meters.items():
        lines += [f"  {name}:", f"    limits: [{limit.yaml()}]", f"    estimate: {preset}", f"    settle: {preset}"]
    return lines


def metered_yaml(vendor_extra: Sequence[str], action: str, max_hold: str) -> Callable[[str, str], str]:
    """A part's policy, for ``start``: its vendor lines (its meters), requests never binding."""

    def yaml(vendor_url: str, redis_url: str) -> str:
        return policy(
            vendor_url,
            [REQUESTS],
            store=redis_url,
            action=action,
            max_hold=max_hold,
            access_log=False,
            vendor_extra=vendor_extra,
        )

    return yaml


def tokens_yaml(
    rate: float, burst: float, action: str, max_hold: str, extra: Sequence[str] = ()
) -> Callable[[str, str], str]:
    """The OpenAI-shaped parts' policy: a ``tokens`` meter (``openai``) of ``rate``/s and
    ``burst``, then ``extra`` vendor lines."""
    return metered_yaml([*meter_yaml({"tokens": (Limit(rate, "1s", burst), "openai")}), *extra], action, max_hold)


async def fleet_run(
    setup: Setup,
    shape: str,
    workers: int,
    seconds: float,
    window: float,
    mix: Mix,
    seed: int,
    tenants: Sequence[str] = (),
) -> dict[str, Any]:
    """``workers`` looping calls for ``seconds`` (worker i as ``tenants[i % len(tenants)]``, if
    any); the vendor's counts at the end of the first window, at the deadline and once every
    worker is done."""
    tally = Tally()
    stats_url = setup.vendor.url + "/__mock/stats"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    before = [outcomes(fetch_metrics(p.admin_url)) for p in setup.replicas]
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        proxy = setup.replicas[i % len(setup.replicas)].url
        tenant = tenants[i % len(tenants)] if tenants else None
        async with aiohttp.ClientSession(timeout=timeout) as session:
            n = 0
            while time.monotonic() < deadline:
                call = draw(rng, mix, stream=(i + n) % 2 == 1)
                if not await one_call(session, proxy, shape, call, tally, t0, deadline, tenant, window):
                    break
                n += 1

    async def snapshot(at: float) -> tuple[float, dict[str, Any]]:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        async with aiohttp.ClientSession() as s, s.get(stats_url) as r:
            return time.monotonic() - t0, await r.json()

    tasks = [asyncio.create_task(worker(i)) for i in range(workers)]
    samples: list[tuple[float, dict[str, Any]]] = []
    at = t0 + window
    while at <= deadline + 1e-6:
        samples.append(await snapshot(at))
        at += SAMPLE_EVERY
    first, last = samples[0], samples[-1]
    await asyncio.gather(*tasks)
    final = await snapshot(0)
    after = [outcomes(fetch_metrics(p.admin_url)) for p in setup.replicas]
    out: dict[str, Any] = {
        "calls_done": tally.done,
        "calls_per_s": tally.done_in_time / seconds,
        "streamed": tally.streamed,
        "proxy_defers": tally.defers,
        "vendor_429": len(tally.vendor_429),
        "vendor_429_after_first_window": sum(t >= window for t in tally.vendor_429),
        "vendor_429_times": [round(t, 3) for t in tally.vendor_429],
        "errors": tally.errors,
        "unfinished": tally.unfinished,
        "worker_usage": tally.usage,
        "tenant_tokens": tally.by_tenant,
        "tenant_tokens_drain": tally.by_tenant_drain,
        "outcomes": [outcome_delta(b, a) for b, a in zip(before, after, strict=True)],
        "vendor_rejected": final[1]["rejected"],
        "meters": {},
    }
    span = last[0] - first[0]
    for currency, w in windows(final[1], shape).items():
        accepted = (
            windows(last[1], shape)[currency]["tokens_accepted"] - windows(first[1], shape)[currency]["tokens_accepted"]
        )
        quota = w["limit"] * span / w["window"]
        per_second = slope([(t, windows(st, shape)[currency]["tokens_accepted"]) for t, st in samples])
        out["meters"][currency] = {
            "limit": w["limit"],
            "tokens_window_max": w["tokens_window_max"],
            "tokens_accepted": w["tokens_accepted"],
            "rejected": w["rejected"],
            "used_after_first_window": accepted,
            "quota_after_first_window": quota,
            "used_pct_ends": 100.0 * accepted / quota,
            "tokens_per_s": per_second,
            "used_pct": 100.0 * per_second / (w["limit"] / w["window"]),
            "occupancy_pct_mean": statistics.fmean(
                100.0 * windows(st, shape)[currency]["used"] / w["limit"] for _, st in samples
            ),
        }
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (t, value): the rate the counter grew at, whatever its edges."""
    if len(points) < 2:
        raise BenchError("the run is too short: lengthen --seconds past the window")
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    return sum((t - mt) * (v - mv) for t, v in points) / sum((t - mt) ** 2 for t, _ in points)


def check_failures(result: dict[str, Any]) -> None:
    total = result["calls_done"] + result["errors"]
    if result["calls_done"] == 0:
        raise BenchError("no call got through")
    if result["errors"] > 0.01 * total:
        raise BenchError(f"{result['errors']} of {total} calls failed (not a 200 nor a 429)")


# -- the parts ---------------------------------------------------------------------------------


def part_a(fleet: Fleet, args: argparse.Namespace, row: str, seed: int) -> dict[str, Any]:
    action, _, max_hold = row.partition("/")
    mix, window, limit = Mix(used=args.used), args.window, args.window_tokens
    burst = mix.costliest
    rate = (limit - burst) / window
    vendor = ["--tokens-per-minute", f"{limit * 60 / window:g}", "--token-window", f"{window:g}s"]

    yaml = tokens_yaml(rate, burst, action, max_hold or args.max_hold)
    setup = start(fleet, vendor, yaml, args.replicas)
    try:
        result = asyncio.run(fleet_run(setup, "openai", args.workers, args.seconds, window, mix, seed))
    finally:
        result_codes = stop(fleet, setup)
    result |= {"policy": f"tokens {rate:g}/s burst {burst}", "exit_codes": result_codes}
    check_failures(result)
    return result


def part_d(fleet: Fleet, args: argparse.Namespace, kind: str, seed: int) -> dict[str, Any]:
    mix, window, limit = Mix(used=args.used), args.window, args.window_tokens
    per_window = math.floor(limit / (mix.costliest if kind == "worst" else mix.mean))
    burst = 1
    rate = (per_window - burst) / window
    vendor = ["--tokens-per-minute", f"{limit * 60 / window:g}", "--token-window", f"{window:g}s"]

    def yaml(vendor_url: str, redis_url: str) -> str:
        return policy(
            vendor_url,
            [Limit(rate, "1s", burst)],
            store=redis_url,
            action="hold",
            max_hold=args.max_hold,
            access_log=False,
        )

    setup = start(fleet, vendor, yaml, args.replicas)
    try:
        result = asyncio.run(fleet_run(setup, "openai", args.workers, args.seconds, window, mix, seed))
    finally:
        result_codes = stop(fleet, setup)
    result |= {"policy": f"requests {rate:g}/s burst {burst}", "exit_codes": result_codes}
    check_failures(result)
    return result


def part_s(fleet: Fleet, args: argparse.Namespace, shared: bool, seed: int) -> dict[str, Any]:
    mix, window, limit = Mix(used=args.used), args.window, args.window_tokens
    burst = mix.costliest
    rate = (limit - burst) / window
    vendor = ["--tokens-per-minute", f"{limit * 60 / window:g}", "--token-window", f"{window:g}s"]
    weights = ", ".join(f"{t}: {w}" for t, w in TENANTS if w != 1)

    extra = [f"share: {{weights: {{default: 1, {weights}}}}}"] if shared else []
    yaml = tokens_yaml(rate, burst, "hold", args.max_hold, extra)
    setup = start(fleet, vendor, yaml, args.replicas)
    names = [t for t, _ in TENANTS]
    try:
        result = asyncio.run(fleet_run(setup, "openai", args.workers, args.seconds, window, mix, seed, names))
    finally:
        result_codes = stop(fleet, setup)
    used, drain = result["tenant_tokens"], result["tenant_tokens_drain"]
    whole, with_drain = sum(used.values()) or 1, sum(used.values()) + sum(drain.values()) or 1
    result |= {
        "policy": f"tokens {rate:g}/s burst {burst}" + (", share 1:2:5" if shared else ", first come"),
        "tenant_parts": {t: used.get(t, 0) / whole for t in names},
        "tenant_parts_with_drain": {t: (used.get(t, 0) + drain.get(t, 0)) / with_drain for t in names},
        "exit_codes": result_codes,
    }
    check_failures(result)
    return result


async def graphql_run(setup: Setup, workers: int, seconds: float, since: float, seed: int) -> dict[str, Any]:
    """``workers`` looping GraphQL queries for ``seconds``; the shop's points used from ``since``
    seconds in to the end (the first full bucket spent), and its THROTTLED answers."""
    stats_url = setup.vendor.url + "/__mock/stats"
    t0 = time.monotonic()
    deadline = t0 + seconds
    got = {"done": 0, "throttled": 0, "defers": 0, "errors": 0}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        proxy = setup.replicas[i % len(setup.replicas)].url
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                requested = rng.randint(10, 100)
                headers = {
                    "X-Mock-Query-Cost": str(requested),
                    "X-Mock-Actual-Cost": str(max(1, round(requested * rng.uniform(0.1, 1.0)))),
                }
                url = f"http://{VENDOR_HOST}{GRAPHQL_PATH}"
                try:
                    async with session.post(
                        url, json={"query": "{ shop { name } }"}, headers=headers, proxy=proxy
                    ) as r:
                        body = await r.read()
                        status, told = r.status, r.headers
                except (aiohttp.ClientError, TimeoutError):
                    got["errors"] += 1
                    continue
                if status == 429 and told.get("X-Quota-Action"):
                    got["defers"] += 1
                    await asyncio.sleep(int(told.get("retry-after-ms", "100")) / 1000)
                elif status != 200:
                    got["errors"] += 1
                elif b"THROTTLED" in body:
                    got["throttled"] += 1
                else:
                    got["done"] += 1

    async def points_at(at: float) -> tuple[float, int]:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        async with aiohttp.ClientSession() as s, s.get(stats_url) as r:
            return time.monotonic() - t0, int((await r.json())["graphql"]["points_used"])

    tasks = [asyncio.create_task(worker(i)) for i in range(workers)]
    first = await points_at(t0 + since)
    last = await points_at(deadline)
    await asyncio.gather(*tasks)
    stats = http_json(stats_url)["graphql"]
    return got | {
        "points_per_s": (last[1] - first[1]) / (last[0] - first[0]),
        "restore_rate": stats["restore_rate"],
        "vendor_throttled": stats["throttled"],
        "vendor_queries": stats["queries"],
    }


def part_g(fleet: Fleet, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    size, restore = args.g_points, args.g_restore
    vendor = ["--graphql-points", f"{size:g}", "--graphql-restore", f"{restore:g}"]
    meter = [
        "feedback: {headers: auto}",
        "meters:",
        "  points:",
        f"    limits: [{{rate: {restore:g}, per: 1s, burst: {size:g}}}]",
        "    estimate: {fixed: 100}",
        "    settle: {json: /extensions/cost/actualQueryCost}",
    ]
    yaml = metered_yaml(meter, "hold", args.max_hold)
    setup = start(fleet, vendor, yaml, args.replicas)
    since = min(args.seconds / 2, size / restore)  # (the first full bucket, spent at once)
    try:
        result = asyncio.run(graphql_run(setup, args.workers, args.seconds, since, seed))
    finally:
        result_codes = stop(fleet, setup)
    result |= {"policy": f"points {restore:g}/s burst {size:g}", "since": since, "exit_codes": result_codes}
    if result["done"] == 0 or result["errors"] > 0.01 * (result["done"] + result["errors"]):
        raise BenchError(f"{result['errors']} calls failed, {result['done']} done")
    return result


def part_c(fleet: Fleet, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    mix, window = Mix(used=args.used), args.window
    meters: dict[str, tuple[Limit, str]] = {}
    vendor = ["--token-window", f"{window:g}s"]
    for currency, limit, costliest in (
        ("input_tokens", args.c_input, math.ceil(mix.prompt[1] / 4)),
        ("output_tokens", args.c_output, mix.cap[1]),
    ):
        meters[currency] = (Limit((limit - costliest) / window, "1s", costliest), f"anthropic_{currency[:-7]}")
        vendor += [f"--{currency.replace('_', '-')}-per-minute", f"{limit * 60 / window:g}"]
    yaml = metered_yaml(meter_yaml(meters), "hold", args.max_hold)
    setup = start(fleet, vendor, yaml, args.replicas)
    try:
        result = asyncio.run(fleet_run(setup, "anthropic", args.workers, args.seconds, window, mix, seed))
    finally:
        result_codes = stop(fleet, setup)
    result |= {
        "policy": ", ".join(f"{k} {v[0].rate:g}/s burst {v[0].burst:g}" for k, v in meters.items()),
        "exit_codes": result_codes,
    }
    check_failures(result)
    return result


async def burst_run(setup: Setup, calls: int, seconds: float, mix: Mix, seed: int) -> dict[str, Any]:
    """``calls`` calls at once, each on a connection of its own, retried on defers until ``seconds``."""
    tally = Tally()
    rng = random.Random(seed)
    t0 = time.monotonic()
    deadline = t0 + seconds
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)

    async def one(i: int) -> None:
        call = draw(rng, mix, stream=i % 2 == 1)
        proxy = setup.replicas[i % len(setup.replicas)].url
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await one_call(session, proxy, "openai", call, tally, t0, deadline)

    await asyncio.gather(*(one(i) for i in range(calls)))
    stats = http_json(setup.vendor.url + "/__mock/stats")
    w = windows(stats, "openai")["tokens"]
    return {
        "calls": calls,
        "calls_done": tally.done,
        "proxy_defers": tally.defers,
        "unfinished": tally.unfinished,
        "vendor_429": len(tally.vendor_429),
        "errors": tally.errors,
        "limit": w["limit"],
        "tokens_window_max": w["tokens_window_max"],
        "tokens_accepted": w["tokens_accepted"],
        "vendor_rejected": w["rejected"],
        "worker_usage": tally.usage,
    }


def part_b(fleet: Fleet, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    window, limit, calls = args.window, args.b_window_tokens, args.b_calls
    each = 10 * limit // calls  # every call's estimate: together 10x the window
    cap = each // 2
    mix = Mix(prompt=(4 * (each - cap), 4 * (each - cap)), cap=(cap, cap))
    burst = each
    rate = (limit - burst) / window
    vendor = ["--tokens-per-minute", f"{limit * 60 / window:g}", "--token-window", f"{window:g}s"]

    yaml = tokens_yaml(rate, burst, "hold", args.max_hold)
    setup = start(fleet, vendor, yaml, args.replicas)
    try:
        result = asyncio.run(burst_run(setup, calls, args.b_seconds, mix, seed))
    finally:
        result_codes = stop(fleet, setup)
    result |= {
        "policy": f"tokens {rate:g}/s burst {burst}",
        "estimate_each": each,
        "estimates_total": each * calls,
        "exit_codes": result_codes,
    }
    if result["errors"] > 0.01 * calls:
        raise BenchError(f"{result['errors']} of {calls} calls failed")
    return result


# -- the report --------------------------------------------------------------------------------


def med(results: list[dict[str, Any]], key: str, currency: str | None = None) -> float:
    if currency is None:
        return float(statistics.median(r[key] for r in results))
    return float(statistics.median(r["meters"][currency][key] for r in results))


def total(results: list[dict[str, Any]], key: str, currency: str | None = None) -> int:
    if currency is None:
        return int(sum(r[key] for r in results))
    return int(sum(r["meters"][currency][key] for r in results))


def used_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    try:
        got = (float(low), float(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH, e.g. 0.05-1") from None
    if not 0 < got[0] <= got[1] <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: 0 < LOW <= HIGH <= 1")
    return got


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/meters.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--parts", default=",".join(PARTS), help="which parts, of a,d,b,c,s,g (default all)")
    p.add_argument("--seconds", type=float, default=30.0, help="each fleet row's run, a, d and c (default 30)")
    p.add_argument("--window", type=float, default=10.0, help="the vendor's token window, seconds (default 10)")
    p.add_argument(
        "--window-tokens", type=int, default=100_000, help="a and d: the vendor's tokens per window (default 100000)"
    )
    p.add_argument(
        "--used",
        type=used_range,
        default=(0.05, 1.0),
        metavar="LOW-HIGH",
        help="a, d and c: the share of its cap a call's answer uses, uniform (default 0.05-1)",
    )
    p.add_argument("--workers", type=int, default=40, help="a, d and c: workers (default 40)")
    p.add_argument("--replicas", type=int, default=2, help="replicas sharing one Redis (default 2)")
    p.add_argument("--max-hold", default="30s", help="on_limit max_hold of the hold rows (default 30s)")
    p.add_argument(
        "--actions",
        default="hold,hold/2s,defer",
        help="a: the on_limit actions, a row each; hold/D: hold with max_hold D (default hold,hold/2s,defer)",
    )
    p.add_argument("--baselines", default="worst,mean", help="d: the request limits, a row each (default worst,mean)")
    p.add_argument("--b-calls", type=int, default=200, help="b: calls at once (default 200)")
    p.add_argument("--b-window-tokens", type=int, default=20_000, help="b: the vendor's tokens per window (20000)")
    p.add_argument("--b-seconds", type=float, default=15.0, help="b: how long deferred calls retry (default 15)")
    p.add_argument("--c-input", type=int, default=120_000, help="c: input tokens per window (default 120000)")
    p.add_argument("--g-points", type=float, default=2000, help="g: the shop's bucket, points (default 2000)")
    p.add_argument("--g-restore", type=float, default=100, help="g: points restored a second (default 100)")
    p.add_argument("--c-output", type=int, default=40_000, help="c: output tokens per window (default 40000)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    p.add_argument("--seed", type=int, default=35, help="the calls' random seed (each round adds 1)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if any(x not in PARTS for x in parts):
        p.error(f"--parts: of {','.join(PARTS)}")
    actions = [x for x in args.actions.split(",") if x]
    baselines = [x for x in args.baselines.split(",") if x]
    if any(a not in ("hold", "defer") and not a.startswith("hold/") for a in actions):
        p.error("--actions: of hold, hold/DURATION, defer")
    if any(b not in ("worst", "mean") for b in baselines):
        p.error("--baselines: of worst,mean")
    rows_per_round = (len(actions) if "a" in parts else 0) + (len(baselines) if "d" in parts else 0)
    rows_per_round += ("c" in parts) + 2 * ("s" in parts) + ("g" in parts)
    budget = args.rounds * (rows_per_round * (args.seconds + 45) + ("b" in parts) * (args.b_seconds + 45))
    watchdog(fleet, 60 + budget)
    print(f"bench/meters.py: load average {loadavg()} at start (2 cores shared: figures are provisional)", flush=True)

    got: dict[str, list[dict[str, Any]]] = {}

    def label(action: str) -> str:
        return f"hold {args.max_hold}" if action == "hold" else action.replace("/", " ")

    for rnd in range(args.rounds):
        seed = args.seed + rnd
        plan: list[tuple[str, Callable[[], dict[str, Any]]]] = []
        if "a" in parts:
            plan += [(f"a tokens meter, {label(a)}", functools.partial(part_a, fleet, args, a, seed)) for a in actions]
        if "d" in parts:
            plan += [(f"d requests only, {b}", functools.partial(part_d, fleet, args, b, seed)) for b in baselines]
        if "b" in parts:
            plan.append(("b 200 at once", functools.partial(part_b, fleet, args, seed)))
        if "c" in parts:
            plan.append(("c anthropic, hold", functools.partial(part_c, fleet, args, seed)))
        if "g" in parts:
            plan.append(("g shopify graphql, hold", functools.partial(part_g, fleet, args, seed)))
        if "s" in parts:
            plan += [
                (
                    f"s tenants, {'share' if shared else 'first come'}",
                    functools.partial(part_s, fleet, args, shared, seed),
                )
                for shared in (True, False)
            ]
        for name, run in plan:
            t = time.monotonic()
            r = run()
            brief = {k: v for k, v in r.items() if k not in ("vendor_429_times", "outcomes")}
            print(f"  round {rnd + 1} {name} ({time.monotonic() - t:.0f} s): {json.dumps(brief)}", flush=True)
            got.setdefault(name, []).append(r)

    missed: list[str] = []
    fleet_rows: list[list[str]] = []
    for name, results in got.items():
        if name.startswith(("b ", "s ", "g ")):
            continue
        metered = not name.startswith("d ")
        for currency in results[0]["meters"]:
            late = total(results, "vendor_429_after_first_window")
            used = med(results, "used_pct", currency)
            fullest = max(r["meters"][currency]["tokens_window_max"] for r in results)
            limit = results[0]["meters"][currency]["limit"]
            binding = name.startswith("c ") and currency == max(
                results[0]["meters"], key=lambda c: results[0]["meters"][c]["used_pct"]
            )
            target = metered and (not name.startswith("c ") or binding)
            verdict = "-"
            if metered:
                ok = late == 0 and fullest <= limit and (used >= 90.0 or not target)
                verdict = "ok" if ok else "MISSED"
                if not ok:
                    missed.append(f"{name} {currency}")
            fleet_rows.append(
                [
                    name,
                    results[0]["policy"] if currency == next(iter(results[0]["meters"])) else "",
                    currency,
                    f"{total(results, 'vendor_429') - late}/{late}",
                    f"{used:.1f} %" + (" (binding)" if binding else ""),
                    f"{med(results, 'occupancy_pct_mean', currency):.1f} %",
                    f"{fullest}/{limit}",
                    f"{med(results, 'calls_done'):.0f} ({med(results, 'calls_per_s'):.1f}/s)",
                    f"{med(results, 'proxy_defers'):.0f}",
                    verdict,
                ]
            )
    if fleet_rows:
        print(
            f"\n{args.workers} workers on {args.replicas} replicas, {args.seconds:g} s, "
            f"vendor window {args.window:g} s (median of {args.rounds}); vendor 429s in the first window/after "
            "it; used: the rate the vendor's tokens_accepted grew at after the first window / the window's "
            "tokens per second; window held: the mean of what the vendor's window held (sampled every 0.5 s) / "
            "its limit; fullest: the vendor's tokens_window_max (refused arrivals at their estimate) / limit"
        )
        print(
            table(
                fleet_rows,
                [
                    "row",
                    "proxy policy",
                    "vendor window",
                    "vendor 429",
                    "used",
                    "window held",
                    "fullest",
                    "calls done",
                    "proxy defers",
                    "target",
                ],
            )
        )
    if "b 200 at once" in got:
        results = got["b 200 at once"]
        r0 = results[0]
        fullest = max(r["tokens_window_max"] for r in results)
        late = total(results, "vendor_429")
        ok = fullest <= r0["limit"] and late == 0
        if not ok:
            missed.append("b 200 at once")
        print(
            f"\n{r0['calls']} calls at once (estimates {r0['estimate_each']} each, {r0['estimates_total']} "
            f"= {r0['estimates_total'] / r0['limit']:.0f}x the window), hold, deferred ones retried for "
            f"{args.b_seconds:g} s (median of {args.rounds}):"
        )
        print(
            table(
                [
                    [
                        r0["policy"],
                        f"{fullest}/{r0['limit']}",
                        late,
                        f"{med(results, 'calls_done'):.0f}",
                        f"{med(results, 'proxy_defers'):.0f}",
                        f"{med(results, 'unfinished'):.0f}",
                        "ok" if ok else "MISSED",
                    ]
                ],
                ["proxy policy", "fullest/limit", "vendor 429", "done", "proxy defers", "unfinished", "target"],
            )
        )
    for name, results in got.items():
        if not name.startswith("g "):
            continue
        used = statistics.median(100 * r["points_per_s"] / r["restore_rate"] for r in results)
        throttled = sum(r["vendor_throttled"] for r in results)
        verdict = "ok" if throttled == 0 and used >= 90 else "MISSED"
        if verdict != "ok":
            missed.append(name)
        r0 = results[0]
        print(
            f"\nShopify's GraphQL shape, {args.workers} workers, hold (median of {args.rounds}); used: the shop's "
            f"points used a second from {r0['since']:g} s in (its first full bucket spent) / its restore rate"
        )
        print(
            table(
                [[r0["policy"], f"{used:.1f} %", throttled, f"{med(results, 'vendor_queries'):.0f}", verdict]],
                ["proxy policy", "used", "THROTTLED", "queries", "target"],
            )
        )
    share_rows = []
    for name, results in got.items():
        if not name.startswith("s "):
            continue
        parts_of = {t: statistics.median(r["tenant_parts"][t] for r in results) for t, _ in TENANTS}
        off = max(abs(parts_of[t] - w / 8) for t, w in TENANTS)
        drained = {t: statistics.median(r["tenant_parts_with_drain"][t] for r in results) for t, _ in TENANTS}
        off_drained = max(abs(drained[t] - w / 8) for t, w in TENANTS)
        verdict = "-"
        if name.endswith("share"):
            verdict = "ok" if off <= 0.05 and total(results, "vendor_429_after_first_window") == 0 else "MISSED"
            if verdict != "ok":
                missed.append(name)
        share_rows.append(
            [
                name,
                *(f"{100 * parts_of[t]:.1f} %" for t, _ in TENANTS),
                f"{100 * off:.1f}",
                f"{100 * off_drained:.1f}",
                f"{total(results, 'vendor_429') - total(results, 'vendor_429_after_first_window')}/"
                f"{total(results, 'vendor_429_after_first_window')}",
                verdict,
            ]
        )
    if share_rows:
        print(
            f"\nThree tenants, a third of the {args.workers} workers each, hold; each tenant's part of the tokens "
            f"its answers used after the first window, by the deadline (median of {args.rounds}; weights 1:2:5 = "
            "12.5/25/62.5 %; with the drain: also the held calls answered after the deadline):"
        )
        head = ["row", "t1", "t2", "t5", "worst off (points)", "with the drain", "vendor 429", "target"]
        print(table(share_rows, head))
    exits = unclean_exits({"exit_code": c} for rs in got.values() for r in rs for c in r["exit_codes"])
    for line in exits:
        print(f"bench: {line}")
    missed += exits
    print(f"load average {loadavg()} at the end")
    dump_json(args.json, {"args": vars(args), "results": got, "missed": missed})
    if missed:
        print("targets missed: " + "; ".join(missed))
    return 2 if missed and args.strict else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
