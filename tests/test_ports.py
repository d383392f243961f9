"""A vendor host without a port means the scheme's default port (SPEC §12).

``hosts: [localhost]`` once matched every port over plain HTTP, so the proxy was a path to
its own admin port and to a Redis on the same machine. Now a host listed without a port
matches port 80 for plain HTTP and 443 for CONNECT (and ``https://`` targets); any other
port must be listed with the host. The loader warns about vendor hosts that are IP
literals, ``localhost`` or single-label names (a warning, not an error).
"""

from __future__ import annotations

import dataclasses
import functools

import aiohttp
import pytest

from proxy.pipeline.match import Router
from proxy.pipeline.target import RequestTarget
from proxy.policy import ConfigErrors, parse_policy
from proxy.wire.refusals import Denied
from tests.conftest import client_session, make_policy

LOCAL_VENDOR = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    vendors:
      - name: local
        hosts: [localhost, "localhost:$vendor_port"]
        limits: [{rate: 100, per: 1s}]
"""


async def test_a_host_without_a_port_does_not_reach_other_ports(vendor, start_proxy) -> None:
    vendor_port = int(vendor.url.rsplit(":", 1)[1])
    proxy = await start_proxy(make_policy(LOCAL_VENDOR, vendor_port=vendor_port))
    admin_port = proxy.admin_address.port
    async with client_session() as s:
        # The listed port is the vendor.
        async with s.get(f"http://localhost:{vendor_port}/v1/x", proxy=proxy.url) as r:
            assert r.status == 200
        # The proxy's own admin port, on the same host: not a vendor.
        async with s.get(f"http://localhost:{admin_port}/status", proxy=proxy.url) as r:
            assert r.status == 403, await r.text()
            assert r.headers["X-Quota-Action"] == "deny"
            assert f"localhost:{admin_port}" in (await r.json())["message"]
        # Origin form with a Host header naming another port: the same.
        headers = {"Host": f"localhost:{admin_port}"}
        async with s.get(f"{proxy.url}/status", headers=headers) as r:
            assert r.status == 403
    assert [r["path_qs"] for r in vendor.mock.requests] == ["/v1/x"]


async def test_connect_to_an_unlisted_port_is_refused(vendor, start_proxy) -> None:
    vendor_port = int(vendor.url.rsplit(":", 1)[1])
    proxy = await start_proxy(make_policy(LOCAL_VENDOR, vendor_port=vendor_port))
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientHttpProxyError) as refused:
            await s.get(f"https://localhost:{proxy.admin_address.port}/status", proxy=proxy.url)
    assert refused.value.status == 403


@functools.cache
def router() -> Router:
    return Router(
        make_policy("""
    version: 1
    vendors:
      - name: plain
        hosts: [api.example]
        limits: [{rate: 1}]
      - name: other-port
        hosts: ["api.example:8443", "api2.example:8080"]
        limits: [{rate: 1}]
""")
    )


def vendor_of(scheme: str, host: str, port: int | None) -> str | None:
    try:
        return router().match(RequestTarget(True, scheme, host, port, "/x"), {}).vendor.name
    except Denied:
        return None


@pytest.mark.parametrize(
    ("scheme", "host", "port", "vendor"),
    [
        ("http", "api.example", None, "plain"),
        ("http", "api.example", 80, "plain"),
        ("http", "api.example", 8080, None),
        ("http", "api.example", 6379, None),
        ("http", "api.example", 443, None),  # plain HTTP to the TLS port: not the default of http
        ("https", "api.example", None, "plain"),
        ("https", "api.example", 443, "plain"),
        ("https", "api.example", 80, None),
        ("http", "api.example", 8443, "other-port"),
        ("https", "api.example", 8443, "other-port"),
        ("http", "api2.example", 8080, "other-port"),
        ("http", "api2.example", None, None),
        ("http", "api2.example", 80, None),
    ],
)
def test_the_default_port_is_the_schemes(scheme: str, host: str, port: int | None, vendor: str | None) -> None:
    assert vendor_of(scheme, host, port) == vendor


def test_connect_matches_a_host_without_a_port_on_443_only() -> None:
    assert router().vendor_for_connect("api.example", 443).name == "plain"  # type: ignore[union-attr]
    assert router().vendor_for_connect("api.example", 80) is None
    assert router().vendor_for_connect("api.example", 8443).name == "other-port"  # type: ignore[union-attr]
    assert router().vendor_for_connect("api2.example", 443) is None


def test_a_port_of_one_vendor_no_longer_collides_with_a_host_of_another() -> None:
    text = """\
version: 1
vendors:
  - name: a
    hosts: [api.example]
    limits: [{rate: 1}]
  - name: b
    hosts: ["api.example:8443"]
    limits: [{rate: 1}]
  - name: c
    hosts: ["api.example:80"]
    limits: [{rate: 1}]
"""
    with pytest.raises(ConfigErrors) as raised:
        parse_policy(text, "p.yaml")
    assert str(raised.value) == 'p.yaml:10: vendors[2].hosts[0]: host "api.example:80" already belongs to vendor "a"'


WARNED = """\
version: 1
vendors:
  - name: a
    hosts:
      - api.example
      - localhost
      - "localhost:8443"
      - 10.0.0.7
      - "[::1]:9443"
      - my_service
      - api.svc.cluster.local
    limits: [{rate: 1}]
"""


def test_the_loader_warns_about_local_and_ambiguous_hosts() -> None:
    policy = parse_policy(WARNED, "p.yaml")
    assert [str(w) for w in policy.warnings] == [
        'p.yaml:6: vendors[0].hosts[1]: "localhost" is this machine: the proxy would reach whatever listens there'
        " on the ports listed (80 and 443 without a port); name the vendor by its public DNS name",
        'p.yaml:7: vendors[0].hosts[2]: "localhost:8443" is this machine: the proxy would reach whatever listens'
        " there on the ports listed (80 and 443 without a port); name the vendor by its public DNS name",
        'p.yaml:8: vendors[0].hosts[3]: "10.0.0.7" is an IP address: anything at that address is reachable on the'
        " ports listed (80 and 443 without a port); name the vendor by its DNS name",
        'p.yaml:9: vendors[0].hosts[4]: "[::1]:9443" is an IP address: anything at that address is reachable on the'
        " ports listed (80 and 443 without a port); name the vendor by its DNS name",
        'p.yaml:10: vendors[0].hosts[5]: "my_service" is a single-label name: it resolves through the search'
        " domains of the proxy's host, possibly to an internal service; use a fully qualified name",
    ]
    assert dataclasses.replace(policy, warnings=()) == policy  # warnings take no part in comparing policies
