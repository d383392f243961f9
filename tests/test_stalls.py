"""A request whose worker or vendor stops moving its bytes mid-exchange is bounded in time.

A worker that sends no byte of its body, or takes no byte of its answer, for the
connections' ``idle_timeout`` is cut; a vendor that takes no byte of an upload for its
``timeouts.read`` is a 504. Either way the vendor connection is closed and the request's
concurrency slot freed: a stalled peer cannot hold them for ever (each case below held
both indefinitely before the bound).
"""

from __future__ import annotations

import asyncio
import json
import socket

from tests.conftest import vendor_policy
from tests.dataplane.wire import Peer, read_response

IDLE = 0.4  # connections.idle_timeout
READ = 0.4  # the vendor's timeouts.read
TARGET = b"http://api.payments.example/v1/x"
SECOND = b"GET %s HTTP/1.1\r\nHost: api.payments.example\r\n\r\n" % TARGET
POLICY = dict(
    extra_top=f"connections: {{idle_timeout: {int(IDLE * 1000)}ms}}",
    extra_vendor=f"concurrency: 1\n            timeouts: {{read: {int(READ * 1000)}ms}}",
)


async def _answered_200(port: int) -> None:
    """The vendor's one concurrency slot is free again: a new request goes through."""
    other = await Peer.connect(port)
    try:
        answer = await other.exchange(SECOND)
        assert answer.status == 200, answer
    finally:
        await other.close()


async def test_a_worker_that_stops_sending_its_body_is_answered_408_and_frees_its_slot(raw_vendor, start_proxy) -> None:
    dropped = asyncio.Event()

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"Content-Length" not in head:  # the second request
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read()
            return
        await reader.read()  # the upload never completes: the proxy drops the connection
        dropped.set()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url, **POLICY))
    client = await Peer.connect(proxy.address.port)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await client.send(
            b"POST %s HTTP/1.1\r\nHost: api.payments.example\r\nContent-Length: 100\r\n\r\n0123456789" % TARGET
        )
        answer = await read_response(client.reader)
        waited = loop.time() - started
        assert answer.status == 408, answer
        assert json.loads(answer.body)["error"]["code"] == "request_timeout"
        assert answer.headers["x-should-retry"] == "true"  # the vendor never got it whole
        assert answer.headers["Connection"] == "close"
        assert IDLE * 0.9 <= waited < IDLE + 3
        assert await client.closed()
        await asyncio.wait_for(dropped.wait(), 5)
    finally:
        await client.close()
    await _answered_200(proxy.address.port)


async def test_a_worker_that_stops_reading_its_answer_is_cut_and_frees_its_slot(raw_vendor, start_proxy) -> None:
    cut = asyncio.Event()

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"/v1/big" not in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
        try:
            while True:  # as fast as the proxy takes it, until it drops the connection
                writer.write(b"x" * 65536)
                await writer.drain()
        except ConnectionError:
            cut.set()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url, **POLICY))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once: the worker reads nothing
    sock.connect(("127.0.0.1", proxy.address.port))
    sock.setblocking(False)
    try:
        sock.send(b"GET http://api.payments.example/v1/big HTTP/1.1\r\nHost: api.payments.example\r\n\r\n")
        await asyncio.wait_for(cut.wait(), IDLE + 5)
    finally:
        sock.close()
    await _answered_200(proxy.address.port)


async def test_a_vendor_that_stops_reading_an_upload_is_504_at_its_read_timeout(raw_vendor, start_proxy) -> None:
    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"Content-Length" not in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        await reader.read(0)  # reads no more of the upload, answers nothing
        await asyncio.Event().wait()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url, **POLICY))
    client = await Peer.connect(proxy.address.port)
    size = 1 << 30

    async def upload() -> None:
        client.writer.write(
            b"POST %s HTTP/1.1\r\nHost: api.payments.example\r\nContent-Length: %d\r\n\r\n" % (TARGET, size)
        )
        while True:  # the worker keeps sending: only the vendor has stopped
            client.writer.write(b"y" * 65536)
            await client.writer.drain()

    sending = asyncio.ensure_future(upload())
    try:
        answer = await read_response(client.reader, head=True)
        assert answer.status == 504, answer
        assert answer.headers["x-should-retry"] == "false"  # a POST that may have reached it
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        await client.close()
    await _answered_200(proxy.address.port)
