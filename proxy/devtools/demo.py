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
is why the autoscaler adds them.

This module is the run itself: its configuration, the proxy's policy, the sampling loop and
the command. The fleets are in ``demo_fleet``; the live rows, the summary and the PNG are in
``demo_report``. Ctrl-C stops early and still writes the plot and the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

import aiohttp
from aiohttp import web

from proxy.devtools.demo_defaults import DEFAULT_DURATION, DEFAULT_PLOT
from proxy.devtools.demo_fleet import PER_WORKER_RATE, Fleet, workers_at
from proxy.devtools.demo_report import Display, Row, Summary, summary_text, write_plot
from proxy.devtools.mockvendor import MockVendor

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from proxy.server import ProxyServer

__all__ = ["DemoConfig", "run", "run_demo"]

SCALE_EVERY: Final = 0.25
"""How often the autoscaler adjusts the fleets, seconds."""
VENDOR = "vendor-b"
VENDOR_B_HOST = "api.vendor-b.example"
_PATH = "/v1/charges"
MAX_HOLD_MS: Final = 250
"""The proxy's ``on_limit.max_hold``. Workers are sequential, so at most one request per
worker waits in the proxy; at 95/s a 500 ms hold would absorb 47 of them and 40 workers
would never see a defer. 250 ms holds up to ~24 and defers the rest, showing both."""


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


# -- sampling ----------------------------------------------------------------------------


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
        with Display(config, live) as display:
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
