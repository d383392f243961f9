"""Shared plumbing for the bench scripts: processes we own (by PID), /proc readers,
policy files, Prometheus text parsing, percentiles.

Nothing here is part of the product. Every process a script starts is registered
in a ``Fleet`` and stopped by its PID (SIGTERM, then SIGKILL) when the script ends,
however it ends; a watchdog bounds each script's wall-clock time. Traffic goes to
127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
VENDOR_HOST = "api.bench.example"  # never resolved: the proxy routes it to the mock vendor
VENDOR_NAME = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")

_PROXY_READY = re.compile(r"quota-proxy listening on http://([^\s]+) \(admin http://([^\s,]+)")
_VENDOR_READY = re.compile(r"mock-vendor listening on http://([^\s]+)")


class BenchError(Exception):
    """A measurement could not be taken; the script exits non-zero."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# -- /proc ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), seconds."""
    user, system = cpu_split(pid)
    return user + system


def cpu_split(pid: int) -> tuple[float, float]:
    """utime and stime of ``pid`` (all its threads), seconds: user space and the kernel."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    fields = raw[raw.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def fd_count(pid: int) -> int:
    """Open file descriptors of ``pid`` (entries of /proc/<pid>/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_limit(pid: int) -> int:
    """The soft RLIMIT_NOFILE of ``pid``, from /proc/<pid>/limits."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise BenchError(f"/proc/{pid}/limits has no 'Max open files'")


def status_kb(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/<pid>/status, e.g. VmRSS or VmHWM."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise BenchError(f"/proc/{pid}/status has no {key}")


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM (writing 5 to clear_refs, Linux >= 4.0); False if not permitted."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_busy() -> dict[str, float]:
    """Busy seconds per CPU since boot from /proc/stat ({"cpu0": s, ...}; idle and iowait excluded)."""
    out: dict[str, float] = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *vals = line.split()
                ticks = [int(v) for v in vals[:8]]  # user nice system idle iowait irq softirq steal
                out[name] = (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK
    return out


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class RssSampler:
    """Samples VmRSS of a PID every ``interval`` seconds in a thread."""

    def __init__(self, pid: int, interval: float = 0.010) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append(status_kb(self.pid, "VmRSS"))
            except (OSError, BenchError):
                return
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                next_t = time.monotonic()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


# -- processes --------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    url: str = ""
    admin_url: str = ""
    exit_code: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 20) -> str:
        out = []
        for path in (self.stdout, self.stderr):
            try:
                lines = path.read_text(errors="replace").splitlines()[-n:]
            except OSError:
                continue
            out += [f"  {self.name} {path.name}: {line}" for line in lines]
        return "\n".join(out)


@dataclass
class Fleet:
    """Owns every process a script starts and a scratch directory; stops them by PID."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="quota-bench-")))
    procs: list[Proc] = field(default_factory=list)
    keep: bool = False

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        cpus: str | None = None,
        cwd: Path = ROOT,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
    ) -> Proc:
        """``nofile``: the child's limit of open files, soft and hard (as a container's
        ``nofile``: the process cannot raise it; e.g. 1024, a common default)."""
        if cpus is not None:
            argv = ["taskset", "-c", cpus, *argv]
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"

        def limit_files() -> None:
            if nofile is not None:
                hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
                cap = min(nofile, hard)
                resource.setrlimit(resource.RLIMIT_NOFILE, (cap, cap))

        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(
                list(argv),
                cwd=cwd,
                stdout=fo,
                stderr=fe,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                preexec_fn=limit_files if nofile is not None else None,
            )
        proc = Proc(name, popen, out, err)
        self.procs.append(proc)
        return proc

    def wait_line(self, proc: Proc, pattern: re.Pattern[str], timeout: float = 20.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            text = proc.stdout.read_text(errors="replace")
            m = pattern.search(text)
            if m:
                return m
            if not proc.alive():
                raise BenchError(f"{proc.name} exited with {proc.popen.returncode} before it was ready:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{proc.name} not ready after {timeout:.0f}s:\n{proc.tail()}")
            time.sleep(0.02)

    # -- the pieces ----------------------------------------------------------------------

    def redis(self, name: str = "redis", cpus: str | None = None, port: int | None = None) -> Proc:
        """A redis-server without persistence on a free port (never 6379), or on ``port`` (a
        restart where a killed one listened)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchError("redis-server is not installed (apt-get install redis-server)")
        while port is None or port == 6379:
            port = free_port()
        proc = self.start(
            name,
            [
                binary,
                "--port",
                str(port),
                "--bind",
                LOOPBACK,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
            ],
            cpus=cpus,
        )
        proc.url = f"redis://{LOOPBACK}:{port}/0"
        import redis as sync_redis

        client = sync_redis.Redis(host=LOOPBACK, port=port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                if not proc.alive():
                    raise BenchError(f"redis-server exited at start:\n{proc.tail()}")
                try:
                    if client.ping():
                        return proc
                except sync_redis.RedisError:
                    if time.monotonic() > deadline:
                        raise BenchError("redis-server did not answer PING within 10s") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def vendor(
        self,
        rate: float,
        burst: float | None = None,
        name: str = "vendor",
        cpus: str | None = None,
        window: str | None = None,
        extra: Sequence[str] = (),
    ) -> Proc:
        """The mock vendor: a token bucket (``rate``, ``burst``; 0: no request quota) or, with
        ``window`` (e.g. ``"1s"``), a strict sliding window of ``rate x window`` requests;
        ``extra``: more of its flags (``--tokens-per-minute N``...)."""
        argv = [sys.executable, "-m", "proxy", "mock-vendor", "--listen", f"{LOOPBACK}:0", "--rate", f"{rate:g}"]
        if burst is not None:
            argv += ["--burst", f"{burst:g}"]
        if window is not None:
            argv += ["--window", window]
        argv += list(extra)
        proc = self.start(name, argv, cpus=cpus)
        m = self.wait_line(proc, _VENDOR_READY)
        proc.url = f"http://{m.group(1)}"
        return proc

    def proxy(
        self,
        policy_yaml: str,
        store: str | None = None,
        name: str = "proxy",
        cpus: str | None = None,
        nofile: int | None = None,
        tree: Path | None = None,
    ) -> Proc:
        """``tree``: run quota-proxy from that checkout instead of this one (an older commit's
        ``git worktree``, to compare versions in one run)."""
        cfg = self.workdir / f"{name}.yaml"
        cfg.write_text(policy_yaml)
        argv = [
            sys.executable,
            "-m",
            "proxy",
            "run",
            "-c",
            str(cfg),
            "--listen",
            f"{LOOPBACK}:0",
            "--admin-listen",
            f"{LOOPBACK}:0",
            "--log-level",
            "warning",
        ]
        if store is not None:
            argv += ["--store", store]
        if tree is None:
            proc = self.start(name, argv, cpus=cpus, nofile=nofile)
        else:
            proc = self.start(name, argv, cpus=cpus, nofile=nofile, cwd=tree, env={"PYTHONPATH": str(tree)})
        m = self.wait_line(proc, _PROXY_READY)
        proc.url, proc.admin_url = f"http://{m.group(1)}", f"http://{m.group(2)}"
        return proc

    # -- stopping ------------------------------------------------------------------------

    def stop(self, proc: Proc, timeout: float = 10.0) -> int | None:
        """SIGTERM by PID, SIGKILL after ``timeout``; returns the exit status."""
        if proc.popen.poll() is None:
            try:
                proc.popen.send_signal(signal.SIGTERM)
                proc.exit_code = proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
                proc.exit_code = None  # did not stop on SIGTERM
        else:
            proc.exit_code = proc.popen.returncode
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.exit_code

    def kill(self, proc: Proc) -> None:
        """SIGKILL by PID at once (a crash, not a shutdown), and forget it."""
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(5)
        proc.exit_code = proc.popen.returncode
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill_all_now(self) -> None:
        """For the watchdog: SIGKILL every owned PID, no waiting."""
        for proc in self.procs:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)


def watchdog(fleet: Fleet, seconds: float) -> None:
    """Bound the script's wall-clock time: past ``seconds``, kill what we own and exit 3."""

    def fire() -> None:
        print(
            f"bench: watchdog: still running after {seconds:.0f}s; killing owned processes", file=sys.stderr, flush=True
        )
        fleet.kill_all_now()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def require_pinning() -> None:
    if shutil.which("taskset") is None:
        raise BenchError("taskset is not installed (apt-get install util-linux); run with --no-pin to skip pinning")
    if (os.cpu_count() or 1) < 2:
        raise BenchError("pinning needs at least 2 CPUs; run with --no-pin")


# -- policy -----------------------------------------------------------------------------


@dataclass
class Limit:
    rate: float
    per: str = "1s"
    burst: float | None = None

    def yaml(self) -> str:
        burst = "" if self.burst is None else f", burst: {_num(self.burst)}"
        return f"{{rate: {_num(self.rate)}, per: {self.per}{burst}}}"


def _num(x: float) -> str:
    """A YAML number PyYAML reads back as a number (it takes ``1e+09`` for a string)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def policy(
    vendor_url: str,
    limits: Iterable[Limit],
    *,
    store: str = "memory://",
    store_timeout: str = "50ms",
    tenant_limits: Iterable[Limit] = (),
    action: str = "hold",
    max_hold: str = "500ms",
    access_log: bool = True,
    drain: float = 3.0,
    on_failure: str = "closed",
    cooloff: str | None = None,
    vendor_extra: Iterable[str] = (),
) -> str:
    """One vendor's policy; ``vendor_extra``: more YAML lines of the vendor, indented as its keys."""
    lines = [
        "version: 1",
        f"listen: {LOOPBACK}:0",
        f"admin_listen: {LOOPBACK}:0",
        f"access_log: {'true' if access_log else 'false'}",
        f"drain_timeout: {drain:g}",
        "store:",
        f"  url: {store}",
        f"  timeout: {store_timeout}",
        f"  on_failure: {on_failure}",
        *([f"  breaker: {{cooloff: {cooloff}}}"] if cooloff is not None else []),
        "vendors:",
        f"  - name: {VENDOR_NAME}",
        f"    hosts: [{VENDOR_HOST}]",
        f"    route: /{VENDOR_NAME}",
        f"    upstream: {vendor_url}",
        "    limits:",
        *(f"      - {lim.yaml()}" for lim in limits),
    ]
    tl = list(tenant_limits)
    if tl:
        lines += ["    tenant_limits:", "      default:", *(f"        - {lim.yaml()}" for lim in tl)]
    lines += ["    on_limit:", f"      action: {action}", f"      max_hold: {max_hold}"]
    lines += [f"    {line}" for line in vendor_extra]
    return "\n".join(lines) + "\n"


# -- metrics and Redis ------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+([-+0-9.eEinfINFNaN]+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def fetch_metrics(admin_url: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    import urllib.request

    with urllib.request.urlopen(admin_url + "/metrics", timeout=timeout) as r:
        return parse_prometheus(r.read().decode())


def outcomes(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """ratelimit_requests_total summed over tenants, by outcome."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "ratelimit_requests_total":
            out[labels.get("outcome", "?")] = out.get(labels.get("outcome", "?"), 0.0) + value
    return out


def outcome_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What ``outcomes`` counted between two snapshots, by outcome."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def http_json(url: str, method: str = "GET") -> Any:
    """GET (or an empty POST) on 127.0.0.1, the answer parsed as JSON."""
    import urllib.request

    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def metric_sum(samples: list[tuple[str, dict[str, str], float]], metric: str) -> float:
    return sum(v for n, _, v in samples if n == metric)


def commandstats(redis_url: str) -> dict[str, int]:
    """calls per command from INFO commandstats."""
    import redis as sync_redis

    client = sync_redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        info = client.info("commandstats")
    finally:
        client.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def script_calls(before: dict[str, int], after: dict[str, int]) -> tuple[int, dict[str, int]]:
    """(EVALSHA + EVAL calls, every command's delta) between two commandstats."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    delta = {k: v for k, v in delta.items() if v}
    return delta.get("evalsha", 0) + delta.get("eval", 0), delta


# -- numbers ----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        raise BenchError("no samples")
    k = max(0, min(len(sorted_values) - 1, round(p / 100.0 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def fleet_parser(prog: str, doc: str, *, duration: float, rate: float, burst: float) -> argparse.ArgumentParser:
    """A fleet script's command line: its description from ``doc``, then --replicas, --workers,
    --duration, --rate and --burst with these defaults."""
    p = argparse.ArgumentParser(
        prog=prog, description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=2, help="proxy replicas sharing Redis (default 2)")
    p.add_argument("--workers", type=int, default=40, help="concurrent workers (default 40)")
    p.add_argument("--duration", type=float, default=duration, help=f"seconds each worker loops (default {duration:g})")
    p.add_argument("--rate", type=float, default=rate, help=f"configured proxy rate, per second (default {rate:g})")
    p.add_argument("--burst", type=float, default=burst, help=f"configured proxy burst (default {burst:g})")
    return p


def unclean_exits(per_replica: Iterable[dict[str, Any]]) -> list[str]:
    """["a replica did not exit 0 on SIGTERM"] when one did not, else []."""
    return ["a replica did not exit 0 on SIGTERM"] if any(r["exit_code"] != 0 for r in per_replica) else []


def dump_json(path: str | None, payload: object) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def run_main(main_fn, argv: Sequence[str] | None = None) -> int:  # type: ignore[no-untyped-def]
    """Run ``main_fn(fleet, argv)`` with cleanup; BenchError → exit 1 with the reason."""
    fleet = Fleet()
    try:
        return int(main_fn(fleet, argv) or 0)
    except BenchError as exc:
        print(f"bench: measurement failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    finally:
        fleet.stop_all()


async def paced(
    url: str,
    proxy: str | None,
    rate: float,
    duration: float,
    warmup: float,
    on_measure_start=None,
    ctx: ssl.SSLContext | None = None,
) -> tuple[list[float], int, dict[int | str, int], float]:
    """Open-loop load (request i launched at t0 + i/rate, whatever the answers' pace), keep-alive,
    over TLS with ``ctx``: (latencies of the measured part, errors, statuses, achieved rate).
    A non-200 status is also counted under "<status> <whose answer>" (the proxy's reason or
    "vendor")."""
    connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=30, ssl=ctx if ctx is not None else True)
    timeout = aiohttp.ClientTimeout(total=10)
    latencies: list[float] = []
    statuses: dict[int | str, int] = {}
    errors = 0
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(measure: bool) -> None:
            nonlocal errors
            t = time.perf_counter()
            try:
                async with session.get(url, proxy=proxy) as resp:
                    await resp.read()
                    status = resp.status
                    reason = resp.headers.get("X-Quota-Reason") or resp.headers.get("X-Quota-Action")
            except (aiohttp.ClientError, TimeoutError):
                errors += 1 if measure else 0
                return
            if measure:
                latencies.append(time.perf_counter() - t)
                statuses[status] = statuses.get(status, 0) + 1
                if status != 200:  # say whose answer it was: the proxy's (and why) or the vendor's
                    why = f"{status} {reason or 'vendor'}"
                    statuses[why] = statuses.get(why, 0) + 1

        interval = 1.0 / rate
        t0 = time.perf_counter()
        measure_from = t0 + warmup
        end = measure_from + duration
        i = measured = 0
        started_measure = False
        while True:
            due = t0 + i * interval
            if due >= end:
                break
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
                continue
            measure = due >= measure_from
            if measure and not started_measure:
                started_measure = True
                if on_measure_start is not None:
                    on_measure_start()
            measured += measure
            task = asyncio.ensure_future(one(measure))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=15)
            if pending:
                raise BenchError(f"{len(pending)} requests still pending 15 s after the load ended")
    return latencies, errors, statuses, measured / duration


def wait_cpu(proc: Proc, timeout: float) -> float:
    """Wait for ``proc`` to exit; return its CPU seconds read just before it exits."""
    deadline = time.monotonic() + timeout
    cpu = 0.0
    while proc.popen.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            cpu = cpu_seconds(proc.pid)
        if time.monotonic() > deadline:
            raise BenchError(f"{proc.name} still running {timeout:.0f}s after it should have ended")
        time.sleep(0.05)
    return cpu
