"""The tenant from proxy credentials (``tenant.from: proxy_auth``, SPEC §12).

A worker configured with ``HTTP_PROXY=http://acme:SECRET@proxy:8080`` (or HTTPS_PROXY)
makes its client send ``Proxy-Authorization: Basic`` on every plain request and on each
CONNECT; the proxy takes the tenant from it and ignores the tenant header, so a worker
cannot spend another tenant's share. Missing or wrong credentials get 407 with
``Proxy-Authenticate: Basic realm="quota-proxy"`` and the proxy's JSON body; the header
never reaches a vendor, and the secret never reaches a log. Real clients (requests,
httpx, aiohttp, curl) configured only through the environment.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import requests

from proxy.server import ProxyServer
from proxy.telemetry.accesslog import AccessLog
from tests.conftest import HttpsVendor, curl, make_policy, value, vendor_policy
from tests.helpers.cli import PROXY_VARS
from tests.helpers.intercept import HOST, URL, ProxyCA, new_proxy_ca, scrape, upstream_of

SECRETS = {"acme": "acme-s3cret:with colon", "globex": "globex-secret"}
DIGESTS = {tenant: hashlib.sha256(secret.encode()).hexdigest() for tenant, secret in SECRETS.items()}
TENANT_SECTION = (
    "tenant: {from: proxy_auth, credentials: {"
    + ", ".join(f"{tenant}: {{sha256: {digest}}}" for tenant, digest in DIGESTS.items())
    + "}}"
)
TENANT_LIMITS = (
    "tenant_limits: {default: [{rate: 100, per: 1h}], "
    "overrides: {acme: [{rate: 2, per: 1h, burst: 2}], globex: [{rate: 100, per: 1h}]}}"
)
PLAIN_URL = "http://api.payments.example"
CLIENT_VARS = (*PROXY_VARS, "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")


def proxy_url(proxy: ProxyServer, tenant: str | None, secret: str | None = None) -> str:
    """``http://tenant:secret@host:port``, the user information percent-encoded as a URL needs."""
    if tenant is None:
        return proxy.url
    from urllib.parse import quote

    secret = SECRETS[tenant] if secret is None else secret
    return f"http://{quote(tenant, safe='')}:{quote(secret, safe='')}@{proxy.address}"


def basic(tenant: str, secret: str) -> str:
    """A ``Proxy-Authorization`` value, as a client builds it from ``http://tenant:secret@...``."""
    return "Basic " + base64.b64encode(f"{tenant}:{secret}".encode()).decode()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


Client = Callable[[str, dict[str, str], Path, ProxyCA | None], Awaitable[Answer]]


def _lower(items: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in items}


async def via_requests(url: str, headers: dict[str, str], tmp: Path, ca: ProxyCA | None) -> Answer:
    def call() -> Answer:
        with requests.Session() as s:
            r = s.get(url, headers=headers, timeout=20)
            return Answer(r.status_code, _lower(r.headers.items()), r.content)

    return await asyncio.to_thread(call)


async def via_httpx(url: str, headers: dict[str, str], tmp: Path, ca: ProxyCA | None) -> Answer:
    verify: Any = ca.trust() if ca is not None else True
    async with httpx.AsyncClient(trust_env=True, verify=verify, timeout=20) as c:
        r = await c.get(url, headers=headers)
        return Answer(r.status_code, _lower(r.headers.items()), r.content)


async def via_aiohttp(url: str, headers: dict[str, str], tmp: Path, ca: ProxyCA | None) -> Answer:
    ssl_ctx: Any = ca.trust() if ca is not None else True
    async with aiohttp.ClientSession(trust_env=True) as s, s.get(url, headers=headers, ssl=ssl_ctx) as r:
        return Answer(r.status, _lower(r.headers.items()), await r.read())


async def via_curl(url: str, headers: dict[str, str], tmp: Path, ca: ProxyCA | None) -> Answer:
    options = ("--cacert", str(ca.cert)) if ca is not None else ()
    return Answer(*await curl("GET", url, headers, None, tmp, *options))


CLIENTS: dict[str, Client] = {"requests": via_requests, "httpx": via_httpx, "aiohttp": via_aiohttp, "curl": via_curl}


def set_proxy(monkeypatch: pytest.MonkeyPatch, url: str, *, https: bool = False, ca: ProxyCA | None = None) -> None:
    for var in CLIENT_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTPS_PROXY", "https_proxy") if https else ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, url)
    if ca is not None:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca.cert))
    assert "NO_PROXY" not in os.environ and "no_proxy" not in os.environ


async def tenant_level(proxy: ProxyServer, tenant: str) -> float:
    runtime = proxy.runtime
    _, levels = await runtime.limiter.peek(runtime.policy.vendor("payments"), tenant)
    return levels[0]


def assert_challenge(got: Answer) -> None:
    assert got.status == 407, got
    assert got.headers["proxy-authenticate"] == 'Basic realm="quota-proxy"'
    body = json.loads(got.body)
    assert body["error"]["type"] == "forbidden" and body["error"]["code"] == "proxy_auth_required"
    assert "HTTP_PROXY=http://TENANT:SECRET@" in body["message"]
    assert got.headers["x-should-retry"] == "false"


# -- plain HTTP through HTTP_PROXY -----------------------------------------------------------


@pytest.mark.parametrize("name", list(CLIENTS))
async def test_http_proxy_credentials_name_the_tenant(name, vendor, start_proxy, monkeypatch, tmp_path) -> None:
    client = CLIENTS[name]
    log = io.StringIO()
    proxy = await start_proxy(
        vendor_policy(vendor.url, extra_top=TENANT_SECTION, tenant_limits=TENANT_LIMITS, on_limit="{action: defer}"),
        access_log=AccessLog(log),
    )
    set_proxy(monkeypatch, proxy_url(proxy, "acme"))
    # acme's worker claims to be globex: the header is ignored, acme's share is spent.
    claims_globex = {"X-Tenant-Id": "globex", "X-Kept": name}
    for i in range(2):
        got = await client(f"{PLAIN_URL}/v1/charges?i={i}", claims_globex, tmp_path, None)
        assert got.status == 200, got
    refused = await client(f"{PLAIN_URL}/v1/charges", claims_globex, tmp_path, None)
    assert refused.status == 429 and refused.headers["x-quota-scope"] == "tenant", refused
    assert "tenant acme" in json.loads(refused.body)["message"]
    assert await tenant_level(proxy, "globex") == pytest.approx(100)  # globex's share untouched

    # Wrong secret, unknown tenant, no credentials: 407, and nothing reaches the vendor.
    for url in (proxy_url(proxy, "acme", "guess"), proxy_url(proxy, "initech", "x"), proxy.url):
        set_proxy(monkeypatch, url)
        assert_challenge(await client(f"{PLAIN_URL}/v1/charges", claims_globex, tmp_path, None))

    seen = vendor.mock.requests
    assert [r["path_qs"] for r in seen] == ["/v1/charges?i=0", "/v1/charges?i=1"]
    for r in seen:
        assert r["headers"]["x-kept"] == name
        assert "proxy-authorization" not in r["headers"] and "x-tenant-id" not in r["headers"]
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="forwarded") == 2
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="deferred") == 1
    # Refused before the target is read: counted without a vendor.
    assert value(samples, "ratelimit_requests_total", limiter="none", tenant="-", outcome="denied") == 3
    await proxy.stop()
    assert SECRETS["acme"] not in log.getvalue() and "guess" not in log.getvalue()
    assert "initech" not in log.getvalue()  # a user the policy does not know is not echoed


async def test_credentials_are_checked_before_the_target(vendor, start_proxy) -> None:
    """An unauthenticated client learns nothing about which hosts are vendors."""
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=TENANT_SECTION))
    async with aiohttp.ClientSession() as s:
        for url in (f"{PLAIN_URL}/v1", "http://not-a-vendor.example/v1"):
            async with s.get(url, proxy=proxy.url) as r:
                assert r.status == 407
        async with s.get("http://not-a-vendor.example/v1", proxy=proxy_url(proxy, "acme")) as r:
            assert r.status == 403


async def test_a_route_url_needs_the_header_too(vendor, start_proxy) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=TENANT_SECTION))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{proxy.url}/payments/v1") as r:
            assert r.status == 407
        auth = {"Proxy-Authorization": basic("globex", SECRETS["globex"])}
        async with s.get(f"{proxy.url}/payments/v1", headers=auth) as r:
            assert r.status == 200
    assert "proxy-authorization" not in vendor.mock.requests[0]["headers"]


# -- HTTPS through HTTPS_PROXY, intercepted ----------------------------------------------------

INTERCEPTED = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    $tenant
    tls:
      ca_cert: $ca_cert
      ca_key: $ca_key
      upstream_ca_file: $vendor_ca
    vendors:
      - name: payments
        hosts: [$host]
        upstream: $upstream
        limits: [{rate: 1000, per: 1s}]
        on_limit: {action: defer}
        $tenant_limits
"""


@pytest.fixture
def proxy_ca(tmp_path: Path) -> ProxyCA:
    return new_proxy_ca(tmp_path)


async def intercepting_proxy(start_proxy: Any, proxy_ca: ProxyCA, vendor: HttpsVendor) -> ProxyServer:
    policy = make_policy(
        INTERCEPTED,
        tenant=TENANT_SECTION,
        ca_cert=proxy_ca.cert,
        ca_key=proxy_ca.key,
        vendor_ca=vendor.ca_file,
        host=HOST,
        upstream=upstream_of(vendor),
        tenant_limits=TENANT_LIMITS,
    )
    return await start_proxy(policy)


@pytest.mark.parametrize("name", list(CLIENTS))
async def test_connect_credentials_bind_the_intercepted_tunnel(
    name, https_vendor, start_proxy, proxy_ca, monkeypatch, tmp_path
) -> None:
    client = CLIENTS[name]
    proxy = await intercepting_proxy(start_proxy, proxy_ca, https_vendor)
    set_proxy(monkeypatch, proxy_url(proxy, "acme"), https=True, ca=proxy_ca)
    claims_globex = {"X-Tenant-Id": "globex"}
    for _ in range(2):
        assert (await client(f"{URL}/v1/charges", claims_globex, tmp_path, proxy_ca)).status == 200
    refused = await client(f"{URL}/v1/charges", claims_globex, tmp_path, proxy_ca)
    assert refused.status == 429 and "tenant acme" in json.loads(refused.body)["message"]
    assert await tenant_level(proxy, "globex") == pytest.approx(100)
    for r in https_vendor.mock.requests:
        assert not [h for h in r["headers"] if h.startswith("proxy-") or h == "x-tenant-id"], r["headers"]

    # Wrong credentials: the CONNECT is answered 407 and no tunnel opens.
    set_proxy(monkeypatch, proxy_url(proxy, "acme", "guess"), https=True, ca=proxy_ca)
    with pytest.raises(Exception) as failed:  # each client has its own error for a refused CONNECT
        await client(f"{URL}/v1/charges", {}, tmp_path, proxy_ca)
    assert "407" in str(failed.value) or "Proxy Authentication Required" in str(failed.value), repr(failed.value)
    assert len(https_vendor.mock.requests) == 2
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="forwarded") == 2
    assert value(samples, "ratelimit_requests_total", limiter="none", tenant="-", outcome="denied") == 1


# -- a blind tunnel --------------------------------------------------------------------------

TUNNELLED = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    $tenant
    vendors:
      - name: payments
        hosts: [api.payments.example]
        upstream: $upstream
        limits: [{rate: 1000, per: 1s}]
        on_limit: {action: defer}
        connect: tunnel
        $tenant_limits
"""


async def raw_connect(proxy: ProxyServer, extra: str = "") -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    try:
        authority = "api.payments.example:443"
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        body = await asyncio.wait_for(reader.readexactly(int(headers.get("Content-Length", "0"))), 5)
        return int(lines[0].split(" ")[1]), headers, body
    finally:
        writer.close()


async def test_a_blind_tunnels_token_is_the_authenticated_tenants(https_vendor, start_proxy) -> None:
    policy = make_policy(TUNNELLED, tenant=TENANT_SECTION, upstream=https_vendor.url, tenant_limits=TENANT_LIMITS)
    proxy = await start_proxy(policy)
    status, headers, body = await raw_connect(proxy, "X-Tenant-Id: globex\r\n")
    assert status == 407
    assert headers["Proxy-Authenticate"] == 'Basic realm="quota-proxy"'
    assert json.loads(body)["error"]["code"] == "proxy_auth_required"
    token = basic("acme", SECRETS["acme"])
    status, _, _ = await raw_connect(proxy, f"Proxy-Authorization: {token}\r\nX-Tenant-Id: globex\r\n")
    assert status == 200
    assert await tenant_level(proxy, "acme") == pytest.approx(1, abs=0.01)
    assert await tenant_level(proxy, "globex") == pytest.approx(100)


async def test_no_secret_in_the_logs(vendor, start_proxy, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    log = io.StringIO()
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top=TENANT_SECTION), access_log=AccessLog(log))
    async with aiohttp.ClientSession() as s:
        for secret in (SECRETS["acme"], "wrong-secret"):
            async with s.get(f"{PLAIN_URL}/v1", proxy=proxy_url(proxy, "acme", secret)) as r:
                await r.read()
    await proxy.stop()
    for text in (caplog.text, log.getvalue()):
        for secret in (SECRETS["acme"], "wrong-secret", DIGESTS["acme"]):
            assert secret not in text
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [(line["tenant"], line["status"]) for line in lines] == [("acme", 200), (None, 407)]
    assert lines[1]["detail"] == "proxy credentials not accepted"  # whether acme exists is not told
