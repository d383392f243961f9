"""The mock vendor served on its own until a signal: ``quota-proxy mock-vendor`` runs ``serve``."""

from __future__ import annotations

import asyncio
import signal
import ssl
import sys
import time
from collections.abc import Callable

from aiohttp import web

from proxy.devtools.mockvendor import MockVendor
from proxy.devtools.mockvendor_quota import format_number
from proxy.names import format_authority

__all__ = ["serve"]


async def _limits_at(vendor: MockVendor, schedule: tuple[tuple[float, float], ...]) -> None:
    """Change the limit at each (seconds after start, rate) of ``schedule``."""
    started = time.monotonic()
    for at, rate in sorted(schedule):
        await asyncio.sleep(max(started + at - time.monotonic(), 0.0))
        vendor.set_limit(rate)
        print(f"mock-vendor: limit now {format_number(rate)}/s", flush=True)


def _token_quotas(vendor: MockVendor) -> str:
    """``; tokens in any 60s: openai 1000, anthropic input_tokens 500 ...``, or nothing."""
    counted = [
        (shape.name, window) for shape in vendor.shapes if shape.meter is not None for window in shape.meter.windows
    ]
    if not counted:
        return ""
    told = ", ".join(f"{name} {window.currency} {window.limit}" for name, window in counted)
    return f"; in any {format_number(counted[0][1].window)}s window at most {told}"


async def _serve(
    vendor: MockVendor,
    host: str,
    port: int,
    schedule: tuple[tuple[float, float], ...] = (),
    tls: ssl.SSLContext | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    runner = web.ServerRunner(web.Server(vendor.handle, access_log=None), shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024, ssl_context=tls)
        try:
            await site.start()
        except OSError as exc:
            print(f"mock-vendor: cannot listen on {format_authority(host, port)}: {exc}", file=sys.stderr)
            return 1
        bound_port = runner.addresses[0][1]
        if vendor.rate is None:
            quota = "rate unlimited, burst unlimited"
        elif vendor.window is not None:
            quota = (
                f"rate {format_number(vendor.rate)}/s, sliding window {format_number(vendor.window)}s: "
                f"at most {vendor.window_limit} requests in any window"
            )
        else:
            assert vendor.burst is not None
            quota = f"rate {format_number(vendor.rate)}/s, burst {format_number(vendor.burst)}"
        scheme = "http" if tls is None else "https"
        quota += _token_quotas(vendor)
        print(f"mock-vendor listening on {scheme}://{format_authority(host, bound_port)} ({quota})", flush=True)
        changes = asyncio.ensure_future(_limits_at(vendor, schedule))
        try:
            await stop.wait()
        finally:
            changes.cancel()
        return 0
    finally:
        await runner.cleanup()
        for sig in signals:
            loop.remove_signal_handler(sig)


def serve(
    vendor: MockVendor,
    host: str,
    port: int,
    schedule: tuple[tuple[float, float], ...] = (),
    tls: ssl.SSLContext | None = None,
) -> int:
    """Serve ``vendor`` on ``host:port`` until SIGTERM or SIGINT, then return 0 (1 if it cannot listen).

    ``schedule``: (seconds after start, rate) pairs at which the limit changes (``set_limit``);
    ``tls``: serve HTTPS with this context (``https://`` in the line below).

    Prints ``mock-vendor listening on http://HOST:PORT (rate R/s, burst B)`` once bound
    (``(rate R/s, sliding window Ws: at most N requests in any window)`` with a window; then
    ``; in any 60s window at most openai tokens 1000, anthropic input_tokens 500`` with token
    quotas).
    """
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop
    except ImportError:
        pass
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(vendor, host, port, schedule, tls))
