"""The request path on the data plane, end to end: what a broken upload becomes."""

from __future__ import annotations

import asyncio
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

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got_head.set()
        await reader.read()  # the body never ends well: the proxy drops the connection

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
