"""The aiohttp details the proxy relies on beyond aiohttp's documented API
(proxy/aiohttp_internals.py), each checked against the installed aiohttp.

A failure here after an aiohttp upgrade means one of them changed: adapt
aiohttp_internals.py (its comments say what each is for) before shipping the upgrade.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from proxy.aiohttp_internals import (
    HeadersWithBody,
    answer_begun,
    connection_tag,
    cut_connections,
    no_hidden_resend,
    send_continue,
    served_connection,
    stop_keep_alive,
)
from tests.conftest import eventually

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


class Guard:
    """A ConnectionGuard that records what the connection reported."""

    def __init__(self, head_timeout: float = 60.0, idle_timeout: float = 60.0) -> None:
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.open = 0
        self.timeouts: list[tuple[bool, float]] = []
        self.closed_all = asyncio.Event()
        self.waiters: dict[object, Callable[[], None]] = {}

    def opened(self) -> None:
        self.open += 1

    def closed(self) -> None:
        self.open -= 1
        if self.open == 0:
            self.closed_all.set()

    def head_timed_out(self, partial: bool) -> bytes:
        self.timeouts.append((partial, time.monotonic()))
        return b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n" if partial else b""

    def waiting(self, connection: object, evict: Callable[[], None]) -> None:
        self.waiters[connection] = evict

    def not_waiting(self, connection: object) -> None:
        self.waiters.pop(connection, None)


async def test_answer_begun_counts_the_answer_but_not_an_interim_100_continue() -> None:
    seen: list[bool] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        seen.append(answer_begun(request))
        await send_continue(request)
        seen.append(answer_begun(request))
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"body")
        seen.append(answer_begun(request))
        return resp

    async with listening(web.Server(handler, access_log=None)) as url:
        raw = await exchange(url, GET_AND_CLOSE)
    assert seen == [False, False, True]
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), raw


async def test_after_a_100_continue_aiohttp_itself_can_still_answer_500() -> None:
    """aiohttp decides whether it may still send its 500 from the same counter."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await send_continue(request)
        raise RuntimeError("a bug after the interim answer")

    async with listening(web.Server(handler, access_log=None)) as url:
        raw = await exchange(url, GET_AND_CLOSE)
    assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 500 "), raw


async def test_headers_with_body_are_held_back_until_the_body() -> None:
    for response, sent_at_prepare in ((web.StreamResponse(), True), (HeadersWithBody(), False)):
        writer = mock.Mock(write_headers=mock.AsyncMock(), write=mock.AsyncMock(), write_eof=mock.AsyncMock())
        await response.prepare(make_mocked_request("GET", "/", writer=writer))
        assert writer.send_headers.called is sent_at_prepare, type(response).__name__


async def test_a_tagged_connection_hands_its_tag_to_every_request_on_it() -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(text=repr(connection_tag(request)))

    server = web.Server(handler, access_log=None)
    async with (
        listening(lambda: served_connection(server, Guard(), tag="the tag")) as tagged,
        listening(server) as plain,
        aiohttp.ClientSession() as s,
    ):
        for _ in range(2):  # two requests on one keep-alive connection
            async with s.get(tagged) as r:
                assert await r.text() == "'the tag'"
        async with s.get(plain) as r:
            assert await r.text() == "None"


async def test_keep_alive_can_be_stopped_and_requests_in_flight_cut() -> None:
    release, cancelled = asyncio.Event(), asyncio.Event()
    started: list[str] = []

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        started.append(request.path)
        try:
            if request.path == "/released":
                await release.wait()
            else:
                await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response(text="ok")

    server = web.Server(handler, handler_cancellation=True, access_log=None)
    async with listening(server) as url:
        host, port = url.removeprefix("http://").split(":")
        connections = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
        for (_, writer), path in zip(connections, ("/released", "/cut"), strict=True):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())  # HTTP/1.1: keep-alive
        await eventually(lambda: len(started) == 2, "both requests in their handler")
        (released, released_writer), (cut, cut_writer) = connections

        stop_keep_alive(server)
        release.set()
        answer = await asyncio.wait_for(released.read(), WAIT)  # answered, then closed: no keep-alive
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"ok"), answer

        cut_connections(server)
        await asyncio.wait_for(cancelled.wait(), WAIT)
        assert await asyncio.wait_for(cut.read(), WAIT) == b""
        for writer in (released_writer, cut_writer):
            writer.close()


# -- the head and idle timers of a served connection ----------------------------------------------


def test_the_private_attributes_the_head_timer_reads_exist() -> None:
    slots = {name for cls in web.RequestHandler.__mro__ for name in getattr(cls, "__slots__", ())}
    assert {"_waiter", "_request_count", "_keepalive_handle"} <= slots


@contextlib.asynccontextmanager
async def served(guard: Guard, handler: Callable[[web.BaseRequest], Any]) -> AsyncIterator[str]:
    server = web.Server(handler, handler_cancellation=True, access_log=None)
    async with listening(lambda: served_connection(server, guard)) as url:
        yield url


async def ok(request: web.BaseRequest) -> web.StreamResponse:
    await request.read()
    if request.path == "/slow":
        await asyncio.sleep(0.6)
    return web.Response(text="ok")


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    return head + await asyncio.wait_for(reader.readexactly(2), WAIT)  # "ok"


async def test_a_head_not_in_by_its_deadline_gets_the_guards_answer_then_close() -> None:
    guard = Guard(head_timeout=0.3)
    async with served(guard, ok) as url:
        reader, writer = await connect(url)
        started = time.monotonic()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert (
            await asyncio.wait_for(reader.read(), WAIT) == b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"
        )
        ((partial, at),) = guard.timeouts
        assert partial and 0.25 <= at - started < WAIT
        await asyncio.wait_for(guard.closed_all.wait(), WAIT)
        writer.close()


async def test_a_first_head_already_overdue_when_aiohttp_takes_the_connection_still_times_out() -> None:
    """The front door hands a connection over, its first bytes in hand, with what is left of
    the head's time: none left (a first byte just before the deadline) is a timeout at once."""
    guard = Guard(head_timeout=60.0, idle_timeout=60.0)
    server = web.Server(ok, access_log=None)

    class Door(asyncio.Protocol):
        """What front_door.FrontDoor does with a plain request's first bytes."""

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            overdue = asyncio.get_running_loop().time() - 1
            proto = served_connection(server, guard, head_deadline=overdue)
            self.transport.set_protocol(proto)
            proto.connection_made(self.transport)
            proto.data_received(data)

    async with listening(Door) as url:
        reader, writer = await connect(url)
        writer.write(b"GET / HTTP/1.1\r\n")
        assert (await asyncio.wait_for(reader.read(), WAIT)).startswith(b"HTTP/1.1 408")
        writer.close()


async def test_requests_being_served_are_never_timed_and_a_later_head_is_timed_from_its_first_byte() -> None:
    guard = Guard(head_timeout=0.3, idle_timeout=5.0)
    async with served(guard, ok) as url:
        reader, writer = await connect(url)
        for path in ("/slow", "/slow"):  # each served longer than the head timeout
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert (await read_answer(reader)).startswith(b"HTTP/1.1 200 OK")
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        await asyncio.sleep(0.5)  # a body arriving slowly is the handler's business, not a head
        writer.write(b"cd")
        assert (await read_answer(reader)).startswith(b"HTTP/1.1 200 OK")
        assert guard.timeouts == []
        await asyncio.sleep(0.5)  # idle for longer than a head may take: no head is due
        started = time.monotonic()
        writer.write(b"GET / HTTP/1.1\r\n")
        assert (await asyncio.wait_for(reader.read(), WAIT)).startswith(b"HTTP/1.1 408")
        ((partial, at),) = guard.timeouts
        assert partial and 0.25 <= at - started < WAIT
        writer.close()


async def test_an_idle_connection_is_closed_silently_by_the_idle_timer() -> None:
    guard = Guard(head_timeout=5.0, idle_timeout=0.3)
    async with served(guard, ok) as url:
        reader, writer = await connect(url)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await read_answer(reader)
        answered = time.monotonic()
        assert await asyncio.wait_for(reader.read(), WAIT) == b""
        assert 0.25 <= time.monotonic() - answered < WAIT
        assert guard.timeouts == []  # idle is not a head timeout
        await asyncio.wait_for(guard.closed_all.wait(), WAIT)
        writer.close()


class _HangUp(asyncio.Protocol):
    """Reads a request head, counts it, and closes the connection without answering."""

    def __init__(self, heads: list[bytes]) -> None:
        self.heads = heads
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if b"\r\n\r\n" in self.buffer:
            self.heads.append(self.buffer)
            self.transport.close()


async def test_aiohttp_resends_a_get_on_a_broken_connection_unless_told_not_to() -> None:
    """The resend exists (so the switch matters), and no_hidden_resend turns it off."""
    heads: list[bytes] = []
    async with listening(lambda: _HangUp(heads)) as url:
        for fix, sent in ((lambda s: s, 2), (no_hidden_resend, 1)):
            heads.clear()
            async with aiohttp.ClientSession() as session:
                fixed = fix(session)
                assert fixed is session
                with contextlib.suppress(aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                    async with session.get(url):
                        pass
            assert len(heads) == sent, f"aiohttp sent {len(heads)} copies of one GET, expected {sent}"


async def test_no_hidden_resend_refuses_a_session_it_cannot_fix() -> None:
    class Renamed:
        """A ClientSession whose switch went away in an upgrade."""

    with pytest.raises(RuntimeError, match="_retry_connection is gone"):
        no_hidden_resend(Renamed())  # type: ignore[arg-type]
