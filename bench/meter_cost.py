#!/usr/bin/env python3
"""Meter cost (issue 35, SPEC §14): what a ``tokens`` meter adds to a stream's first byte and a call's CPU.

Two proxies side by side, from two policies identical but for one thing: the vendor of one has
a ``tokens`` meter (``estimate: openai``, ``settle: openai``), the other none. Every limit is far
above the load (nothing is ever held, deferred or refused; the script fails if anything is), the
store is ``memory://`` (``--store redis``: one redis-server on a free port, shared), the access
log is off. One mock vendor without a token quota answers both (``POST /v1/chat/completions``,
an answer of ``X-Mock-Output-Tokens`` tokens). Prompts of ``--prompt-chars`` characters,
``max_tokens`` 256: the estimate has a body to read.

Part 1, streams: one aiohttp session (keep-alive) sends streamed completions (``stream_options:
{include_usage: true}``, ``--stream-tokens`` 200: 17 events) in turn to the vendor directly,
through the plain proxy and through the metered one (the order rotating every request),
``--streams`` per path per round. TTFB is the time from sending the request to the first body
bytes (``readany``); the answer is then read to its end, counting the pieces it came in and
checking it has its usage and ``[DONE]``. Target: the metered proxy's p50 TTFB (the median of the
rounds') within 1 ms of the plain one's, and at least half as large a share of its answers in
several pieces as the plain one's (the mock writes the events back to back, so how many pieces
reach the client is timing; a relay that gathered the stream for the settlement would give none).

Part 2, CPU: ``--clients`` closed-loop aiohttp clients send JSON (not streamed) completions to
one proxy for ``--seconds`` (after a 1-s warm-up); the proxy's utime+stime delta (/proc) over the
answers completed in that time is its CPU per request. Plain and metered alternate, ``--rounds``
times (the order swapped each round); ``--together``: both at once each round, ``--clients``
each, so that whatever else the shared machine runs weighs on both alike (the figures are
then those of two loaded proxies side by side, each higher than alone). Target: the median of
the rounds' ratios metered / plain <= 1.25.

    python bench/meter_cost.py                       # 3 rounds, ~1.5 min
    python bench/meter_cost.py --rounds 5 --seconds 20 --store redis --json /tmp/meter_cost.json
    python bench/meter_cost.py --together --rounds 8 --seconds 4 --streams 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
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
    Proc,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    loadavg,
    metric_sum,
    outcomes,
    percentile,
    policy,
    run_main,
    table,
    unclean_exits,
    watchdog,
)
from meters import ASK, Call, meter_yaml
from meters import OPENAI_PATH as PATH

HUGE = Limit(100_000_000, "1s", 1_000_000)  # requests and tokens: never the one that binds
CAP = 256  # max_tokens
TTFB_TARGET_MS = 1.0
CPU_TARGET = 1.25
PATHS = ("direct", "plain", "metered")


def payload(prompt_chars: int, stream: bool) -> dict[str, Any]:
    """meters.py's call: its body states no reply size (``ASK`` asks for it)."""
    return Call(prompt_chars, CAP, 0, stream).openai()


def yaml_for(vendor_url: str, store_url: str, metered: bool) -> str:
    meter = meter_yaml({"tokens": (HUGE, "openai")})
    return policy(
        vendor_url, [HUGE], store=store_url, action="defer", access_log=False, vendor_extra=meter if metered else []
    )


@dataclass
class Streams:
    ttfb: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    ttlb: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    pieces: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PATHS})
    errors: int = 0


async def stream_round(
    targets: dict[str, tuple[str, str | None]], n: int, warmup: int, prompt: int, out: int
) -> Streams:
    """``n`` streamed calls per path (after ``warmup`` unmeasured ones), the paths in turn."""
    got = Streams()
    body, headers = payload(prompt, True), {ASK: str(out), "Authorization": "Bearer sk-mock"}
    timeout = aiohttp.ClientTimeout(total=10)
    names = list(targets)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=4)) as session:
        for i in range(warmup + n):
            for name in names[i % 3 :] + names[: i % 3]:
                url, proxy = targets[name]
                t0 = time.perf_counter()
                try:
                    async with session.post(url, json=body, headers=headers, proxy=proxy) as r:
                        first = await r.content.readany()
                        t1 = time.perf_counter()
                        pieces, tail = 1, [first]
                        async for chunk in r.content.iter_any():
                            pieces += 1
                            tail.append(chunk)
                        t2, status = time.perf_counter(), r.status
                except (aiohttp.ClientError, TimeoutError):
                    got.errors += 1
                    continue
                whole = b"".join(tail)
                if status != 200 or b'"usage": {' not in whole or not whole.rstrip().endswith(b"data: [DONE]"):
                    got.errors += 1
                    continue
                if i >= warmup:
                    got.ttfb[name].append(t1 - t0)
                    got.ttlb[name].append(t2 - t0)
                    got.pieces[name].append(pieces)
    return got


async def closed_loop(proxy: Proc, clients: int, seconds: float, prompt: int, out: int) -> dict[str, float]:
    """``clients`` closed-loop JSON calls through ``proxy``: its CPU seconds over the answers
    completed in ``seconds`` after a 1-s warm-up."""
    body, headers = payload(prompt, False), {ASK: str(out), "Authorization": "Bearer sk-mock"}
    url = f"http://{VENDOR_HOST}{PATH}"
    done = errors = 0
    running = True

    async def client() -> None:
        nonlocal done, errors
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            while running:
                try:
                    async with session.post(url, json=body, headers=headers, proxy=proxy.url) as r:
                        answer = await r.json()
                        ok = r.status == 200 and answer["usage"]["total_tokens"] > 0
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
                    ok = False
                done += ok
                errors += not ok

    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    await asyncio.sleep(1.0)
    n0, e0, cpu0, t0 = done, errors, cpu_seconds(proxy.pid), time.perf_counter()
    await asyncio.sleep(seconds)
    n1, e1, cpu1, t1 = done, errors, cpu_seconds(proxy.pid), time.perf_counter()
    running = False
    await asyncio.gather(*tasks)
    if n1 == n0:
        raise BenchError(f"no call answered through {proxy.name}:\n{proxy.tail()}")
    if e1 - e0 > 0.01 * (n1 - n0):
        raise BenchError(f"{e1 - e0} of {n1 - n0 + e1 - e0} calls through {proxy.name} failed:\n{proxy.tail()}")
    n = n1 - n0
    return {"requests": n, "per_s": n / (t1 - t0), "cpu_s": cpu1 - cpu0, "cpu_us_per_request": (cpu1 - cpu0) / n * 1e6}


def cpu_round(
    proxies: dict[str, Proc], args: argparse.Namespace, rnd: int, run: Callable[[Any], Any]
) -> list[tuple[str, dict[str, float]]]:
    """Part 2's round ``rnd``: each proxy's closed loop, in turn (the order swapped each
    round) or, ``--together``, both at once."""
    names = ["plain", "metered"] if rnd % 2 == 0 else ["metered", "plain"]

    def loop(name: str) -> Any:
        return closed_loop(proxies[name], args.clients, args.seconds, args.prompt_chars, args.output_tokens)

    if args.together:

        async def both() -> list[dict[str, float]]:
            return list(await asyncio.gather(*(loop(name) for name in names)))

        return list(zip(names, run(both()), strict=True))
    return [(name, run(loop(name))) for name in names]


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/meter_cost.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians; default 3)")
    p.add_argument("--streams", type=int, default=300, help="part 1: streamed calls per path per round (default 300)")
    p.add_argument("--stream-tokens", type=int, default=200, help="part 1: the answers' tokens (default 200)")
    p.add_argument("--seconds", type=float, default=10.0, help="part 2: measured seconds per proxy per round (10)")
    p.add_argument("--clients", type=int, default=8, help="part 2: closed-loop clients (default 8)")
    p.add_argument("--output-tokens", type=int, default=100, help="part 2: the answers' tokens (default 100)")
    p.add_argument("--prompt-chars", type=int, default=2000, help="the prompt's characters (default 2000)")
    p.add_argument("--store", choices=("memory", "redis"), default="memory", help="the proxies' store (memory)")
    p.add_argument("--together", action="store_true", help="part 2: both proxies loaded at once each round")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when a target is missed")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.streams < 1 or args.seconds <= 0 or args.clients < 1:
        p.error("--rounds, --streams, --seconds and --clients must be positive")
    watchdog(fleet, 90 + args.rounds * (2 * (args.seconds + 8) + 3 * args.streams * 0.05 + 20))
    try:
        import uvloop

        run: Callable[[Any], Any] = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    print(f"bench/meter_cost.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")

    vendor = fleet.vendor(0)  # no request quota, no token quota: overhead only
    store = fleet.redis().url if args.store == "redis" else "memory://"
    proxies = {name: fleet.proxy(yaml_for(vendor.url, store, name == "metered"), name=name) for name in PATHS[1:]}
    before = {name: outcomes(fetch_metrics(pr.admin_url)) for name, pr in proxies.items()}
    targets: dict[str, tuple[str, str | None]] = {"direct": (vendor.url + PATH, None)}
    targets |= {name: (f"http://{VENDOR_HOST}{PATH}", pr.url) for name, pr in proxies.items()}

    streams: list[Streams] = []
    cpu: dict[str, list[dict[str, float]]] = {"plain": [], "metered": []}
    for rnd in range(args.rounds):
        s = run(stream_round(targets, args.streams, 20, args.prompt_chars, args.stream_tokens))
        if s.errors > 0.01 * 3 * args.streams:
            raise BenchError(f"round {rnd + 1}: {s.errors} streamed calls failed or came back incomplete")
        streams.append(s)
        p50 = {k: percentile(sorted(v), 50) * 1000 for k, v in s.ttfb.items()}
        print(f"  round {rnd + 1} streams: p50 TTFB ms " + ", ".join(f"{k} {v:.3f}" for k, v in p50.items()))
        for name, c in cpu_round(proxies, args, rnd, run):
            cpu[name].append(c)
            print(
                f"  round {rnd + 1} cpu {name}: {c['requests']:.0f} calls ({c['per_s']:.0f}/s), "
                f"{c['cpu_us_per_request']:.0f} µs CPU each",
                flush=True,
            )

    samples = {name: fetch_metrics(pr.admin_url) for name, pr in proxies.items()}
    for name in proxies:
        oc = outcomes(samples[name])
        bound = {k: v - before[name].get(k, 0.0) for k, v in oc.items() if k != "forwarded"}
        if any(bound.values()):
            raise BenchError(f"{name}: the limiter bound ({bound}); every limit must stay far above the load")
    estimated = metric_sum(samples["metered"], "ratelimit_meter_estimated_total")
    settled = metric_sum(samples["metered"], "ratelimit_meter_settled_total")
    if estimated <= 0 or settled <= 0:
        raise BenchError(f"the metered proxy did not meter (estimated {estimated}, settled {settled})")
    if metric_sum(samples["plain"], "ratelimit_meter_estimated_total") > 0:
        raise BenchError("the plain proxy metered")
    codes = {name: fleet.stop(pr) for name, pr in proxies.items()}

    ttfb = {k: sorted(x for s in streams for x in s.ttfb[k]) for k in PATHS}
    ttlb = {k: sorted(x for s in streams for x in s.ttlb[k]) for k in PATHS}
    pieces = {k: [x for s in streams for x in s.pieces[k]] for k in PATHS}
    round_diffs = [
        (percentile(sorted(s.ttfb["metered"]), 50) - percentile(sorted(s.ttfb["plain"]), 50)) * 1000 for s in streams
    ]
    diff = med(round_diffs)
    multi = {k: 100.0 * sum(x > 1 for x in v) / len(v) for k, v in pieces.items()}
    ttfb_ok = diff <= TTFB_TARGET_MS and multi["metered"] >= 0.5 * multi["plain"]
    cpu_med = {k: med([c["cpu_us_per_request"] for c in v]) for k, v in cpu.items()}
    ratios = [
        m["cpu_us_per_request"] / q["cpu_us_per_request"] for m, q in zip(cpu["metered"], cpu["plain"], strict=True)
    ]
    ratio = med(ratios)
    cpu_ok = ratio <= CPU_TARGET

    rows: list[list[str]] = []
    for k in PATHS:
        row = [k, str(len(ttfb[k]))] + [f"{percentile(ttfb[k], q) * 1000:.3f}" for q in (50, 90, 99)]
        row += [
            f"{percentile(ttlb[k], 50) * 1000:.3f}",
            f"{statistics.fmean(pieces[k]):.2f} (max {max(pieces[k])})",
            f"{multi[k]:.1f} %",
        ]
        rows.append(row)
    print(
        f"\nPart 1, streams: {args.streams} streamed calls per path per round, {args.rounds} rounds, the paths in "
        f"turn; {args.stream_tokens}-token answers, {args.prompt_chars}-character prompts, store {args.store}; "
        "milliseconds from sending the request to the first body bytes (TTFB) and to the last (TTLB)"
    )
    print(table(rows, ["path", "n", "p50 TTFB", "p90 TTFB", "p99 TTFB", "p50 TTLB", "pieces, mean", "in several"]))
    print(
        f"metered - plain p50 TTFB: {diff:+.3f} ms (median of the rounds' {', '.join(f'{d:+.3f}' for d in round_diffs)}"
        f"; target <= {TTFB_TARGET_MS:g} ms, several pieces >= half the plain's share): {'ok' if ttfb_ok else 'MISSED'}"
    )
    rows = []
    for k in ("plain", "metered"):
        rows.append(
            [
                k,
                " ".join(f"{c['cpu_us_per_request']:.0f}" for c in cpu[k]),
                f"{cpu_med[k]:.0f}",
                f"{med([c['per_s'] for c in cpu[k]]):.0f}",
                "" if k == "plain" else " ".join(f"{r:.3f}" for r in ratios),
                "" if k == "plain" else f"{ratio:.3f}",
                "" if k == "plain" else ("ok" if cpu_ok else "MISSED"),
            ]
        )
    print(
        f"\nPart 2, CPU: {args.clients} closed-loop clients, {args.seconds:g} s per proxy per round"
        + (" (both at once)" if args.together else "")
        + ", JSON answers of "
        f"{args.output_tokens} tokens; the proxy's utime+stime / answers (target: metered / plain <= {CPU_TARGET:g})"
    )
    print(table(rows, ["proxy", "µs CPU/request per round", "median", "calls/s", "ratio per round", "ratio", "target"]))

    missed = [] if ttfb_ok else [f"streams: metered - plain p50 TTFB {diff:+.3f} ms"]
    missed += [] if cpu_ok else [f"CPU: metered / plain {ratio:.3f}"]
    exits = unclean_exits({"exit_code": c} for c in codes.values())
    for line in exits:
        print(f"bench: {line}")
    missed += exits
    print(f"load average {loadavg()} at the end")
    dump_json(
        args.json,
        {
            "args": vars(args),
            "streams": {
                k: {
                    "n": len(ttfb[k]),
                    **{f"ttfb_p{q}_ms": percentile(ttfb[k], q) * 1000 for q in (50, 90, 99)},
                    "ttlb_p50_ms": percentile(ttlb[k], 50) * 1000,
                    "pieces_mean": statistics.fmean(pieces[k]),
                    "several_pieces_pct": multi[k],
                }
                for k in PATHS
            },
            "ttfb_p50_diff_ms_per_round": round_diffs,
            "cpu": cpu,
            "cpu_ratio_per_round": ratios,
            "meter": {"estimated": estimated, "settled": settled},
            "exit_codes": codes,
            "missed": missed,
        },
    )
    if missed:
        print("targets missed: " + "; ".join(missed))
    return 2 if missed and args.strict else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
