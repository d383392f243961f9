"""Binding the two listeners, and stopping gracefully.

At start the file-descriptor limit is raised to its hard limit (fdlimit.py), and the
cap on workers' connections lowered to what it holds, so the admin listener keeps
answering however many connections the proxy port is sent.

SIGTERM: /readyz turns 503, the proxy listener stops accepting, in-flight and
held requests finish (bounded by ``drain_timeout``), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from aiohttp import web

from proxy.app import Runtime
from proxy.ops.admin import AdminState, Reload, admin_app
from proxy.ops.reload import Reloader
from proxy.policy import mask_password
from proxy.policy.model import Address, Policy
from proxy.tasks import spawn
from proxy.telemetry.accesslog import AccessLog
from proxy.telemetry.metrics import GaugeCollector
from proxy.tls.front_door import ConnectGate
from proxy.wire.connections import ConnectionLimits
from proxy.wire.fdlimit import FdLimit, raise_fd_limit

_GC_YOUNG = 10_000
"""Net new container objects between two young-generation collections."""

log = logging.getLogger("quota_proxy")

_ADMIN_IDLE_TIMEOUT = 75.0  # seconds an admin connection may idle: longer than common scrape intervals


class CannotListen(Exception):
    """A listener could not be bound (the port is in use, the address is not this host's...)."""

    def __init__(self, role: str, address: Address, error: OSError) -> None:
        if isinstance(error, socket.gaierror) or not error.errno or error.errno < 0:
            reason = error.strerror or str(error)  # a name that does not resolve: its own message
        else:
            reason = os.strerror(error.errno)  # not the event loop's long wording of it
        super().__init__(f"cannot listen on {address} ({role}): {reason[:1].lower()}{reason[1:]}")
        self.role = role
        self.address = address
        self.error = error


def _bound(addresses: Iterable[tuple[str, int]]) -> Address:
    for host, port, *_ in addresses:
        return Address(host, port)
    raise RuntimeError("listener is not bound")


@dataclass(frozen=True, slots=True)
class WorkerSockets:
    """How a worker of ``run --workers N`` binds (proxy/ops/workers.py): the proxy listener with
    SO_REUSEPORT, so that the kernel spreads connections over the workers' sockets, and its
    admin endpoints on a Unix socket only the supervisor asks. ``index``: which worker
    (its access-log lines say so)."""

    admin_socket: str
    index: int = 0


class ProxyServer:
    """Both listeners of one Runtime. ``start`` binds, ``stop`` drains.

    The proxy listener's connections go through the ConnectGate: plain HTTP is handed
    to the data plane's HTTP/1.1 server, CONNECT is answered by the gate. ``fd_capacity``:
    the worker connections the file-descriptor limit holds (None: no such bound).
    """

    def __init__(
        self,
        runtime: Runtime,
        listen: Address,
        admin_listen: Address,
        *,
        reload: Reload | None = None,
        fd_capacity: int | None = None,
        worker: WorkerSockets | None = None,
    ) -> None:
        self.runtime = runtime
        self._worker = worker
        self._listen = listen
        self._admin_listen = admin_listen
        self.limits = ConnectionLimits(lambda: runtime.policy.connections, runtime.metrics, fd_capacity)
        self.gate = ConnectGate(runtime.handler, lambda: runtime.leaf_minter, self.limits)
        self.admin = AdminState(lambda: runtime.deps, self.gate.tunnels.count, reload, self._connections)
        self._listener: asyncio.Server | None = None
        self._admin_runner = web.AppRunner(
            admin_app(self.admin),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            keepalive_timeout=_ADMIN_IDLE_TIMEOUT,
        )
        for name, doc, read in (
            ("ratelimit_connections_open", "Workers' connections open on the proxy listener.", self._open),
            (
                "ratelimit_connections_max",
                "The cap on them: connections.max, or what file descriptors hold.",
                self._cap,
            ),
        ):
            runtime.metrics.add_gauges(GaugeCollector(name, doc, [], read))
        self.address = listen
        self.admin_address = admin_listen

    async def start(self) -> None:
        """Bind both listeners; raises CannotListen (having bound nothing) if either fails."""
        await self._admin_runner.setup()
        role, address = "admin_listen", self._admin_listen
        try:
            admin_site: web.BaseSite = (
                web.TCPSite(self._admin_runner, address.host, address.port, reuse_address=True)
                if self._worker is None
                else web.UnixSite(self._admin_runner, self._worker.admin_socket)
            )
            await admin_site.start()
            role, address = "listen", self._listen
            self._listener = await asyncio.get_running_loop().create_server(
                self.gate.protocol,
                address.host,
                address.port,
                reuse_address=True,
                reuse_port=self._worker is not None,
                backlog=1024,
            )
        except OSError as exc:
            await self._admin_runner.cleanup()
            raise CannotListen(role, address, exc) from exc
        self.address = _bound(s.getsockname() for s in self._listener.sockets)
        if self._worker is None:
            self.admin_address = _bound(self._admin_runner.addresses)
        self.admin.serving = True

    def _open(self) -> list[tuple[list[str], float]]:
        return [([], float(self.gate.open_connections))]

    def _cap(self) -> list[tuple[list[str], float]]:
        return [([], float(self.limits.cap))]

    def _connections(self) -> dict[str, object]:
        """/status's view of the proxy listener's connections."""
        settings = self.runtime.policy.connections
        return {
            "open": self.gate.open_connections,
            "max": self.limits.cap,
            "max_configured": settings.max,
            "head_timeout_seconds": settings.head_timeout,
            "idle_timeout_seconds": settings.idle_timeout,
        }

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_address}"

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests and tunnels finish (bounded by
        drain_timeout), then close everything."""
        self.admin.draining = True
        drain = self.runtime.policy.drain_timeout
        if self._listener is not None:
            self._listener.close()
        # Let requests that arrived just before the close start being handled.
        await asyncio.sleep(0)
        self.gate.close_idle()  # idle connections close now, busy ones after their answer
        # What is still open at the bound is closed, its requests cancelled: the drain ends at drain_timeout.
        cut = asyncio.get_running_loop().call_later(drain, self._cut_in_flight)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain):
                    await asyncio.gather(self.gate.served_drained(), self.gate.drained())
                    # Answers heard out for workers that went away: their requests are still
                    # at the vendor, their slots taken until the vendor is done.
                    await self.runtime.handler.deps.upstreams.heard_out()
        finally:
            cut.cancel()
            self._cut_in_flight()
        if self._listener is not None:
            await self._listener.wait_closed()
        await self._admin_runner.cleanup()
        await self.runtime.close()

    def _cut_in_flight(self) -> None:
        self.gate.cut()  # the requests on them are cancelled


async def serve(
    policy: Policy,
    listen: Address,
    admin_listen: Address,
    ready_line: bool = True,
    load: Callable[[], Policy] | None = None,
    watch: str | None = None,
    worker: WorkerSockets | None = None,
) -> int:
    """Run until SIGTERM or SIGINT; returns the exit status. With ``load``, SIGHUP and
    POST /reload reload the policy; with ``watch`` (the policy's path) so does a change
    to the file."""
    fd_limit = raise_fd_limit()  # before binding: the listeners' sockets count too
    # The access log is one JSON object per line, nothing around it, for log pipelines.
    runtime = Runtime(policy, access_log=AccessLog(sys.stderr, worker=None if worker is None else worker.index))
    reloader = Reloader(runtime, load) if load is not None else None
    server = ProxyServer(
        runtime,
        listen,
        admin_listen,
        reload=reloader.reload if reloader is not None else None,
        fd_capacity=None if fd_limit is None else fd_limit.connection_capacity,
        worker=worker,
    )
    # Handlers first: /readyz may answer while the proxy listener is still binding,
    # and a SIGTERM from whoever saw it ready must drain, not kill.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if reloader is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: spawn(reloader.reload("SIGHUP"), name="reload"))
    try:
        await server.start()
    except CannotListen as exc:
        print(f"quota-proxy: {exc}", file=sys.stderr, flush=True)  # one line, like the CLI's other refusals
        await runtime.close()
        return 1
    _log_fd_limit(fd_limit, policy)  # only once listening: a refusal to start stays one line
    # What start-up built lives as long as the process: out of the collector's full passes,
    # which would otherwise rescan it, stalling the event loop (and held requests' timing).
    gc.collect()
    gc.freeze()
    # A young generation of 700 objects (the default) fills with the objects of the
    # requests in flight, not with garbage: a collection every ~50 requests, each one
    # traversing them all (~6-15 µs per request under load, issue 11). Garbage cycles are
    # few, so a larger one is collected rarely and the memory it holds stays small.
    gc.set_threshold(_GC_YOUNG, *gc.get_threshold()[1:])
    watcher = spawn(reloader.watch(watch), name="watch-policy") if reloader and watch else None
    if ready_line:
        print(
            f"quota-proxy listening on {server.url} (admin {server.admin_url}, store "
            f"{mask_password(policy.store.url)}, {len(policy.vendors)} vendor(s))",
            flush=True,
        )
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    log.info("draining: finishing in-flight requests (at most %.1fs)", runtime.policy.drain_timeout)
    await server.stop()
    log.info("stopped")
    return 0


def _log_fd_limit(limit: FdLimit | None, policy: Policy) -> None:
    """Say what the file-descriptor limit is, and warn when it holds fewer worker
    connections than ``connections.max`` (the cap is then lowered to what fits)."""
    if limit is None:
        return
    (log.warning if limit.problem else log.info)("%s", limit.report)
    capacity = limit.connection_capacity
    if capacity < policy.connections.max:
        log.warning(
            "connections.max %d lowered to %d: the file-descriptor limit (%d) cannot hold more (a worker "
            "connection may need a vendor connection too); raise it (ulimit -n, systemd LimitNOFILE=, "
            "the container runtime's nofile) to serve more",
            policy.connections.max,
            capacity,
            limit.soft,
        )
