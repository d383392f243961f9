"""The straight path (proxy/pipeline/lane.py) against the general one: the same bytes to the vendor,
the same bytes to the worker, the same access-log line and the same metrics, request for
request; and the usual request never enters the general path.

Every case is sent twice to one proxy: once as it comes (the straight path takes it, or
hands it over where it stops being usual), once with the lane switched off (``Lane.serve``
handing every request to the general path), and the two runs compared. The vendor is a
raw TCP server answering each case's exact bytes and recording the exact bytes it got.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from proxy.pipeline.handler import ProxyHandler
from proxy.pipeline.lane import Lane
from proxy.telemetry.accesslog import AccessLog
from proxy.wire import http1
from proxy.wire.http1 import Http1Connection
from proxy.wire.request import Request
from proxy.wire.responder import Responder
from tests.conftest import eventually, metric_samples, value, vendor_policy
from tests.helpers.intercept import ProxyCA, intercept_policy, new_proxy_ca

WAIT = 10.0
HOST = "api.payments.example"

OK_BODY = b'{"ok":true}'
OK = b"".join(
    (
        b"HTTP/1.1 200 OK\r\n",
        b"Content-Type: application/json\r\n",
        b"Date: Tue, 01 Dec 2026 12:00:00 GMT\r\n",
        b"Content-Length: 11\r\n\r\n",
        OK_BODY,
    )
)


@dataclass
class ScriptedVendor:
    """A raw vendor: every request it reads (its head, and a body its ``Content-Length``
    frames) is recorded as bytes and answered ``answer``."""

    answer: bytes = OK
    got: list[bytes] = field(default_factory=list)
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"\r\ncontent-length: *(\d+)", head.lower())
                body = await reader.readexactly(int(length.group(1))) if length is not None else b""
                self.got.append(head + body)
                writer.write(self.answer)
                await writer.drain()
                if b"Connection: close" in self.answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[ScriptedVendor]:
    vendor = ScriptedVendor()
    server = await asyncio.start_server(vendor.serve, "127.0.0.1", 0)
    vendor.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield vendor
    server.close()
    await server.wait_closed()


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection, read one answer whole (by its framing, or to the close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        interim = b""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        while head.startswith(b"HTTP/1.1 100 "):  # an interim answer: kept, and the final one read after it
            interim += head
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        low = head.lower()
        found = re.search(rb"\r\ncontent-length: *(\d+)", low)
        if data.startswith(b"HEAD ") or head[9:12] in (b"204", b"304"):
            body = b""
        elif found is not None:
            body = await asyncio.wait_for(reader.readexactly(int(found.group(1))), WAIT)
        elif b"transfer-encoding: chunked" in low:
            body = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), WAIT)
        else:
            body = await asyncio.wait_for(reader.read(), WAIT)
        return interim + head + body
    finally:
        writer.close()


async def _read_ok(reader: asyncio.StreamReader) -> bytes:
    """The next answer on ``reader``, which must be the scripted vendor's 200 with its body; its head."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    assert head.startswith(b"HTTP/1.1 200 OK") and await reader.readexactly(11) == OK_BODY, head
    return head


_DATE = re.compile(rb"\r\nDate: [^\r]*")


def _comparable(answer: bytes, vendor_answer: bytes) -> bytes:
    """The worker's answer with a ``Date`` the proxy added (the vendor sent none) blanked."""
    return answer if b"\r\nDate:" in vendor_answer else _DATE.sub(b"\r\nDate: -", answer)


def _log_fields(line: str) -> dict[str, Any]:
    fields = json.loads(line)
    assert isinstance(fields.pop("ts"), float) and isinstance(fields.pop("duration_ms"), float)
    return fields


FAMILIES = (
    "ratelimit_requests_total",
    "ratelimit_requests_by_mode_total",
    "http_client_responses_total",
    "http_client_request_duration_seconds_count",
    "ratelimit_deferred_total",
    "ratelimit_endpoint_requests_total",
)


def _counts(text: str) -> dict[Any, float]:
    return {key: sample for key, sample in metric_samples(text).items() if key[0] in FAMILIES}


def _general_only(self: Lane, conn: Any, request: Request) -> None:
    return None  # no flight: the general path serves every request


@dataclass
class Run:
    vendor_got: bytes
    answer: bytes
    log: dict[str, Any]
    metrics: dict[Any, float]


async def _run(proxy: Any, vendor: ScriptedVendor, stream: io.StringIO, data: bytes) -> Run:
    async def metrics() -> dict[Any, float]:
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
            return _counts(await r.text())

    before = await metrics()
    seen = len(vendor.got)
    stream.seek(0)
    stream.truncate()
    answer = await _exchange(proxy.address.port, data)
    proxy.runtime.deps.access_log.flush()
    after = await metrics()
    lines = [line for line in stream.getvalue().splitlines() if line]
    assert len(lines) == 1, lines
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    return Run(b"".join(vendor.got[seen:]), answer, _log_fields(lines[0]), delta)


def _request(method: str, target: str, *fields: str, host: str | None = HOST, version: str = "1.1") -> bytes:
    lines = [f"{method} {target} HTTP/{version}", *([f"Host: {host}"] if host else []), *fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


ABSOLUTE = f"http://{HOST}/v1/charges?limit=3"
REQUESTS = {
    "plain GET": _request("GET", ABSOLUTE, "User-Agent: t/1", "Accept: */*"),
    "hop-by-hop fields": _request(
        "GET", ABSOLUTE, "Connection: keep-alive", "Proxy-Connection: Keep-Alive", "Keep-Alive: 300", "TE: trailers"
    ),
    "tenant and credential": _request("GET", ABSOLUTE, "X-Tenant-Id: acme", "Authorization: Bearer sk_test"),
    "odd spelling": _request("GET", ABSOLUTE, "accept:   */*", "X-Dup: 1", "x-dup: 2", "X-Latin: caf\xe9"),
    "DELETE": _request("DELETE", f"http://{HOST}/v1/charges/ch_1"),
    "POST without a body": _request("POST", f"http://{HOST}/v1/charges", "Content-Length: 0"),
    "POST with a small body": _request(
        "POST", f"http://{HOST}/v1/charges", "Content-Type: application/x-www-form-urlencoded", "Content-Length: 25"
    )
    + b"amount=2000&currency=usd&",
    "PUT with a body and a tenant": _request("PUT", f"http://{HOST}/v1/x", "X-Tenant-Id: acme", "Content-Length: 2")
    + b"{}",
    "POST, the body at the limit": _request("POST", f"http://{HOST}/v1/files", "Content-Length: 65536") + b"b" * 65536,
    "OPTIONS": _request("OPTIONS", f"http://{HOST}/v1/charges"),
    "HTTP/1.0 keep-alive": _request("GET", ABSOLUTE, "Connection: keep-alive", version="1.0"),
    "HTTP/1.0, closes": _request("GET", ABSOLUTE, version="1.0"),
    "HTTP/1.0 POST with a body": _request(
        "POST", f"http://{HOST}/v1/charges", "Connection: Keep-Alive", "Content-Length: 5", version="1.0"
    )
    + b"hello",
    "worker closes": _request("GET", ABSOLUTE, "Connection: close"),
    "route (origin form)": _request("GET", "/payments/v1/charges", host="127.0.0.1"),
    "Host names the vendor": _request("GET", "/v1/charges"),
    "no Host, absolute form": _request("GET", ABSOLUTE, host=None),
    "fragment": _request("GET", f"http://{HOST}/v1/charges#top"),
    "X-Quota-On-Limit": _request("GET", ABSOLUTE, "X-Quota-On-Limit: hold"),
    "a wish, spelled otherwise": _request("GET", ABSOLUTE, "x-quota-on-limit: Shed", "X-QUOTA-MAX-HOLD: 100ms"),
    "HEAD": _request("HEAD", ABSOLUTE),
    # Not usual: the general path from the start.
    "another X-Quota-* field": _request("GET", ABSOLUTE, "X-Quota-Something: 1"),
    "a wish that cannot be read": _request("GET", ABSOLUTE, "X-Quota-On-Limit: later"),
    "Connection names a field": _request("GET", ABSOLUTE, "Connection: X-Private", "X-Private: 1"),
    "Upgrade, not asked of this hop": _request("GET", ABSOLUTE, "Upgrade: websocket"),
    "Upgrade asked of this hop": _request("GET", ABSOLUTE, "Connection: Upgrade", "Upgrade: websocket"),
    "POST, a body over the limit": _request("POST", f"http://{HOST}/v1/files", "Content-Length: 65537") + b"b" * 65537,
    "POST, a chunked body": _request("POST", f"http://{HOST}/v1/charges", "Transfer-Encoding: chunked")
    + b"5\r\nhello\r\n0\r\n\r\n",
    "POST, Expect: 100-continue": _request(
        "POST", f"http://{HOST}/v1/charges", "Expect: 100-continue", "Content-Length: 2"
    )
    + b"{}",
}
ANSWERS = {
    "plain": OK,
    "no Date": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + OK_BODY,
    "hop-by-hop fields": b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n"
    b"Proxy-Authenticate: Basic\r\nX-Quota-Action: fake\r\nContent-Length: 11\r\n\r\n" + OK_BODY,
    "own reason phrase": b"HTTP/1.1 201 Made It\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok",
    "HTTP/1.0 keep-alive": b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 11\r\n\r\n" + OK_BODY,
    "empty body": b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "vendor closes": b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 11\r\n\r\n" + OK_BODY,
    # Handed over with the answer: the general path relays (and feeds back) these.
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "204": b"HTTP/1.1 204 No Content\r\nDate: Tue, 01 Dec 2026 12:00:00 GMT\r\n\r\n",
    "vendor 429": b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}",
    "large body": b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100_000,
    "Connection names a field": b"HTTP/1.1 200 OK\r\nConnection: X-Trace\r\nX-Trace: 1\r\nContent-Length: 2\r\n\r\nok",
    "watched remaining quota": b"HTTP/1.1 200 OK\r\nX-RateLimit-Remaining: 5\r\nContent-Length: 2\r\n\r\nok",
    "no length, closed": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the close",
}
CASES = [(r, "plain") for r in REQUESTS] + [("plain GET", a) for a in ANSWERS if a != "plain"]
GENERAL_REQUESTS = {"fragment", "another X-Quota-* field", "Connection names a field", "Upgrade asked of this hop"}
GENERAL_REQUESTS |= {"a wish that cannot be read"}
GENERAL_REQUESTS |= {"POST, a body over the limit", "POST, a chunked body", "POST, Expect: 100-continue"}
"""Requests that are not usual: the general path serves them from the start."""
HANDED_OVER = {"chunked", "204", "vendor 429", "large body", "Connection names a field", "watched remaining quota"}
HANDED_OVER |= {"no length, closed"}
"""Answers the straight path hands to the general path's relay."""


@pytest.mark.parametrize(("request_case", "answer_case"), CASES, ids=[f"{r} / {a}" for r, a in CASES])
async def test_the_straight_path_writes_what_the_general_path_writes(
    scripted: ScriptedVendor,
    start_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    general_calls: list[str],
    request_case: str,
    answer_case: str,
) -> None:
    policy = vendor_policy(
        scripted.url,
        limits="[{rate: 1000, per: 1s}, {rate: 60000, per: 1m}]",
        tenant_limits="tenant_limits: {default: [{rate: 500, per: 1s}]}",
        extra_vendor="feedback: {remaining_header: X-RateLimit-Remaining, low_watermark: 1}",
    )
    scripted.answer = ANSWERS[answer_case]
    data = REQUESTS[request_case]
    runs = []
    for lane in ("straight", "general"):
        if lane == "general":
            monkeypatch.setattr(Lane, "flight", _general_only)
        stream = io.StringIO()
        proxy = await start_proxy(policy, access_log=AccessLog(stream))  # each its own buckets
        runs.append(await _run(proxy, scripted, stream, data))
        if lane == "straight":
            took = len(general_calls)
            usual = request_case not in GENERAL_REQUESTS and answer_case not in HANDED_OVER
            assert took == (0 if usual else 1), f"the general path served {took} of 1"
    straight, general = runs
    assert straight.vendor_got == general.vendor_got
    if request_case == "a wish that cannot be read":  # the proxy's own answer: its Date is its own
        straight.answer, general.answer = (_DATE.sub(b"\r\nDate: -", a) for a in (straight.answer, general.answer))
    assert _comparable(straight.answer, scripted.answer) == _comparable(general.answer, scripted.answer)
    assert straight.log == general.log
    assert straight.metrics == general.metrics
    assert straight.metrics  # something was counted
    if request_case == "a wish that cannot be read":
        assert straight.answer.startswith(b"HTTP/1.1 400 ")  # (the general path's answer, and log line)
    else:
        assert straight.log["outcome"] == "forwarded"


async def _exchange_intercepted(port: int, ca: ProxyCA, data: bytes, connect_headers: str = "") -> bytes:
    """``data`` inside an intercepted tunnel (CONNECT, then TLS with the proxy's leaf): one answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n{connect_headers}\r\n".encode())
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(writer.start_tls(ca.trust(), server_hostname=HOST), WAIT)
        writer.write(data)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        found = re.search(rb"\r\ncontent-length: *(\d+)", head.lower())
        assert found is not None, head
        return head + await asyncio.wait_for(reader.readexactly(int(found.group(1))), WAIT)
    finally:
        writer.close()


@pytest.mark.parametrize("connect_headers", ["", "X-Tenant-Id: acme\r\n"], ids=["no tenant", "tenant on CONNECT"])
async def test_inside_an_intercepted_tunnel_the_straight_path_writes_what_the_general_path_writes(
    scripted: ScriptedVendor,
    start_proxy: Any,
    monkeypatch: pytest.MonkeyPatch,
    general_calls: list[str],
    tmp_path: Any,
    connect_headers: str,
) -> None:
    ca = new_proxy_ca(tmp_path)
    policy = intercept_policy(ca, upstream=scripted.url, vendor_ca=None)
    data = _request("GET", "/v1/charges?limit=3", "User-Agent: t/1", "Connection: keep-alive")
    runs = []
    for lane in ("straight", "general"):
        if lane == "general":
            monkeypatch.setattr(Lane, "flight", _general_only)
        stream = io.StringIO()
        proxy = await start_proxy(policy, access_log=AccessLog(stream))
        seen = len(scripted.got)
        answer = await _exchange_intercepted(proxy.address.port, ca, data, connect_headers)
        if lane == "straight":
            assert general_calls == []
        proxy.runtime.deps.access_log.flush()
        lines = [_log_fields(line) for line in stream.getvalue().splitlines()]
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
            counts = _counts(await r.text())
        runs.append((b"".join(scripted.got[seen:]), answer, lines, counts))
    assert runs[0] == runs[1]
    assert runs[0][2][-1]["tenant"] == ("acme" if connect_headers else "default")
    assert runs[0][2][-1]["outcome"] == "forwarded"


@pytest.fixture
def general_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The targets of the requests the general path was asked to serve."""
    calls: list[str] = []
    serve = ProxyHandler.__call__

    async def counted(self: ProxyHandler, request: Request, responder: Responder, *args: Any, **kwargs: Any) -> None:
        calls.append(request.target)
        await serve(self, request, responder, *args, **kwargs)

    monkeypatch.setattr(ProxyHandler, "__call__", counted)
    return calls


async def _warmed(
    proxy: Any, vendor: ScriptedVendor, general_calls: list[str], stream: io.StringIO | None = None
) -> None:
    """One usual request through ``proxy`` (its store and vendor connections opened, a
    token taken), then everything it left forgotten: the vendor's record, the general
    path's calls, the access log."""
    await _exchange(proxy.address.port, REQUESTS["plain GET"])
    if stream is not None:
        proxy.runtime.deps.access_log.flush()
        stream.seek(0)
        stream.truncate()
    general_calls.clear()
    vendor.got.clear()


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_the_usual_request_never_enters_the_general_path(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str], redis_url: str, store: str
) -> None:
    policy = vendor_policy(scripted.url, store=redis_url if store == "redis" else "memory://")
    proxy = await start_proxy(policy)
    await _exchange(proxy.address.port, REQUESTS["plain GET"])  # the first opens the store's connection
    general_calls.clear()
    usual = ("plain GET", "hop-by-hop fields", "tenant and credential", "DELETE", "route (origin form)", "HEAD")
    for case in (*usual, "X-Quota-On-Limit", "a wish, spelled otherwise"):
        answer = await _exchange(proxy.address.port, REQUESTS[case])
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert general_calls == []
    # ...and what is not usual does.
    answer = await _exchange(proxy.address.port, REQUESTS["another X-Quota-* field"])
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and general_calls == [ABSOLUTE]


@pytest.mark.parametrize("case", ["plain GET", "POST with a small body"])
async def test_a_held_request_is_handed_over_with_the_stores_answer(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str], redis_url: str, case: str
) -> None:
    """The store says "wait": the general path holds it, with the reservation the straight
    path's call made (one store call, no second acquire), and sends its body whole."""
    stream = io.StringIO()
    policy = vendor_policy(
        scripted.url, store=redis_url, limits="[{rate: 1, per: 1s, burst: 2}]", on_limit="{action: hold, max_hold: 2s}"
    )
    proxy = await start_proxy(policy, access_log=AccessLog(stream))
    # The first opens the store's connection and takes a token: one is left (and less
    # than a second's refill, 1/s) when the two below come.
    await _warmed(proxy, scripted, general_calls, stream)
    first, second = await asyncio.gather(
        _exchange(proxy.address.port, REQUESTS[case]), _exchange(proxy.address.port, REQUESTS[case])
    )
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")
    proxy.runtime.deps.access_log.flush()
    outcomes = sorted(json.loads(line)["outcome"] for line in stream.getvalue().splitlines())
    assert outcomes == ["forwarded", "held"]
    assert len(general_calls) == 1  # the held one, handed over
    assert len(scripted.got) == 2 and scripted.got[0] == scripted.got[1]  # the same bytes, the body whole
    if case != "plain GET":
        assert scripted.got[0].endswith(b"\r\n\r\namount=2000&currency=usd&")


async def test_a_reload_that_renames_the_tenant_header_is_followed(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str]
) -> None:
    proxy = await start_proxy(vendor_policy(scripted.url))
    await _exchange(proxy.address.port, _request("GET", ABSOLUTE, "X-Tenant-Id: acme"))
    renamed = vendor_policy(scripted.url, extra_top="tenant: {header: X-Customer}")
    proxy.runtime.apply(renamed)
    answer = await _exchange(proxy.address.port, _request("GET", ABSOLUTE, "X-Customer: globex", "X-Tenant-Id: acme"))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    got = scripted.got[-1].lower()
    assert b"x-customer" not in got and b"x-tenant-id: acme" in got  # the new header stripped, the old one forwarded

    async with aiohttp.ClientSession() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        samples = metric_samples(await r.text())
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="globex", outcome="forwarded") == 1
    assert general_calls == []


async def test_a_worker_gone_while_the_store_answers_is_counted_once_as_gone(
    scripted: ScriptedVendor, start_proxy: Any, own_redis: Any
) -> None:
    """The worker hangs up while the straight path waits for Redis (paused): one error
    outcome, one log line, nothing sent to the vendor, the breaker not left probing."""
    stream = io.StringIO()
    policy = vendor_policy(scripted.url, store=own_redis.url, store_timeout="10s")  # gone long before it times out
    proxy = await start_proxy(policy, access_log=AccessLog(stream))
    assert (await _exchange(proxy.address.port, REQUESTS["plain GET"])).startswith(b"HTTP/1.1 200")  # connected

    def logged() -> list[str]:
        proxy.runtime.deps.access_log.flush()
        return stream.getvalue().splitlines()

    own_redis.pause()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
        writer.write(REQUESTS["plain GET"])
        await writer.drain()
        pipe = proxy.runtime.limiter.store._pipe._proto  # its acquire waits for Redis's answer
        await eventually(lambda: len(pipe._waiters) == 1, "the acquire sent")
        writer.close()
        await eventually(lambda: len(logged()) == 2, "the gone request's log line")
    finally:
        own_redis.resume()
    gone = json.loads(logged()[1])
    assert gone["outcome"] == "error" and gone["detail"] == "the worker went away"
    assert (await _exchange(proxy.address.port, REQUESTS["plain GET"])).startswith(b"HTTP/1.1 200")  # and on
    assert len(scripted.got) == 2  # the first and the last: never the one whose worker went away
    assert proxy.runtime.limiter.breaker.allow()


async def test_an_answer_the_worker_is_slow_to_take_is_finished_once_it_drains(
    scripted: ScriptedVendor, start_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport cannot take a straight answer at once (its buffer over the mark): the
    serving task waits for the worker to take it, and only then counts and logs it, and
    the connection goes on to its next request."""
    paused: list[Http1Connection] = []
    real_write = Http1Connection.write

    def write(self: Http1Connection, data: bytes) -> None:
        real_write(self, data)
        if data.startswith(b"HTTP/1.1 200") and not paused:
            self.pause_writing()  # as a transport over its high-water mark does
            paused.append(self)

    monkeypatch.setattr(Http1Connection, "write", write)
    stream = io.StringIO()
    proxy = await start_proxy(vendor_policy(scripted.url), access_log=AccessLog(stream))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    try:
        writer.write(REQUESTS["plain GET"])
        await eventually(lambda: bool(paused), "the answer written, the transport over its mark")
        proxy.runtime.deps.access_log.flush()
        assert stream.getvalue() == ""  # not counted before the worker has it
        paused[0].resume_writing()
        await _read_ok(reader)
        await eventually(lambda: (proxy.runtime.deps.access_log.flush(), stream.getvalue())[1] != "", "the log line")
        assert json.loads(stream.getvalue())["outcome"] == "forwarded"
        writer.write(REQUESTS["plain GET"])  # and the connection takes the next one
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)).startswith(b"HTTP/1.1 200 OK")
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order_whichever_path_serves_them(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str]
) -> None:
    """Three requests in one write: the first goes straight, the second (X-Quota-*) and the
    third, behind it, are the serving task's; the answers come in the order asked."""
    proxy = await start_proxy(vendor_policy(scripted.url))
    await _warmed(proxy, scripted, general_calls)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    try:
        first = _request("GET", f"http://{HOST}/v1/a")
        second = _request("GET", f"http://{HOST}/v1/b", "X-Quota-On-Limit: hold")
        third = _request("GET", f"http://{HOST}/v1/c")
        writer.write(first + second + third)
        for _ in range(3):
            await _read_ok(reader)
    finally:
        writer.close()
    assert [head.split(b" ")[1] for head in scripted.got] == [b"/v1/a", b"/v1/b", b"/v1/c"]
    assert general_calls == [f"http://{HOST}/v1/b", f"http://{HOST}/v1/c"]


def _split(data: bytes, at: int) -> list[bytes]:
    return [data[:at], data[at:]] if 0 < at < len(data) else [data]


SPLITS = [("whole", "soon")] + [
    (where, when) for where in ("after the head", "inside the body", "one byte short") for when in ("soon", "late")
]


@pytest.mark.parametrize(("where", "when"), SPLITS, ids=[f"{w}, {t}" for w, t in SPLITS])
async def test_a_small_body_split_from_its_head_reaches_the_vendor_whole(
    scripted: ScriptedVendor,
    start_proxy: Any,
    general_calls: list[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    when: str,
) -> None:
    """Many clients write a small body apart from its head. The request boards the
    straight path once the body is whole, if that is within BOARD_WAIT ("soon"); later,
    the general path takes it and streams the rest as it comes ("late"). Either way the
    vendor gets the request byte for byte, the worker its answer, and one token is taken."""
    monkeypatch.setattr(http1, "BOARD_WAIT", 60.0 if when == "soon" else 0.01)
    stream = io.StringIO()
    proxy = await start_proxy(vendor_policy(scripted.url), access_log=AccessLog(stream))
    await _warmed(proxy, scripted, general_calls, stream)
    data = REQUESTS["POST with a small body"]
    head_end = data.index(b"\r\n\r\n") + 4
    at = {"whole": 0, "after the head": head_end, "inside the body": head_end + 7, "one byte short": len(data) - 1}
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    try:
        first, *rest = _split(data, at[where])
        writer.write(first)
        await writer.drain()
        if when == "late":
            await eventually(lambda: len(general_calls) == 1, "the general path taking the request")
        for piece in rest:
            writer.write(piece)
        await _read_ok(reader)
        writer.write(data)  # and the connection takes the next one
        await _read_ok(reader)
    finally:
        writer.close()
    assert len(scripted.got) == 2 and scripted.got[0] == scripted.got[1]
    assert scripted.got[0].endswith(b"Content-Length: 25\r\n\r\namount=2000&currency=usd&")
    assert len(general_calls) == (1 if when == "late" else 0)
    proxy.runtime.deps.access_log.flush()
    assert [json.loads(line)["outcome"] for line in stream.getvalue().splitlines()] == ["forwarded"] * 2


async def test_a_worker_gone_before_its_small_body_is_whole_costs_nothing(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its head and half its body, then the worker hangs up: the request was never whole,
    so nothing reaches the vendor and no token is taken; the proxy serves on."""
    monkeypatch.setattr(http1, "BOARD_WAIT", 60.0)
    proxy = await start_proxy(vendor_policy(scripted.url, limits="[{rate: 1, per: 60s, burst: 2}]"))
    await _exchange(proxy.address.port, REQUESTS["plain GET"])  # one token of two
    scripted.got.clear()
    data = REQUESTS["POST with a small body"]
    _, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    writer.write(data[:-10])
    await writer.drain()
    served = proxy.gate._served  # the worker-side connections
    await eventually(lambda: any(not c.idle for c in served), "the head read: the connection busy with it")
    writer.close()
    await eventually(lambda: not served, "the connection closed")
    answer = await _exchange(proxy.address.port, data)  # the second token is still there
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer
    assert len(scripted.got) == 1 and general_calls == []


async def test_a_small_body_pipelined_with_the_next_request_is_answered_in_order(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str]
) -> None:
    proxy = await start_proxy(vendor_policy(scripted.url))
    await _warmed(proxy, scripted, general_calls)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    try:
        post = _request("POST", f"http://{HOST}/v1/a", "Content-Length: 5") + b"hello"
        writer.write(post + _request("GET", f"http://{HOST}/v1/b") + post.replace(b"/v1/a", b"/v1/c"))
        for _ in range(3):
            await _read_ok(reader)
    finally:
        writer.close()
    assert [got.split(b" ")[1] for got in scripted.got] == [b"/v1/a", b"/v1/b", b"/v1/c"]
    assert scripted.got[0].endswith(b"\r\n\r\nhello") and scripted.got[2].endswith(b"\r\n\r\nhello")
    assert general_calls == [f"http://{HOST}/v1/b", f"http://{HOST}/v1/c"]  # the first straight, then behind it


@pytest.mark.parametrize(
    ("fields", "retry"),
    [((), "false"), (("Idempotency-Key: k1",), "true")],
    ids=["a POST may have been processed", "with an Idempotency-Key"],
)
async def test_a_vendor_gone_after_a_small_body_says_whether_to_retry(
    start_proxy: Any, general_calls: list[str], fields: tuple[str, ...], retry: str
) -> None:
    """The vendor reads the whole request and closes without a word: it may have processed
    it, so a POST is "do not retry" unless it carries an Idempotency-Key (SPEC §9)."""
    got: list[bytes] = []

    async def rude(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        got.append(head + await reader.readexactly(5))
        writer.close()

    server = await asyncio.start_server(rude, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        proxy = await start_proxy(vendor_policy(url))
        answer = await _exchange(
            proxy.address.port, _request("POST", f"http://{HOST}/v1/charges", *fields, "Content-Length: 5") + b"hello"
        )
    finally:
        server.close()
    assert answer.startswith(b"HTTP/1.1 502 "), answer
    assert f"\r\nx-should-retry: {retry}\r\n".encode() in answer.lower()
    assert len(got) == 1 and got[0].endswith(b"\r\n\r\nhello")
    assert general_calls == [f"http://{HOST}/v1/charges"]  # handed over with the failure


async def test_an_http_1_0_worker_keeps_its_connection_only_when_it_asks(
    scripted: ScriptedVendor, start_proxy: Any, general_calls: list[str]
) -> None:
    """HTTP/1.0 clients (ApacheBench's ``-k``) keep a connection only with ``Connection:
    keep-alive``, and only while the answers say so: each straight answer does; without
    the field the answer says close and the proxy closes."""
    proxy = await start_proxy(vendor_policy(scripted.url))
    await _warmed(proxy, scripted, general_calls)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.address.port)
    try:
        for _ in range(3):
            writer.write(REQUESTS["HTTP/1.0 keep-alive"])
            head = await _read_ok(reader)
            assert b"\r\nConnection: keep-alive\r\n" in head, head
        writer.write(REQUESTS["HTTP/1.0, closes"])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert b"\r\nConnection: close\r\n" in head, head
        assert await asyncio.wait_for(reader.read(), WAIT) == OK_BODY  # then the close
    finally:
        writer.close()
    assert len(scripted.got) == 4 and general_calls == []
