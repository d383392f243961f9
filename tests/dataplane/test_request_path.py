"""The request path on the data plane, end to end: what a broken upload becomes."""

from __future__ import annotations

import asyncio
import gc
import json
import logging

import pytest

from tests.conftest import vendor_policy
from tests.dataplane.wire import Peer, read_request, read_response


async def test_an_upload_whose_framing_breaks_mid_body_is_a_400_not_a_crash(
    raw_vendor, start_proxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's chunked body turns malformed while it streams to the vendor: the
    worker is answered 400 (its request was bad), the vendor's half-sent request is
    dropped with its connection, and nothing is logged as the proxy's own error."""
    got_head = asyncio.Event()
    dropped = asyncio.Event()

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got_head.set()
        await reader.read()  # the body never ends well: the proxy drops the connection
        dropped.set()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url))
    client = await Peer.connect(proxy.address.port)
    try:
        await client.send(
            b"POST http://api.payments.example/v1/up HTTP/1.1\r\nHost: api.payments.example\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
        )
        await asyncio.wait_for(got_head.wait(), 5)
        with caplog.at_level(logging.ERROR):
            await client.send(b"zz-not-a-chunk\r\n")
            answer = await read_response(client.reader)
            await asyncio.wait_for(dropped.wait(), 5)
            await asyncio.sleep(0)  # the proxy's side of the drop (connection_lost) runs
            gc.collect()  # a future failed and never awaited says so when it is collected
        assert answer.status == 400
        assert json.loads(answer.body)["error"]["type"] == "bad_request"
        assert await client.closed()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        await client.close()


async def test_pipelined_requests_through_the_proxy_come_back_in_order(raw_vendor, start_proxy) -> None:
    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen = await read_request(reader)
            path = seen.start.split(" ")[1].encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(path), path))
            await writer.drain()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url))
    client = await Peer.connect(proxy.address.port)
    try:
        await client.send(
            b"".join(
                b"GET http://api.payments.example/p%d HTTP/1.1\r\nHost: api.payments.example\r\n\r\n" % i
                for i in range(5)
            )
        )
        bodies = [(await read_response(client.reader)).body for _ in range(5)]
        assert bodies == [b"/p%d" % i for i in range(5)]
    finally:
        await client.close()


async def test_a_request_whose_body_is_known_broken_before_it_is_served_never_reaches_the_vendor(
    raw_vendor, start_proxy
) -> None:
    """The chunk-size line after the head does not parse, in the same packet as the head:
    the request is answered 400 and closed without taking tokens or reaching the vendor
    (forwarding its head would spend a token on a request the vendor can never get whole)."""
    heads = 0

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal heads
        head = await reader.readuntil(b"\r\n\r\n")  # counted as soon as a head is in
        heads += 1
        start = head.split(b"\r\n", 1)[0]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(start), start))
        await writer.drain()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url))
    client = await Peer.connect(proxy.address.port)
    try:
        await client.send(
            b"POST http://api.payments.example/v1/up HTTP/1.1\r\nHost: api.payments.example\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\nab\r\n"
        )
        answer = await read_response(client.reader)
        assert answer.status == 400
        assert json.loads(answer.body)["error"]["type"] == "bad_request"
        assert await client.closed()
        # The next worker's request is the first the vendor sees.
        other = await Peer.connect(proxy.address.port)
        try:
            await other.send(b"GET http://api.payments.example/v1/ok HTTP/1.1\r\nHost: api.payments.example\r\n\r\n")
            assert (await read_response(other.reader)).body == b"GET /v1/ok HTTP/1.1"
        finally:
            await other.close()
        assert heads == 1
    finally:
        await client.close()


async def test_an_http_0_9_request_is_refused_not_forwarded_as_http_1_1(raw_vendor, start_proxy) -> None:
    """``GET /path`` with no version is HTTP/0.9, which llhttp accepts: the proxy speaks
    HTTP/1.x only, so it is a 400 and the vendor sees nothing."""
    seen: list[str] = []

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        seen.append(request.start)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url))
    client = await Peer.connect(proxy.address.port)
    try:
        await client.send(b"GET /v1/ok\r\nHost: api.payments.example\r\n\r\n")
        answer = await read_response(client.reader)
        assert answer.status == 400
        assert await client.closed()
        assert seen == []
    finally:
        await client.close()
