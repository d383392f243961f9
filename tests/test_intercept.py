"""TLS interception (SPEC §8), end to end over real TLS.

The proxy's CA is made with ``init_ca`` in the test's tmp_path; the vendor is the
HTTPS mock vendor (its certificate from a separate trustme CA), reached upstream at
``https://localhost:PORT`` with ``tls.upstream_ca_file`` = that CA. Workers ask for
``https://api.payments.example`` through the proxy (which does not resolve: a request
that reaches the vendor came through the proxy).

Covered here: the seed's rate test over HTTPS (2 replicas sharing Redis); every
request inside one keep-alive tunnel is limited; the leaf certificate a worker sees;
a worker that does not trust the CA is counted and does not disturb others; an
upstream certificate that does not verify is a 502 and nothing is forwarded, unless
``tls.upstream_verify: false`` (which the CLI warns about at start); a vendor 429
inside a tunnel blocks the vendor fleet-wide. Real clients (requests, httpx, aiohttp,
curl) are in test_intercept_clients.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import trustme
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from proxy.devtools.mockvendor import MockVendor
from proxy.server import ProxyServer
from proxy.tls.intercept import tls_error_reason
from tests.conftest import (
    HttpsVendor,
    client_session,
    eventually,
    value,
)
from tests.helpers.intercept import HOST, URL, ProxyCA, intercept_policy, new_proxy_ca, scrape, upstream_of


@pytest.fixture
def proxy_ca(tmp_path: Path) -> ProxyCA:
    return new_proxy_ca(tmp_path)


def labelled(samples: dict[Any, float], name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return {lbl: v for (n, lbl), v in samples.items() if n == name and want <= set(lbl)}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Intercepted:
    """One raw connection to the proxy: ``CONNECT``, then TLS with the proxy's leaf, then
    HTTP/1.1 requests one after another on that same connection (keep-alive)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    sent: int = 0
    log: list[int] = field(default_factory=list)

    @classmethod
    async def open(
        cls,
        proxy: ProxyServer,
        ctx: ssl.SSLContext,
        host: str = HOST,
        connect_headers: str = "",
    ) -> Intercepted:
        reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
        writer.write(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n{connect_headers}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 "), head
        await asyncio.wait_for(writer.start_tls(ctx, server_hostname=host), 5)
        return cls(reader, writer)

    @property
    def ssl_object(self) -> ssl.SSLObject:
        obj = self.writer.get_extra_info("ssl_object")
        assert obj is not None
        return obj

    def peer_certificate(self) -> x509.Certificate:
        der = self.ssl_object.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der)

    async def request(self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> Reply:
        headers = {"Host": HOST, **(headers or {})}
        lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        if body or method in ("POST", "PUT"):
            lines.append(f"Content-Length: {len(body)}")
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        self.sent += 1
        reply = await asyncio.wait_for(self._read_reply(method), 10)
        self.log.append(reply.status)
        return reply

    async def _read_reply(self, method: str) -> Reply:
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *rest = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        status = int(status_line.split(" ")[1])
        headers: dict[str, str] = {}
        for line in rest:
            name, _, val = line.partition(":")
            headers[name.strip().lower()] = val.strip()
        if method == "HEAD" or status in (204, 304):
            return Reply(status, headers, b"")
        if "chunked" in headers.get("transfer-encoding", ""):
            body = bytearray()
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    return Reply(status, headers, bytes(body))
                body += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
        assert "content-length" in headers, headers  # a keep-alive answer must be delimited
        return Reply(status, headers, await self.reader.readexactly(int(headers["content-length"])))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 2)


def is_proxy_defer(status: int, headers: Any) -> bool:
    return status == 429 and headers.get("X-Quota-Action") == "defer"


# -- the seed's rate test, over HTTPS ------------------------------------------------------

RATE = 50.0
VENDOR_RATE = 60.0  # the vendor's own quota, above the configured one: any excess shows as 429s


@dataclass
class Tally:
    forwarded: int = 0
    deferred: int = 0
    vendor_429: int = 0
    unexpected: list[str] = field(default_factory=list)


async def paced_worker(
    s: aiohttp.ClientSession, proxy_url: str, ctx: ssl.SSLContext, stop_at: float, tally: Tally
) -> None:
    """HTTPS_PROXY-style requests back to back until ``stop_at``; on a proxy defer, wait
    X-Quota-Retry-After-Ms (the session keeps each intercepted tunnel alive)."""
    while time.monotonic() < stop_at:
        async with s.get(f"{URL}/v1/charges", proxy=proxy_url, ssl=ctx) as r:
            await r.read()
            if r.status == 200:
                tally.forwarded += 1
            elif is_proxy_defer(r.status, r.headers):
                tally.deferred += 1
                await asyncio.sleep(int(r.headers["X-Quota-Retry-After-Ms"]) / 1000)
            elif r.status == 429:
                tally.vendor_429 += 1
            else:
                tally.unexpected.append(f"{r.status} {(await r.read())[:200]!r}")


@pytest.mark.slow
async def test_aggregate_rate_holds_over_https_with_4_then_40_workers_through_2_replicas(
    https_vendor, redis_url, start_proxy, proxy_ca
):
    https_vendor.mock.configure(VENDOR_RATE, 30)
    policy = intercept_policy(
        proxy_ca,
        upstream=upstream_of(https_vendor),
        vendor_ca=https_vendor.ca_file,
        store=redis_url,
        limits=f"[{{rate: {RATE:g}, per: 1s, burst: 5}}]",
        on_limit="{action: hold, max_hold: 500ms}",
    )
    proxies = [await start_proxy(policy) for _ in range(2)]
    ctx = proxy_ca.trust()
    duration, warmup = 3.5, 0.5
    results: dict[int, tuple[float, Tally, int, int]] = {}
    async with client_session() as s:
        for workers in (4, 40):
            tally = Tally()
            accepted0, rejected0 = https_vendor.mock.accepted, https_vendor.mock.rejected
            start = time.monotonic()
            stop_at = start + duration
            await asyncio.gather(*(paced_worker(s, proxies[i % 2].url, ctx, stop_at, tally) for i in range(workers)))
            rate = https_vendor.mock.measured_rate(since=start + warmup, until=stop_at)
            results[workers] = (
                rate,
                tally,
                https_vendor.mock.accepted - accepted0,
                https_vendor.mock.rejected - rejected0,
            )

    for workers, (rate, tally, accepted, rejected) in results.items():
        summary = f"{workers} workers over HTTPS: vendor-side {rate:.2f}/s for {RATE:g}/s configured, {tally}"
        print(summary, f"vendor 429s: {rejected}")
        assert abs(rate - RATE) <= 0.05 * RATE, summary
        assert rejected == 0, summary  # the vendor, enforcing 60/s, never had to refuse
        assert tally.vendor_429 == 0 and tally.unexpected == [], summary
        assert tally.forwarded == accepted, summary  # every 200 the workers saw came from the vendor
    assert results[40][1].deferred > 0, results[40]  # 40 workers want far more than 50/s

    # Every request came through interception, none as plain HTTP; tunnels were reused.
    total = sum(accepted for _, _, accepted, _ in results.values())
    intercepted = established = 0.0
    for proxy in proxies:
        samples = await scrape(proxy)
        intercepted += value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="intercept")
        established += value(
            samples, "ratelimit_connects_total", limiter="payments", mode="intercept", result="established"
        )
        assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="plain") == 0
    assert intercepted >= total
    assert 1 <= established <= 2 * 44, established  # about one tunnel per worker, not one per request


# -- keep-alive: every request inside one tunnel is limited ---------------------------------


async def test_each_request_inside_one_keep_alive_tunnel_takes_a_token(https_vendor, start_proxy, proxy_ca):
    policy = intercept_policy(
        proxy_ca,
        upstream=upstream_of(https_vendor),
        vendor_ca=https_vendor.ca_file,
        limits="[{rate: 1, per: 1h, burst: 3}]",
        on_limit="{action: defer}",
    )
    proxy = await start_proxy(policy)
    conn = await Intercepted.open(proxy, proxy_ca.trust(), connect_headers="X-Tenant-Id: acme\r\n")
    try:
        replies = [await conn.request("GET", f"/v1/charges?i={i}", {"X-Quota-Trace": "t"}) for i in range(10)]
    finally:
        await conn.close()

    assert [r.status for r in replies] == [200] * 3 + [429] * 7
    for r in replies[:3]:
        assert "x-quota-action" not in r.headers
        assert r.json()["path"] == "/v1/charges"
    for r in replies[3:]:
        assert r.headers["x-quota-action"] == "defer"
        assert int(r.headers["retry-after"]) >= 1
        assert int(r.headers["x-quota-retry-after-ms"]) > 1000  # one token of 1/h is far away
        assert r.json()["action"] == "defer"
        assert r.headers.get("connection", "keep-alive").lower() != "close"  # the tunnel stays open
    assert https_vendor.mock.accepted == 3
    seen = https_vendor.mock.requests
    assert [r["path_qs"] for r in seen] == [f"/v1/charges?i={i}" for i in range(3)]
    for r in seen:
        assert "x-tenant-id" not in r["headers"]
        assert not [h for h in r["headers"] if h.startswith("x-quota-")], r["headers"]

    samples = await scrape(proxy)
    # One CONNECT, one TLS connection, ten limited requests inside it.
    assert labelled(samples, "ratelimit_connects_total") == {
        frozenset({("limiter", "payments"), ("mode", "intercept"), ("result", "established")}): 1.0
    }
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="intercept") == 10
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="plain") == 0
    # The tenant named on the CONNECT is the tenant of the requests inside it.
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="forwarded") == 3
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="deferred") == 7
    assert value(samples, "ratelimit_deferred_total", limiter="payments") == 7
    assert value(samples, "http_client_responses_total", limiter="payments", code="200") == 3
    async with client_session() as s, s.get(f"{proxy.admin_url}/status") as resp:
        status = await resp.json()
    (payments,) = [v for v in status["vendors"] if v["name"] == "payments"]
    assert payments["connect"] == "intercept"  # the default once tls.ca_cert is set
    assert payments["requests_by_mode"] == {"plain": 0, "intercept": 10, "tunnel": 0}


async def test_requests_inside_a_tunnel_name_their_own_tenant_and_stay_apart_from_plain_ones(
    https_vendor, start_proxy, proxy_ca
):
    policy = intercept_policy(
        proxy_ca,
        upstream=upstream_of(https_vendor),
        vendor_ca=https_vendor.ca_file,
        limits="[{rate: 100, per: 1h, burst: 100}]",
        vendor_extra="tenant_limits: {default: [{rate: 1, per: 1h, burst: 1}]}",
    )
    proxy = await start_proxy(policy)
    conn = await Intercepted.open(proxy, proxy_ca.trust())
    try:
        first = await conn.request("GET", "/v1/a", {"X-Tenant-Id": "t1"})
        again = await conn.request("GET", "/v1/a", {"X-Tenant-Id": "t1"})  # t1's one token is spent
        other = await conn.request("GET", "/v1/a", {"X-Tenant-Id": "t2"})  # t2 has its own bucket
    finally:
        await conn.close()
    assert (first.status, again.status, other.status) == (200, 429, 200)
    assert again.headers["x-quota-scope"] == "tenant"
    # A plain HTTP request beside the tunnel goes through the same limits, counted as plain.
    async with (
        client_session() as s,
        s.get(f"http://{HOST}/v1/plain", proxy=proxy.url, headers={"X-Tenant-Id": "t3"}) as r,
    ):
        assert r.status == 200
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="intercept") == 3
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="plain") == 1
    for tenant, outcome in (("t1", "forwarded"), ("t1", "deferred"), ("t2", "forwarded"), ("t3", "forwarded")):
        assert value(samples, "ratelimit_requests_total", limiter="payments", tenant=tenant, outcome=outcome) == 1
    assert [r["path_qs"] for r in https_vendor.mock.requests] == ["/v1/a", "/v1/a", "/v1/plain"]


async def test_a_tunnel_leads_to_its_vendor_only(https_vendor, start_proxy, proxy_ca):
    """Inside a tunnel to api.payments.example, an absolute-form target naming another host
    is refused, and a Host header naming another host changes nothing: never an open proxy."""
    policy = intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    proxy = await start_proxy(policy)
    conn = await Intercepted.open(proxy, proxy_ca.trust())
    try:
        foreign = await conn.request("GET", "https://elsewhere.example/v1/steal")
        same = await conn.request("GET", f"https://{HOST}/v1/absolute")
        other_host = await conn.request("GET", "/v1/host", {"Host": "elsewhere.example"})
    finally:
        await conn.close()
    assert foreign.status == 400, foreign
    assert "does not match the tunnel" in foreign.json()["detail"]
    assert (same.status, other_host.status) == (200, 200)
    assert [r["path_qs"] for r in https_vendor.mock.requests] == ["/v1/absolute", "/v1/host"]
    assert all(r["headers"]["host"] == f"localhost:{https_vendor.port}" for r in https_vendor.mock.requests)


# -- the leaf certificate the worker sees ---------------------------------------------------


async def test_the_leaf_is_for_the_host_signed_by_the_proxy_ca_short_lived_and_http11(
    https_vendor, start_proxy, proxy_ca
):
    validity = 600.0
    policy = intercept_policy(
        proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file, leaf_validity="10m"
    )
    proxy = await start_proxy(policy)
    before = dt.datetime.now(dt.UTC)
    conn = await Intercepted.open(proxy, proxy_ca.trust(alpn=["h2", "http/1.1"]))
    try:
        # ALPN: offered h2 and http/1.1, the proxy only speaks HTTP/1.1 inside the tunnel.
        assert conn.ssl_object.selected_alpn_protocol() == "http/1.1"
        leaf = conn.peer_certificate()
        ok = await conn.request("GET", "/v1/over-the-leaf")
        assert ok.status == 200 and ok.json()["path"] == "/v1/over-the-leaf"
    finally:
        await conn.close()
    after = dt.datetime.now(dt.UTC)

    ca = proxy_ca.certificate()
    leaf.verify_directly_issued_by(ca)  # signed by the proxy's CA (raises otherwise)
    assert leaf.issuer == ca.subject
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [HOST]
    assert san.get_values_for_type(x509.IPAddress) == []
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert ExtendedKeyUsageOID.SERVER_AUTH in leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # Short-lived: it ends at most leaf_validity after it was minted (and not much before).
    assert leaf.not_valid_after_utc <= after + dt.timedelta(seconds=validity + 1)
    assert leaf.not_valid_after_utc >= before + dt.timedelta(seconds=validity - 5)
    assert leaf.not_valid_before_utc <= before  # already valid (backdated for slow worker clocks)

    # A second tunnel presents the cached leaf: minted once.
    second = await Intercepted.open(proxy, proxy_ca.trust())
    try:
        assert second.peer_certificate().serial_number == leaf.serial_number
    finally:
        await second.close()
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_leaf_mint_seconds_count") == 1
    assert value(samples, "ratelimit_connects_total", limiter="payments", mode="intercept", result="established") == 2


# -- a worker that does not trust the CA ------------------------------------------------------


async def test_a_worker_that_does_not_trust_the_ca_is_counted_and_others_are_served(
    https_vendor, start_proxy, proxy_ca, tmp_path, caplog
):
    policy = intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    proxy = await start_proxy(policy)
    trusted = await Intercepted.open(proxy, proxy_ca.trust())
    try:
        assert (await trusted.request("GET", "/v1/before")).status == 200

        # curl and requests (blocking sockets: they send their alert), and an asyncio client,
        # each trusting only the vendor's CA or the system store, never the proxy's CA.
        curl = await asyncio.create_subprocess_exec(
            "curl",
            "--silent",
            "--show-error",
            "--max-time",
            "10",
            "--proxy",
            proxy.url,
            "--cacert",
            str(https_vendor.ca_file),
            f"{URL}/v1/curl",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, curl_err = await curl.communicate()
        assert curl.returncode == 60, curl_err  # "SSL certificate problem"

        def with_requests() -> str:
            import requests

            try:
                requests.get(
                    f"{URL}/v1/requests", proxies={"https": proxy.url}, verify=str(https_vendor.ca_file), timeout=10
                )
            except requests.exceptions.SSLError as exc:
                return str(exc)
            raise AssertionError("requests accepted a leaf it has no reason to trust")

        assert "CERTIFICATE_VERIFY_FAILED" in await asyncio.to_thread(with_requests)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            async with httpx.AsyncClient(proxy=proxy.url, verify=ssl.create_default_context()) as c:
                await c.get(f"{URL}/v1/httpx")

        async def counted() -> bool:
            samples = await scrape(proxy)
            return sum(labelled(samples, "ratelimit_tls_errors_total", limiter="payments").values()) >= 3

        await eventually(counted, "three failed handshakes counted")
        samples = await scrape(proxy)
        reasons = {dict(lbl)["reason"]: v for lbl, v in labelled(samples, "ratelimit_tls_errors_total").items()}
        print("tls error reasons:", reasons)
        # curl's and requests' alerts, named; the asyncio client closes without an alert.
        assert reasons == {"unknown_ca": 2, "closed_in_handshake": 1}, reasons
        assert (
            value(samples, "ratelimit_connects_total", limiter="payments", mode="intercept", result="tls-failed") == 3
        )
        assert "does it trust the proxy's CA?" in caplog.text

        # The proxy keeps serving: the open tunnel, and a new one.
        assert (await trusted.request("GET", "/v1/after")).status == 200
    finally:
        await trusted.close()
    async with httpx.AsyncClient(proxy=proxy.url, verify=proxy_ca.trust()) as c:
        assert (await c.get(f"{URL}/v1/new")).status_code == 200
    # Nothing of the failed workers reached the vendor, and they took no token.
    assert [r["path_qs"] for r in https_vendor.mock.requests] == ["/v1/before", "/v1/after", "/v1/new"]
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="intercept") == 3


def _alert(reason: str) -> ssl.SSLError:
    exc = ssl.SSLError(1, f"[SSL: {reason}] {reason.lower()}")
    exc.reason = reason  # as OpenSSL sets it
    return exc


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (_alert("TLSV1_ALERT_UNKNOWN_CA"), "unknown_ca"),  # curl, requests: they send the alert
        (_alert("SSLV3_ALERT_BAD_CERTIFICATE"), "bad_certificate"),
        # asyncio and uvloop: the worker's FIN during the handshake (Node rejecting the leaf)
        (ConnectionResetError(), "closed_in_handshake"),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), "closed_in_handshake"),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "reset"),  # a real RST
        (TimeoutError(), "timeout"),
    ],
)
def test_a_failed_handshake_is_named_after_what_the_worker_did(exc: BaseException, reason: str) -> None:
    assert tls_error_reason(exc) == reason


async def test_plain_http_inside_an_intercepted_tunnel_is_a_counted_tls_error(https_vendor, start_proxy, proxy_ca):
    policy = intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    proxy = await start_proxy(policy)
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    writer.write(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n".encode())
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
    writer.write(f"GET /v1/cleartext HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())  # no TLS
    rest = await asyncio.wait_for(reader.read(), 5)  # the proxy closes the connection promptly
    writer.close()
    assert b"/v1/cleartext" not in rest and b"HTTP/1.1 200" not in rest

    async def counted() -> bool:
        return bool(labelled(await scrape(proxy), "ratelimit_tls_errors_total", limiter="payments"))

    await eventually(counted, "the failed handshake counted")
    samples = await scrape(proxy)
    assert value(samples, "ratelimit_connects_total", limiter="payments", mode="intercept", result="tls-failed") == 1
    assert https_vendor.mock.requests == []


# -- the vendor's certificate ------------------------------------------------------------------


@dataclass
class Upstream:
    vendor: HttpsVendor
    upstream: str
    vendor_ca: Path | None
    why: str  # what the proxy's 502 detail says


async def other_name_vendor(vendor_ca: tuple[trustme.CA, Path], aiohttp_server: Any) -> HttpsVendor:
    """A vendor whose (otherwise valid) certificate names api.other.example only."""
    ca, path = vendor_ca
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.other.example").configure_cert(ctx)
    mock = MockVendor(rate=None)
    server = await aiohttp_server(mock.app(), ssl=ctx)
    return HttpsVendor(mock, f"https://127.0.0.1:{server.port}", server.port, path)


@pytest.fixture(params=["unknown-ca", "name-mismatch"])
async def bad_upstream(request, https_vendor, vendor_ca, aiohttp_server) -> Upstream:
    if request.param == "unknown-ca":  # no upstream_ca_file: the vendor's CA is in no trust store
        return Upstream(https_vendor, upstream_of(https_vendor), None, "unable to get local issuer certificate")
    vendor = await other_name_vendor(vendor_ca, aiohttp_server)
    return Upstream(vendor, upstream_of(vendor), vendor.ca_file, "Hostname mismatch")


async def test_an_upstream_certificate_that_does_not_verify_is_502_and_nothing_is_forwarded(
    bad_upstream, start_proxy, proxy_ca
):
    policy = intercept_policy(proxy_ca, upstream=bad_upstream.upstream, vendor_ca=bad_upstream.vendor_ca)
    proxy = await start_proxy(policy)
    async with httpx.AsyncClient(proxy=proxy.url, verify=proxy_ca.trust()) as c:
        r = await c.post(f"{URL}/v1/charges", content=b"amount=100", headers={"X-Tenant-Id": "acme"})
    assert r.status_code == 502
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["x-quota-error"] == "upstream-tls"
    assert "x-quota-action" not in r.headers
    body = r.json()
    assert body["error"]["type"] == "upstream_error" and body["error"]["code"] == "upstream_tls"
    assert body["limiter"] == "payments"
    assert "certificate verify failed" in body["detail"] and bad_upstream.why in body["detail"], body
    assert bad_upstream.vendor.mock.requests == []  # the TLS handshake failed: nothing was sent
    assert bad_upstream.vendor.mock.accepted == 0
    samples = await scrape(proxy)
    upstream_errors = {
        dict(lbl)["reason"]: v for lbl, v in labelled(samples, "ratelimit_tls_errors_total", limiter="payments").items()
    }
    assert upstream_errors and all(reason.startswith("upstream") for reason in upstream_errors), upstream_errors
    assert sum(upstream_errors.values()) == 1
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="acme", outcome="error") == 1


async def test_with_upstream_verify_false_the_same_request_is_forwarded(bad_upstream, start_proxy, proxy_ca):
    policy = intercept_policy(
        proxy_ca, upstream=bad_upstream.upstream, vendor_ca=bad_upstream.vendor_ca, tls_extra="upstream_verify: false"
    )
    proxy = await start_proxy(policy)
    async with httpx.AsyncClient(proxy=proxy.url, verify=proxy_ca.trust()) as c:
        r = await c.post(f"{URL}/echo", content=b"amount=100")
    assert r.status_code == 200
    assert r.content == b"amount=100"
    assert [(q["method"], q["path_qs"]) for q in bad_upstream.vendor.mock.requests] == [("POST", "/echo")]


async def test_run_warns_at_start_when_upstream_verify_is_false(
    https_vendor, vendor_ca, aiohttp_server, proxy_ca, tmp_path
):
    from tests.helpers.cli import cli, server_process

    vendor = await other_name_vendor(vendor_ca, aiohttp_server)
    config = tmp_path / "unverified.yaml"
    config.write_text(f"""\
version: 1
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
tls:
  ca_cert: {proxy_ca.cert}
  ca_key: {proxy_ca.key}
  upstream_verify: false
vendors:
  - name: payments
    hosts: [{HOST}]
    upstream: {upstream_of(vendor)}
    limits: [{{rate: 100, per: 1s}}]
""")
    with server_process(cli("run", "-c", str(config)), tmp_path) as proc:
        ready = await asyncio.to_thread(proc.wait_ready)
        assert "upstream_verify is false" in proc.stderr()  # said at start, before any request
        warning = [line for line in proc.stderr().splitlines() if "upstream_verify" in line]
        assert warning and "WARNING" in warning[0] and "NOT verified" in warning[0], warning
        # And it does what it says: a vendor whose certificate names another host is reached.
        async with httpx.AsyncClient(proxy=ready.url, verify=proxy_ca.trust()) as c:
            r = await c.get(f"{URL}/v1/unverified")
        assert r.status_code == 200, r.text
        assert vendor.mock.requests[0]["path_qs"] == "/v1/unverified"
        assert await asyncio.to_thread(proc.terminate_and_wait) == 0


# -- a vendor 429 inside a tunnel ---------------------------------------------------------------


async def test_a_vendor_429_inside_a_tunnel_blocks_the_vendor_on_every_replica(
    https_vendor, redis_url, start_proxy, proxy_ca
):
    policy = intercept_policy(
        proxy_ca,
        upstream=upstream_of(https_vendor),
        vendor_ca=https_vendor.ca_file,
        store=redis_url,
        limits="[{rate: 20, per: 1s, burst: 20}]",
        on_limit="{action: hold, max_hold: 200ms}",
    )
    a, b = [await start_proxy(policy) for _ in range(2)]
    ctx = proxy_ca.trust()
    async with httpx.AsyncClient(proxy=a.url, verify=ctx) as via_a, httpx.AsyncClient(proxy=b.url, verify=ctx) as via_b:
        assert (await via_a.get(f"{URL}/v1/warm")).status_code == 200
        assert (await via_b.get(f"{URL}/v1/warm")).status_code == 200
        https_vendor.mock.script(status=429, retry_after="1", count=1)
        vendor_429 = await via_a.get(f"{URL}/v1/charges")
        t429 = time.monotonic()
        # The vendor's own 429 reaches the worker as the vendor's: no X-Quota-Action.
        assert vendor_429.status_code == 429
        assert "x-quota-action" not in vendor_429.headers
        assert vendor_429.headers["retry-after"] == "1"
        assert vendor_429.json() == {"error": "rate_limited"}

        # The other replica defers at once, inside its own tunnel and for plain HTTP alike.
        inside = await via_b.get(f"{URL}/v1/charges")
        async with client_session() as s, s.get(f"http://{HOST}/v1/plain", proxy=b.url) as plain:
            plain_status, plain_headers = plain.status, {k.lower(): v for k, v in plain.headers.items()}
        for status, headers in ((inside.status_code, dict(inside.headers)), (plain_status, plain_headers)):
            assert status == 429 and headers["x-quota-action"] == "defer", (status, headers)
            assert int(headers["retry-after"]) >= 1
            # The block's end (1 s after the 429) plus one token of 20/s refilling from empty.
            assert 0 < int(headers["x-quota-retry-after-ms"]) <= 1100, headers
        assert len(https_vendor.mock.requests) == 3  # two warm-ups and the one that drew the 429

        # Once the vendor's Retry-After has passed, traffic resumes.
        async def through_b() -> bool:
            return (await via_b.get(f"{URL}/v1/after")).status_code == 200

        await eventually(through_b, "traffic through replica B after the block", deadline=5)
    assert [r["path_qs"] for r in https_vendor.mock.requests][3:] == ["/v1/after"]  # nothing else got through
    assert https_vendor.mock.arrivals[-1] >= t429 + 0.9  # and not before the block ended
    samples_a, samples_b = await scrape(a), await scrape(b)
    assert value(samples_a, "ratelimit_vendor_blocks_total", limiter="payments") == 1
    assert value(samples_b, "ratelimit_vendor_blocks_total", limiter="payments") == 0
    assert value(samples_b, "ratelimit_deferred_total", limiter="payments") >= 2
    assert value(samples_a, "http_client_responses_total", limiter="payments", code="429") == 1


# -- handshake edge cases ---------------------------------------------------------------------


async def test_a_worker_that_never_starts_tls_is_cut_at_the_handshake_timeout_and_counted_as_such(
    https_vendor, start_proxy, proxy_ca, monkeypatch
):
    import proxy.tls.intercept

    monkeypatch.setattr(proxy.tls.intercept, "_HANDSHAKE_TIMEOUT", 0.3)
    proxy_server = await start_proxy(
        intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    )
    reader, writer = await asyncio.open_connection(proxy_server.address.host, proxy_server.address.port)
    writer.write(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n".encode())
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # silent worker: the proxy hangs up
    waited = time.monotonic() - started
    writer.close()
    assert 0.2 <= waited < 3, waited

    async def counted() -> bool:
        return bool(labelled(await scrape(proxy_server), "ratelimit_tls_errors_total", limiter="payments"))

    await eventually(counted, "the handshake timeout counted")
    reasons = {
        dict(lbl)["reason"]: v
        for lbl, v in labelled(await scrape(proxy_server), "ratelimit_tls_errors_total", limiter="payments").items()
    }
    assert reasons == {"timeout": 1}, reasons


async def test_a_client_hello_sent_right_behind_the_connect_is_not_lost(https_vendor, start_proxy, proxy_ca):
    """Bytes that arrive in the same read as the CONNECT head (a client that pipelines its
    ClientHello) are the start of the handshake: dropping them stalls the worker."""
    proxy = await start_proxy(
        intercept_policy(proxy_ca, upstream=upstream_of(https_vendor), vendor_ca=https_vendor.ca_file)
    )
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = proxy_ca.trust().wrap_bio(incoming, outgoing, server_hostname=HOST)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    writer.write(f"CONNECT {HOST}:443 HTTP/1.1\r\nHost: {HOST}:443\r\n\r\n".encode() + outgoing.read())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    try:
        assert head.startswith(b"HTTP/1.1 200 "), head

        async def pump() -> None:
            while True:
                try:
                    tls.do_handshake()
                    return
                except ssl.SSLWantReadError:
                    writer.write(outgoing.read())
                    data = await reader.read(65536)
                    assert data, "the proxy closed the connection during the handshake"
                    incoming.write(data)

        await asyncio.wait_for(pump(), 3)  # well under the proxy's 10 s handshake timeout
        writer.write(outgoing.read())
        tls.write(f"GET /v1/pipelined HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        writer.write(outgoing.read())
        answer = b""
        while b"\r\n\r\n" not in answer:
            try:
                answer += tls.read(65536)
            except ssl.SSLWantReadError:
                data = await asyncio.wait_for(reader.read(65536), 5)
                assert data, answer
                incoming.write(data)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
    finally:
        writer.close()
    assert [r["path_qs"] for r in https_vendor.mock.requests] == ["/v1/pipelined"]
