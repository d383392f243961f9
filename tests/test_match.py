"""match.py: which vendor and tenant a request belongs to, and the origin it goes to
(host[:port] parsing itself is tested in test_names.py)."""

from __future__ import annotations

import pytest

from proxy.pipeline import match as match_module
from proxy.pipeline.match import Router
from proxy.pipeline.target import RequestTarget
from proxy.wire.refusals import BadRequest, Denied
from tests.conftest import make_policy

POLICY = make_policy("""
    version: 1
    tenant: {header: X-Tenant-Id, default: null}
    vendors:
      - name: api
        hosts: [api.example, "[::1]"]
        route: /api
        upstream: https://api.example
        limits: [{rate: 1, per: 1s}]
      - name: api-v2
        hosts: ["api2.example:8443"]
        route: /api/v2
        upstream: http://127.0.0.1:9999
        limits: [{rate: 1, per: 1s}]
      - name: local
        hosts: [localhost, "localhost:8081"]
        limits: [{rate: 1, per: 1s}]
""")
ROUTER = Router(POLICY)
ACME = {"X-Tenant-Id": "acme"}


def target(host: str, port: int | None = None, path: str = "/x", absolute: bool = True) -> RequestTarget:
    return RequestTarget(absolute, "http", host, port, path)


def test_host_without_port_matches_the_default_port_host_with_port_only_that_port() -> None:
    # SPEC §12: a host without a port is the scheme's default port (80 here), never any port
    # (tests/test_ports.py has the whole table).
    assert ROUTER.match(target("api.example"), ACME).vendor.name == "api"
    assert ROUTER.match(target("api.example", 80), ACME).vendor.name == "api"
    assert ROUTER.match(target("api2.example", 8443), ACME).vendor.name == "api-v2"
    assert ROUTER.match(target("::1", 80), ACME).vendor.name == "api"
    for other in (target("api.example", 8080), target("api2.example"), target("api2.example", 443)):
        with pytest.raises(Denied):
            ROUTER.match(other, ACME)


def test_upstream_or_requested_origin() -> None:
    assert ROUTER.match(target("api.example"), ACME).origin == "https://api.example"
    m = ROUTER.match(target("localhost", 8081, "/a?b=%2F"), ACME)
    assert (m.origin, m.path_qs) == ("http://localhost:8081", "/a?b=%2F")


def test_longest_route_prefix_wins_and_is_cut() -> None:
    m = ROUTER.match(target("", None, "/api/v2/charges?x=1", absolute=False), ACME)
    assert (m.vendor.name, m.path_qs) == ("api-v2", "/charges?x=1")
    m = ROUTER.match(target("", None, "/api?x=1", absolute=False), ACME)
    assert (m.vendor.name, m.path_qs) == ("api", "/?x=1")
    with pytest.raises(Denied):
        ROUTER.match(target("", None, "/apix", absolute=False), ACME)


def test_absolute_form_ignores_routes_and_denies_unknown_hosts() -> None:
    with pytest.raises(Denied):
        ROUTER.match(target("elsewhere.example", None, "/api/x"), ACME)


def test_tenants() -> None:
    assert ROUTER.match(target("api.example"), {"X-Tenant-Id": " acme "}).tenant == "acme"
    for bad in ({}, {"X-Tenant-Id": ""}, {"X-Tenant-Id": "a b"}, {"X-Tenant-Id": "x" * 129}, {"X-Tenant-Id": "{slot}"}):
        with pytest.raises(BadRequest):
            ROUTER.match(target("api.example"), bad)


# -- remembered matches: the same answer as working it out, and nothing more ------------------

PARTITIONED = make_policy("""
    version: 1
    tenant: {header: X-Tenant-Id, default: null}
    vendors:
      - name: api
        hosts: [api.example]
        upstream: https://api.example
        limits: [{rate: 1, per: 1s}]
      - name: keyed
        hosts: [keyed.example]
        partition: {header: X-Api-Key}
        limits: [{rate: 1, per: 1s}]
""")


def test_a_remembered_match_is_what_a_fresh_router_says() -> None:
    router = Router(POLICY)
    cases = [
        (target("api.example"), ACME, "GET"),
        (target("api.example"), {"X-Tenant-Id": "other"}, "GET"),
        (target("api.example"), ACME, "POST"),
        (target("localhost", 8081, "/a?b"), ACME, "GET"),
        (target("", None, "/api/v2/charges", absolute=False), ACME, "GET"),
    ]
    for _ in range(2):  # the second round is answered from what the first remembered
        for t, headers, method in cases:
            assert router.match(t, headers, method=method) == Router(POLICY).match(t, headers, method=method)
    assert len(router._matches) == len(cases)


def test_refusals_keep_their_order_once_matches_are_remembered() -> None:
    router = Router(POLICY)
    router.match(target("api.example"), ACME)
    with pytest.raises(Denied):  # no vendor: 403 before the missing tenant's 400
        router.match(target("elsewhere.example"), {})
    with pytest.raises(BadRequest):
        router.match(target("api.example"), {})
    with pytest.raises(BadRequest):
        router.match(target("api.example"), {"X-Tenant-Id": "a b"})


def test_a_partitioned_vendors_match_is_never_remembered() -> None:
    router = Router(PARTITIONED)
    a = router.match(target("keyed.example"), {"X-Tenant-Id": "t", "X-Api-Key": "a"})
    b = router.match(target("keyed.example"), {"X-Tenant-Id": "t", "X-Api-Key": "b"})
    assert a.partition and b.partition and a.partition != b.partition
    assert router.match(target("keyed.example"), {"X-Tenant-Id": "t"}).partition == ""
    assert not router._matches


def test_remembered_matches_are_bounded() -> None:
    router = Router(POLICY)
    for i in range(match_module._MATCHES_MAX + 10):
        router.match(target("api.example", None, f"/n{i}"), ACME)
    assert 0 < len(router._matches) <= match_module._MATCHES_MAX
    long_path = "/" + "x" * match_module._KEY_MAX
    assert router.match(target("api.example", None, long_path), ACME).path_qs == long_path
    assert all(key[0].path_qs != long_path for key in router._matches)
