"""The data plane's vendor-facing client (proxy/wire/upstream.py, pool.py) against raw vendors
on loopback: exact answer bytes out, requests parsed by hand."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trustme

from proxy.wire import inbox, upstream
from proxy.wire.pool import Pool
from proxy.wire.upstream import Origin, UpstreamBroke, UpstreamFailed
from tests.dataplane.wire import Message, read_request, until

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Vendor:
    def __init__(self, handler: Serve) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[Message] = []
        self.port = 0

    @property
    def origin(self) -> Origin:
        return Origin("http", "127.0.0.1", self.port)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def vendor() -> AsyncIterator[Callable[..., Awaitable[Vendor]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Serve, **kwargs: Any) -> Vendor:
        v = Vendor(handler)
        server = await asyncio.start_server(v.serve, "127.0.0.1", 0, **kwargs)
        v.port = server.sockets[0].getsockname()[1]
        servers.append(server)
        return v

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    p = Pool(keepalive=30.0)
    yield p
    await p.close()


def answering(*answers: bytes, then_close: bool = False) -> Callable[[Vendor], Serve]:
    """A vendor handler answering each request of a connection with the next answer."""

    def make(v: Vendor) -> Serve:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for answer in answers:
                v.requests.append(await read_request(reader))
                writer.write(answer)
                await writer.drain()
            if not then_close:
                await reader.read()

        return handler

    return make


async def start_answering(vendor: Any, *answers: bytes, then_close: bool = False, **kwargs: Any) -> Vendor:
    holder: dict[str, Vendor] = {}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answering(*answers, then_close=then_close)(holder["v"])(reader, writer)

    v: Vendor = await vendor(handler, **kwargs)
    holder["v"] = v
    return v


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Bytes:
    def __init__(self, *parts: bytes) -> None:
        self.parts = list(parts)

    async def read(self) -> bytes:
        return self.parts.pop(0) if self.parts else b""


async def get(pool: Pool, origin: Origin, target: str = "/", method: str = "GET", **kwargs: Any) -> tuple[int, bytes]:
    conn = await pool.connection(origin, 5.0)
    resp = await conn.request(
        method, target, kwargs.get("headers", []), kwargs.get("body"), kwargs.get("length"), kwargs.get("timeout", 5.0)
    )
    body = await resp.read_all()
    resp.release()
    return resp.status, body


# -- keep-alive and reuse -------------------------------------------------------------------


async def test_a_fully_read_keep_alive_answer_returns_its_connection(vendor, pool) -> None:
    v = await start_answering(vendor, OK, OK, OK)
    for _ in range(3):
        assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 1
    assert [m.start for m in v.requests] == ["GET / HTTP/1.1"] * 3
    assert v.requests[0].headers["Host"] == f"127.0.0.1:{v.port}"


async def test_an_answer_left_unread_closes_its_connection(vendor, pool) -> None:
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 5000000\r\n\r\n" + b"z" * 5_000_000
    v = await start_answering(vendor, big, OK)
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    await resp.read()  # part of it only
    resp.release()
    assert conn.closed
    assert pool.idle_count(v.origin) == 0


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
)
async def test_an_answer_that_says_close_is_not_reused(vendor, pool, answer) -> None:
    v = await start_answering(vendor, answer, then_close=True)
    assert await get(pool, v.origin) == (200, b"ok")
    assert pool.idle_count(v.origin) == 0


async def test_an_idle_connection_the_vendor_closed_is_skipped_before_sending(vendor, pool) -> None:
    v = await start_answering(vendor, OK, then_close=True)
    assert await get(pool, v.origin) == (200, b"ok")
    await until(lambda: pool.idle_count(v.origin) == 0, "the vendor's close is seen")
    assert await get(pool, v.origin) == (200, b"ok")  # on a new connection
    assert v.connections == 2 and len(v.requests) == 2


async def test_a_request_is_never_sent_twice(vendor, pool) -> None:
    """A vendor that reads the request and drops the connection: the caller is told it may
    have arrived; nothing resends it (SPEC §12)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        v.requests.append(await read_request(reader))
        writer.transport.abort()

    v = await vendor(handler)
    with pytest.raises(UpstreamFailed) as failed:
        await get(pool, v.origin, "/pay", "POST", body=Bytes(b"{}"), length=2)
    assert failed.value.reached
    assert len(v.requests) == 1 and v.connections == 1


# -- framing ----------------------------------------------------------------------------


async def test_chunked_answers_with_extensions_and_trailers(vendor, pool) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;ext=1\r\nabc\r\n4\r\ndefg\r\n0\r\nX-Checksum: 1\r\n\r\n"
    )
    v = await start_answering(vendor, answer, OK)
    assert await get(pool, v.origin) == (200, b"abcdefg")
    assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 1


async def test_a_close_delimited_answer_ends_at_the_close(vendor, pool) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 200 OK\r\n\r\nuntil the end", then_close=True)
    assert await get(pool, v.origin) == (200, b"until the end")


async def test_interim_answers_are_skipped(vendor, pool) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK)
    assert await get(pool, v.origin) == (200, b"ok")


HEAD_WITH_EVERYTHING = (
    b"HTTP/1.1 200 All Fine Here\r\nContent-Type: a/b\r\nX-Url: http://x:1/a:b\r\nX-Empty:\r\nX-Blank: \r\n"
    b"X-Spaced:  \t v a l  \t\r\nX-Latin: \xe9\xff\r\nX-Multi: 1\r\nx-multi: 2\r\nContent-Length: 2\r\n\r\nok"
)
HEAD_FIELDS = [
    ("Content-Type", "a/b"),
    ("X-Url", "http://x:1/a:b"),
    ("X-Empty", ""),
    ("X-Blank", ""),
    ("X-Spaced", "v a l  \t"),  # the whitespace before a value is not its, after it is (as llhttp has it)
    ("X-Latin", "\xe9\xff"),
    ("X-Multi", "1"),
    ("x-multi", "2"),
    ("Content-Length", "2"),
]


async def dripping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes, step: int) -> None:
    """Write ``answer`` ``step`` bytes at a time, each piece its own read at the proxy."""
    for i in range(0, len(answer), step):
        writer.write(answer[i : i + step])
        await writer.drain()
        await asyncio.sleep(0)


@pytest.mark.parametrize("step", [1, 7, 10_000], ids=["byte by byte", "in pieces", "whole"])
async def test_an_answer_head_is_read_field_for_field_however_it_arrives(vendor, pool, step) -> None:
    """The head is split once llhttp has checked it (not field by field through callbacks):
    the same fields, spelling, order and values, and the reason phrase, in one read or many,
    after interim answers."""
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + HEAD_WITH_EVERYTHING

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            await dripping(reader, writer, answer, step)
        await reader.read()

    v = await vendor(handler)
    for _ in range(2):  # and again on the same connection
        conn = await pool.connection(v.origin, 5.0)
        resp = await conn.request("GET", "/", [], None, None, 5.0)
        assert (resp.status, resp.reason) == (200, "All Fine Here")
        assert resp.fields == HEAD_FIELDS
        assert list(resp.headers.items()) == HEAD_FIELDS
        assert await resp.read_all() == b"ok"
        resp.release()
    assert v.connections == 1


async def test_an_answer_without_a_reason_phrase(vendor, pool) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 201\r\nContent-Length: 0\r\n\r\n")
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    assert (resp.status, resp.reason, resp.fields) == (201, "", [("Content-Length", "0")])


async def test_an_endless_answer_head_breaks_off_at_its_bound(vendor, pool, monkeypatch) -> None:
    monkeypatch.setattr(upstream, "HEAD_MAX", 4096)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(10_000):  # never the empty line
            writer.write(b"X-Field-%d: %s\r\n" % (i, b"v" * 100))
            await writer.drain()
        await reader.read()

    v = await vendor(handler)
    with pytest.raises(UpstreamFailed) as failed:
        await get(pool, v.origin)
    assert failed.value.kind == "broken" and "4096" in str(failed.value)


@pytest.mark.parametrize("junk", [OK, b"garbage\r\n\r\n"], ids=["a second answer", "garbage"])
async def test_bytes_after_a_whole_answer_close_the_connection_and_leave_the_answer(vendor, pool, junk) -> None:
    """Bytes after the answer in its last read (a second answer nobody asked for, garbage):
    the answer stands, whole; the connection cannot be trusted after it and is closed,
    never pooled (before, a second answer left it open and in use for ever)."""
    v = await start_answering(vendor, OK + junk, OK)
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    assert await resp.read_all() == b"ok"
    resp.release()
    assert conn.closed
    assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 2


async def test_one_connection_carries_answers_of_every_framing_in_turn(vendor, pool) -> None:
    """The connection's parser is kept from one answer to the next (a new one only after a
    HEAD's, which llhttp, not told of the HEAD, may still take for unfinished): each framing
    leaves it ready for the next answer."""
    v = await start_answering(
        vendor,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=1\r\nab\r\n0\r\nX-Trailer: t\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",  # to a HEAD
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK,
        b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n",
        OK,
    )
    assert await get(pool, v.origin) == (200, b"ab")
    assert await get(pool, v.origin) == (204, b"")
    assert await get(pool, v.origin, method="HEAD") == (204, b"")
    assert await get(pool, v.origin) == (200, b"ok")
    assert await get(pool, v.origin) == (304, b"")
    assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 1


async def test_head_answers_end_with_their_head(vendor, pool) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n", OK)
    status, body = await get(pool, v.origin, method="HEAD")
    assert (status, body) == (200, b"")


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses(vendor, pool, status) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 %d X\r\n\r\n" % status, OK)
    assert await get(pool, v.origin) == (status, b"")
    assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 1


async def test_request_framing(vendor, pool) -> None:
    v = await start_answering(vendor, OK, OK, OK, OK)
    await get(pool, v.origin, "/a", "POST", body=Bytes(b"he", b"llo"), length=5)
    await get(pool, v.origin, "/b", "POST", body=Bytes(b"he", b"llo"))
    await get(pool, v.origin, "/c", "POST")
    await get(pool, v.origin, "/d?x=%2F", "GET", headers=[("X-Multi", "a"), ("X-Multi", "b")])
    a, b, c, d = v.requests
    assert a.headers["Content-Length"] == "5" and a.body == b"hello"
    assert b.headers["Transfer-Encoding"] == "chunked" and b.body == b"hello"
    assert c.headers["Content-Length"] == "0"
    assert d.start == "GET /d?x=%2F HTTP/1.1" and d.headers.getall("X-Multi") == ["a", "b"]
    assert "Content-Length" not in d.headers


async def test_a_truncated_body_is_broken_not_short(vendor, pool) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b", then_close=True)
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    with pytest.raises(UpstreamBroke):
        await resp.read_all()


async def test_a_malformed_answer_fails_the_request(vendor, pool) -> None:
    v = await start_answering(vendor, b"HTTP/1.1 2OO OK\r\n\r\n", then_close=True)
    with pytest.raises(UpstreamFailed) as failed:
        await get(pool, v.origin)
    assert failed.value.reached


# -- flow control -------------------------------------------------------------------------


async def test_large_bodies_both_ways(vendor, pool) -> None:
    size = 20 * 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen = await read_request(reader)
        digest = hashlib.sha256(seen.body).hexdigest().encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (size + len(digest)))
        writer.write(digest)
        for _ in range(size // 65536):
            writer.write(b"d" * 65536)
            await writer.drain()
        await reader.read()

    v = await vendor(handler)
    piece = bytes(range(256)) * 256
    parts = [piece] * (size // len(piece))
    status, body = await get(pool, v.origin, "/up", "PUT", body=Bytes(*parts))
    assert status == 200
    assert body[:64] == hashlib.sha256(b"".join(parts)).hexdigest().encode()
    assert len(body) == size + 64


async def test_a_slow_reader_pauses_the_vendor(vendor, pool) -> None:
    sent = {"bytes": 0}
    size = 64 * 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        while sent["bytes"] < size:
            writer.write(b"s" * 65536)
            await writer.drain()
            sent["bytes"] += 65536

    v = await vendor(handler)
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    last = -1
    while sent["bytes"] != last:
        last = sent["bytes"]
        await asyncio.sleep(0.2)
    assert sent["bytes"] < size / 2
    assert resp._size <= inbox.BODY_HIGH + 1024 * 1024, resp._size
    received = 0
    while chunk := await resp.read():
        received += len(chunk)
    assert received == size


# -- failures -----------------------------------------------------------------------------


async def test_connection_refused_never_reached(pool) -> None:
    with socket_port() as port:
        pass
    with pytest.raises(UpstreamFailed) as failed:
        await pool.connection(Origin("http", "127.0.0.1", port), 5.0)
    assert failed.value.kind == "refused" and not failed.value.reached


async def test_a_silent_vendor_times_out_as_reached(vendor, pool) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    v = await vendor(silent)
    with pytest.raises(UpstreamFailed) as failed:
        await get(pool, v.origin, timeout=0.3)
    assert failed.value.kind == "timeout" and failed.value.reached


async def test_a_body_that_stalls_breaks(vendor, pool) -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await reader.read()

    v = await vendor(stall)
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 0.3)
    assert await resp.read() == b"abc"
    with pytest.raises(UpstreamBroke):
        await resp.read()


async def test_warm_opens_idle_connections_that_requests_then_use(vendor, pool) -> None:
    v = await start_answering(vendor, OK)
    assert await pool.warm(v.origin, 3, 5.0) == []
    await until(lambda: v.connections == 3, "three connections opened")
    assert pool.idle_count(v.origin) == 3
    assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 3


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_ca() -> trustme.CA:
    return trustme.CA()


async def test_tls_verified_against_the_given_ca(vendor, tls_ca) -> None:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.issue_cert("localhost").configure_cert(server_ctx)
    v = await start_answering(vendor, OK, ssl=server_ctx)
    client_ctx = ssl.create_default_context()
    tls_ca.configure_trust(client_ctx)
    trusted = Pool(client_ctx)
    try:
        assert await get(trusted, Origin("https", "localhost", v.port)) == (200, b"ok")
    finally:
        await trusted.close()
    untrusted = Pool(ssl.create_default_context())
    try:
        with pytest.raises(UpstreamFailed) as failed:
            await untrusted.connection(Origin("https", "localhost", v.port), 5.0)
        assert failed.value.kind == "certificate" and not failed.value.reached
    finally:
        await untrusted.close()


class socket_port:
    """A loopback port nothing listens on (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


async def test_connections_idle_past_keepalive_are_closed_not_piled_up(vendor) -> None:
    """A vendor that never closes idle connections: the pool closes them after ``keepalive``,
    so topping up the warm ones replaces them instead of adding to them."""
    closed = {"count": 0}

    async def keep_open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the proxy closes it
        closed["count"] += 1

    v = await vendor(keep_open)
    pool = Pool(keepalive=0.2)
    try:
        assert await pool.warm(v.origin, 2, 5.0) == []
        await until(lambda: pool.idle_count(v.origin) == 0, "the idle connections go stale")
        assert await pool.warm(v.origin, 2, 5.0) == []
        await until(lambda: closed["count"] == 2, "the stale ones are closed")
        assert v.connections == 4 and pool.idle_count(v.origin) == 2
    finally:
        await pool.close()


# -- a small answer all in at once (Response.whole) and the pool's no-await path ----------------


async def test_whole_gives_an_answer_all_in_at_once_and_the_connection_goes_back(vendor, pool) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    v = await start_answering(vendor, chunked, OK)
    assert pool.idle(v.origin) is None  # nothing pooled yet: the caller opens one
    conn = await pool.open(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    await until(lambda: resp._done, "the whole answer in (unread)")
    assert resp.whole(4) is None  # over the limit: read piece by piece instead
    assert resp.whole(1024) == b"abcde" and await resp.read() == b""
    resp.release()
    assert pool.idle(v.origin) is conn  # reused without a coroutine
    assert await get_on(conn) == (200, b"ok") and v.connections == 1


async def test_whole_is_none_while_the_answer_is_still_coming(vendor, pool) -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabc")
        await release.wait()
        writer.write(b"def")
        await writer.drain()

    v = await vendor(slow)
    conn = await pool.connection(v.origin, 5.0)
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    assert await resp.read() == b"abc" and resp.whole(1024) is None
    release.set()
    assert await resp.read_all() == b"def"


async def get_on(conn: Any) -> tuple[int, bytes]:
    resp = await conn.request("GET", "/", [], None, None, 5.0)
    body = await resp.read_all()
    resp.release()
    return resp.status, body


# -- a worker that went away: its answer is heard out ---------------------------------------


async def _cancelled_while_awaiting_the_head(pool: Pool, origin: Origin, timeout: float = 5.0) -> Any:
    conn = await pool.connection(origin, 5.0)
    waiting = asyncio.ensure_future(conn.request("GET", "/", [], None, None, timeout))
    await until(lambda: conn.awaiting_answer, "the request to be written and its answer awaited")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    return conn


async def test_an_answer_whose_worker_went_away_is_heard_out_and_its_connection_pooled(vendor, pool) -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await release.wait()
        writer.write(OK)
        await read_request(reader)  # the next request, on the same connection
        writer.write(OK)
        await reader.read()

    v = await vendor(slow)
    conn = await _cancelled_while_awaiting_the_head(pool, v.origin)
    done: list[bool] = []
    conn.after(lambda _heard: done.append(True))
    assert conn.draining and not conn.closed and done == []  # the vendor still works on it
    release.set()
    await until(lambda: done == [True], "the vendor's answer to be heard out")
    assert not conn.closed and pool.idle_count(v.origin) == 1
    assert await get(pool, v.origin) == (200, b"ok")
    assert v.connections == 1


@pytest.mark.parametrize("how", ["silent", "too long"])
async def test_an_answer_heard_out_ends_at_the_read_timeout_or_its_size_bound(vendor, pool, how) -> None:
    go = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await go.wait()
        if how == "too long":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (upstream.HEAR_OUT_MAX * 4))
            for _ in range(4 * upstream.HEAR_OUT_MAX // 65536):
                writer.write(b"z" * 65536)
                await writer.drain()
        await reader.read()

    v = await vendor(answer)
    conn = await _cancelled_while_awaiting_the_head(pool, v.origin, timeout=0.3)
    done: list[bool] = []
    conn.after(lambda _heard: done.append(True))
    if how == "too long":
        go.set()
    await until(lambda: done == [True], "the hearing out to end")
    assert conn.closed and pool.idle_count(v.origin) == 0


# -- a landing told of the answer (send_head_to: the straight path's, lane.py) ----------------


class Told:
    """A landing that keeps what it is told, and when (``told`` is set then)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.told = asyncio.Event()

    def __call__(self, response: Any, failure: Any) -> None:
        self.calls.append((response, failure))
        self.told.set()


async def land(pool: Pool, origin: Origin, timeout: float = 5.0) -> tuple[Any, Told]:
    conn = await pool.connection(origin, 5.0)
    told = Told()
    conn.send_head_to(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "GET", timeout, told)
    await asyncio.wait_for(told.told.wait(), 5.0)
    return conn, told


@pytest.mark.parametrize("step", [0, 1, 7])
async def test_a_landing_is_told_once_the_read_that_brought_the_head_is_parsed(vendor, pool, step) -> None:
    """Told once, after the whole read is parsed: an answer that came in one read is whole
    when the landing hears of it; one whose body follows in later reads is not, and is read
    on as any other."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: b\r\n\r\nhello"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if step == 0:
            writer.write(answer)
        else:
            for i in range(0, len(answer), step):
                writer.write(answer[i : i + step])
                await writer.drain()
                await asyncio.sleep(0.001)
        await reader.read()

    v = await vendor(serve)
    _, told = await land(pool, v.origin)
    [(response, failure)] = told.calls
    assert failure is None and response.status == 200 and response.block == b"Content-Length: 5\r\nX-A: b\r\n"
    if step == 0:
        assert response.whole_exactly(5) == b"hello"
    else:
        assert await response.read_all() == b"hello"
    response.release()
    await until(lambda: pool.idle_count(v.origin) == 1, "the connection back in the pool")
    assert len(told.calls) == 1


async def test_a_landing_hears_why_no_answer_came(vendor, pool) -> None:
    """Closed before its answer, silent past the read timeout, a malformed head: each is told
    as the head's future would have failed, once, and the connection is not reused."""

    async def close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def malformed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nBad Field\r\n\r\n")
        await reader.read()

    for serve, kind in ((close, "broken"), (silent, "timeout"), (malformed, "broken")):
        v = await vendor(serve)
        conn, told = await land(pool, v.origin, timeout=0.2)
        [(response, failure)] = told.calls
        assert response is None and isinstance(failure, UpstreamFailed)
        assert (failure.kind, failure.reached) == (kind, True)
        conn.unanswered(failure)
        assert conn.closed and len(told.calls) == 1


async def test_a_landing_told_of_a_head_whose_body_broke_in_the_same_read(vendor, pool) -> None:
    """The head and a broken chunk in one read: the landing hears of the answer (its head
    came), whose body then fails as it is read, as an awaited one's does."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
        await reader.read()

    v = await vendor(serve)
    conn, told = await land(pool, v.origin)
    [(response, failure)] = told.calls
    assert failure is None and response.status == 200
    with pytest.raises(UpstreamBroke):
        await response.read_all()
    assert conn.closed


async def test_bytes_after_a_whole_answer_still_land_it(vendor, pool) -> None:
    v = await start_answering(vendor, OK + b"garbage\r\n\r\n", OK)
    conn, told = await land(pool, v.origin)
    [(response, failure)] = told.calls
    assert failure is None and response.whole_exactly(2) == b"ok"
    response.release()
    assert conn.closed  # never pooled


async def test_a_landing_given_up_hears_nothing_and_the_answer_is_heard_out(vendor, pool) -> None:
    """The worker went away (``unanswered(CancelledError)``): the landing is forgotten and
    the vendor's answer heard out, the connection pooled after it."""
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await release.wait()
        writer.write(OK)
        await reader.read()

    v = await vendor(slow)
    conn = await pool.connection(v.origin, 5.0)
    told = Told()
    conn.send_head_to(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "GET", 5.0, told)
    await until(lambda: conn.awaiting_answer, "the request written")
    conn.unanswered(asyncio.CancelledError())
    heard: list[Any] = []
    conn.after(heard.append)
    release.set()
    await until(lambda: len(heard) == 1, "the answer heard out")
    assert told.calls == [] and heard[0].status == 200
    assert pool.idle_count(v.origin) == 1
