"""Real HTTP clients configured the way workers are: only through the HTTP_PROXY environment.

Each client (requests, httpx, aiohttp, curl, and Node's fetch through undici's
EnvHttpProxyAgent) sends a GET and a 2 MiB POST that must reach
the vendor through the in-process proxy with the tenant and X-Quota-* headers stripped,
then sees a proxy defer as 429 + Retry-After + X-Quota-Action, and a 403 for a host no
vendor owns. ``api.payments.example`` does not resolve: the vendor is only reachable
through the proxy, so a request that arrives there came through it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import pytest
import requests

from tests.conftest import curl, vendor_policy
from tests.helpers.cli import PROXY_VARS
from tests.helpers.node import node_request

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # asserts rates or time bounds: run apart from other timed tests

VENDOR_URL = "http://api.payments.example"
FOREIGN_URL = "http://not-a-vendor.example/v1/anything"
BODY = bytes(range(256)) * 8192  # 2 MiB: curl sends Expect: 100-continue above 1 MiB


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    seconds: float = 0.0


Client = Callable[[str, str, dict[str, str], bytes | None, Path], Awaitable[Answer]]


def _lower(items) -> dict[str, str]:
    return {k.lower(): v for k, v in items}


async def via_requests(method: str, url: str, headers: dict[str, str], body: bytes | None, tmp: Path) -> Answer:
    def call() -> Answer:
        with requests.Session() as s:
            s.trust_env = True
            r = s.request(method, url, headers=headers, data=body, timeout=20)
            return Answer(r.status_code, _lower(r.headers.items()), r.content)

    return await asyncio.to_thread(call)


async def via_httpx(method: str, url: str, headers: dict[str, str], body: bytes | None, tmp: Path) -> Answer:
    async with httpx.AsyncClient(trust_env=True, timeout=20) as c:
        r = await c.request(method, url, headers=headers, content=body)
        return Answer(r.status_code, _lower(r.headers.items()), r.content)


async def via_aiohttp(method: str, url: str, headers: dict[str, str], body: bytes | None, tmp: Path) -> Answer:
    data = None if body is None else io.BytesIO(body)  # raw bytes this large draw a ResourceWarning
    async with aiohttp.ClientSession(trust_env=True) as s, s.request(method, url, headers=headers, data=data) as r:
        return Answer(r.status, _lower(r.headers.items()), await r.read())


async def via_curl(method: str, url: str, headers: dict[str, str], body: bytes | None, tmp: Path) -> Answer:
    # No env= override: the monkeypatched os.environ (proxy variables, no no_proxy) is inherited.
    return Answer(*await curl(method, url, headers, body, tmp))


async def via_node(method: str, url: str, headers: dict[str, str], body: bytes | None, tmp: Path) -> Answer:
    # undici's EnvHttpProxyAgent reads the monkeypatched HTTP_PROXY; Node's built-in fetch would not.
    got = await node_request(method, url, headers, body, tmp)
    return Answer(got.status, got.headers, got.body)


CLIENTS: dict[str, Client] = {
    "requests": via_requests,
    "httpx": via_httpx,
    "aiohttp": via_aiohttp,
    "curl": via_curl,
    "node": via_node,
}


@pytest.mark.parametrize("name", list(CLIENTS))
async def test_client_through_http_proxy(name, vendor, start_proxy, monkeypatch, tmp_path):
    client = CLIENTS[name]
    proxy = await start_proxy(
        vendor_policy(vendor.url, limits="[{rate: 2, per: 1h, burst: 2}]", on_limit="{action: defer}")
    )
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)  # curl reads only the lower-case one
    assert "NO_PROXY" not in os.environ and "no_proxy" not in os.environ
    sent = {"X-Tenant-Id": "acme", "X-Quota-On-Limit": "defer", "X-Kept": name}

    # A GET reaches the vendor.
    got = await client("GET", f"{VENDOR_URL}/v1/charges?client={name}", sent, None, tmp_path)
    assert got.status == 200, got
    assert json.loads(got.body)["path"] == "/v1/charges"
    assert "x-quota-action" not in got.headers

    # A POST with a 2 MiB body reaches the vendor whole, and its echo comes back whole.
    started = time.monotonic()
    posted = await client("POST", f"{VENDOR_URL}/echo", sent, BODY, tmp_path)
    elapsed = time.monotonic() - started
    assert posted.status == 200, (posted.status, posted.headers)
    assert hashlib.sha256(posted.body).hexdigest() == hashlib.sha256(BODY).hexdigest()
    assert len(posted.body) == len(BODY)
    # A missing "100 Continue" fails conftest's curl (--expect100-timeout > --max-time); a stall of any
    # client on an answer the proxy owes it lasts until its 20 s timeout.
    assert elapsed < 10, f"{name}: the POST took {elapsed:.2f}s"

    seen = vendor.mock.requests
    assert [(r["method"], r["path_qs"]) for r in seen] == [("GET", f"/v1/charges?client={name}"), ("POST", "/echo")]
    for r in seen:
        assert r["headers"]["x-kept"] == name
        assert "x-tenant-id" not in r["headers"]
        assert not [h for h in r["headers"] if h.startswith("x-quota-")], r["headers"]
        assert "proxy-connection" not in r["headers"]
    assert seen[1]["headers"].get("content-length") == str(len(BODY)) or "chunked" in seen[1]["headers"].get(
        "transfer-encoding", ""
    ), seen[1]["headers"]
    forwarded = proxy.runtime.registry.get_sample_value(
        "ratelimit_requests_total", {"limiter": "payments", "tenant": "acme", "outcome": "forwarded"}
    )
    assert forwarded == 2  # the proxy saw the tenant before stripping it

    # The bucket (2 per hour) is empty: the proxy defers, and the client sees it as such.
    deferred = await client("GET", f"{VENDOR_URL}/v1/charges", sent, None, tmp_path)
    assert deferred.status == 429
    assert deferred.headers["x-quota-action"] == "defer"
    assert int(deferred.headers["retry-after"]) >= 1
    assert int(deferred.headers["x-quota-retry-after-ms"]) >= 1000
    assert json.loads(deferred.body)["action"] == "defer"
    assert len(vendor.mock.requests) == 2

    # A host no vendor owns: 403, never forwarded anywhere.
    denied = await client("GET", FOREIGN_URL, {}, None, tmp_path)
    assert denied.status == 403
    assert denied.headers["x-quota-action"] == "deny"
    assert json.loads(denied.body)["action"] == "deny"
    assert len(vendor.mock.requests) == 2
