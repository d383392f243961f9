#!/usr/bin/env python3
"""The floor of a pure-Python forward proxy on this stack (uvloop, httptools, hiredis).

Not part of the product, and not a proxy anyone should run: it is the least work a Python
process can do per forwarded request, to say how far below proxy.py any design on these
parts can get (issue 11, target 1). Everything is a callback; no task, no future, no
coroutine per request:

- the worker's head is parsed by llhttp, hop-by-hop fields dropped, the absolute-form
  target cut to its path, and the head written to one upstream connection kept per
  worker connection (a GET without a body: the bench's load, nothing else);
- with ``--redis``, one EVALSHA per request first, over one pipelined connection whose
  commands of a loop turn leave in one write, the reply parsed by hiredis; the script
  returns at once (the store's own CPU is on the other core and not counted);
- the vendor's answer is framed by llhttp and relayed byte for byte, unrewritten.

No limiter logic, no metrics, no access log, no timeouts, no error handling. Prints
``floor-proxy listening on http://HOST:PORT``.

``--coroutines``: the same work in the product's shape instead, a task per worker
connection awaiting a future for each step (the next head, the store's reply, the
vendor's answer): what that shape costs over callbacks.

    python bench/_floor_proxy.py --port 8080 --upstream http://127.0.0.1:9000 [--redis redis://127.0.0.1:6379]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import hiredis
import httptools
import uvloop

_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade"})
_SCRIPT = b"return {1, 0, 5, 6, 7}"
_KEYS = b"$3\r\nk:a\r\n$3\r\nk:b\r\n$3\r\nk:c\r\n"


class Store(asyncio.Protocol):
    """One pipelined Redis connection: ``call`` queues an EVALSHA, the turn's queue leaves in one write."""

    def __init__(self, sha: bytes) -> None:
        self._sha = sha
        self._reader = hiredis.Reader()
        self._waiting: deque[Callable[[object], None]] = deque()
        self._out: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def call(self, done: Callable[[object], None]) -> None:
        sha = self._sha
        cmd = b"*6\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$1\r\n3\r\n$3\r\nk:a\r\n$3\r\nk:b\r\n$3\r\nk:c\r\n" % (
            len(sha),
            sha,
        )
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(cmd)
        self._waiting.append(done)

    def _flush(self) -> None:
        assert self.transport is not None
        self.transport.write(b"".join(self._out))
        self._out.clear()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            self._waiting.popleft()(reply)


class Upstream(asyncio.Protocol):
    def __init__(self, client: Client) -> None:
        self._client = client
        self._parser = httptools.HttpResponseParser(self)
        self._parts: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._client.upstream_ready(self)

    def data_received(self, data: bytes) -> None:
        self._parts.append(data)
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        data = b"".join(self._parts)
        self._parts.clear()
        self._client.answer(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.upstream_lost(self)


class Client(asyncio.Protocol):
    def __init__(self, upstream: tuple[str, int], store: Store | None) -> None:
        self._where = upstream
        self._store = store
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._fields: list[bytes] = []
        self._head = b""
        self._up: Upstream | None = None
        self._connecting = False
        self._opening: asyncio.Task[object] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._up is not None and self._up.transport is not None:
            self._up.transport.close()

    def on_message_begin(self) -> None:
        self._url = b""
        self._fields = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _HOP:
            self._fields.append(b"%s: %s\r\n" % (name, value))

    def on_message_complete(self) -> None:
        url = self._url
        path = url[url.index(b"/", url.index(b"//") + 2) :] if url[:1] != b"/" else url
        self._fields.append(b"\r\n")
        self._head = b"%s %s HTTP/1.1\r\n%s" % (self._parser.get_method(), path, b"".join(self._fields))
        if self._store is not None:
            self._store.call(self._granted)
        else:
            self._granted(None)

    def _granted(self, _reply: object) -> None:
        up = self._up
        if up is not None and up.transport is not None:
            up.transport.write(self._head)
        elif not self._connecting:
            self._connecting = True
            loop = asyncio.get_running_loop()
            self._opening = loop.create_task(loop.create_connection(lambda: Upstream(self), *self._where))

    def upstream_ready(self, up: Upstream) -> None:
        self._connecting = False
        self._up = up
        assert up.transport is not None
        up.transport.write(self._head)

    def upstream_lost(self, up: Upstream) -> None:
        if self._up is up:
            self._up = None

    def answer(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)


def _settle(fut: asyncio.Future[object], reply: object) -> None:
    if not fut.done():  # (cancelled: the worker went away)
        fut.set_result(reply)


class CoroutineClient(Client):
    """The same, driven by one task per connection that awaits each step."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._loop = asyncio.get_running_loop()
        self._heads: deque[bytes] = deque()
        self._next: asyncio.Future[object] | None = None
        self._answer: asyncio.Future[object] | None = None
        self._task = self._loop.create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._task.cancel()

    def on_message_complete(self) -> None:
        url = self._url
        path = url[url.index(b"/", url.index(b"//") + 2) :] if url[:1] != b"/" else url
        self._fields.append(b"\r\n")
        self._heads.append(b"%s %s HTTP/1.1\r\n%s" % (self._parser.get_method(), path, b"".join(self._fields)))
        if self._next is not None and not self._next.done():
            self._next.set_result(None)

    async def _serve(self) -> None:
        loop = self._loop
        while True:
            while not self._heads:
                self._next = loop.create_future()
                await self._next
            self._head = self._heads.popleft()
            if self._store is not None:
                granted = loop.create_future()
                self._store.call(functools.partial(_settle, granted))
                await granted
            self._answer = loop.create_future()
            self._granted(None)
            data = await self._answer
            assert self.transport is not None and isinstance(data, bytes)
            self.transport.write(data)

    def answer(self, data: bytes) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(data)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--upstream", required=True)
    p.add_argument("--redis", default="")
    p.add_argument("--coroutines", action="store_true", help="a task per connection, a future per step")
    args = p.parse_args()
    up = urlsplit(args.upstream)
    where = (up.hostname or "127.0.0.1", up.port or 80)
    loop = asyncio.get_running_loop()
    store: Store | None = None
    if args.redis:
        r = urlsplit(args.redis)
        _, store_proto = await loop.create_connection(lambda: Store(b""), r.hostname, r.port or 6379)
        sha = await _load(store_proto)
        store_proto._sha = sha
        store = store_proto
    server = await loop.create_server(
        lambda: (CoroutineClient if args.coroutines else Client)(where, store), args.host, args.port, backlog=1024
    )
    port = server.sockets[0].getsockname()[1]
    print(f"floor-proxy listening on http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


async def _load(store: Store) -> bytes:
    """SCRIPT LOAD through the same connection, before any request."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[object] = loop.create_future()
    assert store.transport is not None
    store.transport.write(b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n$%d\r\n%s\r\n" % (len(_SCRIPT), _SCRIPT))
    store._waiting.append(done.set_result)
    reply = await done
    assert isinstance(reply, bytes), reply
    return reply


if __name__ == "__main__":
    uvloop.run(main())
