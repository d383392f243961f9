"""What a worker sees on the forwarding path (SPEC §5), with real clients and real vendors.

Every test runs an in-process proxy against a vendor on loopback: the MockVendor, a
small aiohttp vendor that records raw paths, headers and connections, or a raw TCP
vendor that writes exact bytes (for response framing and failure cases). Worker-side,
the aiohttp client with ``proxy=`` plays a worker behind ``HTTP_PROXY``; a raw socket
sends exact bytes where a client library would normalise them; curl checks
``Expect: 100-continue`` the way curl really sends it.

No sleeps synchronise anything: vendors and workers hand off through asyncio events,
and every wait is bounded so a hang fails fast instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.limiter import Limiter
from proxy.pipeline.handler import ProxyHandler
from proxy.quota.sizing import Sizing
from proxy.server import ProxyServer
from tests.conftest import free_port, metric_samples, value, vendor_policy

VENDOR_HOST = "api.payments.example"
VENDOR_URL = f"http://{VENDOR_HOST}"
WAIT = 5.0
"""Upper bound on any single wait: a hang fails the test quickly instead of stalling."""

FIVE_MB = 5 * 1024 * 1024
_PATTERN = bytes(range(256))


def pattern(n: int) -> bytes:
    """The MockVendor's /bytes/{n} body."""
    return (_PATTERN * (n // 256 + 1))[:n]


def payload(n: int) -> bytes:
    """An incompressible, non-repeating upload body."""
    return os.urandom(n)


# -- a raw HTTP/1.1 client and parser --------------------------------------------------------


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: CIMultiDict[str]
    body: bytes


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, CIMultiDict[str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.add(name.strip(), value.strip())
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, headers: CIMultiDict[str], *, until_eof: bool) -> bytes:
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields
                    pass
                return bytes(out)
            out += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
    if "Content-Length" in headers:
        return await reader.readexactly(int(headers["Content-Length"]))
    return await reader.read() if until_eof else b""


class RawClient:
    """One TCP connection to the proxy; sends exact bytes, parses answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, proxy: ProxyServer) -> RawClient:
        reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, *, head: bool = False) -> RawResponse:
        async def read() -> RawResponse:
            status_line, headers = await _read_head(self.reader)
            _, status, reason = [*status_line.split(" ", 2), ""][:3]
            code = int(status)
            no_body = head or code in (204, 304) or code < 200
            body = b"" if no_body else await _read_body(self.reader, headers, until_eof=True)
            return RawResponse(code, reason, headers, body)

        return await asyncio.wait_for(read(), WAIT)

    async def exchange(self, data: bytes, *, head: bool = False) -> RawResponse:
        await self.send(data)
        return await self.response(head=head)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


@pytest.fixture
async def raw_client() -> AsyncIterator[Callable[[ProxyServer], Awaitable[RawClient]]]:
    clients: list[RawClient] = []

    async def connect(proxy: ProxyServer) -> RawClient:
        client = await RawClient.connect(proxy)
        clients.append(client)
        return client

    yield connect
    for client in clients:
        await client.close()


def request_bytes(
    method: str,
    target: str,
    headers: list[tuple[str, str]] | None = None,
    body: bytes = b"",
    *,
    host: str | None = VENDOR_HOST,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers or []]
    if body and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers or []):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


# -- vendors ----------------------------------------------------------------------------------


@dataclass
class Seen:
    """One request as a vendor received it."""

    method: str
    raw_path: str
    headers: list[tuple[str, str]]
    body: bytes
    peer: tuple[Any, ...]

    def header_names(self) -> set[str]:
        return {k.lower() for k, _ in self.headers}

    def getall(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


@dataclass
class RecordingVendor:
    """An aiohttp vendor that records raw paths, raw headers, bodies and the client connection."""

    url: str = ""
    seen: list[Seen] = field(default_factory=list)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        assert request.transport is not None
        self.seen.append(
            Seen(
                request.method,
                request.raw_path,
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers],
                body,
                tuple(request.transport.get_extra_info("peername")),
            )
        )
        return web.json_response(
            {"path": request.raw_path, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        )


@pytest.fixture
async def recording_vendor(aiohttp_raw_server: Any) -> RecordingVendor:
    vendor = RecordingVendor()
    server = await aiohttp_raw_server(vendor.handle)
    vendor.url = str(server.make_url("")).rstrip("/")
    return vendor


@dataclass
class VendorRequest:
    method: str
    target: str
    headers: CIMultiDict[str]
    body: bytes


async def read_request(reader: asyncio.StreamReader) -> VendorRequest:
    request_line, headers = await _read_head(reader)
    method, target, _ = request_line.split(" ", 2)
    body = await _read_body(reader, headers, until_eof=False)
    return VendorRequest(method, target, headers, body)


def no_quota_headers(headers: CIMultiDict[str] | Any) -> bool:
    return not [name for name in headers if name.lower().startswith("x-quota-")]


# -- which requests reach the vendor, and where ----------------------------------------------


async def test_absolute_form_reaches_vendor_with_its_path(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1/charges?limit=3", proxy=proxy.url) as r:
        assert r.status == 200
        assert (await r.json())["path"] == "/v1/charges"
        assert no_quota_headers(r.headers)
    (seen,) = vendor.mock.requests
    assert seen["method"] == "GET"
    assert seen["path_qs"] == "/v1/charges?limit=3"


async def test_absolute_form_query_travels_byte_for_byte(vendor, start_proxy) -> None:
    """The query of an absolute-form target travels byte for byte too."""
    proxy = await start_proxy(vendor_policy(vendor.url))
    url = URL(f"{VENDOR_URL}/v1/search?q=a%2Bb%20c&sig=AbC%3D%3D", encoded=True)
    async with aiohttp.ClientSession() as s, s.get(url, proxy=proxy.url) as r:
        assert r.status == 200
    (seen,) = vendor.mock.requests
    assert seen["path_qs"] == "/v1/search?q=a%2Bb%20c&sig=AbC%3D%3D"


@pytest.mark.parametrize(
    ("target", "upstream_target"),
    [
        ("/payments/v1/x?a=%2F%2f&b=c+d&e=%7E~&f=&g=%20x;y", "/v1/x?a=%2F%2f&b=c+d&e=%7E~&f=&g=%20x;y"),
        ("/payments/v1/%2e%2E/x%2Fy?q", "/v1/%2e%2E/x%2Fy?q"),
        ("/payments?x=1", "/?x=1"),
        ("/payments", "/"),
    ],
)
async def test_route_prefix_is_stripped_and_the_rest_kept_byte_for_byte(
    recording_vendor, start_proxy, raw_client, target, upstream_target
) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", target, host=f"{proxy.address.host}:{proxy.address.port}"))
    assert resp.status == 200, resp.body
    (seen,) = recording_vendor.seen
    assert seen.raw_path == upstream_target


async def test_route_prefix_needs_a_segment_boundary(recording_vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", "/paymentsX/v1", host="127.0.0.1"))
    assert resp.status == 403
    assert recording_vendor.seen == []


async def test_route_prefix_with_aiohttp_client(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.post(f"{proxy.url}/payments/v1/refunds?id=7", data=b"{}") as r:
        assert r.status == 200
        assert (await r.json())["method"] == "POST"
    assert [q["path_qs"] for q in vendor.mock.requests] == ["/v1/refunds?id=7"]


async def test_origin_form_matched_by_host(recording_vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", "/v1/balance?currency=eur", host=f"{VENDOR_HOST}:80"))
    assert resp.status == 200
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}/v1/other", headers={"Host": VENDOR_HOST}) as r:
        assert r.status == 200
    assert [q.raw_path for q in recording_vendor.seen] == ["/v1/balance?currency=eur", "/v1/other"]


async def test_absolute_form_foreign_target_is_refused_whatever_the_host_header(
    recording_vendor, start_proxy, raw_client
) -> None:
    """RFC 9112 §3.2.2: in absolute form the target alone names the destination."""
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", "http://evil.example/payments/v1/x", host=VENDOR_HOST))
    assert resp.status == 403
    assert resp.headers["X-Quota-Action"] == "deny"
    async with (
        aiohttp.ClientSession() as s,
        s.get("http://evil.example/v1/x", proxy=proxy.url, headers={"Host": VENDOR_HOST}) as r,
    ):
        assert r.status == 403
    assert recording_vendor.seen == []


async def test_unmatched_host_is_403_deny_with_json(recording_vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    async with aiohttp.ClientSession() as s, s.get("http://other.example/v1", proxy=proxy.url) as r:
        assert r.status == 403
        assert r.headers["X-Quota-Action"] == "deny"
        assert r.content_type == "application/json"
        assert r.headers["x-should-retry"] == "false"
        body = await r.json()
    assert body["error"]["type"] == "forbidden" and body["error"]["code"] == "denied"
    assert body["action"] == "deny"
    assert "other.example" in body["detail"]
    assert body["message"] == body["error"]["message"]
    assert body["message"].startswith("no vendor in the policy matches 'other.example'")
    assert recording_vendor.seen == []


async def test_origin_form_without_host_or_route_is_403(recording_vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(b"GET /v1/x HTTP/1.0\r\n\r\n")
    assert resp.status == 403
    assert json.loads(resp.body)["action"] == "deny"
    assert recording_vendor.seen == []


async def test_connect_is_403_and_points_at_upstream_https(recording_vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(f"CONNECT {VENDOR_HOST}:443 HTTP/1.1\r\nHost: {VENDOR_HOST}:443\r\n\r\n".encode())
    assert resp.status == 403
    assert resp.headers["X-Quota-Action"] == "deny"
    assert "upstream: https://" in json.loads(resp.body)["detail"]
    assert recording_vendor.seen == []


# -- header hygiene, both directions ----------------------------------------------------------


async def test_request_hop_by_hop_tenant_and_quota_headers_are_not_forwarded(
    recording_vendor, start_proxy, raw_client
) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    body = b"hello, vendor"
    resp = await client.exchange(
        request_bytes(
            "POST",
            f"{VENDOR_URL}/v1/charges",
            [
                ("Connection", "keep-alive, X-Hop-One"),
                ("Connection", "x-hop-two"),
                ("X-Hop-One", "1"),
                ("X-Hop-Two", "2"),
                ("Keep-Alive", "timeout=5"),
                ("TE", "trailers"),
                ("Trailer", "X-Checksum"),
                ("Upgrade", "h2c"),
                ("Proxy-Authorization", "Basic c2VjcmV0"),
                ("Proxy-Connection", "keep-alive"),
                ("X-Tenant-Id", "acme"),
                ("X-Quota-On-Limit", "defer"),
                ("X-Quota-Max-Hold", "100ms"),
                ("x-quota-anything", "else"),
                ("Authorization", "Bearer sk_live"),
                ("Idempotency-Key", "k-1"),
                ("X-Multi", "a"),
                ("X-Multi", "b"),
                ("Content-Type", "text/plain"),
                ("Transfer-Encoding", "chunked"),
            ],
            chunked(body[:5], body[5:]),
        )
    )
    assert resp.status == 200, resp.body
    (seen,) = recording_vendor.seen
    names = seen.header_names()
    for gone in (
        "connection",
        "x-hop-one",
        "x-hop-two",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "x-tenant-id",
        "x-quota-on-limit",
        "x-quota-max-hold",
        "x-quota-anything",
    ):
        assert gone not in names, gone
    assert seen.getall("Authorization") == ["Bearer sk_live"]
    assert seen.getall("Idempotency-Key") == ["k-1"]
    assert seen.getall("X-Multi") == ["a", "b"]
    assert seen.getall("Content-Type") == ["text/plain"]
    assert seen.body == body
    # nothing added either (no User-Agent, Accept or Accept-Encoding of the proxy's own); the
    # proxy's hop alone decides Host (the upstream's) and the framing of the upstream request
    framing = "transfer-encoding" if "transfer-encoding" in names else "content-length"
    assert names == {"host", "authorization", "idempotency-key", "x-multi", "content-type", framing}
    assert seen.getall("Transfer-Encoding") == ["chunked"] or seen.getall("Content-Length") == [str(len(body))]


async def test_declined_upgrade_is_forwarded_as_a_plain_request(recording_vendor, start_proxy, raw_client) -> None:
    """The proxy speaks HTTP only: Upgrade is hop-by-hop, the vendor sees a plain GET, and
    the worker's connection stays an HTTP connection."""
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(
        request_bytes(
            "GET",
            f"{VENDOR_URL}/ws",
            [
                ("Connection", "Upgrade"),
                ("Upgrade", "websocket"),
                ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                ("Sec-WebSocket-Version", "13"),
            ],
        )
    )
    assert resp.status == 200
    assert "Upgrade" not in resp.headers
    resp = await client.exchange(request_bytes("GET", f"{VENDOR_URL}/after"))
    assert resp.status == 200
    first, second = recording_vendor.seen
    assert {"upgrade", "connection"}.isdisjoint(first.header_names())
    assert second.raw_path == "/after"


async def test_custom_tenant_header_is_stripped(recording_vendor, start_proxy) -> None:
    proxy = await start_proxy(
        vendor_policy(recording_vendor.url, extra_top="tenant: {header: X-Team, default: shared}")
    )
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers={"X-Team": "blue", "X-Tenant-Id": "kept"}) as r,
    ):
        assert r.status == 200
    (seen,) = recording_vendor.seen
    assert "x-team" not in seen.header_names()
    assert seen.getall("X-Tenant-Id") == ["kept"]  # not the tenant header under this policy


async def test_response_hop_by_hop_removed_end_to_end_kept(raw_vendor, start_proxy, raw_client) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 201 Created\r\n"
            b"Content-Type: application/json\r\n"
            b"Connection: keep-alive, X-Hop\r\n"
            b"X-Hop: secret\r\n"
            b"Keep-Alive: timeout=5, max=100\r\n"
            b"Proxy-Authenticate: Basic realm=vendor\r\n"
            b"Proxy-Connection: keep-alive\r\n"
            b"Upgrade: h2c\r\n"
            b"Trailer: X-Checksum\r\n"
            b"Set-Cookie: a=1; Path=/; HttpOnly\r\n"
            b"Set-Cookie: b=2; Path=/v1\r\n"
            b"Cache-Control: no-store\r\n"
            b"X-Request-Id: req_123\r\n"
            b"Location: /v1/charges/ch_1\r\n"
            b"Server: vendor-edge/1.0\r\n"
            b"Date: Tue, 01 Dec 2026 10:00:00 GMT\r\n"
            b"Transfer-Encoding: chunked\r\n"
            b"\r\n" + chunked(b'{"id":', b'"ch_1"}')
        )
        await writer.drain()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("POST", f"{VENDOR_URL}/v1/charges", body=b"{}"))
    assert resp.status == 201
    assert resp.reason == "Created"
    assert resp.body == b'{"id":"ch_1"}'
    h = resp.headers
    assert h.getall("Set-Cookie") == ["a=1; Path=/; HttpOnly", "b=2; Path=/v1"]
    assert h["Cache-Control"] == "no-store"
    assert h["X-Request-Id"] == "req_123"
    assert h["Location"] == "/v1/charges/ch_1"
    assert h["Content-Type"] == "application/json"
    assert h.getall("Server") == ["vendor-edge/1.0"]  # the vendor's, not replaced by the proxy's
    assert h.getall("Date") == ["Tue, 01 Dec 2026 10:00:00 GMT"]
    for gone in ("X-Hop", "Keep-Alive", "Proxy-Authenticate", "Proxy-Connection", "Upgrade", "Trailer"):
        assert gone not in h, gone
    assert "x-hop" not in h.get("Connection", "").lower()
    # aiohttp's client keeps both cookies apart too
    async with aiohttp.ClientSession() as s, s.post(f"{VENDOR_URL}/v1/charges", proxy=proxy.url, data=b"{}") as r:
        assert r.headers.getall("Set-Cookie") == ["a=1; Path=/; HttpOnly", "b=2; Path=/v1"]
        assert await r.read() == b'{"id":"ch_1"}'


async def test_vendor_cannot_impersonate_the_proxy(raw_vendor, start_proxy) -> None:
    """X-Quota-* is the proxy's namespace: a vendor 429 never carries X-Quota-Action (SPEC §5)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nX-Quota-Action: defer\r\n"
            b"X-Quota-Limiter: fake\r\nContent-Length: 2\r\n\r\n{}"
        )
        await writer.drain()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
        assert r.status == 429
        assert r.headers["Retry-After"] == "2"
        assert no_quota_headers(r.headers)
        assert await r.read() == b"{}"


# -- bodies: big, both ways, streamed ---------------------------------------------------------


async def test_upload_5mb_with_content_length(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    data = payload(FIVE_MB)
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{VENDOR_URL}/sha256", proxy=proxy.url, data=io.BytesIO(data)) as r,
    ):
        assert r.status == 200
        assert await r.json() == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": FIVE_MB}
    (seen,) = vendor.mock.requests
    assert seen["headers"]["content-length"] == str(FIVE_MB)
    assert "transfer-encoding" not in seen["headers"]


async def test_upload_5mb_chunked(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    data = payload(FIVE_MB)

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 100_000):
            yield data[i : i + 100_000]

    async with aiohttp.ClientSession() as s, s.post(f"{VENDOR_URL}/sha256", proxy=proxy.url, data=body()) as r:
        assert r.status == 200
        assert await r.json() == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": FIVE_MB}
    (seen,) = vendor.mock.requests
    assert seen["headers"]["transfer-encoding"] == "chunked"


async def test_download_5mb(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    digest = hashlib.sha256()
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/bytes/{FIVE_MB}", proxy=proxy.url) as r:
        assert r.status == 200
        assert r.headers["Content-Length"] == str(FIVE_MB)
        size = 0
        async for chunk in r.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
    assert size == FIVE_MB
    assert digest.hexdigest() == hashlib.sha256(pattern(FIVE_MB)).hexdigest()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_echo_5mb_both_ways(vendor, start_proxy, framing) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    data = payload(FIVE_MB)

    async def body() -> AsyncIterator[bytes]:
        view = memoryview(data)
        for i in range(0, len(data), 256 * 1024):
            yield bytes(view[i : i + 256 * 1024])

    sent: io.BytesIO | AsyncIterator[bytes] = io.BytesIO(data) if framing == "content-length" else body()
    async with aiohttp.ClientSession() as s, s.post(f"{VENDOR_URL}/echo", proxy=proxy.url, data=sent) as r:
        assert r.status == 200
        got = await r.read()
    assert len(got) == FIVE_MB
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_response_bytes_reach_the_worker_before_the_vendor_finishes(raw_vendor, start_proxy, framing) -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nfirst")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n" if framing == "chunked" else b"second")
        await writer.drain()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/stream", proxy=proxy.url) as r:
        assert r.status == 200
        first = await asyncio.wait_for(r.content.readexactly(5), WAIT)
        assert first == b"first"
        assert not release.is_set()  # the vendor is still holding the rest back
        release.set()
        assert await asyncio.wait_for(r.content.read(), WAIT) == b"second"


async def test_request_bytes_reach_the_vendor_before_the_worker_finishes(aiohttp_raw_server, start_proxy) -> None:
    first_arrived = asyncio.Event()
    first = b"x" * 1000

    async def handler(request: web.BaseRequest) -> web.Response:
        head = await request.content.readexactly(len(first))
        first_arrived.set()
        rest = await request.content.read()
        return web.Response(body=head + rest)

    server = await aiohttp_raw_server(handler)
    proxy = await start_proxy(vendor_policy(str(server.make_url("")).rstrip("/")))

    async def body() -> AsyncIterator[bytes]:
        yield first
        # a buffering proxy would never show the vendor this chunk, and this wait would time out
        await asyncio.wait_for(first_arrived.wait(), WAIT)
        yield b"rest"

    async with aiohttp.ClientSession() as s, s.post(f"{VENDOR_URL}/upload", proxy=proxy.url, data=body()) as r:
        assert r.status == 200
        assert await r.read() == first + b"rest"


async def test_worker_going_away_closes_the_upstream_connection(raw_vendor, start_proxy) -> None:
    upstream_closed = asyncio.Event()
    streaming = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        streaming.set()
        if await reader.read() == b"":
            upstream_closed.set()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/stream", proxy=proxy.url) as r:
        assert await asyncio.wait_for(r.content.readexactly(5), WAIT) == b"first"
        r.close()  # the worker gives up mid-body
    await asyncio.wait_for(upstream_closed.wait(), WAIT)
    assert streaming.is_set()


async def test_worker_going_away_mid_upload_closes_the_upstream_connection(raw_vendor, start_proxy, raw_client) -> None:
    first_arrived = asyncio.Event()
    upstream_closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        received = b""
        while chunk := await reader.read(65536):
            received += chunk
            if b"hello" in received:
                first_arrived.set()
        upstream_closed.set()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    client = await raw_client(proxy)
    await client.send(
        request_bytes("POST", f"{VENDOR_URL}/upload", [("Transfer-Encoding", "chunked")]) + b"5\r\nhello\r\n"
    )
    await asyncio.wait_for(first_arrived.wait(), WAIT)
    await client.close()  # the worker dies mid-upload
    await asyncio.wait_for(upstream_closed.wait(), WAIT)


# -- no body: HEAD, 204, 304; Expect: 100-continue --------------------------------------------


async def test_head_has_no_body_and_the_connection_stays_usable(vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("HEAD", f"{VENDOR_URL}/bytes/1000"), head=True)
    assert resp.status == 200
    assert resp.headers["Content-Length"] == "1000"
    assert resp.body == b""
    # if the proxy had sent a body after the HEAD answer, this response would be garbage
    resp = await client.exchange(request_bytes("GET", f"{VENDOR_URL}/bytes/10"))
    assert resp.status == 200
    assert resp.body == pattern(10)
    async with aiohttp.ClientSession() as s, s.head(f"{VENDOR_URL}/bytes/5000", proxy=proxy.url) as r:
        assert r.status == 200
        assert await asyncio.wait_for(r.read(), WAIT) == b""


@pytest.mark.parametrize("status", [204, 304])
async def test_204_and_304_have_no_body_and_do_not_hang(vendor, start_proxy, raw_client, status) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", f"{VENDOR_URL}/status/{status}"))
    assert resp.status == status
    assert "Transfer-Encoding" not in resp.headers
    assert resp.headers.get("Content-Length", "0") == "0"
    resp = await client.exchange(request_bytes("GET", f"{VENDOR_URL}/bytes/3"))
    assert (resp.status, resp.body) == (200, pattern(3))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/status/{status}", proxy=proxy.url) as r:
        assert r.status == status
        assert await asyncio.wait_for(r.read(), WAIT) == b""


async def test_expect_100_continue_upload(vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    client = await raw_client(proxy)
    data = payload(300_000)
    await client.send(
        request_bytes("POST", f"{VENDOR_URL}/sha256", [("Expect", "100-continue"), ("Content-Length", str(len(data)))])
    )
    interim = await asyncio.wait_for(client.reader.readuntil(b"\r\n\r\n"), WAIT)
    assert interim.startswith(b"HTTP/1.1 100 ")
    await client.send(data)
    resp = await client.response()
    assert resp.status == 200
    assert json.loads(resp.body) == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (seen,) = vendor.mock.requests
    assert "expect" not in seen["headers"]  # the proxy answered the expectation itself


async def test_expect_100_continue_refused_request_gets_no_continue(recording_vendor, start_proxy, raw_client) -> None:
    """A request refused before forwarding answers with its final status, not 100: the body is never sent."""
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(
        request_bytes(
            "POST", "http://other.example/upload", [("Expect", "100-continue"), ("Content-Length", "1000000")]
        )
    )
    assert resp.status == 403
    assert recording_vendor.seen == []


async def test_curl_big_upload_with_expect_100_continue(vendor, start_proxy, tmp_path: Path) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    data = payload(2 * 1024 * 1024)  # over 1 MB: curl sends Expect: 100-continue on its own
    upload = tmp_path / "upload.bin"
    upload.write_bytes(data)
    proc = await asyncio.create_subprocess_exec(
        "curl",
        "-sS",
        "--fail-with-body",
        "--proxy",
        proxy.url,
        "--expect100-timeout",
        "30",
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        f"@{upload}",
        "-D",
        "-",
        f"{VENDOR_URL}/sha256",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err
    head, _, body = out.replace(b"\r\n", b"\n").rpartition(b"\n\n")
    assert b"HTTP/1.1 100" in head
    assert json.loads(body) == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


# -- the worker's mistakes: 400, never 500 ----------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "mentions"),
    [
        ({"X-Quota-On-Limit": "sometimes"}, "X-Quota-On-Limit"),
        ({"X-Quota-Max-Hold": "soon"}, "X-Quota-Max-Hold"),
        ({"X-Quota-Max-Hold": "-1s"}, "X-Quota-Max-Hold"),
        ({"X-Tenant-Id": "acme corp/../x"}, "X-Tenant-Id"),
        ({"X-Tenant-Id": ""}, "X-Tenant-Id"),
        ({"X-Tenant-Id": "t" * 129}, "X-Tenant-Id"),
    ],
)
async def test_bad_worker_headers_are_400(recording_vendor, start_proxy, headers, mentions) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers=headers) as r:
            assert r.status == 400
            assert r.headers["x-should-retry"] == "false"
            body = await r.json()
        assert body["error"]["type"] == body["error"]["code"] == "bad_request"
        assert mentions in body["detail"]
        assert body["message"] == body["error"]["message"] == f"bad request: {body['detail']}"
        assert recording_vendor.seen == []
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
            assert r.status == 200  # still serving
    assert len(recording_vendor.seen) == 1


async def test_missing_tenant_without_default_is_400(recording_vendor, start_proxy) -> None:
    proxy = await start_proxy(
        vendor_policy(recording_vendor.url, extra_top="tenant: {header: X-Tenant-Id, default: null}")
    )
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
            assert r.status == 400
            assert "X-Tenant-Id" in (await r.json())["detail"]
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers={"X-Tenant-Id": "acme"}) as r:
            assert r.status == 200
    (seen,) = recording_vendor.seen
    assert "x-tenant-id" not in seen.header_names()


@pytest.mark.parametrize(
    "request_line",
    [
        "GET http://user:pw@api.payments.example/v1 HTTP/1.1",
        "GET http://api.payments.example:99999/v1 HTTP/1.1",
        "GET http://api.payments.example:x/v1 HTTP/1.1",
        "GET http://[::1/v1 HTTP/1.1",
        "GET http:///v1 HTTP/1.1",
        "GET http://bad_host!/v1 HTTP/1.1",
        "GET ftp://api.payments.example/v1 HTTP/1.1",
        "OPTIONS * HTTP/1.1",
        "GET api.payments.example/v1 HTTP/1.1",
    ],
)
async def test_malformed_targets_are_400_and_the_proxy_keeps_serving(
    recording_vendor, start_proxy, raw_client, request_line
) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(f"{request_line}\r\nHost: {VENDOR_HOST}\r\n\r\n".encode())
    assert resp.status == 400, (resp.status, resp.body)
    assert recording_vendor.seen == []
    other = await raw_client(proxy)
    resp = await other.exchange(request_bytes("GET", f"{VENDOR_URL}/v1"))
    assert resp.status == 200


@pytest.mark.parametrize(
    "host",
    ["api.payments.example:x", "bad host", "[::1", "user@api.payments.example"],
)
async def test_bad_host_header_is_400(recording_vendor, start_proxy, raw_client, host) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", "/v1", host=host))
    assert resp.status == 400, (resp.status, resp.body)
    assert recording_vendor.seen == []


async def test_request_smuggling_framing_is_refused(recording_vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(
        request_bytes(
            "POST", f"{VENDOR_URL}/v1", [("Content-Length", "4"), ("Transfer-Encoding", "chunked")], b"0\r\n\r\n"
        )
    )
    assert resp.status == 400
    assert recording_vendor.seen == []


# -- when the vendor fails --------------------------------------------------------------------


async def test_upstream_refused_is_502_json(start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(f"http://127.0.0.1:{free_port()}"))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
            assert r.status == 502
            assert r.headers["x-should-retry"] == "true"  # refused: the request never left
            body = await r.json()
        assert body["error"]["type"] == "upstream_error" and body["error"]["code"] == "upstream_unreachable"
        assert body["limiter"] == "payments"
        assert body["message"].endswith("the request was not sent (safe to retry)")
        assert r.headers.get("X-Quota-Action") is None
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
            assert r.status == 502  # and again: nothing broke


@pytest.mark.parametrize(
    ("where", "path_headers"),
    [
        # The general request path (an X-Quota-* header it does not read takes a request there), and the
        # straight one (lane.py), each with a bug in a step it takes before the vendor.
        ((ProxyHandler, "admit"), {"X-Quota-Trace": "1"}),
        ((Limiter, "took"), {}),
    ],
    ids=["general", "straight"],
)
async def test_a_bug_in_the_proxy_is_a_500_counted_as_an_error(
    vendor, start_proxy, monkeypatch, caplog, where, path_headers
) -> None:
    async def bug(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug")

    def sync_bug(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug")

    monkeypatch.setattr(*where, bug if where[1] == "admit" else sync_bug)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url, headers=path_headers) as r:
            assert r.status == 500
            assert r.headers["X-Quota-Error"] == "proxy-error"
            body = await r.json()
        samples = metric_samples(await (await s.get(f"{proxy.admin_url}/metrics")).text())
    message = "internal proxy error (see the proxy's log); the request may have been sent"
    assert body == {
        "error": {"type": "proxy_error", "code": "internal_error", "message": message},
        "message": message,
        "limiter": "payments",
        "detail": "internal proxy error",
    }
    assert r.headers["x-should-retry"] == "true"  # a GET is safe to repeat
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="error") == 1
    assert f"internal error on GET {VENDOR_URL}/v1" in caplog.text
    assert vendor.mock.accepted == 0


async def test_a_bug_once_the_answer_has_begun_never_splices_a_500_into_it(
    recording_vendor, start_proxy, raw_client, monkeypatch
) -> None:
    def bug(*args: object) -> None:
        raise RuntimeError("a bug after the answer was sent")

    monkeypatch.setattr(Sizing, "observe", bug)  # runs once the vendor's answer is relayed
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", f"{VENDOR_URL}/v1"))
    assert resp.status == 200 and json.loads(resp.body)["path"] == "/v1"
    assert await asyncio.wait_for(client.reader.read(), WAIT) == b""  # then the connection is cut
    async with aiohttp.ClientSession() as s:
        samples = metric_samples(await (await s.get(f"{proxy.admin_url}/metrics")).text())
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="error") == 1


async def test_vendor_silent_past_read_timeout_is_504_json(raw_vendor, start_proxy) -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await release.wait()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url, extra_vendor="timeouts: {read: 200ms}"))
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
            assert r.status == 504
            body = await r.json()
    finally:
        release.set()
    assert body["error"]["type"] == "upstream_error" and body["error"]["code"] == "upstream_timeout"
    assert body["limiter"] == "payments"
    assert r.headers["x-should-retry"] == "true"  # it may have reached the vendor, but a GET is idempotent


async def test_mock_vendor_slower_than_read_timeout_is_504(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, extra_vendor="timeouts: {read: 200ms}"))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/delay/400", proxy=proxy.url) as r:
        assert r.status == 504
        assert (await r.json())["error"]["code"] == "upstream_timeout"


async def test_vendor_stalling_mid_body_past_read_timeout_breaks_the_worker_response(raw_vendor, start_proxy) -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        await release.wait()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url, extra_vendor="timeouts: {read: 200ms}"))
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(r.read(), WAIT)
    finally:
        release.set()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_vendor_closing_mid_body_is_an_error_for_the_worker(raw_vendor, start_proxy, raw_client, framing) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if framing == "chunked":
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"400\r\n"
                + b"a" * 1024
                + b"\r\n400\r\n"
                + b"b" * 10
            )
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"a" * 1000)
        await writer.drain()
        # and the connection closes

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(r.read(), WAIT)
    # the raw view: the worker's connection ends before a complete body
    client = await raw_client(proxy)
    with pytest.raises(asyncio.IncompleteReadError):
        await client.exchange(request_bytes("GET", f"{VENDOR_URL}/v1"))


async def test_vendor_502_is_passed_through_untouched(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/status/502", proxy=proxy.url) as r:
        assert r.status == 502
        assert no_quota_headers(r.headers)
        body = await r.json()
    assert body == {"ok": False, "status": 502, "method": "GET"}  # the vendor's, not the proxy's


# -- the vendor's own 429 ---------------------------------------------------------------------


async def test_vendor_429_without_retry_after_gets_one(vendor, start_proxy) -> None:
    policy = vendor_policy(vendor.url)
    proxy = await start_proxy(policy)
    vendor.mock.script(429, retry_after=None)
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
        assert r.status == 429
        assert await r.read() == b'{"error": "rate_limited"}'
        assert r.headers["Retry-After"] == str(math.ceil(policy.vendors[0].feedback.retry_after_default))
        assert no_quota_headers(r.headers)
        assert r.headers["Content-Type"] == "application/json"


async def test_vendor_429_keeps_its_own_retry_after(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    vendor.mock.script(429, retry_after="7")
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
        assert r.status == 429
        assert r.headers.getall("Retry-After") == ["7"]
        assert await r.read() == b'{"error": "rate_limited"}'
        assert no_quota_headers(r.headers)


# -- keep-alive ------------------------------------------------------------------------------

# The proxy keeps a burst's worth of connections to a vendor open (forward.py): burst 1 keeps
# one, so that tests counting the vendor's connections see only the requests' own.
ONE_WARM = "[{rate: 1000, per: 1s, burst: 1}]"


async def test_one_worker_connection_many_requests_one_upstream_connection(
    recording_vendor, start_proxy, raw_client
) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url, limits=ONE_WARM))
    client = await raw_client(proxy)
    for i in range(20):
        if i % 2:
            body = f"body {i}".encode()
            resp = await client.exchange(request_bytes("POST", f"{VENDOR_URL}/v1/{i}", body=body))
            assert json.loads(resp.body)["bytes"] == len(body)
        else:
            resp = await client.exchange(request_bytes("GET", f"{VENDOR_URL}/v1/{i}?n={i}"))
            assert json.loads(resp.body)["path"] == f"/v1/{i}?n={i}"
        assert resp.status == 200
        assert resp.headers.get("Connection", "").lower() != "close"
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as s:
        for i in range(20):
            async with s.get(f"{VENDOR_URL}/v2/{i}", proxy=proxy.url) as r:
                assert r.status == 200
                await r.read()
    assert len(recording_vendor.seen) == 40
    assert len({seen.peer for seen in recording_vendor.seen}) == 1


async def test_upstream_connection_reused_after_big_and_empty_bodies(raw_vendor, start_proxy) -> None:
    """Each answer framed differently; the one vendor connection survives them all."""
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"x" * 70_000, b"y"),
        b'HTTP/1.1 304 Not Modified\r\nETag: "e"\r\n\r\n',
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url, limits=ONE_WARM))  # counts connections
    bodies = []
    async with aiohttp.ClientSession() as s:
        for _ in answers:
            async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
                bodies.append((r.status, len(await asyncio.wait_for(r.read(), WAIT))))
    assert bodies == [(200, 3), (204, 0), (200, 70_001), (304, 0), (200, 2)]
    assert vendor.connections == 1


# -- framing corner cases ---------------------------------------------------------------------


async def test_http10_worker_gets_a_close_delimited_body(raw_vendor, start_proxy, raw_client) -> None:
    """An HTTP/1.0 worker cannot take chunks: a vendor's chunked answer is relayed until close."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(b"abc", b"def"))
        await writer.drain()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    client = await raw_client(proxy)
    await client.send(f"GET {VENDOR_URL}/v1 HTTP/1.0\r\n\r\n".encode())
    resp = await client.response()
    assert resp.status == 200
    assert "Transfer-Encoding" not in resp.headers
    assert resp.body == b"abcdef"


async def test_close_delimited_vendor_body_is_complete_for_the_worker(raw_vendor, start_proxy) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"z" * 100_000)
        await writer.drain()

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url, limits=ONE_WARM))  # counts connections
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # the worker's connection stays usable: the vendor's close was its own hop
            async with s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
                assert r.status == 200
                assert await asyncio.wait_for(r.read(), WAIT) == b"z" * 100_000
    assert vendor.connections == 2


async def test_vendor_closing_before_answering_is_502(raw_vendor, start_proxy) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # and hang up without a word

    vendor = await raw_vendor(handler)
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with aiohttp.ClientSession() as s, s.get(f"{VENDOR_URL}/v1", proxy=proxy.url) as r:
        assert r.status == 502
        assert (await r.json())["error"]["code"] == "upstream_unreachable"
        assert r.headers["x-should-retry"] == "true"  # sent, but a GET


async def test_refused_request_with_unread_body_keeps_the_connection_usable(
    recording_vendor, start_proxy, raw_client
) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    body = b"q" * 50_000
    resp = await client.exchange(request_bytes("POST", "http://other.example/v1", body=body))
    assert resp.status == 403
    resp = await client.exchange(request_bytes("POST", f"{VENDOR_URL}/v1", [("X-Quota-On-Limit", "never")], body))
    assert resp.status == 400
    resp = await client.exchange(request_bytes("POST", f"{VENDOR_URL}/v1", body=b"after"))
    assert resp.status == 200
    (seen,) = recording_vendor.seen
    assert seen.body == b"after"


async def test_absolute_form_scheme_and_host_are_case_insensitive(recording_vendor, start_proxy, raw_client) -> None:
    proxy = await start_proxy(vendor_policy(recording_vendor.url))
    client = await raw_client(proxy)
    resp = await client.exchange(request_bytes("GET", "HTTP://API.Payments.Example./V1/Mixed?Q=A"))
    assert resp.status == 200
    (seen,) = recording_vendor.seen
    assert seen.raw_path == "/V1/Mixed?Q=A"
