"""The aiohttp internals the project relies on (proxy/wire/aiohttp_internals.py), each exercised.

A failure here after an aiohttp upgrade means one of them changed: adapt
aiohttp_internals.py (its comments say what each is for) before shipping the upgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from proxy.wire.aiohttp_internals import send_continue

WAIT = 5.0


@contextlib.asynccontextmanager
async def listening(factory: Callable[[], asyncio.BaseProtocol]) -> AsyncIterator[str]:
    """A listener on a free port serving connections with ``factory``; yields its URL."""
    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    try:
        host, port = server.sockets[0].getsockname()[:2]
        yield f"http://{host}:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes, read until the server closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), WAIT)
    finally:
        writer.close()


GET_AND_CLOSE = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def test_send_continue_writes_an_interim_answer_not_counted_as_the_answer() -> None:
    seen: list[int] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await send_continue(request)
        seen.append(request.writer.output_size)
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"body")
        seen.append(request.writer.output_size)
        return resp

    async with listening(web.Server(handler, access_log=None)) as url:
        raw = await exchange(url, GET_AND_CLOSE)
    assert seen[0] == 0 and seen[1] > 0
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), raw


async def test_after_a_100_continue_aiohttp_itself_can_still_answer_500() -> None:
    """aiohttp decides whether it may still send its 500 from the same counter."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await send_continue(request)
        raise RuntimeError("a bug after the interim answer")

    async with listening(web.Server(handler, access_log=None)) as url:
        raw = await exchange(url, GET_AND_CLOSE)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 500 "), raw
