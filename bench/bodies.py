#!/usr/bin/env python3
"""Large bodies through the proxy: peak RSS growth and checksums.

Three transfers through one proxy replica (memory:// by default, an unlimited
mock vendor behind it):

  upload          POST /sha256 with a 50 MB body streamed from an async generator
                  (chunked, never held whole by the client); the vendor's sha256
                  must match the one computed while generating
  download        GET /bytes/52428800 read as fast as possible; sha256 and length
                  checked against the vendor's known byte pattern
  slow-download   the same read at --slow-rate MB/s: the vendor writes far faster
                  than the worker reads, so an unbounded buffer in the proxy shows

For each, the proxy's VmRSS is sampled every 10 ms from /proc/<pid>/status
during the transfer and compared with its baseline just before (after a warm-up
transfer, so pools and first-use allocations are already paid); VmHWM (the
kernel's own peak, reset through /proc/<pid>/clear_refs) is shown alongside.
Target (issue 2): growth below 20 MB for each.

    python bench/bodies.py
    python bench/bodies.py --size-mb 200 --store redis
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from _common import (
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    RssSampler,
    dump_json,
    loadavg,
    policy,
    reset_peak_rss,
    run_main,
    status_kb,
    table,
    watchdog,
)

MB = 1024 * 1024
_CHUNK = 64 * 1024
_PATTERN = bytes(range(256)) * (_CHUNK // 256)


def pattern_sha256(n: int) -> str:
    """sha256 of the mock vendor's /bytes/{n} body: bytes(range(256)) repeated."""
    digest = hashlib.sha256()
    while n >= _CHUNK:
        digest.update(_PATTERN)
        n -= _CHUNK
    digest.update(_PATTERN[:n])
    return digest.hexdigest()


class Upload:
    """A body generated on the fly, hashed as it is produced."""

    def __init__(self, size: int, chunk: int = _CHUNK) -> None:
        self.size = size
        self.chunk = chunk
        self.digest = hashlib.sha256()
        self.sent = 0

    async def __call__(self) -> AsyncIterator[bytes]:
        block = os.urandom(self.chunk)
        counter = 0
        while self.sent < self.size:
            n = min(self.chunk, self.size - self.sent)
            # Varying content (not one repeated block) without paying urandom for every chunk.
            data = counter.to_bytes(8, "little") + block[8:n] if n >= 8 else block[:n]
            counter += 1
            self.digest.update(data)
            self.sent += n
            yield data


async def upload(session: aiohttp.ClientSession, proxy: str, size: int) -> dict[str, Any]:
    body = Upload(size)
    async with session.post(
        f"http://{VENDOR_HOST}/sha256", data=body(), proxy=proxy, headers={"Content-Type": "application/octet-stream"}
    ) as resp:
        payload = await resp.json(content_type=None)
        if resp.status != 200:
            raise BenchError(f"upload: status {resp.status}: {payload}")
    ok = payload.get("sha256") == body.digest.hexdigest() and payload.get("bytes") == size
    return {"bytes": payload.get("bytes"), "checksum_ok": ok}


async def download(session: aiohttp.ClientSession, proxy: str, size: int, rate_mb: float | None) -> dict[str, Any]:
    digest = hashlib.sha256()
    got = 0
    start = time.monotonic()
    async with session.get(f"http://{VENDOR_HOST}/bytes/{size}", proxy=proxy) as resp:
        if resp.status != 200:
            raise BenchError(f"download: status {resp.status}")
        async for chunk in resp.content.iter_chunked(_CHUNK):
            digest.update(chunk)
            got += len(chunk)
            if rate_mb:
                ahead = got / (rate_mb * MB) - (time.monotonic() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    return {"bytes": got, "checksum_ok": got == size and digest.hexdigest() == pattern_sha256(size)}


async def transfer(kind: str, proxy_url: str, pid: int, size: int, slow_rate: float) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=600, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Warm-up: the same kind of transfer, small, so the baseline includes pools and code paths.
        if kind == "upload":
            await upload(session, proxy_url, 2 * MB)
        else:
            await download(session, proxy_url, 2 * MB, None)
        await asyncio.sleep(0.3)
        base_samples = []
        for _ in range(20):
            base_samples.append(status_kb(pid, "VmRSS"))
            await asyncio.sleep(0.01)
        baseline = statistics.median(base_samples)
        hwm_reset = reset_peak_rss(pid)
        t0 = time.monotonic()
        with RssSampler(pid, 0.010) as sampler:
            if kind == "upload":
                result = await upload(session, proxy_url, size)
            else:
                result = await download(session, proxy_url, size, slow_rate if kind == "slow-download" else None)
        elapsed = time.monotonic() - t0
        await asyncio.sleep(0.2)
        after = status_kb(pid, "VmRSS")
        hwm = status_kb(pid, "VmHWM")
    if len(sampler.samples) < 3:
        raise BenchError(f"{kind}: only {len(sampler.samples)} RSS samples")
    peak = max(sampler.samples)
    return {
        "kind": kind,
        **result,
        "seconds": elapsed,
        "mb_per_s": size / MB / elapsed,
        "baseline_mb": baseline / 1024,
        "peak_mb": peak / 1024,
        "growth_mb": (peak - baseline) / 1024,
        "hwm_growth_mb": (hwm - baseline) / 1024 if hwm_reset else None,
        "after_mb": after / 1024,
        "samples": len(sampler.samples),
    }


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/bodies.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size-mb", type=float, default=50.0, help="body size in MiB (default 50)")
    p.add_argument("--slow-rate", type=float, default=25.0, help="slow-download read rate, MiB/s (default 25)")
    p.add_argument("--kinds", default="upload,download,slow-download", help="which transfers (default all three)")
    p.add_argument("--store", choices=["memory", "redis"], default="memory", help="proxy store (default memory)")
    p.add_argument("--limit-mb", type=float, default=20.0, help="growth target, MiB (default 20)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when a transfer grows RSS by --limit-mb or more")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - {"upload", "download", "slow-download"}:
        p.error("--kinds takes upload, download, slow-download")
    size = int(args.size_mb * MB)
    slow_seconds = size / MB / args.slow_rate if "slow-download" in kinds else 0
    watchdog(fleet, 120 + slow_seconds + len(kinds) * (30 + size / MB / 5))

    print(f"bench/bodies.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    vendor = fleet.vendor(0)
    store = fleet.redis().url if args.store == "redis" else "memory://"
    proxy = fleet.proxy(policy(vendor.url, [Limit(100000, "1s", 100000)], store=store), name="proxy")
    results = []
    try:
        for kind in kinds:
            results.append(asyncio.run(transfer(kind, proxy.url, proxy.pid, size, args.slow_rate)))
    finally:
        code = fleet.stop(proxy)

    rows = [
        [
            r["kind"],
            f"{r['bytes']}",
            "ok" if r["checksum_ok"] else "MISMATCH",
            f"{r['seconds']:.2f}",
            f"{r['mb_per_s']:.0f}",
            f"{r['baseline_mb']:.1f}",
            f"{r['peak_mb']:.1f}",
            f"{r['growth_mb']:+.1f}",
            "-" if r["hwm_growth_mb"] is None else f"{r['hwm_growth_mb']:+.1f}",
            r["samples"],
        ]
        for r in results
    ]
    print(f"{args.size_mb:g} MiB bodies through one proxy ({args.store} store); RSS of the proxy in MiB")
    print(
        table(
            rows,
            [
                "transfer",
                "bytes",
                "sha256",
                "seconds",
                "MiB/s",
                "RSS before",
                "RSS peak",
                "growth",
                "VmHWM growth",
                "samples",
            ],
        )
    )
    dump_json(args.json, {"size": size, "proxy_exit_code": code, "transfers": results})
    if code != 0:
        print(f"note: the proxy exited {code} on SIGTERM")
    bad = [r["kind"] for r in results if not r["checksum_ok"]]
    if bad:
        raise BenchError(f"checksum mismatch: {', '.join(bad)}")
    over = [r["kind"] for r in results if r["growth_mb"] >= args.limit_mb]
    if over:
        print(f"target missed (growth < {args.limit_mb:g} MiB): {', '.join(over)}")
        return 2 if args.strict else 0
    print(f"target met: every transfer grew the proxy's RSS by less than {args.limit_mb:g} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
