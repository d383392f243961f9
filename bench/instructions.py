"""Instructions per request: a CPU figure that does not move with the machine's load.

On this shared 2-core machine the CPU time per request of one proxy moves by ±30 % from
one round to the next (bench/peers.py prints the rounds), so a change worth a few per cent
cannot be seen in it. This script counts instead: each system runs under valgrind's
callgrind, which counts the instructions the process executes in user space, exactly,
whatever else the machine is doing. Sequential requests (one at a time, keep-alive) keep
the count from depending on how requests happened to batch: two runs of the same code
agree within about 0.1 %.

What it does not count: system calls' kernel time (the reads and writes every proxy makes,
about 40 % of a forwarded request's CPU in bench/peers.py's profile) and the cost of
cache misses. So it compares the Python work of two versions, or of a design and a floor;
bench/peers.py remains the figure for CPU per request against proxy.py.

Systems (``--systems``):

  redis        quota-proxy from this checkout, bench/peers.py's policy (Redis store, limits
               that never bind, access log and metrics on)
  memory       the same on memory:// (the embedded default: the limiter's work in-process)
  floor        bench/_floor_proxy.py: callbacks only, no store
  floor_redis  the same with one pipelined EVALSHA per request
  floor_async  floor_redis in the product's shape (a task per connection, a future per step)

and, to compare versions, ``--tree NAME=PATH`` (quota-proxy from another checkout, e.g. a
``git worktree`` of an older commit, same policy) or ``--also NAME=COMMAND`` (any forward
proxy; {port}, {upstream} and {redis} are filled in).

Each system: started under ``valgrind --tool=callgrind``, warmed up (``--warmup``
requests), its counters zeroed (``callgrind_control --zero``), then ``--requests``
requests, then its counters dumped and divided by the requests. The load is one aiohttp
client sending ``GET http://api.bench.example/v1/ping`` through the proxy, as with
``HTTP_PROXY``, one request at a time on one keep-alive connection.

    python bench/instructions.py [--systems redis,floor_async] [--tree before=/tmp/wt]
        [--requests 600] [--warmup 200] [--rounds 1] [--json FILE] [--keep-dumps DIR]

Needs valgrind (``apt-get install valgrind``). A run of one system takes about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from _common import LOOPBACK, ROOT, BenchError, Fleet, Proc, free_port, loadavg, run_main, watchdog
from throughput import CREDENTIAL, TARGET_URL, product_policy

BENCH = Path(__file__).resolve().parent
SYSTEMS = ("redis", "memory", "shapes", "floor", "floor_redis", "floor_async")
_TOTALS = re.compile(rb"^(?:summary|totals): (\d+)", re.M)
_START_TIMEOUT = 180.0  # seconds for a system to answer its first request under valgrind (50x slower)


def _valgrind() -> tuple[str, str]:
    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if valgrind is None or control is None:
        raise BenchError("valgrind is not installed (apt-get install valgrind)")
    return valgrind, control


async def _send(url: str, count: int, body: int = 0) -> None:
    """``count`` requests through the proxy at ``url``, one at a time on one connection
    (``body``: POSTs of that many bytes, else GETs)."""
    name, _, value = CREDENTIAL.partition(": ")
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=60)
    data = b"x" * body if body else None
    method = "POST" if body else "GET"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(count):
            async with session.request(method, TARGET_URL, proxy=url, headers={name: value}, data=data) as resp:
                await resp.read()
                if resp.status != 200:
                    raise BenchError(f"the proxy answered {resp.status}: {(await resp.text())[:200]}")


def _first_answer(proc: Proc, url: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        try:
            asyncio.run(_send(url, 1))
            return
        except (TimeoutError, aiohttp.ClientError, OSError, BenchError) as exc:
            if not proc.alive():
                raise BenchError(f"{proc.name} exited at start:\n{proc.tail()}") from exc
            if time.monotonic() > deadline:
                raise BenchError(f"{proc.name} did not answer within {_START_TIMEOUT:.0f}s: {exc}") from exc
            time.sleep(1.0)


def command(name: str, spec: str | None, vendor: Proc, redis: Proc, port: int, policy: Path) -> tuple[list[str], Path]:
    """The argv of system ``name`` listening on ``port``, and the directory to run it in."""
    if name in SYSTEMS and spec is None:
        if name in ("redis", "memory", "shapes"):
            policy = policy.with_name(f"policy-{name}.yaml") if name != "redis" else policy
            argv = [sys.executable, "-m", "proxy", "run", "-c", str(policy), "--listen", f"{LOOPBACK}:{port}"]
            return [*argv, "--admin-listen", f"{LOOPBACK}:0", "--log-level", "warning"], ROOT
        argv = [sys.executable, str(BENCH / "_floor_proxy.py"), "--port", str(port), "--upstream", vendor.url]
        argv += ["--redis", redis.url] if name != "floor" else []
        return argv + (["--coroutines"] if name == "floor_async" else []), ROOT
    assert spec is not None
    kind, _, value = spec.partition(":")
    if kind == "tree":
        if name.endswith("-shapes"):  # an older checkout with throughput.py's shapes policy
            policy = policy.with_name("policy-shapes.yaml")
        argv = [sys.executable, "-m", "proxy", "run", "-c", str(policy), "--listen", f"{LOOPBACK}:{port}"]
        return [*argv, "--admin-listen", f"{LOOPBACK}:0", "--log-level", "warning"], Path(value)
    return shlex.split(value.format(port=port, upstream=vendor.url, redis=redis.url)), ROOT


def measure(fleet: Fleet, name: str, spec: str | None, vendor: Proc, redis: Proc, args: argparse.Namespace) -> float:
    """Instructions per request of one system (one run)."""
    valgrind, control = _valgrind()
    policy = fleet.workdir / "policy.yaml"
    port = free_port()
    argv, cwd = command(name, spec, vendor, redis, port, policy)
    out = fleet.workdir / f"callgrind.{name}"
    tool = [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}.%p", "--dump-instr=no"]
    env = {"PYTHONPATH": str(cwd)} if cwd != ROOT else None
    proc = fleet.start(f"{name}-under-valgrind", [*tool, *argv], cwd=cwd, env=env)
    url = f"http://{LOOPBACK}:{port}"
    try:
        _first_answer(proc, url)
        asyncio.run(_send(url, args.warmup, args.body))
        subprocess.run([control, "--zero", str(proc.pid)], check=True, capture_output=True, timeout=60)
        asyncio.run(_send(url, args.requests, args.body))
        subprocess.run([control, "--dump=measured", str(proc.pid)], check=True, capture_output=True, timeout=60)
    finally:
        fleet.stop(proc, timeout=60)
    dumps = [p for p in fleet.workdir.glob(f"callgrind.{name}.{proc.pid}.*") if b"measured" in p.read_bytes()[:4096]]
    if len(dumps) != 1:
        raise BenchError(f"{name}: expected one dump of the measured requests, found {len(dumps)}")
    found = _TOTALS.search(dumps[0].read_bytes())
    if found is None:
        raise BenchError(f"{name}: no totals in {dumps[0]}")
    if args.keep_dumps:  # for callgrind_annotate: where the instructions go, by C function
        Path(args.keep_dumps).mkdir(parents=True, exist_ok=True)
        shutil.copy(dumps[0], Path(args.keep_dumps) / f"callgrind.{name}")
    for leftover in fleet.workdir.glob(f"callgrind.{name}.*"):
        leftover.unlink()
    return int(found.group(1)) / args.requests


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--systems", default="redis,floor_async", help=f"any of {','.join(SYSTEMS)} (default redis,floor_async)"
    )
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="quota-proxy from another checkout (a NAME ending -shapes: the shapes policy)",
    )
    p.add_argument("--also", action="append", default=[], metavar="NAME=COMMAND", help="another forward proxy")
    p.add_argument("--requests", type=int, default=600, help="measured requests per system (default 600)")
    p.add_argument("--warmup", type=int, default=200, help="requests before the count starts (default 200)")
    p.add_argument("--body", type=int, default=0, metavar="BYTES", help="POST bodies of BYTES (default: GETs)")
    p.add_argument("--rounds", type=int, default=1, help="runs per system, interleaved; the median is shown")
    p.add_argument("--base", metavar="NAME", help="the system the others are compared with (default: the first)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--keep-dumps",
        metavar="DIR",
        help="keep each system's callgrind dump of the measured requests as DIR/callgrind.NAME "
        "(callgrind_annotate DIR/callgrind.NAME: instructions by C function)",
    )
    args = p.parse_args(argv)
    systems: dict[str, str | None] = {}
    for name in (s.strip() for s in args.systems.split(",") if s.strip()):
        if name not in SYSTEMS:
            p.error(f"unknown system {name!r}: expected any of {', '.join(SYSTEMS)}")
        systems[name] = None
    for kind, given in (("tree", args.tree), ("cmd", args.also)):
        for spec in given:
            name, sep, value = spec.partition("=")
            if not sep or not name or name in systems:
                p.error(f"--{'tree' if kind == 'tree' else 'also'} takes NAME=VALUE with a new NAME, not {spec!r}")
            systems[name] = f"{kind}:{value}"
    if not systems or args.requests < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("nothing to measure")
    if args.base is not None and args.base not in systems:
        p.error(f"--base {args.base!r} is not among the systems measured")
    _valgrind()
    watchdog(fleet, 120 + len(systems) * args.rounds * (_START_TIMEOUT + (args.requests + args.warmup) * 0.5))
    print(f"bench/instructions.py: load average {loadavg()} at start (instruction counts do not depend on it)")
    redis = fleet.redis()
    vendor = fleet.vendor(1e9)
    (fleet.workdir / "policy.yaml").write_text(product_policy("redis", vendor.url, redis.url, store_timeout="5s"))
    (fleet.workdir / "policy-memory.yaml").write_text(product_policy("memory", vendor.url, None))
    shapes = product_policy("shapes", vendor.url, redis.url, store_timeout="5s")
    (fleet.workdir / "policy-shapes.yaml").write_text(shapes)
    counts: dict[str, list[float]] = {name: [] for name in systems}
    for round_ in range(args.rounds):
        for name, spec in systems.items():
            counts[name].append(measure(fleet, name, spec, vendor, redis, args))
            print(f"round {round_ + 1}/{args.rounds}: {name} {counts[name][-1]:,.0f} instructions/request", flush=True)
    first = args.base or next(iter(systems))
    base = statistics.median(counts[first])
    print(
        f"\nuser-space instructions per request ({args.requests} sequential requests after {args.warmup}), "
        f"median of {args.rounds}"
    )
    width = max(len(n) for n in systems)
    for name in systems:
        mid = statistics.median(counts[name])
        spread = f"{min(counts[name]):,.0f}-{max(counts[name]):,.0f}" if args.rounds > 1 else ""
        print(f"  {name:>{width}}  {mid:>10,.0f}  {mid / base:5.2f}x {first}  {spread}")
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": args.requests, "warmup": args.warmup, "counts": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
