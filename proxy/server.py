"""Binding the two listeners, and stopping gracefully.

SIGTERM: /readyz turns 503, the proxy listener stops accepting, in-flight and
held requests finish (bounded by ``drain_timeout``), then the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from proxy.admin import admin_app
from proxy.app import Runtime
from proxy.policy import mask_password
from proxy.policy.model import Address, Policy

log = logging.getLogger("quota_proxy")


def _bound(runner: web.BaseRunner) -> Address:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            host, port = server.sockets[0].getsockname()[:2]
            return Address(host, port)
    raise RuntimeError("listener is not bound")


class ProxyServer:
    """Both listeners of one Runtime. ``start`` binds, ``stop`` drains."""

    def __init__(self, runtime: Runtime, listen: Address, admin_listen: Address) -> None:
        self.runtime = runtime
        self._listen = listen
        self._admin_listen = admin_listen
        drain = runtime.policy.drain_timeout
        server = web.Server(runtime.handler, handler_cancellation=True, access_log=None)
        self._proxy_runner = web.ServerRunner(server, shutdown_timeout=drain, handle_signals=False)
        self._admin_runner = web.AppRunner(admin_app(runtime.admin), access_log=None, handle_signals=False,
                                           shutdown_timeout=1.0)
        self.address = listen
        self.admin_address = admin_listen

    async def start(self) -> None:
        await self._admin_runner.setup()
        await self._proxy_runner.setup()
        try:
            admin_site = web.TCPSite(self._admin_runner, self._admin_listen.host, self._admin_listen.port,
                                     reuse_address=True)
            await admin_site.start()
            proxy_site = web.TCPSite(self._proxy_runner, self._listen.host, self._listen.port,
                                     reuse_address=True, backlog=1024)
            await proxy_site.start()
        except OSError:
            await self._proxy_runner.cleanup()
            await self._admin_runner.cleanup()
            raise
        self.address = _bound(self._proxy_runner)
        self.admin_address = _bound(self._admin_runner)
        self.runtime.admin.serving = True

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_address}"

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then close everything."""
        self.runtime.admin.draining = True
        # aiohttp waits shutdown_timeout for in-flight handlers, then up to as long again after
        # merely *asking* them to stop (a handler awaiting its vendor never notices): close what
        # is still open at the bound ourselves, so the drain really ends at drain_timeout.
        cut = asyncio.get_running_loop().call_later(self.runtime.policy.drain_timeout, self._cut_in_flight)
        try:
            await self._proxy_runner.cleanup()
        finally:
            cut.cancel()
        await self._admin_runner.cleanup()
        await self.runtime.close()

    def _cut_in_flight(self) -> None:
        server = self._proxy_runner.server
        if server is not None:
            for connection in server.connections:
                connection.force_close()  # connection_lost cancels the handler (handler_cancellation)


async def serve(policy: Policy, listen: Address, admin_listen: Address, ready_line: bool = True) -> int:
    """Run until SIGTERM or SIGINT; returns the exit status."""
    runtime = Runtime(policy)
    server = ProxyServer(runtime, listen, admin_listen)
    # Handlers first: /readyz may answer while the proxy listener is still binding,
    # and a SIGTERM from whoever saw it ready must drain, not kill.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        await runtime.close()
        return 1
    if ready_line:
        print(
            f"quota-proxy listening on {server.url} (admin {server.admin_url}, store "
            f"{mask_password(policy.store.url)}, {len(policy.vendors)} vendor(s))",
            flush=True,
        )
    await stop.wait()
    log.info("draining: finishing in-flight requests (at most %.1fs)", policy.drain_timeout)
    await server.stop()
    log.info("stopped")
    return 0

