"""CPU per Limiter.acquire on our side, against a real redis-server: this tree vs another.

    .venv/bin/python bench/limiter_acquire.py --against /work/main [--acquires 20000] [--rounds 3] [--loop asyncio]

Starts one redis-server on a free port (stopped by its PID at the end), then runs, in
alternating subprocesses (one per tree and round), two loops on the bench policy's shape
(a tenant limit, two global limits, deferral queue, state guard; limits that never bind):

- ``redis``: ``--acquires`` Limiter.acquire calls from 50 concurrent tasks over the
  pipelined connection; process CPU time per acquire (Redis runs in its own process);
- ``no-io``: the same calls with the pipelined script answering a canned reply at once
  (what the limiter and the store spend per acquire, without sockets or event-loop turns).

Prints the median per tree and mode, in µs. Not part of the product; bounded to ~60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASKS = 50
HUGE = 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _child(url: str, acquires: int, mode: str) -> float:
    from proxy.clock import SystemClock
    from proxy.limiter import Breaker, Limiter
    from proxy.limiter.redis_store import RedisStore
    from proxy.policy.model import Limit, OnLimit, TenantLimits, Vendor

    vendor = Vendor(
        name="bench",
        hosts=("api.bench.example",),
        limits=(Limit(HUGE, 1.0, HUGE), Limit(HUGE * 60, 60.0, HUGE * 60)),
        tenant_limits=TenantLimits(default=(Limit(HUGE, 1.0, HUGE),)),
        on_limit=OnLimit("defer", 0.5),
    )
    clock = SystemClock()
    store = RedisStore(url, timeout=0.5)
    limiter = Limiter(store, clock, key_prefix="bench", breaker=Breaker(clock, 3, 1.0))
    await limiter.acquire(vendor, "acme", 0.0)  # connect, load the script
    if mode == "no-io":
        # Redis's answer comes back inside the write: the wire and the loop's turns drop
        # out; encoding the command and parsing the reply stay in.
        proto = store._pipe._proto  # type: ignore[union-attr]
        reply = b"*11\r\n" + b"".join(
            b"$%d\r\n%s\r\n" % (len(x), x)
            for x in (b"1", b"0.000", b"0", b"0.000", b"7", b"0", b"0", b"61000", b"1.0", b"2.0", b"3.0")
        )

        class Echo:
            def write(self, data: bytes) -> None:
                proto.data_received(reply)

            def writelines(self, data: Any) -> None:
                proto.data_received(reply)

            def close(self) -> None:
                pass

        proto.transport = Echo()

    per_task = acquires // TASKS

    async def run() -> None:
        for _ in range(per_task):
            await limiter.acquire(vendor, "acme", 0.0)

    await asyncio.gather(*(run() for _ in range(TASKS)))  # warm-up
    t0 = time.process_time()
    await asyncio.gather(*(run() for _ in range(TASKS)))
    cpu = time.process_time() - t0
    await store.close()
    return cpu / (per_task * TASKS) * 1e6


def _run_child(tree: str, url: str, acquires: int, mode: str, loop: str) -> float:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, __file__, "--child", url, "--acquires", str(acquires), "--mode", mode, "--loop", loop],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", default="/work/main", help="the other tree (its proxy/ is imported)")
    ap.add_argument("--after", default=str(ROOT), help="the tree measured against it (default: this one)")
    ap.add_argument("--acquires", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="redis,no-io")
    ap.add_argument("--child")
    ap.add_argument("--mode", default="redis")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the proxy runs on uvloop")
    args = ap.parse_args()
    if args.child:
        factory = asyncio.new_event_loop
        if args.loop == "uvloop":
            import uvloop

            factory = uvloop.new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            print(runner.run(_child(args.child, args.acquires, args.mode)))
        return 0
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="limiter-bench-")
    redis = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
        trees = {"before": args.against, "after": args.after}
        results: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for mode in args.modes.split(","):
                for name, tree in trees.items():
                    results.setdefault((name, mode), []).append(_run_child(tree, url, args.acquires, mode, args.loop))
        print(f"event loop: {args.loop}; {args.acquires} acquires per run, {TASKS} tasks; medians of {args.rounds}")
        for mode in args.modes.split(","):
            before = statistics.median(results[("before", mode)])
            after = statistics.median(results[("after", mode)])
            print(
                f"{mode:6} before {before:6.1f} µs/acquire  after {after:6.1f} µs/acquire  "
                f"saved {before - after:5.1f} µs ({100 * (before - after) / before:4.1f} %)  "
                f"rounds before {[round(x, 1) for x in results[('before', mode)]]} "
                f"after {[round(x, 1) for x in results[('after', mode)]]}"
            )
    finally:
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
