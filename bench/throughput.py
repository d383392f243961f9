#!/usr/bin/env python3
"""Saturation throughput and CPU per request of ONE proxy replica pinned to ONE core.

The proxy runs under ``taskset -c 1``; the load generator, the mock vendor
(unlimited) and redis-server share core 0. A closed-loop generator keeps
``--connections`` keep-alive connections busy with absolute-form requests
(``GET http://api.bench.example/v1/ping``, what HTTP_PROXY clients send) for
``--duration`` seconds after a warm-up. CPU per request = the proxy's
utime+stime delta (/proc/<pid>/stat) ÷ requests completed in the window.

Modes (every product mode has access log and metrics on; no limit ever binds):
  nolimit  the product, memory://, one global bucket at 1e9/s: the limiter costs a
           dict lookup and no I/O — the "without the limiter" baseline
  memory   the product, memory://, the shape of config/example.yaml (a tenant
           bucket, per-second and per-minute global buckets) at huge rates
  redis    as memory but on Redis: one EVALSHA per request, three keys
  shapes   as redis with every quota shape of SPEC §10 on: two endpoint classes (the
           request matches the second, which has limits of its own and cost 1), a
           concurrency cap on the vendor and on the class (a lease per request, given
           back after the answer), and a partition by the Authorization header the
           generator sends (one credential)
  minimal  bench/_minimal_proxy.py, a bare aiohttp forwarder (no limiter, metrics or
           log): the floor of the stack on this machine, for reference

Load generator: ``wrk`` when installed (apt-get install wrk), else
bench/_loadgen.py (raw asyncio protocols), or as chosen with --generator.

    python bench/throughput.py
    python bench/throughput.py --modes redis --duration 20 --connections 64
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    Proc,
    commandstats,
    cpu_busy,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    loadavg,
    metric_sum,
    outcomes,
    policy,
    require_pinning,
    run_main,
    script_calls,
    table,
    wait_cpu,
    watchdog,
)

BENCH = Path(__file__).resolve().parent
MODES = ("nolimit", "memory", "redis", "shapes", "minimal")
HUGE = 1_000_000_000
TARGET_URL = f"http://{VENDOR_HOST}/v1/ping"
_WRK_REQUESTS = re.compile(r"(\d+) requests in ([\d.]+)(\w+),")
_WRK_NON2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_WRK_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")
_MINIMAL_READY = re.compile(r"minimal-proxy listening on http://(\S+)")
CREDENTIAL = "Authorization: Bearer sk_bench_1"
"""Sent with every request (the ``shapes`` mode partitions by it; the others ignore it)."""
SHAPES = (
    "partition: {header: Authorization}",
    f"concurrency: {HUGE}",
    "endpoints:",
    "  - name: search",
    "    match: {methods: [POST], path: /v1/*/search}",
    f"    limits: [{{rate: {HUGE}, per: 1s, burst: {HUGE}}}]",
    "  - name: ping",
    "    match: {path: /v1/ping}",
    f"    limits: [{{rate: {HUGE}, per: 1s, burst: {HUGE}}}]",
    f"    concurrency: {HUGE}",
)


def wrk_script(target: str = TARGET_URL, body: int = 0) -> str:
    """wrk's Lua: the absolute-form request target, as a client behind HTTP_PROXY sends it
    (``body``: a POST of that many bytes, a form as a payments API takes)."""
    host = target.split("://", 1)[1].split("/", 1)[0]
    name, _, value = CREDENTIAL.partition(": ")
    lua = (
        f'wrk.method = "{"POST" if body else "GET"}"\nwrk.path = "{target}"\nwrk.headers["Host"] = "{host}"\n'
        f'wrk.headers["{name}"] = "{value}"\n'
    )
    if body:
        lua += 'wrk.headers["Content-Type"] = "application/x-www-form-urlencoded"\n'
        lua += f'wrk.body = string.rep("a", {body})\n'
    return lua


def generate(
    fleet: Fleet,
    generator: str,
    proxy_url: str,
    connections: int,
    duration: float,
    cpus: str | None,
    target: str = TARGET_URL,
    body: int = 0,
) -> tuple[dict[str, float], float]:
    """Run the load (absolute-form ``target``; ``body``: POSTs of that many bytes, wrk
    only); returns ({requests, non2xx, errors, elapsed}, generator CPU seconds)."""
    hostport = proxy_url.removeprefix("http://")
    if body and generator != "wrk":
        raise BenchError("POST bodies need wrk (apt-get install wrk)")
    if generator == "wrk":
        script = fleet.workdir / "absolute.lua"
        script.write_text(wrk_script(target, body))
        proc = fleet.start(
            "wrk",
            ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "-s", str(script), f"http://{hostport}/"],
            cpus=cpus,
        )
    else:
        proc = fleet.start(
            "loadgen",
            [
                sys.executable,
                str(BENCH / "_loadgen.py"),
                "--connect",
                hostport,
                "--target",
                target,
                "--connections",
                str(connections),
                "--duration",
                f"{duration:g}",
                "--header",
                CREDENTIAL,
            ],
            cpus=cpus,
        )
    cpu = wait_cpu(proc, duration + 20)
    code = proc.popen.returncode
    fleet.stop(proc)
    text = proc.stdout.read_text(errors="replace")
    if code != 0:
        raise BenchError(f"{generator} exited {code}:\n{proc.tail()}")
    if generator == "wrk":
        m = _WRK_REQUESTS.search(text)
        if not m:
            raise BenchError(f"cannot read wrk's output:\n{text}")
        unit = {"ms": 1e-3, "s": 1.0, "m": 60.0}.get(m.group(3), 1.0)
        non2xx = _WRK_NON2XX.search(text)
        errs = _WRK_ERRORS.search(text)
        return {
            "requests": int(m.group(1)),
            "elapsed": float(m.group(2)) * unit,
            "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "errors": sum(map(int, errs.groups())) if errs else 0,
        }, cpu
    try:
        return json.loads(text.strip().splitlines()[-1]), cpu
    except (ValueError, IndexError):
        raise BenchError(f"cannot read the load generator's output:\n{proc.tail()}") from None


def cpu_names(spec: str | None) -> list[str]:
    """taskset CPU list ("1", "0,1", "2-3") as /proc/stat names."""
    if not spec:
        return []
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += [f"cpu{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def start_proxy(
    fleet: Fleet, mode: str, vendor: Proc, redis: Proc | None, cpus: str | None, access_log: bool = True
) -> Proc:
    if mode == "minimal":
        proc = fleet.start(
            "minimal",
            [sys.executable, str(BENCH / "_minimal_proxy.py"), "--listen", f"{LOOPBACK}:0", "--upstream", vendor.url],
            cpus=cpus,
        )
        proc.url = "http://" + fleet.wait_line(proc, _MINIMAL_READY).group(1)
        return proc
    yaml = product_policy(mode, vendor.url, redis.url if redis is not None else None, access_log)
    return fleet.proxy(yaml, name=f"proxy-{mode}", cpus=cpus)


def product_policy(
    mode: str, vendor_url: str, redis_url: str | None, access_log: bool = True, store_timeout: str = "50ms"
) -> str:
    """The policy of a product mode (nolimit, memory, redis, shapes): limits that never bind."""
    if mode == "nolimit":
        return policy(vendor_url, [Limit(HUGE, "1s", HUGE)], action="defer", access_log=access_log)
    return policy(
        vendor_url,
        [Limit(HUGE, "1s", HUGE), Limit(HUGE * 60, "1m")],
        store=redis_url if mode in ("redis", "shapes") and redis_url is not None else "memory://",
        tenant_limits=[Limit(HUGE, "1s", HUGE)],
        action="defer",
        access_log=access_log,
        store_timeout=store_timeout,
        vendor_extra=SHAPES if mode == "shapes" else (),
    )


def measure(fleet: Fleet, args: argparse.Namespace, mode: str, vendor: Proc, redis: Proc | None) -> dict[str, Any]:
    proxy = start_proxy(fleet, mode, vendor, redis, args.proxy_cpu, not args.no_access_log)
    try:
        # Warm-up: connections, pools, the Lua script, first-call allocations.
        generate(fleet, args.generator, proxy.url, args.connections, args.warmup, args.load_cpu)
        before_metrics = outcomes(fetch_metrics(proxy.admin_url)) if proxy.admin_url else {}
        before_cmd = commandstats(redis.url) if redis is not None else {}
        others = [p for p in (vendor, redis) if p is not None]
        cpu_others0 = sum(cpu_seconds(p.pid) for p in others)
        busy0 = cpu_busy()
        cpu0, t0 = cpu_seconds(proxy.pid), time.monotonic()
        load, gen_cpu = generate(fleet, args.generator, proxy.url, args.connections, args.duration, args.load_cpu)
        cpu1, t1 = cpu_seconds(proxy.pid), time.monotonic()
        busy1 = cpu_busy()
        cpu_others1 = sum(cpu_seconds(p.pid) for p in others)
        after_cmd = commandstats(redis.url) if redis is not None else {}
        after_samples = fetch_metrics(proxy.admin_url) if proxy.admin_url else []
        after_metrics = outcomes(after_samples)
    finally:
        code = fleet.stop(proxy)
    done = int(load["requests"])
    if done <= 0:
        raise BenchError(f"{mode}: no request completed\n{proxy.tail()}")
    problem = None
    if load["non2xx"] > 0.01 * done or load["errors"] > 0.01 * done:
        problem = f"{load['non2xx']} non-2xx and {load['errors']} socket errors out of {done} requests"
    delta = {k: int(after_metrics.get(k, 0) - before_metrics.get(k, 0)) for k in after_metrics}
    evalsha = script_calls(before_cmd, after_cmd)[0] if redis is not None and mode in ("redis", "shapes") else None
    window = t1 - t0
    proxy_cpus = cpu_names(args.proxy_cpu)
    core_busy = sum(busy1[c] - busy0[c] for c in proxy_cpus) if proxy_cpus else None
    return {
        "mode": mode,
        "requests": done,
        "rps": done / load["elapsed"],
        "cpu_us_per_request": (cpu1 - cpu0) / done * 1e6,
        "proxy_core_utilisation": (cpu1 - cpu0) / window,
        "core0_utilisation": (gen_cpu + cpu_others1 - cpu_others0) / window,
        # what else ran on the proxy's core(s) in the window: other tenants of the machine
        "proxy_core_others": None if core_busy is None else max(core_busy - (cpu1 - cpu0), 0.0) / window,
        "non2xx": load["non2xx"],
        "errors": load["errors"],
        "outcomes": {k: v for k, v in delta.items() if v},
        "evalsha_per_request": None if evalsha is None else evalsha / done,
        "exit_code": code,
        "store_errors": int(metric_sum(after_samples, "ratelimit_store_errors_total")),
        "problem": problem,
    }


def median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one mode's rounds, the one with the median CPU per request."""
    ordered = sorted(results, key=lambda r: r["cpu_us_per_request"])
    return ordered[(len(ordered) - 1) // 2]


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/throughput.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per mode (default 10)")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds of load first (default 3)")
    p.add_argument("--connections", type=int, default=50, help="keep-alive connections (default 50)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of all modes; medians (default 1)")
    p.add_argument(
        "--generator",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="auto: wrk when installed, else bench/_loadgen.py",
    )
    p.add_argument("--proxy-cpu", default="1", help="taskset CPU list for the proxy (default 1)")
    p.add_argument("--load-cpu", default="0", help="taskset CPU list for generator, vendor, redis (default 0)")
    p.add_argument(
        "--no-access-log",
        action="store_true",
        help="turn the proxy's access log off (to see what it costs; the targets are with it on)",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin anything (figures then mean less)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when redis mode costs more than 250 µs/request")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}")
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "python"
    elif args.generator == "wrk" and not shutil.which("wrk"):
        p.error("wrk is not installed (apt-get install wrk), use --generator python")
    if args.no_pin:
        args.proxy_cpu = args.load_cpu = None
    else:
        require_pinning()
    watchdog(fleet, len(modes) * (args.duration + args.warmup + 60) + 30)

    print(f"bench/throughput.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    print(
        f"generator {args.generator}, {args.connections} connections; proxy on CPU {args.proxy_cpu or 'any'}, "
        f"generator/vendor/redis on CPU {args.load_cpu or 'any'}"
    )
    vendor = fleet.vendor(0, cpus=args.load_cpu)
    redis = fleet.redis(cpus=args.load_cpu) if {"redis", "shapes"} & set(modes) else None
    # Rounds interleave the modes (the machine's noise falls on all of them alike); each
    # mode's figures are then its round with the median CPU per request.
    rounds = [[measure(fleet, args, mode, vendor, redis) for mode in modes] for _ in range(args.rounds)]
    results = [median_round([r[i] for r in rounds]) for i in range(len(modes))]
    if args.rounds > 1:
        for i, mode in enumerate(modes):
            print(f"{mode}: CPU µs/req by round " + ", ".join(f"{r[i]['cpu_us_per_request']:.0f}" for r in rounds))

    rows = [
        [
            r["mode"],
            r["requests"],
            f"{r['rps']:.0f}",
            f"{r['cpu_us_per_request']:.0f}",
            f"{r['proxy_core_utilisation'] * 100:.0f}%",
            "-" if r["proxy_core_others"] is None else f"{r['proxy_core_others'] * 100:.0f}%",
            f"{r['core0_utilisation'] * 100:.0f}%",
            "-" if r["evalsha_per_request"] is None else f"{r['evalsha_per_request']:.3f}",
            ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()) or "-",
            r["store_errors"] if r["mode"] != "minimal" else "-",
        ]
        for r in results
    ]
    print(
        table(
            rows,
            [
                "mode",
                "requests",
                "req/s",
                "CPU µs/req",
                "proxy core",
                "others there",
                "load core",
                "evalsha/req",
                "proxy outcomes",
                "store errors",
            ],
        )
    )
    for r in results:
        if r["proxy_core_utilisation"] < 0.85:
            print(
                f"note: {r['mode']}: the proxy's core was only {r['proxy_core_utilisation'] * 100:.0f}% busy — "
                "not saturated (generator, vendor or another tenant of the machine was the bottleneck); "
                "CPU µs/req is still valid, req/s understates capacity"
            )
        if r["exit_code"] not in (0, None) and r["mode"] != "minimal":
            print(f"note: {r['mode']}: the proxy exited {r['exit_code']} on SIGTERM")
    dump_json(args.json, results)
    failed = [f"{r['mode']}: {r['problem']}" for r in results if r["problem"]]
    if failed:
        print("measurement invalid (more than 1% of requests failed): " + "; ".join(failed))
    redis_r = next((r for r in results if r["mode"] == "redis"), None)
    shapes_r = next((r for r in results if r["mode"] == "shapes"), None)
    if redis_r is not None and shapes_r is not None:
        print(
            f"shapes / redis CPU per request: {shapes_r['cpu_us_per_request'] / redis_r['cpu_us_per_request']:.2f} "
            "(endpoint classes, concurrency caps and a partition on, against none)"
        )
    if redis_r is not None:
        ok = redis_r["cpu_us_per_request"] <= 250
        print(
            f"target (redis store, <= 250 µs CPU/request): {'met' if ok else 'missed'} "
            f"({redis_r['cpu_us_per_request']:.0f} µs)"
        )
        if not ok and args.strict:
            return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_main(main))
