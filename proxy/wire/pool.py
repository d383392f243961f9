"""Keep-alive connections to one vendor's origins (``Pool``): opens them (TLS through
``loop.create_connection(ssl=...)``), keeps the idle ones per origin for the next request,
closes those idle too long, and waits out the answers being heard out (upstream.py's ``abandon``)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque

from proxy.wire.upstream import Origin, UpstreamConnection, UpstreamFailed


class Pool:
    """Keep-alive connections to one vendor's origins. ``ssl_context``: for https origins
    (False: no verification); ``keepalive``: seconds an idle connection is kept."""

    def __init__(self, ssl_context: ssl.SSLContext | bool = True, keepalive: float = 30.0) -> None:
        if ssl_context is True:
            ssl_context = ssl.create_default_context()
        elif ssl_context is False:
            ssl_context = ssl.create_default_context()
            ssl_context.check_hostname = False
            ssl_context.verify_mode = ssl.CERT_NONE
        self._ssl = ssl_context
        self._keepalive = keepalive
        self._idle: dict[Origin, deque[UpstreamConnection]] = {}
        """Idle connections per origin, the longest idle first: requests take the newest, the
        oldest are closed once idle ``keepalive`` seconds (``_sweep``)."""
        self._all: set[UpstreamConnection] = set()
        self._heard: set[asyncio.Task[None]] = set()  # answers being heard out (abandon)
        self.closed = False

    async def connection(self, origin: Origin, connect_timeout: float | None) -> UpstreamConnection:
        """An idle connection to ``origin`` if one is open, else a new one. Raises
        UpstreamFailed (``reached=False``) when none can be made."""
        return self.idle(origin) or await self.open(origin, connect_timeout)

    def idle(self, origin: Origin) -> UpstreamConnection | None:
        """The newest idle connection to ``origin`` still usable, if any (no await: the usual case)."""
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive:
                return conn
            conn.close()
        return None

    async def open(self, origin: Origin, connect_timeout: float | None) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        tls = self._ssl if origin.scheme == "https" else None
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                )
        except TimeoutError:
            raise UpstreamFailed("connect-timeout", "did not accept a connection in time", reached=False) from None
        except ssl.SSLCertVerificationError as exc:
            raise UpstreamFailed("certificate", f"certificate verification failed: {exc}", reached=False) from exc
        except ssl.SSLError as exc:
            raise UpstreamFailed("tls", f"TLS error: {exc}", reached=False) from exc
        except OSError as exc:
            raise UpstreamFailed("refused", f"cannot connect: {exc}", reached=False) from exc
        if self.closed:
            conn.close()
            raise UpstreamFailed("refused", "the pool is closed", reached=False)
        self._all.add(conn)
        return conn

    def idle_count(self, origin: Origin) -> int:
        idle = self._idle.get(origin)
        if not idle:
            return 0
        self._sweep(idle)
        return sum(1 for c in idle if not c.closed)

    def _sweep(self, idle: deque[UpstreamConnection]) -> None:
        """Close the connections idle for ``keepalive`` seconds (a vendor need not close them
        itself: without this, every warm top-up would add to them)."""
        stale = time.monotonic() - self._keepalive
        while idle and idle[0].idle_since <= stale:
            idle.popleft().close()

    async def warm(self, origin: Origin, count: int, connect_timeout: float) -> list[BaseException]:
        """Open connections to ``origin`` until ``count`` are idle; returns the failures."""
        missing = count - self.idle_count(origin)
        if missing <= 0:
            return []
        opened = await asyncio.gather(
            *(self.open(origin, connect_timeout) for _ in range(missing)), return_exceptions=True
        )
        failures = []
        for conn in opened:
            if isinstance(conn, UpstreamConnection):
                self.give_back(conn)
            else:
                failures.append(conn)
        return failures

    def give_back(self, conn: UpstreamConnection) -> None:
        """``conn`` idle again (its answer read whole, or never used): kept for the next request."""
        if self.closed or conn.closed:
            conn.close()
            return
        conn.idle_since = now = time.monotonic()
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = deque()
        idle.append(conn)
        if idle[0].idle_since <= now - self._keepalive:  # (the test before the call: once per request)
            self._sweep(idle)

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    def _hearing(self, task: asyncio.Task[None]) -> None:
        self._heard.add(task)
        task.add_done_callback(self._heard.discard)

    async def heard_out(self) -> None:
        """Return once no answer is being heard out (the drain waits for them: their
        requests are still at the vendor, their concurrency slots still taken)."""
        while self._heard:
            await asyncio.wait(list(self._heard))

    async def close(self) -> None:
        self.closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
