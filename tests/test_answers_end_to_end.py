"""The proxy's own answers through a running proxy, in each dialect (SPEC §5, §9): what a
worker's SDK receives on a defer, shed, dead store, deny, 502 and 504; whether 502/504
invite a retry; answers_max_wait; the RateLimit fields on forwarded answers."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

from proxy.pipeline.answer_samples import describe
from proxy.server import ProxyServer
from tests.conftest import client_session, free_port, vendor_policy

AnswerDialect = str  # a built-in preset's name

BASE = "http://api.payments.example"
DIALECTS: tuple[AnswerDialect, ...] = ("generic", "stripe", "openai")

# (error.type, error.code) of a rate-limited answer, per dialect: what the SDK keys on.
RATE_LIMITED = {
    "generic": ("rate_limited", "deferred"),
    "stripe": ("invalid_request_error", "rate_limit"),
    "openai": ("requests", "rate_limit_exceeded"),
}


async def call(proxy: ProxyServer, path: str, method: str = "GET", **headers: str) -> tuple[int, Any, dict[str, Any]]:
    async with (
        client_session() as s,
        s.request(method, BASE + path, proxy=proxy.url, headers=headers, data=b"x" if method == "POST" else None) as r,
    ):
        return r.status, r.headers, await r.json(content_type=None)


def check_retry(dialect: AnswerDialect, headers: Any, retry: bool) -> None:
    """The retry verdict, in the headers this dialect's SDK obeys."""
    flag = "true" if retry else "false"
    assert headers["x-should-retry"] == flag
    if dialect == "openai":
        assert "Stripe-Should-Retry" not in headers
    else:  # generic speaks Stripe's too: its SDK retries every 5xx it is not told otherwise
        assert headers["Stripe-Should-Retry"] == flag


def check_body(body: dict[str, Any]) -> None:
    """SPEC §5: ``error`` is an object; the sentence is there twice."""
    assert isinstance(body["error"], dict)
    assert isinstance(body["message"], str) and body["message"]
    assert body["error"]["message"] == body["message"]


def limited(dialect: AnswerDialect, *, on_limit: str, extra: str = "", store: str = "memory://") -> Any:
    return vendor_policy(
        "http://127.0.0.1:1",  # never reached: one token, then refusals
        store=store,
        limits="[{rate: 1, per: 1h, burst: 1}]",
        on_limit=on_limit,
        extra_vendor=f"answers: {dialect}\n            {extra}",
    )


# -- rate limited ------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_defer(dialect: AnswerDialect, vendor: Any, start_proxy: Any) -> None:
    policy = vendor_policy(
        vendor.url,
        limits="[{rate: 10, per: 1s, burst: 1}]",
        on_limit="{action: defer}",
        extra_vendor=f"answers: {dialect}",
    )
    proxy = await start_proxy(policy)
    assert (await call(proxy, "/ok"))[0] == 200
    status, headers, body = await call(proxy, "/deferred")
    assert status == 429
    check_body(body)
    assert (body["error"]["type"], body["error"]["code"]) == RATE_LIMITED[dialect]
    check_retry(dialect, headers, retry=True)
    assert headers["X-Quota-Action"] == "defer" and body["action"] == "defer"
    assert 0 < int(headers["X-Quota-Retry-After-Ms"]) <= int(headers["retry-after-ms"]) <= 1000
    assert headers["Retry-After"] == "1" and body["retry_after"] == 1
    assert body["retry_after_ms"] == int(headers["retry-after-ms"])
    assert body["message"].startswith("payments is over its quota (global 10/1s burst 1); retry in ")
    # The proxy's own 429 describes the bucket that refused: empty, full again within a second.
    assert headers["RateLimit-Policy"] == '"quota-proxy-global-10-1s";q=10;w=1'
    assert headers["RateLimit"] == '"quota-proxy-global-10-1s";r=0;t=1'
    assert vendor.mock.accepted == 1


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_check_answers_shows_a_defer_as_a_real_one_is(
    dialect: AnswerDialect, vendor: Any, start_proxy: Any
) -> None:
    """``check --answers``' sample defer has the real one's fields, bucket and RateLimit items."""
    policy = vendor_policy(
        vendor.url,
        # 2/s: the second call is refused unless the machine takes half a second between the two
        # (at 80/s the bucket refilled in 12.5 ms, and a busy suite let it: a 200).
        limits="[{rate: 2, per: 1s, burst: 1}, {rate: 4000, per: 1m}]",
        on_limit="{action: defer}",
        extra_vendor=f"answers: {dialect}",
    )
    proxy = await start_proxy(policy)
    assert (await call(proxy, "/ok"))[0] == 200
    status, headers, body = await call(proxy, "/deferred")
    assert status == 429 and body["bucket"] == "global 2/1s burst 1"
    sampled = describe(policy.vendors[0]).split("  defer (", 1)[1].split("\n  long defer (", 1)[0]
    head, _, text = sampled.partition("\n    \n")
    names = [line.strip().split(":", 1)[0] for line in head.splitlines()[2:]]
    real = [name for name in headers if name not in ("Content-Length", "Date", "Server", "Connection")]
    assert sorted(names) == sorted(real), sampled
    assert f"RateLimit-Policy: {headers['RateLimit-Policy']}" in head
    assert f"RateLimit: {headers['RateLimit']}" in head
    sample_body = json.loads(text)
    assert sample_body.keys() == body.keys()
    assert sample_body["bucket"] == body["bucket"] and sample_body["limiter"] == body["limiter"]


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_shed(dialect: AnswerDialect, start_proxy: Any) -> None:
    proxy = await start_proxy(limited(dialect, on_limit="{action: shed}"))
    await call(proxy, "/spent")  # the one token (the vendor is unreachable: 502)
    status, headers, body = await call(proxy, "/shed")
    assert status == 503
    check_body(body)
    check_retry(dialect, headers, retry=False)
    assert body["action"] == "shed" and headers["X-Quota-Action"] == "shed"
    for name in ("Retry-After", "retry-after-ms", "X-Quota-Retry-After-Ms"):
        assert name not in headers


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_defer_too_long_to_sit_out_says_do_not_retry(dialect: AnswerDialect, start_proxy: Any) -> None:
    proxy = await start_proxy(limited(dialect, on_limit="{action: defer}", extra="answers_max_wait: 30s"))
    await call(proxy, "/spent")
    status, headers, body = await call(proxy, "/deferred")
    assert status == 429
    check_retry(dialect, headers, retry=False)  # an hour: re-enqueue rather than block a worker
    assert (body["error"]["type"], body["error"]["code"]) == RATE_LIMITED[dialect]
    assert int(headers["Retry-After"]) > 3500 and body["retry_after"] == int(headers["Retry-After"])
    assert body["message"].endswith("(longer than one call should wait: re-enqueue the job)")


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_dead_store_failing_closed(dialect: AnswerDialect, start_proxy: Any) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proxy = await start_proxy(limited(dialect, on_limit="{action: defer}", store=dead))
    status, headers, body = await call(proxy, "/x")
    assert status == 429
    check_body(body)
    check_retry(dialect, headers, retry=True)
    assert headers["X-Quota-Reason"] == "store-unavailable" and body["reason"] == "store-unavailable"
    assert headers["X-Quota-Action"] == "defer"
    assert int(headers["retry-after-ms"]) >= 1 and int(headers["Retry-After"]) >= 1
    assert "quota store is unavailable" in body["message"]
    assert headers["RateLimit"].endswith(";r=0;t=1")
    if dialect != "generic":
        assert (body["error"]["type"], body["error"]["code"]) == RATE_LIMITED[dialect]
    else:
        assert (body["error"]["type"], body["error"]["code"]) == ("rate_limited", "store_unavailable")


# -- denied ------------------------------------------------------------------------------


async def raw_connect(proxy: ProxyServer, authority: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    try:
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode("latin-1")
        lines = head.split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if line)}
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
        return int(lines[0].split(" ")[1]), headers, json.loads(body)
    finally:
        writer.close()


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_deny(dialect: AnswerDialect, start_proxy: Any) -> None:
    # Without a CA, CONNECT to the vendor is denied (connect: deny): its dialect answers.
    proxy = await start_proxy(limited(dialect, on_limit="{action: defer}"))
    status, headers, body = await raw_connect(proxy, "api.payments.example:443")
    assert status == 403
    check_body(body)
    assert headers["x-should-retry"] == "false" and headers["x-quota-action"] == "deny"
    assert headers.get("stripe-should-retry") == (None if dialect == "openai" else "false")
    expected = {"generic": "forbidden", "stripe": "invalid_request_error", "openai": "invalid_request_error"}
    assert body["error"]["type"] == expected[dialect] and body["error"]["code"] == "denied"
    assert "connect: deny" in body["message"]


async def test_a_host_in_no_vendor_is_denied_in_the_generic_dialect(start_proxy: Any) -> None:
    proxy = await start_proxy(limited("stripe", on_limit="{action: defer}"))
    async with client_session() as s, s.get("http://elsewhere.example/v1", proxy=proxy.url) as r:
        assert r.status == 403
        body = await r.json()
    assert body["error"]["type"] == "forbidden" and r.headers["Stripe-Should-Retry"] == "false"


# -- the vendor fails: 502 / 504, retried only when it is safe --------------------------


@pytest.fixture
async def silent_vendor() -> AsyncIterator[str]:
    """A vendor that accepts connections, reads the request and never answers."""
    release = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    release.set()
    server.close()


@pytest.fixture
def unaccepting_vendor() -> Iterator[str]:
    """A port whose accept queue is full: a connection attempt hangs (its SYN is dropped)
    until the proxy's connect timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(2):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    yield f"http://127.0.0.1:{port}"
    for s in (*fillers, listener):
        s.close()


def failing(upstream: str, dialect: AnswerDialect) -> Any:
    return vendor_policy(
        upstream,
        extra_vendor=f"answers: {dialect}\n            timeouts: {{connect: 300ms, read: 300ms}}",
    )


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(
    ("method", "headers", "retry"),
    [
        ("POST", {}, False),  # the vendor may be processing it: never resend a payment
        ("POST", {"Idempotency-Key": "charge-42"}, True),  # the vendor deduplicates it
        ("GET", {}, True),
    ],
)
async def test_a_vendor_that_never_answers_is_504(
    dialect: AnswerDialect,
    method: str,
    headers: dict[str, str],
    retry: bool,
    silent_vendor: str,
    start_proxy: Any,
) -> None:
    proxy = await start_proxy(failing(silent_vendor, dialect))
    status, answer_headers, body = await call(proxy, "/v1/charges", method, **headers)
    assert status == 504
    check_body(body)
    check_retry(dialect, answer_headers, retry)
    assert body["error"]["code"] == "upstream_timeout"
    assert answer_headers["X-Quota-Error"] == "upstream-timeout"
    assert "X-Quota-Action" not in answer_headers and "Retry-After" not in answer_headers


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_refused_connection_is_a_502_safe_to_retry_even_for_a_post(
    dialect: AnswerDialect, start_proxy: Any
) -> None:
    proxy = await start_proxy(failing(f"http://127.0.0.1:{free_port()}", dialect))
    status, headers, body = await call(proxy, "/v1/charges", "POST")
    assert status == 502
    check_body(body)
    check_retry(dialect, headers, retry=True)  # the request never left the proxy
    assert body["error"]["code"] == "upstream_unreachable"
    expected = {"generic": "upstream_error", "stripe": "api_error", "openai": "server_error"}
    assert body["error"]["type"] == expected[dialect]


async def test_a_connect_timeout_is_a_504_safe_to_retry_even_for_a_post(
    unaccepting_vendor: str, start_proxy: Any
) -> None:
    proxy = await start_proxy(failing(unaccepting_vendor, "stripe"))
    status, headers, body = await call(proxy, "/v1/charges", "POST")
    assert status == 504
    check_retry("stripe", headers, retry=True)
    assert body["error"]["code"] == "upstream_timeout"
    assert body["message"] == "payments did not accept a connection in time: the request was not sent (safe to retry)"


# -- RateLimit fields on forwarded answers ------------------------------------------------


@pytest.fixture
async def quota_vendor(aiohttp_server: Any) -> str:
    """A vendor that sends the RateLimit field given in the ``rl`` query parameter, if any."""

    async def handle(request: web.Request) -> web.Response:
        rl = request.query.get("rl")
        return web.json_response({"ok": True}, headers={"RateLimit": rl} if rl else None)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def forwarded(proxy: ProxyServer, vendor_says: str | None = None) -> tuple[list[str], list[str]]:
    params = {"rl": vendor_says} if vendor_says else None
    async with client_session() as s, s.get(BASE + "/v1/x", proxy=proxy.url, params=params) as r:
        assert r.status == 200
        return r.headers.getall("RateLimit-Policy", []), r.headers.getall("RateLimit", [])


async def test_forwarded_answers_describe_the_tightest_bucket(quota_vendor: str, start_proxy: Any) -> None:
    policy = vendor_policy(
        quota_vendor,
        limits="[{rate: 100, per: 1s, burst: 10}, {rate: 4000, per: 1m}]",
        tenant_limits="tenant_limits: {default: [{rate: 20, per: 1s, burst: 20}]}",
        extra_vendor="ratelimit_headers: true",
    )
    proxy = await start_proxy(policy)
    policies, limits = await forwarded(proxy)
    # The global 100/1s burst 10 is the tightest: 9 whole tokens left after this request.
    assert policies == ['"quota-proxy-global-100-1s";q=100;w=1']
    assert limits == ['"quota-proxy-global-100-1s";r=9;t=1']


async def test_the_vendors_fields_pass_through_and_the_proxy_adds_only_a_tighter_item(
    quota_vendor: str, start_proxy: Any
) -> None:
    proxy = await start_proxy(
        vendor_policy(quota_vendor, limits="[{rate: 5, per: 1s}]", extra_vendor="ratelimit_headers: true")
    )
    # The vendor says 2 remain: fewer than the proxy's 4, so its field stands alone.
    assert await forwarded(proxy, '"vendor";r=2;t=10') == ([], ['"vendor";r=2;t=10'])
    # The vendor says 500 remain: the proxy's bucket is tighter, its item goes beside the vendor's.
    policies, limits = await forwarded(proxy, '"vendor";r=500;t=10')
    assert limits[0] == '"vendor";r=500;t=10'
    assert policies == ['"quota-proxy-global-5-1s";q=5;w=1']
    assert len(limits) == 2 and limits[1].startswith('"quota-proxy-global-5-1s";r=')


async def test_without_ratelimit_headers_forwarded_answers_are_the_vendors(quota_vendor: str, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(quota_vendor))
    assert await forwarded(proxy) == ([], [])
    assert await forwarded(proxy, '"vendor";r=500;t=10') == ([], ['"vendor";r=500;t=10'])
