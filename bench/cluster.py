#!/usr/bin/env python3
"""redis:// against redis+cluster://: CPU per request and req/s of ONE proxy replica on ONE core.

Three proxies, the product with the shape of config/example.yaml at rates that never
bind (access log and metrics on), each pinned to core 1 and measured in turn:

  redis             redis://, acquires on the pipelined connection (pipelined.py)
  cluster-redis-py  redis+cluster:// on a three-node Redis Cluster, acquires through
                    redis-py's cluster client one call at a time (the path before 0.x)
  cluster           the same cluster, acquires on one pipelined connection per primary
                    (cluster_pipelined.py)

The load generator (wrk when installed, else bench/_loadgen.py), the mock vendor, the
redis-server and the cluster's three nodes share core 0. The systems take turns within
each round (interleaved, so a noisy neighbour hits all alike); the table gives medians
over the rounds. CPU per request = the proxy's utime+stime delta ÷ requests completed.

    python bench/cluster.py
    python bench/cluster.py --rounds 5 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis as sync_redis
from _common import (
    _PROXY_READY,
    LOOPBACK,
    BenchError,
    Fleet,
    Proc,
    commandstats,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    free_port,
    loadavg,
    metric_sum,
    require_pinning,
    run_main,
    script_calls,
    table,
    watchdog,
)
from throughput import generate, product_policy

SYSTEMS = ("redis", "cluster-redis-py", "cluster")

# The "before" path without a product switch: the proxy process with RedisStore's
# default turned to redis-py, then the ordinary CLI.
_REDIS_PY_LAUNCHER = (
    "import sys, proxy.limiter.redis_store as s; "
    "s.RedisStore.__init__.__kwdefaults__['pipelined'] = False; "
    "from proxy.cli import main; sys.argv[0] = 'quota-proxy'; raise SystemExit(main())"
)


def start_cluster(fleet: Fleet, cpus: str | None) -> tuple[str, list[str]]:
    """Three cluster-enabled redis-servers, no replicas: (redis+cluster:// URL, node URLs)."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise BenchError("redis-server and redis-cli are needed (apt-get install redis-server)")
    ports = []
    while len(ports) < 3:
        port = free_port()
        if port <= 55535 and port not in ports and port != 6379:  # the cluster bus is port + 10000
            ports.append(port)
    for port in ports:
        node = [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
        node += ["--dir", str(fleet.workdir), "--loglevel", "warning"]
        node += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
        fleet.start(f"cluster-{port}", node, cpus=cpus)
    for port in ports:
        _wait(lambda p=port: bool(_ask(p, "PING")), "PING")
    create = fleet.start(
        "cluster-create",
        [cli, "--cluster", "create", *(f"{LOOPBACK}:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"],
    )
    if create.popen.wait(30) != 0:
        raise BenchError(f"redis-cli --cluster create failed:\n{create.tail()}")

    _wait(lambda: all(b"cluster_state:ok" in _ask(p, "CLUSTER", "INFO") for p in ports), "cluster_state:ok")
    return f"redis+cluster://{LOOPBACK}:{ports[0]}", [f"redis://{LOOPBACK}:{p}/0" for p in ports]


def _ask(port: int, *command: str) -> Any:
    with sync_redis.Redis(host=LOOPBACK, port=port, socket_timeout=0.5) as client:
        return client.execute_command(*command)


def _wait(probe: Any, what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if probe():
                return
        except sync_redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise BenchError(f"no {what} within {within:.0f}s")
        time.sleep(0.05)


def start_proxy(fleet: Fleet, system: str, vendor_url: str, store: str, args: argparse.Namespace) -> Proc:
    yaml = product_policy("redis", vendor_url, store, store_timeout=args.store_timeout)
    cpus = args.proxy_cpu
    if system != "cluster-redis-py":
        return fleet.proxy(yaml, name=f"proxy-{system}", cpus=cpus)
    cfg = fleet.workdir / f"proxy-{system}.yaml"
    cfg.write_text(yaml)
    argv = [sys.executable, "-c", _REDIS_PY_LAUNCHER, "run", "-c", str(cfg)]
    argv += ["--listen", f"{LOOPBACK}:0", "--admin-listen", f"{LOOPBACK}:0", "--log-level", "warning"]
    proc = fleet.start(f"proxy-{system}", argv, cpus=cpus)
    m = fleet.wait_line(proc, _PROXY_READY)
    proc.url, proc.admin_url = f"http://{m.group(1)}", f"http://{m.group(2)}"
    return proc


def measure(fleet: Fleet, args: argparse.Namespace, proxy: Proc, redis_urls: list[str]) -> dict[str, Any]:
    before = [commandstats(u) for u in redis_urls]
    cpu0 = cpu_seconds(proxy.pid)
    load, _ = generate(fleet, args.generator, proxy.url, args.connections, args.duration, args.load_cpu)
    cpu1 = cpu_seconds(proxy.pid)
    after = [commandstats(u) for u in redis_urls]
    done = int(load["requests"])
    if done <= 0:
        raise BenchError(f"{proxy.name}: no request completed\n{proxy.tail()}")
    evalsha = sum(script_calls(b, a)[0] for b, a in zip(before, after, strict=True))
    return {
        "requests": done,
        "rps": done / load["elapsed"],
        "cpu_us_per_request": (cpu1 - cpu0) / done * 1e6,
        "evalsha_per_request": evalsha / done,
        "failed": int(load["non2xx"] + load["errors"]),
    }


async def _acquire_loop(url: str, pipelined: bool, callers: int, duration: float) -> dict[str, float]:
    """``callers`` tasks acquiring on one RedisStore for ``duration`` s: the store alone,
    without the HTTP around it (the shape of config/example.yaml's buckets)."""
    from proxy.limiter.redis_store import RedisStore
    from proxy.limiter.store import BucketSpec

    huge = 1e9
    buckets = (
        BucketSpec("bench:{bench}:state", huge, huge, "global", "1s", field="g:1s"),
        BucketSpec("bench:{bench}:state", huge, huge, "global", "1m", field="g:1m"),
        BucketSpec("bench:{bench}:t:default:1s", huge, huge, "tenant", "tenant"),
    )
    store = RedisStore(url, timeout=1.0, pipelined=pipelined)
    done = errors = 0
    why: Counter[str] = Counter()
    stop = 0.0

    async def caller() -> None:
        nonlocal done, errors
        while time.monotonic() < stop:
            try:
                await store.acquire(buckets, 1, 0)
                done += 1
            except Exception as exc:  # redis-py's cluster client raises more than RedisError
                errors += 1
                why[f"{type(exc).__name__}: {exc}"[:100]] += 1

    try:
        stop = time.monotonic() + 0.5  # warm-up: connections, the script, the slot map
        await asyncio.gather(*(caller() for _ in range(callers)))
        done = errors = 0
        cpu0, t0 = time.process_time(), time.monotonic()
        stop = t0 + duration
        await asyncio.gather(*(caller() for _ in range(callers)))
        cpu1, t1 = time.process_time(), time.monotonic()
    finally:
        await store.close()
    return {
        "acquires": done,
        "rate": done / (t1 - t0),
        "cpu_us": (cpu1 - cpu0) / max(done, 1) * 1e6,
        "errors": errors,
        "why": dict(why.most_common(3)),
    }


def store_alone(fleet: Fleet, args: argparse.Namespace, system: str, url: str) -> dict[str, Any]:
    """One run of _acquire_loop in a child process pinned like the proxies."""
    pipelined = "1" if system != "cluster-redis-py" else "0"
    argv = [sys.executable, str(Path(__file__).resolve()), "--store-loop", url, pipelined]
    argv += [str(args.connections), f"{args.store_duration:g}"]
    proc = fleet.start(f"store-{system}", argv, cpus=args.proxy_cpu)
    code = proc.popen.wait(args.store_duration + 30)
    fleet.stop(proc)
    if code != 0:
        raise BenchError(f"the store loop of {system} exited {code}:\n{proc.tail()}")
    return dict(json.loads(proc.stdout.read_text().strip().splitlines()[-1]))


def refusals(proxy: Proc) -> str:
    """The most frequent outcomes other than forwarded, with their detail (the access log)."""
    seen: Counter[str] = Counter()
    for line in proxy.stderr.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("outcome") not in (None, "forwarded"):
                seen[f"{entry['outcome']}: {entry.get('detail')}"] += 1
    return "; ".join(f"{n} x {what}" for what, n in seen.most_common(3)) or "nothing logged"


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/cluster.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=int, default=3, help="measured seconds per system per round (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured seconds of load per proxy first (default 1)")
    p.add_argument("--connections", type=int, default=50, help="keep-alive connections (default 50)")
    p.add_argument("--generator", choices=["auto", "wrk", "python"], default="auto")
    p.add_argument("--proxy-cpu", default="1", help="taskset CPU list for the proxies (default 1)")
    p.add_argument("--load-cpu", default="0", help="taskset CPU list for generator, vendor, Redis (default 0)")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything (figures then mean less)")
    p.add_argument(
        "--store-timeout",
        default="1s",
        help="the proxies' store.timeout (default 1s, as bench/peers.py: on a shared machine a 50 ms "
        "timeout trips the breaker and the figures measure refusals)",
    )
    p.add_argument(
        "--store-duration",
        type=float,
        default=1.0,
        help="seconds per system per round of the store alone (acquires in-process, no HTTP); 0: skip",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--store-loop", nargs=4, metavar=("URL", "PIPELINED", "CALLERS", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.store_loop:  # the child process of store_alone
        url, pipelined, callers, seconds = args.store_loop
        print(json.dumps(asyncio.run(_acquire_loop(url, pipelined == "1", int(callers), float(seconds)))))
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        p.error(f"--systems takes {', '.join(SYSTEMS)}")
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "python"
    if args.no_pin:
        args.proxy_cpu = args.load_cpu = None
    else:
        require_pinning()
    per_round = args.duration + 5 + (args.store_duration + 3 if args.store_duration > 0 else 0)
    watchdog(fleet, len(systems) * (args.warmup + args.rounds * per_round) + 60)

    print(f"bench/cluster.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    print(
        f"generator {args.generator}, {args.connections} connections; proxies on CPU {args.proxy_cpu or 'any'}, "
        f"generator/vendor/redis/cluster on CPU {args.load_cpu or 'any'}; {args.rounds} interleaved rounds "
        f"of {args.duration:g}s per system"
    )
    vendor = fleet.vendor(0, cpus=args.load_cpu)
    stores: dict[str, tuple[str, list[str]]] = {}
    if "redis" in systems:
        redis = fleet.redis(cpus=args.load_cpu)
        stores["redis"] = (redis.url, [redis.url])
    if {"cluster", "cluster-redis-py"} & set(systems):
        cluster = start_cluster(fleet, args.load_cpu)
        stores["cluster"] = stores["cluster-redis-py"] = cluster
    proxies = {s: start_proxy(fleet, s, vendor.url, stores[s][0], args) for s in systems}
    for proxy in proxies.values():  # connections, pools, the Lua script, first-call allocations
        generate(fleet, args.generator, proxy.url, args.connections, args.warmup, args.load_cpu)

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    alone: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for i in range(args.rounds):
        for s in systems:
            runs[s].append(measure(fleet, args, proxies[s], stores[s][1]))
            if args.store_duration > 0:
                alone[s].append(store_alone(fleet, args, s, stores[s][0]))
        print(f"round {i + 1}: " + ", ".join(f"{s} {runs[s][-1]['cpu_us_per_request']:.0f} µs" for s in systems))
    store_errors = {
        s: int(metric_sum(fetch_metrics(proxies[s].admin_url), "ratelimit_store_errors_total")) for s in systems
    }
    for proxy in proxies.values():
        fleet.stop(proxy)
    for s in systems:
        if store_errors[s] or any(r["failed"] for r in runs[s]):
            print(f"{s}: what went wrong, from its access log: {refusals(proxies[s])}")

    med = {
        s: {k: statistics.median(r[k] for r in runs[s]) for k in ("rps", "cpu_us_per_request", "evalsha_per_request")}
        for s in systems
    }
    rows = [
        [
            s,
            f"{med[s]['rps']:.0f}",
            f"{med[s]['cpu_us_per_request']:.0f}",
            " / ".join(f"{r['cpu_us_per_request']:.0f}" for r in runs[s]),
            f"{med[s]['evalsha_per_request']:.3f}",
            sum(r["failed"] for r in runs[s]),
            store_errors[s],
        ]
        for s in systems
    ]
    print(
        table(
            rows,
            ["system", "req/s", "CPU µs/req", "per round", "evalsha/req", "failed", "store errors"],
        )
    )
    pairs = [("cluster", "redis"), ("cluster-redis-py", "redis"), ("cluster", "cluster-redis-py")]
    for a, b in pairs:
        if a in med and b in med:
            print(
                f"{a} / {b}: CPU per request {med[a]['cpu_us_per_request'] / med[b]['cpu_us_per_request']:.2f}x, "
                f"req/s {med[a]['rps'] / med[b]['rps']:.2f}x"
            )
    if args.store_duration > 0:
        solo = {s: {k: statistics.median(r[k] for r in alone[s]) for k in ("rate", "cpu_us")} for s in systems}
        print(
            f"\nthe store alone ({args.connections} callers in one process on CPU {args.proxy_cpu or 'any'}, "
            "acquire after acquire, no HTTP, store timeout 1s):"
        )
        rows = [
            [
                s,
                f"{solo[s]['rate']:.0f}",
                f"{solo[s]['cpu_us']:.1f}",
                " / ".join(f"{r['cpu_us']:.1f}" for r in alone[s]),
                int(sum(r["errors"] for r in alone[s])),
            ]
            for s in systems
        ]
        print(table(rows, ["system", "acquires/s", "CPU µs/acquire", "per round", "errors"]))
        for s in systems:
            why = Counter[str]()
            for r in alone[s]:
                why.update(r["why"])
            if why:
                print(f"{s}: store errors: " + "; ".join(f"{n} x {w}" for w, n in why.most_common(3)))
        for a, b in pairs:
            if a in solo and b in solo:
                print(
                    f"{a} / {b}: CPU per acquire {solo[a]['cpu_us'] / solo[b]['cpu_us']:.2f}x, "
                    f"acquires/s {solo[a]['rate'] / solo[b]['rate']:.2f}x"
                )
    print(f"load average {loadavg()} at the end")
    dump_json(args.json, {"runs": runs, "medians": med, "store_errors": store_errors, "store_alone": alone})
    failed = [s for s in systems if sum(r["failed"] for r in runs[s]) > 0.01 * sum(r["requests"] for r in runs[s])]
    if failed:
        print("measurement invalid (more than 1% of requests failed): " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
