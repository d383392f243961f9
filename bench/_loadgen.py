#!/usr/bin/env python3
"""A small closed-loop HTTP/1.1 load generator (the fallback when ``wrk`` is absent).

Raw asyncio protocols on uvloop, keep-alive, one request in flight per
connection, no HTTP library in the loop: a few tens of µs of CPU per request, so
one process can saturate a Python proxy on another core. Responses must carry
Content-Length or be chunked. Prints one JSON line:
``{"requests", "non2xx", "errors", "elapsed"}``. Loopback targets only.

    python bench/_loadgen.py --connect 127.0.0.1:8080 --target http://api.bench.example/v1/ping \\
        --connections 50 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


class _Conn(asyncio.Protocol):
    def __init__(self, request: bytes, stats: dict[str, int], deadline: float, done: asyncio.Future[None]) -> None:
        self.request = request
        self.stats = stats
        self.deadline = deadline
        self.done = done
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        if time.monotonic() >= self.deadline:
            self.transport.close()
            return
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            try:
                status = int(lines[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                self._fail()
                return
            length = None
            chunked = False
            close = False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip())
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
                elif name == "connection" and "close" in value.lower():
                    close = True
            body_start = end + 4
            if chunked:
                consumed = self._chunked_end(body_start)
                if consumed is None:
                    return
            else:
                consumed = body_start + (length or 0)
                if len(self.buf) < consumed:
                    return
            del self.buf[:consumed]
            self.stats["requests"] += 1
            if not 200 <= status < 300:
                self.stats["non2xx"] += 1
            if close:
                self.stats["errors"] += 1  # the server closed: a sign of trouble in a keep-alive bench
                assert self.transport is not None
                self.transport.close()
                return
            self._send()

    def _chunked_end(self, pos: int) -> int | None:
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            pos = eol + 2 + size + 2
            if len(buf) < pos:
                return None
            if size == 0:
                return pos

    def _fail(self) -> None:
        self.stats["errors"] += 1
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def run(host: str, port: int, request: bytes, connections: int, duration: float) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    stats = {"requests": 0, "non2xx": 0, "errors": 0}
    start = time.monotonic()
    deadline = start + duration
    futures = []
    for _ in range(connections):
        done: asyncio.Future[None] = loop.create_future()
        try:
            await loop.create_connection(lambda d=done: _Conn(request, stats, deadline, d), host, port)
        except OSError:
            stats["errors"] += 1
            continue
        futures.append(done)
    if futures:
        await asyncio.wait(futures, timeout=duration + 10)
    return {**stats, "elapsed": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/_loadgen.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, metavar="127.0.0.1:PORT", help="where to connect (loopback only)")
    p.add_argument("--target", required=True, help="request target: an absolute URL (proxy form) or a path")
    p.add_argument("--host", default=None, help="Host header (default: the target's host)")
    p.add_argument("--connections", type=int, default=50)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--header", action="append", default=[], metavar="NAME: VALUE", help="an extra request header")
    args = p.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    if not host.startswith("127.") and host not in ("localhost", "::1"):
        p.error("loopback targets only")
    target = args.target
    host_header = args.host or (target.split("://", 1)[1].split("/", 1)[0] if "://" in target else host)
    extra = "".join(f"{h}\r\n" for h in args.header)
    request = f"GET {target} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: quota-bench\r\n{extra}\r\n".encode()
    try:
        import uvloop

        result = uvloop.run(run(host, int(port), request, args.connections, args.duration))
    except ImportError:  # pragma: no cover
        result = asyncio.run(run(host, int(port), request, args.connections, args.duration))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
