"""CONNECT (HTTPS_PROXY): deny, wrong port, malformed, and blind tunnels with their token
and concurrency cap. Interception has its own file (test_intercept.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl

import httpx
import pytest

from proxy.server import ProxyServer
from proxy.tls.blind_tunnel import BlindTunnels
from tests.conftest import HttpsVendor, client_session, eventually, make_policy, metric_samples, value

TUNNEL_POLICY = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    vendors:
      - name: payments
        hosts: [api.payments.example]
        upstream: $upstream
        limits: [{rate: 1, per: 1h, burst: $burst}]
        on_limit: {action: defer}
        connect: tunnel
        max_tunnels: $max_tunnels
      - name: closed
        hosts: [api.closed.example, "api.ported.example:8443"]
        limits: [{rate: 100, per: 1s}]
        connect: deny
"""


async def tunnel_proxy(start_proxy, vendor: HttpsVendor, *, burst: int = 100, max_tunnels: int = 10) -> ProxyServer:
    policy = make_policy(TUNNEL_POLICY, upstream=vendor.url, burst=burst, max_tunnels=max_tunnels)
    return await start_proxy(policy)


async def raw_connect(
    proxy: ProxyServer, authority: str, extra: str = ""
) -> tuple[int, dict[str, str], bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a CONNECT and read the proxy's answer head (and body, if it sends one)."""
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{extra}\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    body = b""
    if "Content-Length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["Content-Length"])), 5)
    return status, headers, body, reader, writer


def vendor_trust(vendor: HttpsVendor) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(vendor.ca_file))


@pytest.mark.parametrize(
    ("authority", "why"),
    [
        ("elsewhere.example:443", "no vendor"),
        ("api.closed.example:443", "connect: deny"),
        ("api.payments.example:8443", "no vendor"),  # the vendor's port is 443
        ("api.ported.example:443", "no vendor"),  # listed with its own port, 8443
    ],
)
async def test_connects_that_are_denied(https_vendor, start_proxy, authority: str, why: str) -> None:
    proxy = await tunnel_proxy(start_proxy, https_vendor)
    status, headers, body, reader, writer = await raw_connect(proxy, authority)
    assert status == 403
    assert headers["X-Quota-Action"] == "deny"
    assert why in json.loads(body)["detail"]
    assert await asyncio.wait_for(reader.read(), 5) == b""  # and the connection is closed
    writer.close()
    assert https_vendor.mock.accepted == 0


async def test_a_deny_vendor_is_told_how_to_reach_it(https_vendor, start_proxy) -> None:
    proxy = await tunnel_proxy(start_proxy, https_vendor)
    _, _, body, _, writer = await raw_connect(proxy, "api.ported.example:8443")
    writer.close()
    assert "upstream: https://" in json.loads(body)["detail"]


@pytest.mark.parametrize(
    ("authority", "shown"),
    [
        ("api.closed.example:443", "403 CONNECT denied by policy (connect: deny)"),
        ("elsewhere.example:443", "403 CONNECT denied: no vendor in the policy has this host and port"),
    ],
)
async def test_requests_and_httpx_show_why_a_connect_was_refused(
    https_vendor, start_proxy, authority: str, shown: str
) -> None:
    """They never read a refused CONNECT's body: the status line carries the reason."""
    import requests

    proxy = await tunnel_proxy(start_proxy, https_vendor)
    url = f"https://{authority.removesuffix(':443')}/v1/x"

    def with_requests() -> str:
        try:
            requests.get(url, proxies={"https": proxy.url}, timeout=5)
        except requests.exceptions.ProxyError as exc:
            return str(exc)
        return "no error"

    assert shown in await asyncio.to_thread(with_requests)
    async with httpx.AsyncClient(proxy=proxy.url, timeout=5) as client:
        with pytest.raises(httpx.ProxyError) as raised:
            await client.get(url)
    assert shown.split(" ", 1)[1] in str(raised.value)


@pytest.mark.parametrize("authority", ["api.payments.example", "user@api.payments.example:443", "[::1:443"])
async def test_malformed_connect_targets_are_400(https_vendor, start_proxy, authority: str) -> None:
    proxy = await tunnel_proxy(start_proxy, https_vendor)
    status, _, _, _, writer = await raw_connect(proxy, authority)
    writer.close()
    assert status == 400


async def test_tunnel_carries_tls_end_to_end_with_one_token_per_connect(https_vendor, start_proxy) -> None:
    proxy = await tunnel_proxy(start_proxy, https_vendor, burst=2)
    # One tunnel, kept alive: many requests inside cost the one token of the CONNECT.
    async with httpx.AsyncClient(proxy=proxy.url, verify=vendor_trust(https_vendor)) as client:
        for i in range(5):
            r = await client.get(f"https://api.payments.example/v1/x?i={i}", headers={"X-Tenant-Id": "acme"})
            assert r.status_code == 200
            assert r.json()["path"] == "/v1/x"
    # The proxy never saw the requests: the vendor did, tenant header and all (blind bytes).
    assert https_vendor.mock.accepted == 5
    assert https_vendor.mock.requests[0]["headers"]["x-tenant-id"] == "acme"
    # A second tunnel takes the second token; the third CONNECT is deferred.
    async with httpx.AsyncClient(proxy=proxy.url, verify=vendor_trust(https_vendor)) as client:
        assert (await client.get("https://api.payments.example/v1/y")).status_code == 200
    status, headers, body, _, writer = await raw_connect(proxy, "api.payments.example:443")
    writer.close()
    assert status == 429
    assert headers["X-Quota-Action"] == "defer"
    assert int(headers["Retry-After"]) >= 1
    assert json.loads(body)["action"] == "defer"
    async with client_session() as s, s.get(f"{proxy.admin_url}/metrics") as resp:
        samples = metric_samples(await resp.text())
    assert value(samples, "ratelimit_connects_total", limiter="payments", mode="tunnel", result="established") == 2
    assert value(samples, "ratelimit_requests_by_mode_total", limiter="payments", mode="tunnel") == 2
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="deferred") == 1


async def test_concurrent_tunnels_are_capped_per_vendor(https_vendor, start_proxy) -> None:
    proxy = await tunnel_proxy(start_proxy, https_vendor, max_tunnels=2)
    first = await raw_connect(proxy, "api.payments.example:443")
    second = await raw_connect(proxy, "api.payments.example:443")
    assert first[0] == second[0] == 200
    status, _headers, body, _, writer = await raw_connect(proxy, "api.payments.example:443")
    writer.close()
    assert status == 429
    assert "max_tunnels" in json.loads(body)["bucket"]
    assert proxy.gate.tunnels.count("payments") == 2
    first[4].close()
    await eventually(lambda: proxy.gate.tunnels.count("payments") == 1, "the closed tunnel to be released")
    third = await raw_connect(proxy, "api.payments.example:443")
    assert third[0] == 200
    for conn in (second, third):
        conn[4].close()
    await eventually(lambda: proxy.gate.tunnels.count("payments") == 0, "every tunnel to be released")
    async with client_session() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        samples = metric_samples(await r.text())
    assert value(samples, "ratelimit_tunnels_open", limiter="payments") == 0


IDLE_TUNNEL_POLICY = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    connections: {idle_timeout: 300ms}
    vendors:
      - name: payments
        hosts: [api.payments.example]
        upstream: $upstream
        limits: [{rate: 1, per: 1h, burst: 2}]
        on_limit: {action: defer}
        timeouts: {connect: 1s, read: 400ms}
        connect: tunnel
"""


async def test_a_silent_tunnel_is_closed_and_a_busy_one_is_not(https_vendor, start_proxy) -> None:
    # A blind tunnel holds a tunnel slot and a concurrency lease for as long as it is open:
    # no bytes either way for longer than the vendor's read timeout (and the connections'
    # idle_timeout) means no exchange is waiting in it, and it is closed, slot and lease freed.
    proxy = await start_proxy(make_policy(IDLE_TUNNEL_POLICY, upstream=https_vendor.url))
    status, _, _, reader, writer = await raw_connect(proxy, "api.payments.example:443")
    assert status == 200
    loop = asyncio.get_running_loop()
    opened = loop.time()
    assert await asyncio.wait_for(reader.read(), 5) == b"", "the proxy closed the silent tunnel"
    assert 0.4 <= loop.time() - opened < 3
    writer.close()
    await eventually(lambda: proxy.gate.tunnels.count("payments") == 0, "its slot to be freed")

    # The second (and last) token: a tunnel kept busy past the bound stays open, so every
    # request rides it (a reconnect would be deferred: no token left).
    async with httpx.AsyncClient(proxy=proxy.url, verify=vendor_trust(https_vendor)) as client:
        for i in range(8):
            r = await client.get(f"https://api.payments.example/v1/x?i={i}")
            assert r.status_code == 200
            await asyncio.sleep(0.15)  # the pace of the traffic under test, not a synchronisation
    assert https_vendor.mock.accepted == 8


async def test_a_tunnel_to_an_unreachable_vendor_is_502(start_proxy) -> None:
    from tests.conftest import free_port

    policy = make_policy(TUNNEL_POLICY, upstream=f"https://127.0.0.1:{free_port()}", burst=5, max_tunnels=5)
    proxy = await start_proxy(policy)
    status, headers, body, _, writer = await raw_connect(proxy, "api.payments.example:443")
    writer.close()
    assert status == 502
    assert json.loads(body)["error"]["code"] == "upstream_unreachable"
    assert headers["x-should-retry"] == "true"  # nothing went through the tunnel
    assert proxy.gate.tunnels.count("payments") == 0


async def test_plain_requests_still_work_beside_connect(https_vendor, vendor, start_proxy) -> None:
    policy = make_policy(TUNNEL_POLICY, upstream=vendor.url, burst=5, max_tunnels=5)
    proxy = await start_proxy(policy)
    async with client_session() as s, s.get("http://api.payments.example/v1/plain", proxy=proxy.url) as r:
        assert r.status == 200
    assert vendor.mock.requests[0]["path_qs"] == "/v1/plain"


async def test_the_cap_counts_connects_still_held_for_their_token(https_vendor, start_proxy) -> None:
    # 5/s with a burst of 1: the second and third CONNECTs are held 0.2 s and 0.4 s for
    # their tokens. The cap of 2 must count the held one, not only tunnels already open.
    policy = make_policy(
        TUNNEL_POLICY.replace("{action: defer}", "{action: hold, max_hold: 1s}").replace(
            "rate: 1, per: 1h", "rate: 5, per: 1s"
        ),
        upstream=https_vendor.url,
        burst=1,
        max_tunnels=2,
    )
    proxy = await start_proxy(policy)
    answers = await asyncio.gather(*(raw_connect(proxy, "api.payments.example:443") for _ in range(4)))
    statuses = sorted(a[0] for a in answers)
    assert statuses == [200, 200, 429, 429]
    assert proxy.gate.tunnels.count("payments") == 2
    for a in answers:
        a[4].close()
    await eventually(lambda: proxy.gate.tunnels.count("payments") == 0, "every tunnel to be released")


async def test_a_bug_while_answering_a_connect_cuts_it_and_counts_an_error(
    https_vendor, start_proxy, monkeypatch, caplog
) -> None:
    async def bug(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(BlindTunnels, "dial", bug)
    proxy = await tunnel_proxy(start_proxy, https_vendor)
    reader, writer = await asyncio.open_connection(proxy.address.host, proxy.address.port)
    writer.write(b"CONNECT api.payments.example:443 HTTP/1.1\r\nHost: api.payments.example:443\r\n\r\n")
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(reader.read(), 5) == b""  # no answer: the connection is cut
    writer.close()
    async with client_session() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        samples = metric_samples(await r.text())
    assert value(samples, "ratelimit_requests_total", limiter="payments", tenant="default", outcome="error") == 1
    assert value(samples, "ratelimit_connects_total", limiter="payments", mode="tunnel", result="refused") == 0
    assert "internal error on CONNECT" in caplog.text
