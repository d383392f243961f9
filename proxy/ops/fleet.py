"""``run --workers N``: the supervisor (workers.py) and the one admin port over its workers
(workers_admin.py), from start to SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from proxy.ops.workers import Supervisor, WorkerCommand, ready_line
from proxy.ops.workers_admin import AdminServer
from proxy.policy.model import Policy
from proxy.server import CannotListen
from proxy.tasks import spawn

log = logging.getLogger("quota_proxy.workers")


async def run_workers(
    policy: Policy,
    count: int,
    command: WorkerCommand,
    load: Callable[[str], Policy],
    text: str,
    watch: bool,
) -> int:
    """Serve ``policy`` (read from ``text``, the file ``policy.source``'s) from ``count``
    workers until SIGTERM or SIGINT, ``watch``-ing the file if asked; the exit status."""
    supervisor = Supervisor(policy, count, command, load, text)
    try:
        supervisor.reserve_port()
    except OSError as exc:
        print(f"quota-proxy: {CannotListen('listen', policy.listen, exc)}", file=sys.stderr, flush=True)
        return 1
    admin = AdminServer(supervisor)
    try:
        await admin.start(policy.admin_listen)
    except OSError as exc:
        supervisor.release_port()
        print(f"quota-proxy: {CannotListen('admin_listen', policy.admin_listen, exc)}", file=sys.stderr, flush=True)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: spawn(supervisor.reload("SIGHUP"), name="reload"))
    watching = supervisor.watch(policy.source) if watch else None
    starting = asyncio.ensure_future(supervisor.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set() or not starting.result():  # SIGTERM while starting, or a worker failed
        failed = not stop.is_set()
        stopped.cancel()
        await supervisor.stop()
        await starting  # resolved: every slot has said how its first start went
        await admin.stop()
        if watching is not None:
            watching.close()
        if failed:
            print("quota-proxy: a worker failed to start (its error is above)", file=sys.stderr, flush=True)
        return 1 if failed else 0
    pids = " ".join(str(w.pid) for w in supervisor.workers)
    log.info("%d workers serving %s (pids %s)", count, supervisor.listen, pids)
    print(ready_line(supervisor.listen, admin.address, policy), flush=True)
    watcher = spawn(watching, name="watch-policy") if watching is not None else None
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    log.info("draining: %d workers finish in-flight requests (at most %.1fs)", count, supervisor.policy.drain_timeout)
    await supervisor.stop()
    await admin.stop()
    log.info("stopped")
    return 0
