"""The data plane's worker-facing HTTP/1.1 server (proxy/wire/http1.py), on the wire:
raw bytes in, answers parsed by hand."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.wire import http1, inbox, parsing
from proxy.wire.body import Body
from proxy.wire.http1 import Http1Connection
from proxy.wire.request import Request
from proxy.wire.responder import Responder
from tests.dataplane.wire import Peer, read_head, read_response, request, until

Handler = Callable[[Request, Responder], Awaitable[None]]


class Guard:
    """The connection settings, and what the connections reported."""

    def __init__(self, head_timeout: float = 30.0, idle_timeout: float = 30.0) -> None:
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        self.open = 0
        self.timed_out: list[bool] = []
        self.waiting_now: dict[object, Callable[[], None]] = {}

    def opened(self) -> None:
        self.open += 1

    def closed(self) -> None:
        self.open -= 1

    def head_timed_out(self, partial: bool) -> bytes:
        self.timed_out.append(partial)
        return b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" if partial else b""

    def waiting(self, connection: object, evict: Callable[[], None]) -> None:
        self.waiting_now[connection] = evict

    def not_waiting(self, connection: object) -> None:
        self.waiting_now.pop(connection, None)


class Server:
    def __init__(self, handler: Handler, guard: Guard) -> None:
        self.handler = handler
        self.guard = guard
        self.connections: list[Http1Connection] = []
        self.port = 0
        self.served: list[str] = []

    def protocol(self) -> Http1Connection:
        conn = Http1Connection(self._handle, self.guard)
        self.connections.append(conn)
        return conn

    async def _handle(self, req: Request, resp: Responder) -> None:
        self.served.append(f"{req.method} {req.target}")
        await self.handler(req, resp)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    servers: list[asyncio.Server] = []
    peers: list[Server] = []

    async def start(handler: Handler, guard: Guard | None = None) -> Server:
        server = Server(handler, guard or Guard())
        listener = await asyncio.get_running_loop().create_server(server.protocol, "127.0.0.1", 0)
        server.port = listener.sockets[0].getsockname()[1]
        servers.append(listener)
        peers.append(server)
        return server

    yield start
    for s in peers:
        for conn in s.connections:
            conn.close()
    for listener in servers:
        listener.close()
        await listener.wait_closed()


@pytest.fixture
async def peer() -> AsyncIterator[Callable[[Server], Awaitable[Peer]]]:
    peers: list[Peer] = []

    async def connect(server: Server) -> Peer:
        p = await Peer.connect(server.port)
        peers.append(p)
        return p

    yield connect
    for p in peers:
        await p.close()


async def echo(req: Request, resp: Responder) -> None:
    """Reads the whole body, answers what it saw as JSON."""
    body = await req.body.read_all()
    seen = {
        "method": req.method,
        "target": req.target,
        "version": req.version,
        "headers": list(req.headers.items()),
        "bytes": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "body": body[:100].decode("latin-1"),
    }
    await resp.send(200, "OK", [("Content-Type", "application/json")], json.dumps(seen).encode())


async def stream_back(req: Request, resp: Responder) -> None:
    """Streams the body back as it arrives (chunked)."""
    resp.start(200, "OK", [("Content-Type", "application/octet-stream")])
    while chunk := await req.body.read():
        await resp.write(chunk)
    await resp.finish()


def seen(message: Any) -> dict[str, Any]:
    return json.loads(message.body)


# -- framing in ---------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order(serve, peer) -> None:
    gate = asyncio.Event()

    async def handler(req: Request, resp: Responder) -> None:
        if req.target == "/slow":
            await gate.wait()  # the first answer is late: the second must still come after it
        await echo(req, resp)

    server = await serve(handler)
    client = await peer(server)
    await client.send(request("GET", "/slow") + request("POST", "/two", body=b"second body") + request("GET", "/three"))
    await until(lambda: server.served == ["GET /slow"], "the first request is being served, alone")
    gate.set()
    first, second, third = [await read_response(client.reader) for _ in range(3)]
    assert [seen(m)["target"] for m in (first, second, third)] == ["/slow", "/two", "/three"]
    assert seen(second)["body"] == "second body"


async def test_a_head_split_across_packets_byte_by_byte(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    data = request("POST", "http://api.example/v1?q=a%2Bb", [("X-Long", "v" * 300), ("X-Two", "a")], b"hello")
    for i in range(len(data)):
        await client.send(data[i : i + 1])
    answer = seen(await read_response(client.reader))
    assert answer["target"] == "http://api.example/v1?q=a%2Bb"
    assert ("X-Long", "v" * 300) in [tuple(h) for h in answer["headers"]]
    assert answer["body"] == "hello"


async def test_chunk_extensions_and_trailers(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    body = b"5;name=value\r\nhello\r\n6;x\r\n world\r\n0\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n"
    answer = await client.exchange(request("POST", "/v1", [("Transfer-Encoding", "chunked")], body))
    assert seen(answer)["body"] == "hello world"
    assert "X-Checksum" not in [h[0] for h in seen(answer)["headers"]]  # a trailer is not a head field
    again = await client.exchange(request("GET", "/after"))  # the connection is still in step
    assert seen(again)["target"] == "/after"


async def test_header_values_travel_byte_for_byte(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    answer = await client.exchange(
        request("GET", "/", [("X-Bytes", "caf\xe9 \x7e"), ("X-Multi", "a"), ("x-multi", "b")])
    )
    headers = [tuple(h) for h in seen(answer)["headers"]]
    assert ("X-Bytes", "caf\xe9 \x7e") in headers
    assert ("X-Multi", "a") in headers and ("x-multi", "b") in headers


async def test_bodies_larger_than_every_buffer_stream_both_ways(serve, peer) -> None:
    server = await serve(stream_back)
    client = await peer(server)
    body = bytes(range(256)) * (20 * 1024 * 1024 // 256)  # 20 MB, far over BODY_HIGH and WRITE_HIGH

    async def upload() -> None:
        await client.send(request("PUT", "/echo", body=body))

    sender = asyncio.ensure_future(upload())
    answer = await read_response(client.reader)
    await sender
    assert answer.headers["Transfer-Encoding"] == "chunked"
    assert len(answer.body) == len(body)
    assert hashlib.sha256(answer.body).digest() == hashlib.sha256(body).digest()


async def test_a_slow_reader_holds_the_writer_back(serve, peer) -> None:
    """A worker that does not read: the answer waits in bounded buffers, the handler blocks."""
    piece = b"x" * 64 * 1024
    total = 64 * 1024 * 1024
    progress = {"written": 0, "buffered": 0}
    done = asyncio.Event()

    async def handler(req: Request, resp: Responder) -> None:
        resp.start(200, "OK", [("Content-Length", str(total))])
        conn = server.connections[0]
        assert conn.transport is not None
        while progress["written"] < total:
            await resp.write(piece)
            progress["written"] += len(piece)
            progress["buffered"] = max(progress["buffered"], conn.transport.get_write_buffer_size())
        await resp.finish()
        done.set()

    server = await serve(handler)
    client = await peer(server)
    await client.send(request("GET", "/big"))
    # the handler stops once the kernel's buffers and the transport's fill up
    last = -1
    while progress["written"] != last:
        last = progress["written"]
        await asyncio.sleep(0.2)
    assert progress["written"] < total / 2, progress
    assert progress["buffered"] <= http1.WRITE_HIGH + len(piece), progress
    status, _ = await read_head(client.reader)
    received = 0
    while received < total:
        received += len(await client.reader.read(1024 * 1024))
    await asyncio.wait_for(done.wait(), 10)
    assert status.startswith("HTTP/1.1 200") and received == total


async def test_an_upload_the_handler_does_not_read_pauses_the_worker(serve, peer) -> None:
    started = asyncio.Event()
    release = asyncio.Event()
    bodies: list[Body] = []

    async def handler(req: Request, resp: Responder) -> None:
        bodies.append(req.body)
        started.set()
        await release.wait()
        await echo(req, resp)

    server = await serve(handler)
    client = await peer(server)
    body = b"y" * (32 * 1024 * 1024)
    sender = asyncio.ensure_future(client.send(request("POST", "/up", body=body)))
    await started.wait()
    last = -1
    while bodies[0]._size != last:
        last = bodies[0]._size
        await asyncio.sleep(0.2)
    assert not sender.done()  # the worker is held back by TCP, not buffered in the proxy
    assert bodies[0]._size <= inbox.BODY_HIGH + 1024 * 1024, bodies[0]._size
    release.set()
    answer = await read_response(client.reader)
    await sender
    assert seen(answer)["bytes"] == len(body)


# -- refusals on the wire ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"G@T / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_a_malformed_request_is_400_and_the_connection_closed(serve, peer, data) -> None:
    server = await serve(echo)
    client = await peer(server)
    answer = await client.exchange(data)
    assert answer.status == 400
    assert answer.headers["Connection"] == "close"
    assert json.loads(answer.body)["error"]["type"] == "bad_request"
    assert await client.closed()


async def test_a_malformed_request_behind_good_ones_is_answered_after_them(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    await client.send(request("GET", "/one") + b"NOT HTTP AT ALL\r\n\r\n")
    first = await read_response(client.reader)
    second = await read_response(client.reader)
    assert (first.status, second.status) == (200, 400)
    assert await client.closed()


@pytest.mark.parametrize("where", ["field", "target"])
async def test_an_oversized_head_is_431_and_the_connection_closed(serve, peer, where) -> None:
    server = await serve(echo)
    client = await peer(server)
    big = "a" * (parsing.MAX_HEAD + 1024)
    data = request("GET", "/x", [("X-Big", big)]) if where == "field" else request("GET", "/" + big)
    answer = await client.exchange(data)
    assert answer.status == 431
    assert await client.closed()
    assert server.served == []


async def test_a_head_of_too_many_fields_is_431_however_small(serve, peer) -> None:
    # Thousands of tiny fields fit in MAX_HEAD but cost a callback each, here and at the vendor.
    server = await serve(echo)
    client = await peer(server)
    answer = await client.exchange(request("GET", "/x", [(f"X-{i}", "v") for i in range(parsing.MAX_FIELDS + 1)]))
    assert answer.status == 431
    assert await client.closed()
    assert server.served == []
    ok = await (await peer(server)).exchange(
        request("GET", "/x", [(f"X-{i}", "v") for i in range(parsing.MAX_FIELDS - 1)])
    )
    assert ok.status == 200


async def test_trailers_are_bounded_like_a_head(serve, peer) -> None:
    # Trailers are dropped, but each is parsed: an endless trailer section would keep the
    # request (and the connection) busy for ever.
    server = await serve(echo)
    client = await peer(server)
    trailers = "".join(f"X-T{i}: {'t' * 100}\r\n" for i in range(parsing.MAX_HEAD // 100 + 10))
    await client.send(request("POST", "/v1", [("Transfer-Encoding", "chunked")]) + b"2\r\nab\r\n0\r\n")
    await client.send(trailers.encode())
    answer = await read_response(client.reader)
    assert answer.status in (400, 431)
    assert await client.closed()


async def test_many_heads_together_are_not_taken_for_one_oversized_head(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    one = request("GET", "/p", [("X-Pad", "p" * 900)])
    count = 2 * parsing.MAX_HEAD // len(one)
    await client.send(one * count)
    answers = [await read_response(client.reader) for _ in range(count)]
    assert {a.status for a in answers} == {200}


async def test_a_crashing_handler_answers_500_and_closes(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        raise RuntimeError("bug")

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(request("GET", "/"))
    assert answer.status == 500
    assert await client.closed()


# -- 100-continue -------------------------------------------------------------------------


async def test_expect_100_continue_is_invited_when_the_body_is_read(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    await client.send(request("POST", "/up", [("Expect", "100-continue"), ("Content-Length", "5")]))
    interim = await read_response(client.reader)
    assert interim.status == 100
    await client.send(b"hello")
    answer = await read_response(client.reader)
    assert answer.status == 200 and seen(answer)["body"] == "hello"


async def test_a_refused_expect_100_continue_gets_no_invitation(serve, peer) -> None:
    async def refuse(req: Request, resp: Responder) -> None:
        await resp.send(429, "Too Many Requests", [("Retry-After", "1")], b"{}")

    server = await serve(refuse)
    client = await peer(server)
    await client.send(request("POST", "/up", [("Expect", "100-continue"), ("Content-Length", "5")]))
    answer = await read_response(client.reader)
    assert answer.status == 429  # no 100 Continue before it
    assert answer.headers["Connection"] == "close"  # the body never invited: it may or may not come
    assert await client.closed()


async def test_an_unread_body_is_dropped_and_the_connection_kept(serve, peer) -> None:
    async def refuse(req: Request, resp: Responder) -> None:
        if req.target == "/refuse":
            await resp.send(403, "Forbidden", [], b"no")
        else:
            await echo(req, resp)

    server = await serve(refuse)
    client = await peer(server)
    assert (await client.exchange(request("POST", "/refuse", body=b"q" * 500_000))).status == 403
    after = await client.exchange(request("POST", "/after", body=b"after"))
    assert seen(after)["body"] == "after"


# -- framing out --------------------------------------------------------------------------


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses_carry_none(serve, peer, status) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        if req.target == "/next":
            await echo(req, resp)
            return
        resp.start(status, "No Body", [("ETag", '"x"')])
        await resp.write(b"must not be sent")
        await resp.finish()

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(request("GET", "/"))
    assert answer.status == status
    assert "Transfer-Encoding" not in answer.headers
    assert seen(await client.exchange(request("GET", "/next")))["target"] == "/next"  # nothing stray in between


async def test_head_answers_keep_the_length_and_send_no_body(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        await resp.send(200, "OK", [("Content-Type", "text/plain")], b"twelve bytes")

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(request("HEAD", "/"), head=True)
    assert answer.headers["Content-Length"] == "12"
    streamed = await client.exchange(request("GET", "/"))
    assert streamed.body == b"twelve bytes"


async def test_connection_close_is_honoured(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    answer = await client.exchange(request("GET", "/", [("Connection", "close")]))
    assert answer.status == 200 and answer.headers["Connection"] == "close"
    assert await client.closed()


async def test_http_1_0_gets_a_close_delimited_stream_and_no_chunks(serve, peer) -> None:
    server = await serve(stream_back)
    client = await peer(server)
    await client.send(request("POST", "/", body=b"ten bytes!", version="1.0"))
    answer = await read_response(client.reader)  # read to the close
    assert answer.start.startswith("HTTP/1.1 200")
    assert "Transfer-Encoding" not in answer.headers and answer.headers["Connection"] == "close"
    assert answer.body == b"ten bytes!"


async def test_http_1_0_keep_alive_with_a_length(serve, peer) -> None:
    server = await serve(echo)
    client = await peer(server)
    first = await client.exchange(request("GET", "/a", [("Connection", "keep-alive")], version="1.0"))
    assert first.headers["Connection"] == "keep-alive" and seen(first)["version"] == "1.0"
    second = await client.exchange(request("GET", "/b", version="1.0"))
    assert seen(second)["target"] == "/b" and second.headers["Connection"] == "close"
    assert await client.closed()


async def test_an_answer_shorter_than_its_length_cuts_the_connection(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        resp.start(200, "OK", [("Content-Length", "100")])
        await resp.write(b"only ten b")
        await resp.finish()

    server = await serve(handler)
    client = await peer(server)
    await client.send(request("GET", "/"))
    _, headers = await read_head(client.reader)
    assert headers["Content-Length"] == "100"
    assert await client.reader.read() == b"only ten b"  # then the close: never a complete-looking body


async def test_hop_by_hop_fields_are_this_hops(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        resp.start(200, "OK", [("Connection", "x-hop"), ("Transfer-Encoding", "gzip"), ("X-Kept", "1")])
        await resp.write(b"abc")
        await resp.finish()

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(request("GET", "/"))
    assert answer.headers.getall("Transfer-Encoding") == ["chunked"]
    assert "Connection" not in answer.headers and answer.headers["X-Kept"] == "1"
    assert answer.body == b"abc"


# -- Upgrade and CONNECT ------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"", b"with a body"])
async def test_upgrade_is_never_honoured(serve, peer, body) -> None:
    server = await serve(echo)
    client = await peer(server)
    answer = await client.exchange(request("POST", "/ws", [("Connection", "Upgrade"), ("Upgrade", "websocket")], body))
    assert answer.status == 200 and seen(answer)["body"] == body.decode()
    after = await client.exchange(request("GET", "/after"))
    assert seen(after)["target"] == "/after"


async def test_connect_reaches_the_handler_then_the_connection_closes(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        await resp.send(403, "Forbidden", [], req.method.encode())

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(
        b"CONNECT api.example:443 HTTP/1.1\r\nHost: api.example:443\r\n\r\nGET / HTTP/1.1\r\n\r\n"
    )
    assert answer.status == 403 and answer.body == b"CONNECT"
    assert await client.closed()
    assert server.served == ["CONNECT api.example:443"]


# -- timeouts and the end of a connection -----------------------------------------------------


async def test_a_partial_head_gets_408_at_head_timeout(serve, peer) -> None:
    guard = Guard(head_timeout=0.3)
    server = await serve(echo, guard)
    client = await peer(server)
    await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
    answer = await read_response(client.reader)
    assert answer.status == 408
    assert await client.closed()
    assert guard.timed_out == [True]


async def test_an_idle_keep_alive_connection_closes_at_idle_timeout(serve, peer) -> None:
    guard = Guard(head_timeout=0.2, idle_timeout=0.5)
    server = await serve(echo, guard)
    client = await peer(server)
    loop = asyncio.get_running_loop()
    answer = await client.exchange(request("GET", "/"))
    assert answer.status == 200
    idle_since = loop.time()
    assert await client.closed()
    assert loop.time() - idle_since >= 0.45  # the idle timeout, not the (shorter) head timeout
    assert guard.timed_out == []
    await until(lambda: guard.open == 0, "the connection is counted closed")


async def test_a_request_being_served_is_never_cut_by_the_head_timeout(serve, peer) -> None:
    async def slow(req: Request, resp: Responder) -> None:
        await asyncio.sleep(0.5)
        await echo(req, resp)

    guard = Guard(head_timeout=0.2)
    server = await serve(slow, guard)
    client = await peer(server)
    assert (await client.exchange(request("GET", "/"))).status == 200


async def test_a_worker_that_goes_away_cancels_its_request(serve, peer) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(req: Request, resp: Responder) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    guard = Guard()
    server = await serve(handler, guard)
    client = await peer(server)
    await client.send(request("GET", "/"))
    await started.wait()
    await client.close()
    await asyncio.wait_for(cancelled.wait(), 5)
    await until(lambda: guard.open == 0, "the connection is counted closed")


async def test_stop_keep_alive_closes_after_the_current_answer(serve, peer) -> None:
    release = asyncio.Event()

    async def handler(req: Request, resp: Responder) -> None:
        await release.wait()
        await echo(req, resp)

    server = await serve(handler)
    busy = await peer(server)
    idle = await peer(server)
    release.set()
    await idle.exchange(request("GET", "/warm"))
    release.clear()
    await busy.send(request("GET", "/busy"))
    await until(lambda: "GET /busy" in server.served, "the busy request is being served")
    for conn in server.connections:
        conn.stop_keep_alive()
    assert await idle.closed()
    release.set()
    answer = await read_response(busy.reader)
    assert answer.status == 200 and answer.headers["Connection"] == "close"
    assert await busy.closed()


async def test_a_later_head_is_timed_from_its_first_byte_not_from_the_idle_start(serve, peer) -> None:
    guard = Guard(head_timeout=0.4, idle_timeout=5.0)
    server = await serve(echo, guard)
    client = await peer(server)
    loop = asyncio.get_running_loop()
    assert (await client.exchange(request("GET", "/first"))).status == 200
    await asyncio.sleep(0.6)  # idle for longer than a head may take: the idle timeout rules then
    await client.send(b"GET /second HTTP/1.1\r\n")
    started = loop.time()
    answer = await read_response(client.reader)
    assert answer.status == 408 and loop.time() - started >= 0.35
    assert guard.timed_out == [True]


async def test_a_connection_handed_over_with_its_head_overdue_still_times_out() -> None:
    """As the front door hands a connection over, with the bytes it read and the deadline
    that ran from the connection's start."""
    guard = Guard(head_timeout=30.0)
    loop = asyncio.get_running_loop()

    class Door(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            conn = Http1Connection(echo, guard, deadline=loop.time() - 1.0)
            self.transport.set_protocol(conn)
            conn.connection_made(self.transport)
            conn.data_received(data)

    listener = await loop.create_server(Door, "127.0.0.1", 0)
    try:
        client = await Peer.connect(listener.sockets[0].getsockname()[1])
        await client.send(b"GET / HT")
        assert (await read_response(client.reader)).status == 408
        assert guard.timed_out == [True]
        await client.close()
    finally:
        listener.close()


async def test_a_new_connection_at_the_cap_may_evict_one_stalled_in_its_head(serve, peer) -> None:
    guard = Guard()
    server = await serve(echo, guard)
    client = await peer(server)
    await client.send(b"GET / HTTP/1.1\r\nHost: x")
    await until(lambda: server.connections[0].head_started, "part of the head is in")
    (evict,) = guard.waiting_now.values()
    evict()
    assert (await read_response(client.reader)).status == 408
    assert await client.closed()


async def test_an_answer_given_before_the_body_came_keeps_the_connection_in_step(serve, peer) -> None:
    """The vendor answered before the upload's end: the reader of the body is cancelled,
    the rest of the body arrives later and is dropped, the next request is served."""

    async def answer_early(req: Request, resp: Responder) -> None:
        if req.target == "/early":
            reader = asyncio.ensure_future(req.body.read_all())
            await asyncio.sleep(0)  # the reader waits for the body
            await resp.send(200, "OK", [], b"early")
            reader.cancel()
            return
        await echo(req, resp)

    server = await serve(answer_early)
    client = await peer(server)
    head = request("POST", "/early", [("Content-Length", "8")])
    assert (await client.exchange(head)).body == b"early"
    await client.send(b"the body")  # after the answer
    after = await client.exchange(request("GET", "/after"))
    assert seen(after)["target"] == "/after"


async def test_an_empty_reason_gets_the_standard_phrase(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        await resp.send(404, "", [], b"")

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(request("GET", "/"))
    assert answer.start == "HTTP/1.1 404 Not Found"
    assert "Date" in answer.headers


# -- a whole answer in one write (Responder.complete) -------------------------------------


@pytest.mark.parametrize(
    ("fields", "version", "framing"),
    [
        ([("Content-Length", "12")], "1.1", "Content-Length"),
        ([], "1.1", "Transfer-Encoding"),
        ([], "1.0", "Connection"),  # no chunks for HTTP/1.0: the close delimits the body
    ],
)
async def test_complete_sends_head_body_and_end_in_one_write(serve, peer, fields, version, framing) -> None:
    writes: list[bytes] = []

    async def handler(req: Request, resp: Responder) -> None:
        resp.start(200, "OK", [("Content-Type", "text/plain"), *fields])
        await resp.complete(b"twelve bytes")
        assert resp.finished

    server = await serve(handler)
    client = await peer(server)
    await until(lambda: bool(server.connections), "the connection")
    conn = server.connections[0]
    original = conn.write

    def counted(data: bytes) -> None:
        writes.append(data)
        original(data)

    conn.write = counted
    await client.send(request("GET", "/", version=version))
    answer = await read_response(client.reader)
    assert answer.body == b"twelve bytes" and framing in answer.headers
    assert len(writes) == 1 and writes[0].endswith(b"0\r\n\r\n" if framing == "Transfer-Encoding" else b"twelve bytes")


async def test_complete_keeps_heads_bodiless_and_cuts_a_short_body(serve, peer) -> None:
    async def handler(req: Request, resp: Responder) -> None:
        resp.start(200, "OK", [("Content-Length", "100" if req.target == "/short" else "12")])
        await resp.complete(b"twelve bytes")

    server = await serve(handler)
    client = await peer(server)
    answer = await client.exchange(request("HEAD", "/"), head=True)
    assert answer.headers["Content-Length"] == "12" and answer.body == b""
    assert (await client.exchange(request("GET", "/"))).body == b"twelve bytes"  # nothing stray from the HEAD
    await client.send(request("GET", "/short"))
    _, headers = await read_head(client.reader)
    assert headers["Content-Length"] == "100"
    assert await client.reader.read() == b"twelve bytes"  # then the close: never a complete-looking body
