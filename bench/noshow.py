#!/usr/bin/env python3
"""Reserved quota nobody claims (issue 34): issue 34's table, this checkout against another.

Redis, one replica, a vendor allowing 10/s burst 10 that counts a STRICT SLIDING WINDOW (20
in any 1 s), ``defer``, an endpoint class ``files`` of ``cost: 5``. A burst of calls at once,
each on a connection of its own, whose deferred ones never come back; then ten workers that
sleep exactly ``retry-after-ms`` (each repeating its own URL on its own connection) for
``--seconds``. Rows: 20 x ``cost: 5`` and 40 x ``cost: 1`` deferred, and the same burst shed
(``X-Quota-On-Limit: shed``), the baseline. Each row's figure is the workers' calls served
per second; the target is >= 90 % of the shed run's, with no vendor 429.

    python bench/noshow.py                          # this checkout
    python bench/noshow.py --tree ../old --rounds 2 # and another (a git worktree), interleaved

The sustained overload of issue 34 (SDKs that give up) is ``bench/quota.py --parts retriers
--kinds giveup,giveup-fresh --fleets 40 --bursts 1,5``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
from _common import VENDOR_HOST, Fleet, Limit, http_json, loadavg, policy, run_main, table, watchdog

FILES = ["endpoints:", "  - {name: files, match: {path: '/v1/files*'}, cost: 5}"]
ROWS = (
    ("shed", "/v1/files", 20, True),
    ("20 x cost 5", "/v1/files", 20, False),
    ("40 x cost 1", "/v1/ping", 40, False),
)


async def burst(proxy: str, path: str, calls: int, shed: bool) -> int:
    headers = {"X-Quota-On-Limit": "shed"} if shed else {}

    async def one(i: int) -> int:
        url = f"http://{VENDOR_HOST}{path}/b{i}"
        async with aiohttp.ClientSession() as s, s.get(url, proxy=proxy, headers=headers) as r:
            await r.read()
            return int(r.headers.get("X-Quota-Action") == "defer")

    return sum(await asyncio.gather(*(one(i) for i in range(calls))))


async def workers(proxy: str, count: int, seconds: float) -> int:
    served = 0
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        nonlocal served
        calls = 0
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                calls += 1
                while time.monotonic() < deadline:
                    async with s.get(f"http://{VENDOR_HOST}/v1/ping/{i}-{calls}", proxy=proxy) as r:
                        await r.read()
                        if r.status == 200:
                            served += 1
                            break
                        hint = int(r.headers.get("retry-after-ms", "100")) / 1000
                    await asyncio.sleep(min(hint, max(deadline - time.monotonic(), 0.0)))

    await asyncio.gather(*(worker(i) for i in range(count)))
    return served


def run_row(fleet: Fleet, path: str, calls: int, shed: bool, seconds: float, tree: Path | None) -> dict[str, Any]:
    redis = fleet.redis(name=f"redis-{time.monotonic_ns()}")
    vendor = fleet.vendor(20, window="1s", name=f"vendor-{time.monotonic_ns()}")
    yaml = policy(
        vendor.url, [Limit(10, "1s", 10)], store=redis.url, action="defer", access_log=False, vendor_extra=FILES
    )
    proc = fleet.proxy(yaml, name=f"proxy-{time.monotonic_ns()}", tree=tree)
    try:

        async def go() -> tuple[int, int]:
            return await burst(proc.url, path, calls, shed), await workers(proc.url, 10, seconds)

        deferred, served = asyncio.run(go())
        stats = http_json(vendor.url + "/__mock/stats")
    finally:
        fleet.stop(proc)
        fleet.stop(vendor)
        fleet.stop(redis)
    return {"deferred": deferred, "served_per_s": served / seconds, "vendor_429": stats["rejected"]}


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="bench/noshow.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=12.0, help="the workers' run after each burst")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    p.add_argument("--tree", type=Path, help="also run this checkout's proxy (a git worktree), interleaved")
    args = p.parse_args(argv)
    trees: list[tuple[str, Path | None]] = [("this", None)] + ([("tree", args.tree)] if args.tree else [])
    watchdog(fleet, 120 + args.rounds * len(trees) * len(ROWS) * (args.seconds + 10))
    print(f"bench/noshow.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    got: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for name, tree in trees:
            for row, path, calls, shed in ROWS:
                r = run_row(fleet, path, calls, shed, args.seconds, tree)
                got.setdefault((name, row), []).append(r)
                print(f"  {name} {row}: {r}", flush=True)
    rows, missed = [], []
    for name, _ in trees:
        base = statistics.median(r["served_per_s"] for r in got[(name, "shed")])
        for row, *_ in ROWS:
            served = statistics.median(r["served_per_s"] for r in got[(name, row)])
            late = sum(r["vendor_429"] for r in got[(name, row)])
            ok = served >= 0.9 * base and not late
            if not ok and name == "this":
                missed.append(row)
            rows.append([name, row, f"{served:.2f}", f"{served / base * 100:.0f} %", late, "ok" if ok else "missed"])
    print(f"served per second after the burst ({args.seconds:g} s, median of {args.rounds}), vs the shed run:")
    print(table(rows, ["proxy", "burst", "served/s", "of shed", "vendor 429", ""]))
    return 2 if missed else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
