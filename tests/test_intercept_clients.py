"""Real HTTPS clients configured the way workers are: HTTPS_PROXY in the environment and
the proxy's CA trusted, calling ``https://api.payments.example`` with unchanged code.

Each client (requests, httpx, aiohttp, curl, and Node's fetch through undici's
EnvHttpProxyAgent with NODE_EXTRA_CA_CERTS) sends a GET and a 2 MiB POST through TLS
interception: both reach the HTTPS mock vendor with the tenant and X-Quota-* headers
stripped; a vendor 429 comes back as the vendor's (no X-Quota-Action); then a proxy defer
comes back inside the tunnel as 429 + Retry-After + X-Quota-Action. The vendor's host name
does not resolve: what reaches the vendor came through the proxy.
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

from tests.conftest import curl, value
from tests.helpers.cli import PROXY_VARS, TRUST_VARS
from tests.helpers.intercept import URL, ProxyCA, intercept_policy, new_proxy_ca, scrape, upstream_of
from tests.helpers.node import NodeAnswer, NodeFailure, node_fetch, node_request

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # asserts rates or time bounds: run apart from other timed tests

BODY = bytes(range(256)) * 8192  # 2 MiB: curl sends Expect: 100-continue above 1 MiB
CLIENT_VARS = (*PROXY_VARS, *TRUST_VARS)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


@dataclass
class Worker:
    """What a worker is configured with: the proxy's URL (already in HTTPS_PROXY) and its CA."""

    proxy_url: str
    ca: ProxyCA
    tmp: Path


Client = Callable[[Worker, str, str, dict[str, str], bytes | None], Awaitable[Answer]]


def _lower(items) -> dict[str, str]:
    return {k.lower(): v for k, v in items}


async def via_requests(w: Worker, method: str, url: str, headers: dict[str, str], body: bytes | None) -> Answer:
    # Trust comes from REQUESTS_CA_BUNDLE and the proxy from HTTPS_PROXY, both in the environment.
    def call() -> Answer:
        with requests.Session() as s:
            s.trust_env = True
            r = s.request(method, url, headers=headers, data=body, timeout=20)
            return Answer(r.status_code, _lower(r.headers.items()), r.content)

    return await asyncio.to_thread(call)


async def via_httpx(w: Worker, method: str, url: str, headers: dict[str, str], body: bytes | None) -> Answer:
    async with httpx.AsyncClient(proxy=w.proxy_url, verify=w.ca.trust(), timeout=20) as c:
        r = await c.request(method, url, headers=headers, content=body)
        return Answer(r.status_code, _lower(r.headers.items()), r.content)


async def via_aiohttp(w: Worker, method: str, url: str, headers: dict[str, str], body: bytes | None) -> Answer:
    data = None if body is None else io.BytesIO(body)  # raw bytes this large draw a ResourceWarning
    async with (
        aiohttp.ClientSession(trust_env=True) as s,
        s.request(method, url, headers=headers, data=data, ssl=w.ca.trust()) as r,
    ):
        return Answer(r.status, _lower(r.headers.items()), await r.read())


async def via_curl(w: Worker, method: str, url: str, headers: dict[str, str], body: bytes | None) -> Answer:
    # No env= override: the monkeypatched os.environ (proxy variables, no no_proxy) is inherited.
    return Answer(*await curl(method, url, headers, body, w.tmp, "--cacert", str(w.ca.cert)))


async def via_node(w: Worker, method: str, url: str, headers: dict[str, str], body: bytes | None) -> Answer:
    # HTTPS_PROXY for undici's EnvHttpProxyAgent, the proxy's CA through NODE_EXTRA_CA_CERTS.
    env = {**os.environ, "NODE_EXTRA_CA_CERTS": str(w.ca.cert)}
    got = await node_request(method, url, headers, body, w.tmp, env=env)
    return Answer(got.status, got.headers, got.body)


@pytest.fixture
def proxy_ca(tmp_path: Path) -> ProxyCA:
    return new_proxy_ca(tmp_path)


CLIENTS: dict[str, Client] = {
    "requests": via_requests,
    "httpx": via_httpx,
    "aiohttp": via_aiohttp,
    "curl": via_curl,
    "node": via_node,
}


@pytest.mark.parametrize("name", list(CLIENTS))
async def test_client_through_https_proxy_with_interception(
    name, https_vendor, start_proxy, proxy_ca, monkeypatch, tmp_path
):
    client = CLIENTS[name]
    proxy = await start_proxy(
        intercept_policy(
            proxy_ca,
            upstream=upstream_of(https_vendor),
            vendor_ca=https_vendor.ca_file,
            limits="[{rate: 3, per: 1h, burst: 3}]",
            on_limit="{action: hold}",
        )
    )
    for var in CLIENT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.setenv("https_proxy", proxy.url)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(proxy_ca.cert))
    assert "NO_PROXY" not in os.environ and "no_proxy" not in os.environ
    worker = Worker(proxy.url, proxy_ca, tmp_path)
    sent = {"X-Tenant-Id": "acme", "X-Quota-On-Limit": "defer", "X-Kept": name}

    # A GET reaches the vendor over a verified TLS connection to it.
    got = await client(worker, "GET", f"{URL}/v1/charges?client={name}", sent, None)
    assert got.status == 200, got
    assert json.loads(got.body)["path"] == "/v1/charges"
    assert "x-quota-action" not in got.headers

    # A POST with a 2 MiB body reaches the vendor whole, and its echo comes back whole.
    started = time.monotonic()
    posted = await client(worker, "POST", f"{URL}/echo", sent, BODY)
    elapsed = time.monotonic() - started
    assert posted.status == 200, (posted.status, posted.headers)
    assert len(posted.body) == len(BODY)
    assert hashlib.sha256(posted.body).hexdigest() == hashlib.sha256(BODY).hexdigest()
    # A missing "100 Continue" fails conftest's curl (--expect100-timeout > --max-time); a stall of any
    # client on an answer the proxy owes it lasts until its 20 s timeout.
    assert elapsed < 10, f"{name}: the POST took {elapsed:.2f}s"

    # The vendor's own 429 is passed through as the vendor's: its Retry-After, no X-Quota-Action.
    https_vendor.mock.script(status=429, retry_after="7", count=1)
    vendor_429 = await client(worker, "GET", f"{URL}/v1/charges", sent, None)
    assert vendor_429.status == 429
    assert "x-quota-action" not in vendor_429.headers
    assert vendor_429.headers["retry-after"] == "7"
    assert json.loads(vendor_429.body) == {"error": "rate_limited"}

    seen = https_vendor.mock.requests
    assert [(r["method"], r["path_qs"]) for r in seen] == [
        ("GET", f"/v1/charges?client={name}"),
        ("POST", "/echo"),
        ("GET", "/v1/charges"),
    ]
    for r in seen:
        assert r["headers"]["x-kept"] == name
        assert "x-tenant-id" not in r["headers"]
        assert not [h for h in r["headers"] if h.startswith("x-quota-")], r["headers"]
        assert not [h for h in r["headers"] if h.startswith("proxy-")], r["headers"]
    assert seen[1]["headers"].get("content-length") == str(len(BODY)) or "chunked" in seen[1]["headers"].get(
        "transfer-encoding", ""
    ), seen[1]["headers"]

    # Now the proxy itself defers (the bucket is spent and the vendor blocked), inside the tunnel.
    deferred = await client(worker, "GET", f"{URL}/v1/charges", sent, None)
    assert deferred.status == 429
    assert deferred.headers["x-quota-action"] == "defer"
    assert deferred.headers["x-quota-limiter"] == "payments"
    assert int(deferred.headers["retry-after"]) >= 1
    assert int(deferred.headers["x-quota-retry-after-ms"]) >= 1000
    assert json.loads(deferred.body)["action"] == "defer"
    assert len(https_vendor.mock.requests) == 3

    samples = await scrape(proxy)
    # The proxy saw every request inside the tunnels, and the tenant before stripping it.
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="intercept") == 4
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="plain") == 0
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="forwarded") == 3
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="deferred") == 1
    assert value(samples, "ratelimit_vendor_blocks_total", limiter="payments") == 1
    assert value(samples, "ratelimit_connects_total", limiter="payments", mode="intercept", result="established") >= 1
    assert sum(v for (n, _), v in samples.items() if n == "ratelimit_tls_errors_total") == 0


async def test_the_environment_alone_is_enough_for_requests(https_vendor, start_proxy, proxy_ca, monkeypatch):
    """``requests.post("https://...")`` with no argument at all: HTTPS_PROXY and
    REQUESTS_CA_BUNDLE are all the worker changes."""
    proxy = await start_proxy(
        intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    )
    for var in CLIENT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(proxy_ca.cert))

    def post() -> requests.Response:
        return requests.post(f"{URL}/v1/charges", json={"amount": 100}, timeout=20)

    r = await asyncio.to_thread(post)
    assert r.status_code == 200
    assert r.json()["method"] == "POST"
    assert https_vendor.mock.requests[0]["path_qs"] == "/v1/charges"
    # And without the proxy's CA the same call fails verification: the worker's TLS is real.
    monkeypatch.delenv("REQUESTS_CA_BUNDLE")
    with pytest.raises(requests.exceptions.SSLError):
        await asyncio.to_thread(post)
    assert len(https_vendor.mock.requests) == 1


async def test_a_node_worker_that_does_not_trust_the_ca_is_counted_as_closing_in_the_handshake(
    https_vendor, start_proxy, proxy_ca, monkeypatch
):
    """Node rejects the proxy's leaf without a TLS alert: it reads the server's flight, sends
    no Finished and closes (a FIN, not a reset). The reason names that, not ``reset``."""
    proxy = await start_proxy(
        intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    )
    for var in CLIENT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)

    refused = await node_fetch("GET", f"{URL}/v1/untrusted", {}, None)  # no NODE_EXTRA_CA_CERTS
    assert isinstance(refused, NodeFailure), refused
    assert refused.code == "SELF_SIGNED_CERT_IN_CHAIN", refused
    trusted = await node_fetch(
        "GET", f"{URL}/v1/trusted", {}, None, env={**os.environ, "NODE_EXTRA_CA_CERTS": str(proxy_ca.cert)}
    )
    assert isinstance(trusted, NodeAnswer) and trusted.status == 200, trusted

    samples = await scrape(proxy)
    reasons = {
        dict(labels)["reason"]: v for (name, labels), v in samples.items() if name == "ratelimit_tls_errors_total"
    }
    assert reasons == {"closed_in_handshake": 1}, reasons
    assert value(samples, "ratelimit_connects_total", limiter="payments", mode="intercept", result="tls-failed") == 1
    assert [r["path_qs"] for r in https_vendor.mock.requests] == ["/v1/trusted"]
