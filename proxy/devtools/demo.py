"""``quota-proxy demo``: why per-process limits break a quota and a shared bucket does not.

One process on loopback runs two mock vendors, each enforcing the same quota (100
requests/s by default), an in-process quota-proxy on ``memory://`` in front of vendor B,
and two simulated worker fleets that an "autoscaler" grows from 4 to 40 workers:

- fleet A calls vendor A directly; each worker keeps the old per-process limit of 10/s,
  so the fleet's rate is 10/s x workers and crosses the quota at 10 workers;
- fleet B calls vendor B through the proxy (absolute-form requests, what ``HTTP_PROXY``
  clients send); each worker keeps the same 10/s limit, and the proxy's shared bucket
  (a little under the quota) holds or defers whatever exceeds it.

Workers are sequential (one request in flight each) and always have work, as a deep queue
is why the autoscaler adds them. A job refused with 429 is set aside and retried after the
wait it was told, ahead of new jobs, while the worker goes on with other jobs (Celery's
``retry(countdown=...)``): a vendor 429 waits ``Retry-After``, a proxy defer waits
``X-Quota-Retry-After-Ms`` plus a little jitter.

Every second the demo shows one row of rates (a ``rich`` live table on a terminal, a plain
line otherwise); at the end it writes a PNG of both fleets' rates at the vendor against
the quota (matplotlib, Agg) and prints a summary. Ctrl-C stops early and still writes both.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import os
import random
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import aiohttp
from aiohttp import web

from proxy.devtools.demo_defaults import DEFAULT_DURATION, DEFAULT_PLOT
from proxy.devtools.mockvendor import MockVendor
from proxy.tasks import spawn

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from rich.table import Table

    from proxy.server import ProxyServer

__all__ = ["PER_WORKER_RATE", "DemoConfig", "Row", "run", "run_demo", "workers_at"]

PER_WORKER_RATE: Final = 10.0
"""The old per-process client limit every worker keeps, requests per second."""
RAMP_START: Final = 0.10
RAMP_END: Final = 0.75
"""The fleets keep their first size for the first 10 % of the run, grow linearly until 75 %,
then keep their last size, so the steady state is visible however long the run is."""
SCALE_EVERY: Final = 0.25
"""How often the autoscaler adjusts the fleets, seconds."""
TABLE_ROWS: Final = 12
VENDOR = "vendor-b"
VENDOR_B_HOST = "api.vendor-b.example"
_PATH = "/v1/charges"
MAX_HOLD_MS: Final = 250
"""The proxy's ``on_limit.max_hold``. Workers are sequential, so at most one request per
worker waits in the proxy; at 95/s a 500 ms hold would absorb 47 of them and 40 workers
would never see a defer. 250 ms holds up to ~24 and defers the rest, showing both."""
_DEFER_JITTER: Final = 0.05
_TIMER_SLACK: Final = 0.01
_RETRY_JITTER: Final = 0.1


# -- the growth schedule ------------------------------------------------------------------


def workers_at(elapsed: float, duration: float, start: int, end: int) -> int:
    """The fleet size ``elapsed`` seconds into a run of ``duration`` seconds.

    ``start`` until ``RAMP_START`` of the run, then a linear ramp reaching ``end`` at
    ``RAMP_END``, then ``end``; rounded to whole workers, never outside [start, end].
    """
    if duration <= 0:
        return end
    ramp_from, ramp_to = RAMP_START * duration, RAMP_END * duration
    if elapsed <= ramp_from:
        return start
    if elapsed >= ramp_to:
        return end
    share = (elapsed - ramp_from) / (ramp_to - ramp_from)
    value = start + (end - start) * share
    low, high = min(start, end), max(start, end)
    return max(low, min(high, math.floor(value + 0.5)))


# -- configuration -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoConfig:
    duration: float = DEFAULT_DURATION
    plot: Path = Path(DEFAULT_PLOT)
    workers_from: int = 4
    workers_to: int = 40
    quota: float = 100.0

    @property
    def vendor_burst(self) -> float:
        """The mock vendors' bucket: a modest burst, 15 % of a second's quota."""
        return float(max(1, round(self.quota * 0.15)))

    @property
    def proxy_rate(self) -> float:
        """The shared bucket's rate: 5 % under the quota, room for timing jitter on loopback."""
        return self.quota * 0.95

    @property
    def proxy_burst(self) -> float:
        return float(max(1, round(self.quota * 0.10)))


def policy_text(config: DemoConfig, upstream: str) -> str:
    """The proxy's policy: one vendor (B) on ``memory://``, hold up to ``MAX_HOLD_MS``."""
    return textwrap.dedent(f"""\
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        store: {{url: "memory://"}}
        drain_timeout: 1s
        access_log: false
        vendors:
          - name: {VENDOR}
            hosts: [{VENDOR_B_HOST}]
            upstream: {upstream}
            limits: [{{rate: {config.proxy_rate:g}, per: 1s, burst: {config.proxy_burst:g}}}]
            on_limit: {{action: hold, max_hold: {MAX_HOLD_MS}ms}}
            feedback: {{remaining_header: X-RateLimit-Remaining, retry_after_default: 1s}}
        """)


# -- the fleets --------------------------------------------------------------------------


@dataclass(slots=True)
class FleetCounters:
    """What a fleet's workers saw, cumulative."""

    sent: int = 0
    retries: int = 0
    done: int = 0
    vendor_429: int = 0
    deferred: int = 0
    errors: int = 0


class Fleet:
    """Sequential workers with a 10/s client limit each, calling ``url`` (via ``proxy``)."""

    def __init__(self, name: str, session: aiohttp.ClientSession, url: str, proxy: str | None = None) -> None:
        self.name = name
        self.session = session
        self.url = url
        self.proxy = proxy
        self.counters = FleetCounters()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def size(self) -> int:
        return len(self._tasks)

    def scale(self, target: int) -> None:
        while len(self._tasks) < target:
            index = len(self._tasks)
            self._tasks.append(spawn(self._work(), name=f"demo-{self.name}-worker-{index}"))
        while len(self._tasks) > target:
            self._tasks.pop().cancel()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        interval = 1.0 / PER_WORKER_RATE
        counters = self.counters
        retry_at: list[float] = []  # due times of jobs set aside after a 429
        # A new worker starts at a random point of its interval, as real ones would.
        next_send = loop.time() + random.random() * interval
        while True:
            now = loop.time()
            if next_send > now:
                await asyncio.sleep(next_send - now)
                now = loop.time()
            # The client-side limiter: 10/s, burst 1 (GCRA); the small slack absorbs timer lateness
            # so a worker that is always ready really sends 10/s, not a little less.
            next_send = max(next_send, now - _TIMER_SLACK) + interval
            if retry_at and retry_at[0] <= now:
                heapq.heappop(retry_at)
                counters.retries += 1
            counters.sent += 1
            try:
                async with self.session.get(self.url, proxy=self.proxy) as response:
                    await response.read()
                    status, headers = response.status, response.headers
            except (aiohttp.ClientError, TimeoutError):
                counters.errors += 1
                continue
            if status != 429:
                counters.done += 1
                continue
            if headers.get("X-Quota-Action") == "defer":
                counters.deferred += 1
                wait = _float(headers.get("X-Quota-Retry-After-Ms"), 1000.0) / 1000.0
                wait += random.uniform(0, _DEFER_JITTER)
            else:
                counters.vendor_429 += 1
                wait = _float(headers.get("Retry-After"), 1.0) + random.uniform(0, _RETRY_JITTER)
            heapq.heappush(retry_at, loop.time() + wait)


def _float(text: str | None, default: float) -> float:
    try:
        value = float(text) if text is not None else default
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default


# -- sampling ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One second of the run; rates are per second over the second that just ended."""

    elapsed: float
    workers: int
    a_sent: float
    a_accepted: float
    a_429: float
    b_sent: float
    b_forwarded: float
    b_held: int
    b_deferred: float
    b_429: float
    b_at_vendor: float
    """Requests of fleet B that reached vendor B (accepted + 429)."""


@dataclass(slots=True)
class _Snapshot:
    at: float
    a_sent: int
    a_accepted: int
    a_429: int
    b_sent: int
    b_forwarded: float
    b_deferred: float
    b_accepted: int
    b_429: int


def _metric_sum(registry: CollectorRegistry, sample: str, **labels: str) -> float:
    """Sum of the samples named ``sample`` whose labels include ``labels``."""
    total = 0.0
    for family in registry.collect():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@dataclass
class _World:
    config: DemoConfig
    vendor_a: MockVendor
    vendor_b: MockVendor
    fleet_a: Fleet
    fleet_b: Fleet
    registry: CollectorRegistry
    started: float
    rows: list[Row] = field(default_factory=list)

    def snapshot(self, now: float) -> _Snapshot:
        reg = self.registry
        forwarded = _metric_sum(reg, "ratelimit_requests_total", limiter=VENDOR, outcome="forwarded") + _metric_sum(
            reg, "ratelimit_requests_total", limiter=VENDOR, outcome="held"
        )
        return _Snapshot(
            at=now,
            a_sent=self.fleet_a.counters.sent,
            a_accepted=self.vendor_a.accepted,
            a_429=self.vendor_a.rejected,
            b_sent=self.fleet_b.counters.sent,
            b_forwarded=forwarded,
            b_deferred=_metric_sum(reg, "ratelimit_deferred_total", limiter=VENDOR),
            b_accepted=self.vendor_b.accepted,
            b_429=self.vendor_b.rejected,
        )

    def row(self, before: _Snapshot, after: _Snapshot) -> Row:
        dt = max(after.at - before.at, 1e-6)
        return Row(
            elapsed=after.at - self.started,
            workers=self.fleet_a.size,
            a_sent=(after.a_sent - before.a_sent) / dt,
            a_accepted=(after.a_accepted - before.a_accepted) / dt,
            a_429=(after.a_429 - before.a_429) / dt,
            b_sent=(after.b_sent - before.b_sent) / dt,
            b_forwarded=(after.b_forwarded - before.b_forwarded) / dt,
            b_held=int(_metric_sum(self.registry, "ratelimit_held_requests", limiter=VENDOR)),
            b_deferred=(after.b_deferred - before.b_deferred) / dt,
            b_429=(after.b_429 - before.b_429) / dt,
            b_at_vendor=(after.b_accepted + after.b_429 - before.b_accepted - before.b_429) / dt,
        )


# -- output ------------------------------------------------------------------------------


def plain_line(row: Row, quota: float) -> str:
    """One second as one line, for logs and pipes (stable ``key=value`` fields)."""
    return (
        f"t={row.elapsed:5.1f}s workers={row.workers:3d} | "
        f"A sent={row.a_sent:6.1f}/s accepted={row.a_accepted:6.1f}/s vendor_429={row.a_429:6.1f}/s | "
        f"B sent={row.b_sent:6.1f}/s forwarded={row.b_forwarded:6.1f}/s held={row.b_held:3d} "
        f"deferred={row.b_deferred:6.1f}/s vendor_429={row.b_429:6.1f}/s | quota={quota:g}/s"
    )


def _table(rows: Sequence[Row], config: DemoConfig, elapsed: float, stopping: bool) -> Table:
    from rich.table import Table

    quota = config.quota
    state = "stopping…" if stopping else f"{elapsed:4.0f}/{config.duration:g} s (Ctrl-C stops early)"
    table = Table(
        title=f"quota-proxy demo: vendor quota {quota:g}/s, every worker limited to {PER_WORKER_RATE:g}/s  ·  {state}",
        caption="A: workers call the vendor directly  ·  B: the same workers through quota-proxy's shared bucket",
        header_style="bold",
    )
    for name in ("elapsed", "workers"):
        table.add_column(name, justify="right")
    for name in ("A sent/s", "A accepted/s", "A 429/s"):
        table.add_column(name, justify="right", style="red")
    for name in ("B sent/s", "B forwarded/s", "B held", "B deferred/s", "B 429/s"):
        table.add_column(name, justify="right", style="cyan")
    table.add_column("quota", justify="right")
    for row in rows[-TABLE_ROWS:]:
        over = row.a_accepted + row.a_429 > quota
        table.add_row(
            f"{row.elapsed:.0f} s",
            str(row.workers),
            f"[bold]{row.a_sent:.0f}[/bold]" if over else f"{row.a_sent:.0f}",
            f"{row.a_accepted:.0f}",
            f"[bold red]{row.a_429:.0f}[/bold red]" if row.a_429 else "0",
            f"{row.b_sent:.0f}",
            f"[green]{row.b_forwarded:.0f}[/green]",
            str(row.b_held),
            f"{row.b_deferred:.0f}",
            f"[bold red]{row.b_429:.0f}[/bold red]" if row.b_429 else "[green]0[/green]",
            f"{quota:g}",
        )
    return table


class _Display:
    """A rich live table on a terminal, else one plain line per second."""

    def __init__(self, config: DemoConfig, live: bool) -> None:
        self.config = config
        self._live: Any = None
        if live:
            try:
                from rich.live import Live
            except ImportError:
                live = False
            else:
                self._live = Live(_table([], config, 0.0, False), refresh_per_second=4, transient=False)
        self.live = live

    def __enter__(self) -> _Display:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def update(self, rows: Sequence[Row], elapsed: float, stopping: bool = False) -> None:
        if self._live is not None:
            self._live.update(_table(rows, self.config, elapsed, stopping), refresh=True)
        elif rows and not stopping:
            print(plain_line(rows[-1], self.config.quota), flush=True)


@dataclass(frozen=True, slots=True)
class Summary:
    elapsed: float
    stopped_early: bool
    a: FleetCounters
    b: FleetCounters
    a_accepted: int
    a_429: int
    b_accepted: int
    b_429: int
    b_deferred: int


def summary_text(s: Summary, config: DemoConfig, plot: Path | None) -> str:
    span = max(s.elapsed, 1e-6)
    early = " (stopped early)" if s.stopped_early else ""
    lines = []
    if plot is not None:
        lines.append(f"plot: {plot}")
    lines += [
        f"summary: {s.elapsed:.1f} s{early}, workers {config.workers_from} -> {config.workers_to}, "
        f"{PER_WORKER_RATE:g}/s per worker, vendor quota {config.quota:g}/s",
        f"  fleet A (per-worker limits, direct):       sent {s.a.sent} (retries {s.a.retries}), "
        f"vendor accepted {s.a_accepted} ({s.a_accepted / span:.1f}/s), vendor 429s {s.a_429}",
        f"  fleet B (per-worker limits + quota-proxy): sent {s.b.sent} (retries {s.b.retries}), "
        f"deferred by the proxy {s.b_deferred}, vendor accepted {s.b_accepted} "
        f"({s.b_accepted / span:.1f}/s), vendor 429s {s.b_429}",
    ]
    if s.a.errors or s.b.errors:
        lines.append(f"  connection errors: fleet A {s.a.errors}, fleet B {s.b.errors}")
    if s.a_429 and not s.b_429:
        lines.append(
            f"  -> per-process limits sent {s.a_429} requests the vendor refused; "
            "the shared bucket kept fleet B inside the quota"
        )
    return "\n".join(lines)


def write_plot(rows: Sequence[Row], config: DemoConfig, path: Path, summary: Summary) -> None:
    """Both fleets' rates at the vendor and attempted, the quota, the workers; Agg PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.elapsed for r in rows]
    a_vendor = [r.a_accepted + r.a_429 for r in rows]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, layout="constrained"
    )
    fig.suptitle(
        "Per-process limits break the quota when the autoscaler adds workers; the shared bucket does not", fontsize=12
    )
    top.axhline(config.quota, color="black", linestyle="--", linewidth=1.5, label=f"vendor quota {config.quota:g}/s")
    top.fill_between(
        t,
        config.quota,
        a_vendor,
        where=[v > config.quota for v in a_vendor],
        interpolate=True,
        color="tab:red",
        alpha=0.12,
        label="fleet A: over the quota (vendor 429s)",
    )
    top.plot(
        t,
        a_vendor,
        color="tab:red",
        linewidth=2.2,
        label=f"fleet A at the vendor: {PER_WORKER_RATE:g}/s per worker, direct",
    )
    top.plot(
        t,
        [r.a_accepted for r in rows],
        color="tab:red",
        linestyle=":",
        linewidth=1.2,
        label="fleet A accepted by the vendor",
    )
    top.plot(
        t,
        [r.b_sent for r in rows],
        color="tab:blue",
        linestyle=":",
        linewidth=1.5,
        label="fleet B attempted (sent to quota-proxy, incl. deferred)",
    )
    top.plot(
        t,
        [r.b_at_vendor for r in rows],
        color="tab:blue",
        linewidth=2.2,
        label="fleet B at the vendor: through quota-proxy's shared bucket",
    )
    top.set_ylabel("requests / s")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    workers_axis = top.twinx()
    workers_axis.step(
        t,
        [r.workers for r in rows],
        where="post",
        color="tab:gray",
        alpha=0.7,
        linewidth=1.2,
        label="workers per fleet",
    )
    workers_axis.set_ylabel("workers per fleet", color="tab:gray")
    workers_axis.set_ylim(0, max([config.workers_from, config.workers_to, *(r.workers for r in rows)]) * 1.1)
    handles, labels = top.get_legend_handles_labels()
    more_handles, more_labels = workers_axis.get_legend_handles_labels()
    top.legend(handles + more_handles, labels + more_labels, loc="upper left", fontsize=8.5, framealpha=0.9)

    bottom.plot(
        t,
        [r.a_429 for r in rows],
        color="tab:red",
        linewidth=1.8,
        label=f"fleet A: vendor 429s/s (total {summary.a_429})",
    )
    bottom.plot(
        t,
        [r.b_429 for r in rows],
        color="tab:blue",
        linewidth=1.8,
        label=f"fleet B: vendor 429s/s (total {summary.b_429})",
    )
    bottom.set_ylabel("vendor 429s / s")
    bottom.set_xlabel("seconds")
    top_429 = max([1.0, *(r.a_429 for r in rows), *(r.b_429 for r in rows)])
    bottom.set_ylim(-0.05 * top_429, top_429 * 1.15)  # a line at 0 stays visible above the axis
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8.5)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the run -----------------------------------------------------------------------------


async def _serve_vendor(vendor: MockVendor) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(vendor.app(), access_log=None, handle_signals=False, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def _session(workers: int) -> aiohttp.ClientSession:
    # One keep-alive pool per fleet, one connection per (sequential) worker at most.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=workers + 8, force_close=False),
        timeout=aiohttp.ClientTimeout(total=10),
    )


async def run_demo(
    config: DemoConfig, *, live: bool, stop: asyncio.Event | None = None, out: Callable[[str], None] = print
) -> tuple[list[Row], Summary]:
    """Run the whole demo; returns the per-second rows and the summary. ``stop`` ends it early."""
    from proxy.app import Runtime
    from proxy.policy import parse_policy
    from proxy.server import ProxyServer

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    vendor_a = MockVendor(config.quota, config.vendor_burst)
    vendor_b = MockVendor(config.quota, config.vendor_burst)
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []
    fleets: list[Fleet] = []
    server: ProxyServer | None = None
    try:
        runner_a, url_a = await _serve_vendor(vendor_a)
        runners.append(runner_a)
        runner_b, url_b = await _serve_vendor(vendor_b)
        runners.append(runner_b)
        policy = parse_policy(policy_text(config, url_b), "<demo policy>", base_dir=".")
        runtime = Runtime(policy)
        server = ProxyServer(runtime, policy.listen, policy.admin_listen)
        await server.start()

        most = max(config.workers_from, config.workers_to)
        session_a, session_b = _session(most), _session(most)
        sessions += [session_a, session_b]
        fleet_a = Fleet("A", session_a, f"{url_a}{_PATH}")
        fleet_b = Fleet("B", session_b, f"http://{VENDOR_B_HOST}{_PATH}", proxy=server.url)
        fleets += [fleet_a, fleet_b]

        out(
            f"quota-proxy demo: two fleets grow from {config.workers_from} to {config.workers_to} workers over "
            f"{config.duration:g} s; every worker limits itself to {PER_WORKER_RATE:g}/s"
        )
        out(
            f"  vendor A {url_a} and vendor B {url_b}: quota {config.quota:g}/s each (burst "
            f"{config.vendor_burst:g}), 429 + Retry-After beyond it"
        )
        out(
            f"  fleet A calls vendor A directly; fleet B calls {VENDOR_B_HOST} through quota-proxy {server.url} "
            f"(shared bucket {config.proxy_rate:g}/s, burst {config.proxy_burst:g}, hold <= {MAX_HOLD_MS} ms, "
            f"status {server.admin_url}/status)"
        )

        if max(config.workers_from, config.workers_to) * PER_WORKER_RATE <= config.quota:
            out(
                f"  note: {max(config.workers_from, config.workers_to)} workers x {PER_WORKER_RATE:g}/s never exceed "
                f"the quota of {config.quota:g}/s: raise --workers-to to see the difference"
            )

        started = loop.time()
        world = _World(config, vendor_a, vendor_b, fleet_a, fleet_b, runtime.registry, started)
        previous = world.snapshot(started)
        next_row = started + 1.0
        with _Display(config, live) as display:
            while True:
                now = loop.time()
                elapsed = now - started
                if elapsed >= config.duration or stop.is_set():
                    break
                target = workers_at(elapsed, config.duration, config.workers_from, config.workers_to)
                fleet_a.scale(target)
                fleet_b.scale(target)
                if now >= next_row:
                    current = world.snapshot(now)
                    world.rows.append(world.row(previous, current))
                    previous = current
                    next_row += 1.0
                    display.update(world.rows, elapsed)
                wake = min(now + SCALE_EVERY, next_row, started + config.duration)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, wake - loop.time()))
            end = loop.time()
            if end - previous.at >= 0.5:  # a last partial second, when it means something
                current = world.snapshot(end)
                world.rows.append(world.row(previous, current))
                previous = current
                display.update(world.rows, end - started)
            display.update(world.rows, end - started, stopping=True)
            await _stop_fleets(fleets)
        final = world.snapshot(loop.time())
        summary = Summary(
            elapsed=end - started,
            stopped_early=stop.is_set() and end - started < config.duration - 0.01,
            a=fleet_a.counters,
            b=fleet_b.counters,
            a_accepted=vendor_a.accepted,
            a_429=vendor_a.rejected,
            b_accepted=vendor_b.accepted,
            b_429=vendor_b.rejected,
            b_deferred=round(final.b_deferred),
        )
        return world.rows, summary
    finally:
        await _stop_fleets(fleets)
        for session in sessions:
            await session.close()
        if server is not None:
            await server.stop()
        for runner in reversed(runners):
            await runner.cleanup()


async def _stop_fleets(fleets: Sequence[Fleet]) -> None:
    await asyncio.gather(*(fleet.stop() for fleet in fleets))


async def _main_async(config: DemoConfig, live: bool) -> tuple[list[Row], Summary]:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []

    def on_signal(signum: signal.Signals) -> None:
        stop.set()
        # A second Ctrl-C interrupts the clean-up itself.
        with contextlib.suppress(ValueError, RuntimeError):
            loop.remove_signal_handler(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, on_signal, signum)
            installed.append(signum)
    try:
        return await run_demo(config, live=live, stop=stop)
    finally:
        for signum in installed:
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_signal_handler(signum)


# -- the whole command, once its arguments are checked ------------------------------------


def run(config: DemoConfig) -> int:
    """Run the demo with a live table on a terminal (plain lines otherwise), write the plot and
    print the summary: 0, or 1 when matplotlib is missing or the plot cannot be written."""
    try:
        import matplotlib  # noqa: F401  (checked before a minute-long run, not after)
    except ImportError:
        print("quota-proxy demo: matplotlib is missing: pip install 'quota-proxy[demo]'", file=sys.stderr)
        return 1
    live = sys.stdout.isatty() and os.environ.get("TERM") != "dumb"

    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        pass
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        rows, summary = runner.run(_main_async(config, live))
    plot = config.plot.resolve()
    try:
        write_plot(rows, config, plot, summary)
    except OSError as exc:
        print(f"quota-proxy demo: cannot write the plot: {exc}", file=sys.stderr)
        print(summary_text(summary, config, None))
        return 1
    print(summary_text(summary, config, plot))
    return 0
