#!/usr/bin/env python3
"""quota-proxy side by side with a peer, proxy.py: CPU per request on one core, in one run.

Issue 11's yardstick. One command installs the peer (PyPI ``proxy.py``, pinned, into a
venv under a cache directory outside the repository, ``~/.cache/quota-proxy-bench`` by
default), starts one upstream, Redis and every system to compare, each proxy pinned to
CPU 1 (``taskset``) with the load generator, the upstream and Redis on CPU 0, and
measures them in interleaved rounds (the order rotates every round), so that whatever
else the shared machine is doing hits every system alike. Figures are medians over
rounds; ratios are taken within a round, then the median.

Systems (access log and metrics on in ours; no limit ever binds):
  redis    quota-proxy, Redis store (a tenant bucket and per-second and per-minute global
           buckets: one EVALSHA per request over three keys)
  memory   the same policy on memory://
  shapes   (not by default) Redis, throughput.py's ``shapes`` policy: endpoint classes, a
           concurrency cap (a lease taken and given back per request) and a partition
  proxypy  proxy.py forwarding the same requests, no limiter (--num-workers 1
           --num-acceptors 1, otherwise its defaults; one process does the work)
  minimal  bench/_minimal_proxy.py, a bare aiohttp forwarder (optional, for reference)
  floor    (not by default) bench/_floor_proxy.py: the least a Python process on uvloop and
           httptools does per forwarded request (callbacks only, no limiter, metrics or log)
  floor_redis  the same with one pipelined EVALSHA per request: the floor of a limiting proxy
  floor_async  floor_redis in the product's shape: a task per connection, a future per step
  --also NAME=COMMAND   any other forward proxy (a prototype kept outside the repo)
  --tree NAME=PATH      quota-proxy (the ``redis`` system) from another checkout, e.g. a
                        ``git worktree`` of an older commit: versions compared in one run

Load: ``wrk -t1 -c50`` keep-alive with absolute-form targets, as HTTP_PROXY clients send
(``GET http://api.bench.example/v1/ping``; for proxy.py, which resolves the target's
host itself, ``GET http://127.0.0.1:PORT/v1/ping``), or bench/_loadgen.py when wrk is not
installed. The upstream is this script's own ``_upstream`` role: raw asyncio on uvloop
answering a fixed 200 JSON, ~15 µs of CPU per request, so that the load core (generator,
upstream and Redis together) is not what limits the fastest peer.

Also, unless skipped: intercepted HTTPS (``https``: CONNECT + TLS interception against a
TLS upstream, versus our plain HTTP, both driven by bench/https.py's generator) and
added latency at a paced 1,000 req/s (``latency``: bench/_common.py's open loop, direct
versus through each proxy). ``--profile S`` samples quota-proxy (Redis) under the same
load with py-spy for S seconds and prints where the CPU goes.

    python bench/peers.py
    python bench/peers.py --rounds 5 --duration 10 --json peers.json
    python bench/peers.py --skip https,latency --also 'proto=python /tmp/dp-proto/proxy.py --port {port}
        --upstream {upstream} --redis {redis}'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shlex
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    BenchError,
    Fleet,
    Proc,
    commandstats,
    cpu_busy,
    cpu_seconds,
    cpu_split,
    dump_json,
    fetch_metrics,
    free_port,
    loadavg,
    outcome_delta,
    outcomes,
    paced,
    require_pinning,
    run_main,
    script_calls,
    table,
    watchdog,
)
from _profile import print_breakdown, read_collapsed, syscall_share
from https import _run, make_certs, tls_section
from https import generate as tls_generate
from latency import summarize
from throughput import TARGET_URL, cpu_names, generate, product_policy, start_proxy

BENCH = Path(__file__).resolve().parent
PROXYPY_VERSION = "2.4.10"
PYSPY_VERSION = "0.4.3"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quota-proxy-bench"
SYSTEMS = ("redis", "memory", "shapes", "proxypy", "minimal", "floor", "floor_redis", "floor_async")
PATH = "/v1/ping"
# Longer than throughput.py's 50 ms: on two shared cores another tenant can stall Redis or
# the proxy that long, the breaker opens and the round is lost. The timeout costs nothing
# per request (one timer either way); only whether a stall fails requests depends on it.
STORE_TIMEOUT = "1s"
TARGETS = {"cpu": 0.7, "https": 1.3, "p50_ms": 0.5, "p99_ms": 2.0}
_UPSTREAM_READY = re.compile(r"upstream listening on (https?)://(\S+)")


# -- the upstream: a fixed answer, as cheap as Python gets ------------------------------------------


class _Upstream(asyncio.Protocol):
    """HTTP/1.1 keep-alive, pipelining-safe; request bodies (Content-Length) are skipped."""

    def __init__(self, answer: Callable[[], bytes]) -> None:
        self.answer = answer
        self.buf = b""
        self.skip = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        buf = self.buf + data
        out = []
        close = False
        while True:
            if self.skip:
                taken = min(self.skip, len(buf))
                self.skip -= taken
                buf = buf[taken:]
                if self.skip:
                    break
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end].lower()
            buf = buf[end + 4 :]
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                self.skip = int(head[i + 17 :].split(b"\r\n", 1)[0])
            out.append(self.answer())
            if b"\r\nconnection: close" in head:
                close = True
                break
        self.buf = buf
        if out:
            self.transport.write(b"".join(out))
        if close:
            self.transport.close()


def serve_upstream(argv: list[str]) -> int:
    """``peers.py _upstream [--cert C --key K]``: a fixed ``200`` JSON answer on 127.0.0.1:0."""
    import signal
    from email.utils import formatdate

    p = argparse.ArgumentParser(prog="bench/peers.py _upstream")
    p.add_argument("--cert")
    p.add_argument("--key")
    args = p.parse_args(argv)
    ctx = None
    if args.cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(args.cert, args.key)
        ctx.set_alpn_protocols(["http/1.1"])
    body = b'{"ok": true, "method": "GET", "path": "/v1/ping"}'
    cache: dict[int, bytes] = {}

    def answer() -> bytes:  # the same headers an aiohttp vendor sends; Date changes once a second
        now = int(time.time())
        packed = cache.get(now)
        if packed is None:
            cache.clear()
            packed = cache[now] = (
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
                b"Content-Length: %d\r\nDate: %s\r\nServer: bench-upstream\r\n\r\n%s"
                % (len(body), formatdate(now, usegmt=True).encode(), body)
            )
        return packed

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Upstream(answer), LOOPBACK, 0, ssl=ctx, backlog=1024)
        port = server.sockets[0].getsockname()[1]
        print(f"upstream listening on {'https' if ctx else 'http'}://{LOOPBACK}:{port}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()
        return 0

    return _run(serve())


def start_upstream(fleet: Fleet, cpus: str | None, certs: Any = None) -> Proc:
    argv = [sys.executable, str(Path(__file__).resolve()), "_upstream"]
    if certs is not None:
        argv += ["--cert", str(certs.vendor_cert), "--key", str(certs.vendor_key)]
    proc = fleet.start("upstream-tls" if certs is not None else "upstream", argv, cpus=cpus)
    m = fleet.wait_line(proc, _UPSTREAM_READY)
    proc.url = f"{m.group(1)}://{m.group(2)}"
    return proc


# -- the peer and the tools, installed outside the repository ----------------------------------------


def venv_tool(cache: Path, name: str, requirement: str, binary: str) -> Path:
    """``binary`` from a venv ``cache/name`` holding ``requirement``; made (pip) when missing."""
    venv = cache / name
    exe = venv / "bin" / binary
    if exe.exists():
        return exe
    print(f"installing {requirement} into {venv} (once)", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", requirement],
            check=True,
            capture_output=True,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or b"").decode(errors="replace")[-2000:]
        raise BenchError(f"could not install {requirement} into {venv}:\n{tail}") from None
    if not exe.exists():
        raise BenchError(f"{requirement} installed into {venv} but {exe} is missing")
    return exe


def wait_port(proc: Proc, port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1):
                return
        except OSError:
            pass
        if not proc.alive():
            raise BenchError(f"{proc.name} exited with {proc.popen.returncode} at start:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{proc.name} not accepting on port {port} after {timeout:.0f}s:\n{proc.tail()}")
        time.sleep(0.05)


def start_proxypy(fleet: Fleet, exe: Path, cpus: str | None) -> Proc:
    port_file = fleet.workdir / "proxypy.port"
    proc = fleet.start(
        "proxypy",
        [
            str(exe),
            "--hostname",
            LOOPBACK,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--num-workers",
            "1",
            "--num-acceptors",
            "1",
        ],
        cpus=cpus,
    )
    deadline = time.monotonic() + 20
    while not (port_file.exists() and port_file.read_text().strip()):
        if not proc.alive() or time.monotonic() > deadline:
            raise BenchError(f"proxy.py did not write its port file:\n{proc.tail()}")
        time.sleep(0.05)
    port = int(port_file.read_text().split()[0])
    wait_port(proc, port)
    proc.url = f"http://{LOOPBACK}:{port}"
    return proc


def start_ours(fleet: Fleet, mode: str, upstream: Proc, redis: Proc, cpus: str | None) -> Proc:
    """quota-proxy in throughput.py's ``redis``, ``memory``, ``shapes`` or ``minimal`` mode, or a floor."""
    if mode == "minimal":
        return start_proxy(fleet, mode, upstream, redis, cpus)
    if mode.startswith("floor"):
        command = f"{shlex.quote(sys.executable)} {shlex.quote(str(BENCH / '_floor_proxy.py'))} --port {{port}} "
        command += "--upstream {upstream}" + (" --redis {redis}" if mode != "floor" else "")
        command += " --coroutines" if mode == "floor_async" else ""
        return start_also(fleet, mode, command, upstream, redis, cpus)
    yaml = product_policy(mode, upstream.url, redis.url, store_timeout=STORE_TIMEOUT)
    return fleet.proxy(yaml, name=f"proxy-{mode}", cpus=cpus)


def start_also(fleet: Fleet, name: str, command: str, upstream: Proc, redis: Proc, cpus: str | None) -> Proc:
    """``--also NAME=COMMAND``: {port}, {upstream} and {redis} are filled in; it must listen on {port}."""
    port = free_port()
    argv = shlex.split(command.format(port=port, upstream=upstream.url, redis=redis.url))
    proc = fleet.start(name, argv, cpus=cpus)
    wait_port(proc, port)
    proc.url = f"http://{LOOPBACK}:{port}"
    return proc


# -- /proc: a process and its children ---------------------------------------------------------------


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants (proxy.py works in a child process)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # a child that just exited
            total += cpu_seconds(pid)
    return total


def tree_sys(pids: list[int]) -> float:
    """The kernel's share of ``tree_cpu`` (stime): the system calls' side of the cost."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_split(pid)[1]
    return total


# -- one measurement -------------------------------------------------------------------------------


class Window:
    """CPU of the proxy (its process tree), of the load side, and of its core, over a window."""

    def __init__(self, proxy: Proc, load_side: list[Proc], proxy_cpus: list[str]) -> None:
        self.pids = tree_pids(proxy.pid)
        self.load_side = load_side
        self.proxy_cpus = proxy_cpus

    def __enter__(self) -> Window:
        self.busy0 = cpu_busy()
        self.load0 = sum(cpu_seconds(p.pid) for p in self.load_side)
        self.sys0 = tree_sys(self.pids)
        self.cpu0, self.t0 = tree_cpu(self.pids), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu1, self.t1 = tree_cpu(self.pids), time.monotonic()
        self.sys1 = tree_sys(self.pids)
        self.busy1 = cpu_busy()
        self.load1 = sum(cpu_seconds(p.pid) for p in self.load_side)

    def figures(self, done: int, generator_cpu: float) -> dict[str, Any]:
        window = self.t1 - self.t0
        cpu = self.cpu1 - self.cpu0
        core = sum(self.busy1[c] - self.busy0[c] for c in self.proxy_cpus) if self.proxy_cpus else None
        return {
            "cpu_us_per_request": cpu / done * 1e6,
            "sys_us_per_request": (self.sys1 - self.sys0) / done * 1e6,
            "proxy_core": cpu / window,
            "others_there": None if core is None else max(core - cpu, 0.0) / window,
            "load_core": (generator_cpu + self.load1 - self.load0) / window,
        }


def check_load(name: str, load: dict[str, float]) -> int:
    done = int(load["requests"])
    if done <= 0:
        raise BenchError(f"{name}: no request completed")
    if load["non2xx"] > 0.01 * done or load["errors"] > 0.01 * done:
        raise BenchError(f"{name}: {load['non2xx']} non-2xx and {load['errors']} socket errors out of {done}")
    return done


def saturate(
    fleet: Fleet,
    args: argparse.Namespace,
    name: str,
    proxy: Proc,
    target: str,
    load_side: list[Proc],
    redis: Proc | None,
) -> dict[str, Any]:
    before = outcomes(fetch_metrics(proxy.admin_url)) if proxy.admin_url else {}
    cmd0 = commandstats(redis.url) if redis is not None else {}
    redis_cpu0 = cpu_seconds(redis.pid) if redis is not None else 0.0
    with Window(proxy, load_side, cpu_names(args.proxy_cpu)) as w:
        load, gen_cpu = generate(
            fleet, args.generator, proxy.url, args.connections, args.duration, args.load_cpu, target, args.body
        )
    seen = unlimited(name, proxy, before)
    done = check_load(name, load)
    row: dict[str, Any] = {"system": name, "requests": done, "rps": done / load["elapsed"], **w.figures(done, gen_cpu)}
    if redis is not None:
        row["evalsha_per_request"] = script_calls(cmd0, commandstats(redis.url))[0] / done
        # Redis serves this system alone while it is measured: its CPU is this system's.
        row["redis_us_per_request"] = (cpu_seconds(redis.pid) - redis_cpu0) / done * 1e6
    if seen:
        row["outcomes"] = seen
    return row


def unlimited(name: str, proxy: Proc, before: dict[str, float]) -> dict[str, int]:
    """Our outcomes since ``before``; BenchError if anything but forwarded (or a connection
    the generator cut when it stopped) happened: the load must never be limited."""
    if not proxy.admin_url:
        return {}
    delta = outcome_delta(before, outcomes(fetch_metrics(proxy.admin_url)))
    seen = {k: int(v) for k, v in delta.items() if v}
    if set(seen) - {"forwarded", "error"} or seen.get("error", 0) > 100:
        raise BenchError(f"{name}: outcomes {seen}; the load must stay unlimited\n{proxy.tail(5)}")
    return seen


def saturate_tls(
    fleet: Fleet, args: argparse.Namespace, name: str, mode: str, proxy: Proc, certs: Any, load_side: list[Proc]
) -> dict[str, Any]:
    """bench/https.py's generator: ``intercept`` (CONNECT + TLS) or ``plain`` (absolute form)."""
    before = outcomes(fetch_metrics(proxy.admin_url))
    with Window(proxy, load_side, cpu_names(args.proxy_cpu)) as w:
        load, gen_cpu = tls_generate(fleet, mode, proxy, certs, args.connections, args.duration, args.load_cpu)
    seen = unlimited(name, proxy, before)
    done = check_load(name, load)
    row = {"system": name, "requests": done, "rps": done / load["elapsed"], **w.figures(done, gen_cpu)}
    return {**row, "outcomes": seen}


def latency(args: argparse.Namespace, name: str, url: str, proxy: Proc | None) -> dict[str, Any]:
    marks: dict[str, float] = {}
    pids = tree_pids(proxy.pid) if proxy is not None else []

    def mark() -> None:
        marks["cpu0"] = tree_cpu(pids)

    lat, errors, statuses, achieved = _run(
        paced(url, proxy.url if proxy is not None else None, args.latency_rate, args.latency_duration, 1.0, mark)
    )
    if not lat or errors or set(statuses) != {200}:
        raise BenchError(f"latency {name}: {errors} errors, statuses {statuses}")
    out = {"system": name, "n": len(lat), "achieved_rate": achieved, **summarize(lat)}
    if proxy is not None:
        out["cpu_us_per_request"] = (tree_cpu(pids) - marks["cpu0"]) / len(lat) * 1e6
    return out


@contextlib.contextmanager
def sampled(fleet: Fleet, args: argparse.Namespace, proxy: Proc, out: Path, name: str, *more: str) -> Iterator[int]:
    """py-spy --native recording ``proxy`` into ``out`` (``more``: further py-spy options)
    while the block runs; yields the seconds it samples for, and returns once the profile
    is written."""
    exe = venv_tool(args.cache, f"py-spy-{PYSPY_VERSION}", f"py-spy=={PYSPY_VERSION}", "py-spy")
    seconds = max(int(args.profile), 1)
    argv = [str(exe), "record", "--pid", str(proxy.pid), "--duration", str(seconds), "--rate", str(args.profile_rate)]
    argv += ["--native", *more, "--format", "raw", "--output", str(out)]
    spy = fleet.start(name, argv, cpus=args.load_cpu)
    deadline = time.monotonic() + 20
    while "Sampling process" not in spy.stdout.read_text(errors="replace") + spy.stderr.read_text(errors="replace"):
        if not spy.alive() or time.monotonic() > deadline:
            raise BenchError(f"{name} did not start sampling (it needs ptrace: root or CAP_SYS_PTRACE):\n{spy.tail()}")
        time.sleep(0.05)
    yield seconds
    try:
        spy.popen.wait(30)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{name} still running 30 s after its duration:\n{spy.tail()}") from None
    fleet.stop(spy)
    if not out.exists():
        raise BenchError(f"{name} wrote no profile:\n{spy.tail()}")


def profile(
    fleet: Fleet, args: argparse.Namespace, proxy: Proc, target: str, load_side: list[Proc], cpu_us: float | None
) -> dict[str, Any]:
    """py-spy (native frames too) on quota-proxy under the rounds' load; the samples sorted
    into parts (bench/_profile.py) and priced at the rounds' median CPU per request."""
    out = Path(args.profile_out) if args.profile_out else fleet.workdir / "profile.txt"
    with sampled(fleet, args, proxy, out, "py-spy") as seconds:
        with Window(proxy, load_side, cpu_names(args.proxy_cpu)) as w:
            load, gen_cpu = generate(
                fleet, args.generator, proxy.url, args.connections, seconds + 1.0, args.load_cpu, target
            )
        done = check_load("profile", load)
    under = w.figures(done, gen_cpu)["cpu_us_per_request"]
    print(
        f"\n4. profile: quota-proxy ({args.profile_system}) under the same load, py-spy --native at "
        f"{args.profile_rate} Hz for {seconds} s ({under:.0f} µs/req while sampled, "
        f"{cpu_us or float('nan'):.0f} µs/req unsampled: shares priced at the latter)"
    )
    with open(out) as f:
        stacks = read_collapsed(f)
    found = print_breakdown(stacks, cpu_us or under)
    if args.profile_out:
        print(f"collapsed stacks kept in {out} (re-read: python bench/_profile.py {out} --top 10)")
    return {
        **found,
        "syscall_share": syscall_share(stacks),
        "cpu_us_per_request_sampled": under,
        "rps_sampled": done / load["elapsed"],
    }


def spy(fleet: Fleet, args: argparse.Namespace, proxy: Proc, target: str, name: str) -> float:
    """The share of ``proxy``'s samples (its worker processes too) in socket and polling
    system calls under the rounds' load (``syscall_share``)."""
    out = fleet.workdir / f"profile-{name}.txt"
    with sampled(fleet, args, proxy, out, f"py-spy-{name}", "--subprocesses") as seconds:
        load, _ = generate(fleet, args.generator, proxy.url, args.connections, seconds + 1.0, args.load_cpu, target)
        check_load(f"profile {name}", load)
    with open(out) as f:
        return syscall_share(read_collapsed(f))


def print_floor(ours_share: float, ours_us: float, peer_share: float, peer_us: float) -> dict[str, float]:
    """What both proxies spend in the kernel's socket calls, and what is left for the rest."""
    floor_ours, floor_peer = ours_share * ours_us, peer_share * peer_us
    rest_ours, rest_peer = ours_us - floor_ours, peer_us - floor_peer
    print(
        f"\n5. system calls for sockets and polling (the same reads and writes whichever proxy relays the bytes), "
        f"py-spy --native, priced at the rounds' medians:\n"
        f"   quota-proxy (Redis): {ours_share * 100:.0f}% = {floor_ours:.0f} µs/req, the rest {rest_ours:.0f} µs/req\n"
        f"   proxy.py:            {peer_share * 100:.0f}% = {floor_peer:.0f} µs/req, the rest {rest_peer:.0f} µs/req\n"
        f"   proxy.py's system calls alone are {floor_peer / peer_us:.2f}x its CPU per request; ours are "
        f"{floor_ours / peer_us:.2f}x it"
    )
    return {"ours_syscall_us": floor_ours, "peer_syscall_us": floor_peer}


# -- the run ---------------------------------------------------------------------------------------


def rotate(items: list[Any], r: int) -> list[Any]:
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def paired(rounds: list[dict[str, dict[str, Any]]], a: str, b: str, key: str) -> list[float]:
    """a/b of ``key`` within each round that measured both."""
    return [r[a][key] / r[b][key] for r in rounds if a in r and b in r and r[b][key]]


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/peers.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--systems", default="redis,memory,proxypy", help=f"of {', '.join(SYSTEMS)} (default: redis,memory,proxypy)"
    )
    p.add_argument("--also", action="append", default=[], metavar="NAME=COMMAND", help="another proxy to compare")
    p.add_argument(
        "--tree", action="append", default=[], metavar="NAME=PATH", help="quota-proxy from another checkout (redis)"
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per system per round (default 10)")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured load per system before round 1 (default 3)")
    p.add_argument("--connections", type=int, default=50, help="keep-alive connections (default 50)")
    p.add_argument(
        "--body", type=int, default=0, metavar="BYTES", help="part 1 with POSTs of BYTES (wrk; default: GETs)"
    )
    p.add_argument("--generator", choices=["auto", "wrk", "python"], default="auto", help="auto: wrk if installed")
    p.add_argument("--latency-rate", type=float, default=1000.0, help="paced load for added latency (default 1000)")
    p.add_argument(
        "--latency-duration", type=float, default=5.0, help="measured seconds per path per round (default 5)"
    )
    p.add_argument("--skip", default="", help="parts to skip, comma-separated: https, latency")
    p.add_argument("--profile", type=float, default=0.0, metavar="S", help="py-spy quota-proxy (redis) for S seconds")
    p.add_argument(
        "--profile-system", default="redis", help="which of ours --profile samples: redis (default), shapes, memory"
    )
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (default 250)")
    p.add_argument("--profile-out", metavar="FILE", help="keep py-spy's collapsed stacks here")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"venvs of the peer and tools ({DEFAULT_CACHE})")
    p.add_argument("--proxy-cpu", default="1", help="taskset CPU list for each proxy (default 1)")
    p.add_argument("--load-cpu", default="0", help="taskset CPU list for generator, upstream, redis (default 0)")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything (figures then mean less)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when one of issue 11's targets is missed")
    args = p.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(systems) - set(SYSTEMS):
        p.error(f"--systems takes {', '.join(SYSTEMS)}")
    also: dict[str, str] = {}
    for spec in args.also:
        name, sep, command = spec.partition("=")
        if not sep or not name or not command or name in SYSTEMS:
            p.error(f"--also takes NAME=COMMAND with a new NAME, not {spec!r}")
        also[name] = command
    trees: dict[str, Path] = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in SYSTEMS or name in also or name in trees:
            p.error(f"--tree takes NAME=PATH with a new NAME, not {spec!r}")
        if not (Path(path) / "proxy" / "__main__.py").exists():
            p.error(f"--tree {spec!r}: {path} is not a quota-proxy checkout")
        trees[name] = Path(path)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if not skip <= {"https", "latency"}:
        p.error("--skip takes https and/or latency")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "python"
    elif args.generator == "wrk" and not shutil.which("wrk"):
        p.error("wrk is not installed (apt-get install wrk), use --generator python")
    if args.no_pin:
        args.proxy_cpu = args.load_cpu = None
    else:
        require_pinning()
    names = systems + list(also) + list(trees)
    per_round = len(names) * (args.duration + 5)
    per_round += 0 if "https" in skip else 3 * (args.duration + 8)
    per_round += 0 if "latency" in skip else (len(names) + 1) * (args.latency_duration + 6)
    watchdog(fleet, 300 + args.rounds * per_round + len(names) * (args.warmup + 10) + args.profile * 2)

    start_load = loadavg()
    print(f"bench/peers.py: load average {start_load} at start (2 cores shared: figures are provisional)")
    proxypy_exe = venv_tool(args.cache, f"proxypy-{PROXYPY_VERSION}", f"proxy.py=={PROXYPY_VERSION}", "proxy")
    print(
        f"generator {args.generator}"
        + ("" if args.generator == "wrk" else " (wrk is not installed: apt-get install wrk)")
        + f", {args.connections} connections; each proxy on CPU {args.proxy_cpu or 'any'}, generator/upstream/redis "
        f"on CPU {args.load_cpu or 'any'}; {args.rounds} rounds of {args.duration:g} s, order rotating"
    )

    upstream = start_upstream(fleet, args.load_cpu)
    redis = fleet.redis(cpus=args.load_cpu)
    load_side = [upstream, redis]
    up_target = f"{upstream.url}{PATH}"
    procs: dict[str, Proc] = {}
    targets: dict[str, str] = {}
    for name in systems:
        if name == "proxypy":
            procs[name] = start_proxypy(fleet, proxypy_exe, args.proxy_cpu)
            targets[name] = up_target  # proxy.py resolves the target's host itself
        else:
            procs[name] = start_ours(fleet, name, upstream, redis, args.proxy_cpu)
            targets[name] = TARGET_URL
    for name, command in also.items():
        procs[name] = start_also(fleet, name, command, upstream, redis, args.proxy_cpu)
        targets[name] = TARGET_URL
    for name, tree in trees.items():
        yaml = product_policy("redis", upstream.url, redis.url, store_timeout=STORE_TIMEOUT)
        procs[name] = fleet.proxy(yaml, name=f"proxy-{name}", cpus=args.proxy_cpu, tree=tree)
        targets[name] = TARGET_URL

    for name in names:  # connections, pools, the Lua script, first-call allocations
        load, _ = generate(
            fleet,
            args.generator,
            procs[name].url,
            args.connections,
            args.warmup,
            args.load_cpu,
            targets[name],
            args.body,
        )
        check_load(f"{name} warm-up", load)

    certs = tls_proxy = None
    if "https" not in skip:
        certs = make_certs(fleet.workdir)
        tls_upstream = start_upstream(fleet, args.load_cpu, certs)
        load_side.append(tls_upstream)
        tls_proxy = fleet.proxy(
            product_policy("redis", tls_upstream.url, redis.url, store_timeout=STORE_TIMEOUT) + tls_section(certs),
            name="proxy-tls",
            cpus=args.proxy_cpu,
        )
        if "redis" not in procs:
            procs["redis"] = start_ours(fleet, "redis", upstream, redis, args.proxy_cpu)

    uses_redis = {"redis", "shapes", *trees}  # (Redis serves only the system measured: its CPU is that system's)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        rnd: dict[str, Any] = {"load_average_before": loadavg(), "saturation": {}, "https": {}, "latency": {}}
        for name in rotate(names, r):
            rnd["saturation"][name] = saturate(
                fleet, args, name, procs[name], targets[name], load_side, redis if name in uses_redis else None
            )
        if tls_proxy is not None:
            tls_runs = [
                ("plain HTTP", "plain", procs["redis"]),
                ("plain→https", "plain", tls_proxy),
                ("intercept", "intercept", tls_proxy),
            ]
            for label, mode, proxy in rotate(tls_runs, r):
                rnd["https"][label] = saturate_tls(fleet, args, label, mode, proxy, certs, load_side)
        if "latency" not in skip:
            paths: list[tuple[str, str, Proc | None]] = [("direct", up_target, None)]
            paths += [(n, targets[n], procs[n]) for n in names]
            if not args.no_pin:
                os.sched_setaffinity(0, {int(c.removeprefix("cpu")) for c in cpu_names(args.load_cpu)})
            try:
                for name, url, proxy in rotate(paths, r):
                    rnd["latency"][name] = latency(args, name, url, proxy)
            finally:
                os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        rnd["load_average_after"] = loadavg()
        rounds.append(rnd)
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {v['cpu_us_per_request']:.0f} µs" for n, v in rnd["saturation"].items())
            + f"; load average {rnd['load_average_before']} → {rnd['load_average_after']}",
            flush=True,
        )

    result = report(args, names, rounds, start_load)
    if args.profile > 0:
        which = args.profile_system
        if which not in procs:
            procs[which] = start_ours(fleet, which, upstream, redis, args.proxy_cpu)
        cpu_us = result["saturation"].get(which, {}).get("cpu_us_per_request")
        result["profile"] = profile(fleet, args, procs[which], TARGET_URL, load_side, cpu_us)
        peer_us = result["saturation"].get("proxypy", {}).get("cpu_us_per_request")
        if "proxypy" in procs and cpu_us and peer_us:
            peer_share = spy(fleet, args, procs["proxypy"], targets["proxypy"], "proxypy")
            result["floor"] = print_floor(result["profile"]["syscall_share"], cpu_us, peer_share, peer_us)
    dump_json(args.json, result)
    return 2 if args.strict and result["missed"] else 0


def report(args: argparse.Namespace, names: list[str], rounds: list[dict[str, Any]], start_load: str) -> dict[str, Any]:
    sat = [r["saturation"] for r in rounds]
    summary: dict[str, Any] = {}
    rows = []
    for name in names:
        mine = [s[name] for s in sat]
        cpus = [m["cpu_us_per_request"] for m in mine]
        summary[name] = {
            k: med(mine, k)
            for k in ("rps", "cpu_us_per_request", "sys_us_per_request", "proxy_core", "others_there", "load_core")
        }
        evalsha = med(mine, "evalsha_per_request") if all("evalsha_per_request" in m for m in mine) else None
        redis_us = med(mine, "redis_us_per_request") if all("redis_us_per_request" in m for m in mine) else None
        summary[name]["redis_us_per_request"] = redis_us
        rows.append(
            [
                name,
                f"{summary[name]['rps']:.0f}",
                f"{summary[name]['cpu_us_per_request']:.0f}",
                f"{min(cpus):.0f}-{max(cpus):.0f}",
                f"{summary[name]['sys_us_per_request']:.0f}",
                f"{summary[name]['proxy_core'] * 100:.0f}%",
                "-" if math.isnan(summary[name]["others_there"]) else f"{summary[name]['others_there'] * 100:.0f}%",
                f"{summary[name]['load_core'] * 100:.0f}%",
                "-" if evalsha is None else f"{evalsha:.3f}",
                "-" if redis_us is None else f"{redis_us:.0f}",
            ]
        )
    what = f"POSTs of {args.body} bytes" if args.body else "GETs"
    print(f"\n1. saturation, plain HTTP ({what}), medians of {len(rounds)} rounds")
    columns = ["system", "req/s", "CPU µs/req", "range", "of it sys", "proxy core", "others there", "load core"]
    print(table(rows, [*columns, "evalsha/req", "Redis µs/req"]))
    if "redis" in summary and "shapes" in summary:  # a Stripe-shaped vendor against the simple one (issue 24)
        for what, key in (("CPU", "cpu_us_per_request"), ("Redis time", "redis_us_per_request")):
            per_round = [
                r["shapes"][key] / r["redis"][key] for r in sat if r["shapes"].get(key) and r["redis"].get(key)
            ]
            if per_round:
                shown = ", ".join(f"{x:.2f}" for x in per_round)
                print(f"{what} per request shapes / redis: {statistics.median(per_round):.2f}x (rounds: {shown})")
    missed: list[str] = []
    ratios: dict[str, Any] = {}
    if "proxypy" in names:
        for name in names:
            if name == "proxypy":
                continue
            per_round = paired(sat, name, "proxypy", "cpu_us_per_request")
            ratios[name] = {"per_round": per_round, "median": statistics.median(per_round)}
            line = f"CPU per request {name} / proxy.py: {ratios[name]['median']:.2f}x (rounds: "
            print(line + ", ".join(f"{x:.2f}" for x in per_round) + ")")
        if "redis" in ratios:
            ok = ratios["redis"]["median"] <= TARGETS["cpu"]
            print(
                f"target (quota-proxy with Redis <= {TARGETS['cpu']}x proxy.py's CPU per request): "
                + ("met" if ok else "MISSED")
            )
            if not ok:
                missed.append("cpu")
    for name in names:
        low = min(s[name]["proxy_core"] for s in sat)
        if low < 0.85:
            print(
                f"note: {name}: its core was as little as {low * 100:.0f}% busy (not saturated: the load side or "
                "another tenant of the machine held it back; req/s understates it, CPU µs/req is still valid)"
            )

    https_summary: dict[str, Any] = {}
    if rounds and rounds[0]["https"]:
        hs = [r["https"] for r in rounds]
        rows = []
        for label in hs[0]:
            mine = [h[label] for h in hs]
            keys = ("rps", "cpu_us_per_request", "sys_us_per_request", "proxy_core", "load_core")
            https_summary[label] = {k: med(mine, k) for k in keys}
            rows.append(
                [
                    label,
                    f"{https_summary[label]['rps']:.0f}",
                    f"{https_summary[label]['cpu_us_per_request']:.0f}",
                    f"{https_summary[label]['sys_us_per_request']:.0f}",
                    f"{https_summary[label]['proxy_core'] * 100:.0f}%",
                    f"{https_summary[label]['load_core'] * 100:.0f}%",
                ]
            )
        print(
            f"\n2. intercepted HTTPS, quota-proxy (Redis), bench/https.py's generator, medians of {len(rounds)} rounds"
        )
        print(table(rows, ["path", "req/s", "CPU µs/req", "of it sys", "proxy core", "load core"]))
        vs_plain = statistics.median(paired(hs, "intercept", "plain HTTP", "cpu_us_per_request"))
        vs_tls = statistics.median(paired(hs, "intercept", "plain→https", "cpu_us_per_request"))
        ratios["intercept/plain"], ratios["intercept/plain→https"] = vs_plain, vs_tls
        print(f"intercept / plain HTTP: {vs_plain:.2f}x; intercept / plain→https (same TLS upstream): {vs_tls:.2f}x")
        ok = vs_plain <= TARGETS["https"]
        print(f"target (intercepted HTTPS <= {TARGETS['https']}x our plain HTTP): {'met' if ok else 'MISSED'}")
        if not ok:
            missed.append("https")

    latency_summary: dict[str, Any] = {}
    if rounds and rounds[0]["latency"]:
        ls = [r["latency"] for r in rounds]
        rows = []
        for name in ["direct", *names]:
            mine = [lr[name] for lr in ls]
            s = {k: med(mine, k) for k in ("achieved_rate", "p50", "p90", "p99", "max", "cpu_us_per_request")}
            if name != "direct":
                for q in ("p50", "p90", "p99"):
                    s[f"+{q}"] = statistics.median(lr[name][q] - lr["direct"][q] for lr in ls)
            latency_summary[name] = s
            row = [
                name,
                f"{s['achieved_rate']:.0f}",
                *(f"{s[q]:.3f}" for q in ("p50", "p90", "p99")),
                f"{s['max']:.2f}",
            ]
            row += (
                ["", "", "", ""]
                if name == "direct"
                else [*(f"{s[q]:+.3f}" for q in ("+p50", "+p90", "+p99")), f"{s['cpu_us_per_request']:.0f}"]
            )
            rows.append(row)
        print(
            f"\n3. added latency at {args.latency_rate:g} req/s open loop, {args.latency_duration:g} s per path per "
            "round; ms, medians of rounds (+: over direct, paired within a round)"
        )
        print(table(rows, ["path", "req/s", "p50", "p90", "p99", "max", "+p50", "+p90", "+p99", "proxy CPU µs/req"]))
        if "redis" in latency_summary:
            s = latency_summary["redis"]
            ok = s["+p50"] <= TARGETS["p50_ms"] and s["+p99"] <= TARGETS["p99_ms"]
            print(
                f"target (quota-proxy with Redis adds p50 <= {TARGETS['p50_ms']} ms, p99 <= {TARGETS['p99_ms']} ms): "
                f"{'met' if ok else 'MISSED'} (+p50 {s['+p50']:.3f} ms, +p99 {s['+p99']:.3f} ms)"
            )
            if not ok:
                missed.append("latency")

    end_load = loadavg()
    print(f"\nload average {start_load} at start, {end_load} at the end")
    return {
        "load_average": {"start": start_load, "end": end_load},
        "generator": args.generator,
        "connections": args.connections,
        "duration": args.duration,
        "proxypy_version": PROXYPY_VERSION,
        "rounds": rounds,
        "saturation": summary,
        "ratios": ratios,
        "https": https_summary,
        "latency": latency_summary,
        "missed": missed,
    }


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        sys.exit(serve_upstream(sys.argv[2:]))
    sys.exit(run_main(main))
