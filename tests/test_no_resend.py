"""Every request that reaches a vendor took its tokens (SPEC §12): nothing resends.

HTTP clients commonly resend an idempotent request once when the connection it was written
on is reset or closed before an answer (aiohttp's persistent-connection retry does). A vendor
whose load balancer recycles connections would then see two requests for one worker request
and one token. The proxy's client never does (proxy/wire/upstream.py): the worker gets a
502 that says whether it may retry, and a retry it makes takes a token like any request.
Redirects are never followed, and ``Expect: 100-continue`` is answered by the proxy
itself, never sent upstream (so no vendor ``417`` can make the client resend).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest

from tests.conftest import RawHandler, RawVendor, client_session, vendor_policy

VENDOR_URL = "http://api.payments.example"


@dataclass
class Vendor:
    """A raw vendor that reads each request head and answers per ``answer`` (None: hang up)."""

    raw: RawVendor
    heads: list[bytes] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.raw.url


Answer = Callable[[bytes], bytes | None]


@pytest.fixture
def dropping_vendor(raw_vendor: Callable[[RawHandler], Awaitable[RawVendor]]) -> Callable[[Answer], Awaitable[Vendor]]:
    async def start(answer: Answer) -> Vendor:
        heads: list[bytes] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                heads.append(head)
                lines = head.lower().split(b"\r\n")
                length = next((int(x.split(b":", 1)[1]) for x in lines if x.startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                reply = answer(head)
                if reply is None:
                    return  # hang up without a word, like a recycled connection
                writer.write(reply)
                await writer.drain()

        return Vendor(await raw_vendor(handler), heads)

    return start


def hang_up(head: bytes) -> None:
    return None


@pytest.mark.parametrize("method", ["GET", "HEAD", "DELETE", "OPTIONS", "PUT"])
async def test_a_vendor_that_hangs_up_receives_the_request_once(method, dropping_vendor, start_proxy) -> None:
    vendor = await dropping_vendor(hang_up)
    proxy = await start_proxy(vendor_policy(vendor.url, limits="[{rate: 10, per: 1h, burst: 10}]"))
    data = b"payload" if method == "PUT" else None
    async with client_session() as s, s.request(method, f"{VENDOR_URL}/x", proxy=proxy.url, data=data) as r:
        assert r.status == 502
        assert r.headers["x-should-retry"] == "true"  # idempotent: the worker may retry, taking a token
    assert len(vendor.heads) == 1, f"the vendor received {len(vendor.heads)} copies of one {method}"
    payments = proxy.runtime.policy.vendor("payments")
    _, levels = await proxy.runtime.limiter.peek(payments)
    assert levels[0] == pytest.approx(9, abs=0.01)  # one request, one token


async def test_the_same_on_a_reused_connection(dropping_vendor, start_proxy) -> None:
    """The case aiohttp's retry was made for: the first GET is answered on a keep-alive
    connection, the second finds it closed by the vendor right after reading it."""
    answered = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    heads_seen = 0

    def first_only(head: bytes) -> bytes | None:
        nonlocal heads_seen
        heads_seen += 1
        return answered if heads_seen == 1 else None

    vendor = await dropping_vendor(first_only)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with client_session() as s:
        async with s.get(f"{VENDOR_URL}/first", proxy=proxy.url) as r:
            assert r.status == 200
        async with s.get(f"{VENDOR_URL}/second", proxy=proxy.url) as r:
            assert r.status == 502
    assert [h.split(b" ")[1] for h in vendor.heads] == [b"/first", b"/second"]


async def test_redirects_reach_the_worker_and_are_not_followed(dropping_vendor, start_proxy) -> None:
    moved = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
    vendor = await dropping_vendor(lambda head: moved)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with client_session() as s, s.get(f"{VENDOR_URL}/x", proxy=proxy.url, allow_redirects=False) as r:
        assert r.status == 307
    assert len(vendor.heads) == 1


async def test_expect_100_continue_is_never_sent_upstream(dropping_vendor, start_proxy) -> None:
    """A vendor that answers ``Expect`` with 417 would make a client resend without it;
    the proxy answers 100 Continue itself and sends the vendor a plain request."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    vendor = await dropping_vendor(lambda head: ok)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with (
        aiohttp.ClientSession() as s,
        s.put(f"{VENDOR_URL}/x", proxy=proxy.url, data=b"body", expect100=True) as r,
    ):
        assert r.status == 200
    (head,) = vendor.heads
    assert b"expect" not in head.lower()
