"""proxy/names.py: one grammar for hosts, ports and tenant names.

Each table row is judged by every part of the proxy that reads such a name: the policy
loader, the router (request target, Host header and vendor lookup), CONNECT and the CA.
They must agree on the verdict and on the normal form.
"""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import make_mocked_request

from proxy.ca.authority import normalize_host
from proxy.names import format_authority, format_origin, parse_authority, parse_host_port
from proxy.pipeline import target as target_module
from proxy.pipeline.match import Router
from proxy.pipeline.target import RequestTarget, parse_target
from proxy.policy import ConfigErrors, Policy, parse_address, parse_policy
from proxy.wire.refusals import BadRequest

LONG_LABEL = "x" * 63
LONGEST_NAME = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters

HOSTS = [
    # (as written, normal form; None = refused)
    ("api.example", "api.example"),
    ("API.Example.", "api.example"),
    ("my_service", "my_service"),  # container names: underscores are kept
    ("a-b.example", "a-b.example"),
    ("x1.example", "x1.example"),
    (f"{LONG_LABEL}.example", f"{LONG_LABEL}.example"),
    (LONGEST_NAME, LONGEST_NAME),
    ("10.0.0.1", "10.0.0.1"),
    ("2001:DB8:0::1", "2001:db8::1"),
    ("::1", "::1"),
    ("-api.example", None),  # a label may not start with "-"
    ("api-.example", None),  # ... nor end with it (the router used to let this through)
    ("api..example", None),
    ("a b.example", None),
    ("*.example", None),
    ("exämple.com", None),
    ("1.2.3", None),  # digits and dots only: an IPv4 address or nothing
    ("999.1.1.1", None),
    ("010.0.0.1", None),
    (f"x{LONG_LABEL}.example", None),  # a 64-character label
    (LONGEST_NAME + "x", None),  # 254 characters
]


def _policy(hosts: str = '["api.example"]', default_tenant: str = "null") -> Policy:
    return parse_policy(
        f"version: 1\ntenant: {{header: X-Tenant-Id, default: {default_tenant}}}\n"
        f"vendors:\n  - name: a\n    hosts: {hosts}\n    limits: [{{rate: 1}}]\n",
        "names.yaml",
    )


def by_loader(written: str) -> str | None:
    try:
        entry = _policy(f"[{json.dumps(written)}]").vendors[0].hosts[0]
    except ConfigErrors:
        return None
    return entry.removeprefix("[").removesuffix("]")


def by_router(written: str) -> str | None:
    """Absolute form and Host header must agree; the router then finds the vendor by that name."""
    authority = f"[{written}]" if ":" in written else written
    try:
        absolute = parse_target(make_mocked_request("GET", f"http://{authority}/x"))
    except BadRequest:
        absolute = None
    try:
        origin_form = parse_target(make_mocked_request("GET", "/x", headers={"Host": authority}))
    except BadRequest:
        origin_form = None
    assert (absolute and absolute.host) == (origin_form and origin_form.host)
    if absolute is None:
        return None
    router = Router(_policy(f'["{format_authority(absolute.host)}"]'))
    assert router.vendor_for_host(absolute.host, None) is not None
    return absolute.host


def by_connect(written: str) -> str | None:
    """What the CONNECT door calls on ``CONNECT host:443``, then the vendor it looks up."""
    authority = f"[{written}]" if ":" in written else written
    try:
        host, port = parse_authority(f"{authority}:443")
    except ValueError:
        return None
    assert port == 443
    assert Router(_policy(f'["{format_authority(host)}"]')).vendor_for_connect(host, 443) is not None
    return host


def by_ca(written: str) -> str | None:
    try:
        return normalize_host(written)
    except ValueError:
        return None


@pytest.mark.parametrize(("written", "normal"), HOSTS)
@pytest.mark.parametrize("judge", [by_loader, by_router, by_connect, by_ca])
def test_every_part_judges_a_host_the_same_way(judge, written: str, normal: str | None) -> None:
    assert judge(written) == normal


# "\u0661" is an Arabic-Indic digit one: str.isdigit() is true for it, a port is ASCII digits only.
PORTS = [("1", 1), ("443", 443), ("08080", 8080), ("65535", 65535), ("0", None), ("65536", None), ("123456", None),
         ("", None), ("x", None), ("+1", None), ("\u0661", None)]  # fmt: skip


@pytest.mark.parametrize(("written", "port"), PORTS)
def test_the_policy_and_the_wire_read_ports_the_same_way(written: str, port: int | None) -> None:
    def policy_port() -> int | None:
        try:
            return parse_host_port(f"api.example:{written}")[1]
        except ValueError:
            return None

    def wire_port() -> int | None:
        try:
            return parse_authority(f"api.example:{written}")[1]
        except ValueError:
            return None

    assert policy_port() == wire_port() == port


def test_a_listen_address_may_ask_for_port_zero() -> None:
    assert parse_address("127.0.0.1:0").port == 0
    with pytest.raises(ValueError, match=r'"api.example:0": port must be 1..65535'):
        parse_host_port("api.example:0")


TENANTS = [("acme", True), ("Acme-1", True), ("team@corp.example", True), ("ns:acme", True), ("x" * 128, True),
           ("x" * 129, False), ("-acme", False), (".acme", False), ("a b", False), ("{slot}", False),
           ("acme_corp", True), ("acme/corp", False), ("", False)]  # fmt: skip


@pytest.mark.parametrize(("name", "valid"), TENANTS)
def test_the_loader_and_the_router_agree_on_tenant_names(name: str, valid: bool) -> None:
    try:
        _policy(default_tenant=json.dumps(name))
        by_loader = True
    except ConfigErrors:
        by_loader = False
    try:
        Router(_policy()).tenant({"X-Tenant-Id": name})
        by_router = True
    except BadRequest:
        by_router = False
    assert by_loader == by_router == valid


# ---------------------------------------------------------------- the two spellings of host[:port]


@pytest.mark.parametrize(
    ("authority", "expected"),
    [("API.Example", ("api.example", None)), ("api.example:8080", ("api.example", 8080)),
     ("[::1]:80", ("::1", 80)), ("[::1]", ("::1", None)), ("10.0.0.1:1", ("10.0.0.1", 1)),
     ("example.com.", ("example.com", None)), ("[2001:DB8:0::1]:8443", ("2001:db8::1", 8443))],
)  # fmt: skip
def test_authorities(authority: str, expected: tuple[str, int | None]) -> None:
    assert parse_authority(authority) == expected


@pytest.mark.parametrize(
    "bad", ["user@host", "host:0", "host:99999", "host:x", "[::1", "[::1]x", "[1.2.3.4]:80", "bad host", "", "::1",
            "a:b:c"],
)  # fmt: skip
def test_bad_authorities(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_authority(bad)


def test_the_policy_may_write_ipv6_without_brackets_the_wire_may_not() -> None:
    assert parse_host_port("::1") == ("::1", None)
    with pytest.raises(ValueError, match="an IPv6 address goes in brackets"):
        parse_authority("::1")
    with pytest.raises(ValueError, match="user information is not allowed"):
        parse_authority("user@api.example")


def test_formatting_puts_ipv6_in_brackets_and_leaves_default_ports_out() -> None:
    assert format_authority("::1", 8443) == "[::1]:8443"
    assert format_authority("api.example") == "api.example"
    assert format_origin("https", "api.example", 443) == "https://api.example"
    assert format_origin("http", "api.example", 443) == "http://api.example:443"
    assert format_origin("http", "::1", 80) == "http://[::1]"
    assert format_origin("http", "::1", None) == "http://[::1]"


def test_request_target_keeps_the_port_it_was_given() -> None:
    target = parse_target(make_mocked_request("GET", "http://[2001:DB8::1]:8080/a?b"))
    assert target == RequestTarget(True, "http", "2001:db8::1", 8080, "/a?b")


def test_a_target_parsed_again_from_the_cache_is_the_same_and_a_host_header_keys_it() -> None:
    first = parse_target(make_mocked_request("GET", "http://API.example:8080/a?b#frag"))
    again = parse_target(make_mocked_request("GET", "http://API.example:8080/a?b#frag"))
    assert again is first and first == RequestTarget(True, "http", "api.example", 8080, "/a?b")
    # Origin form: the same path under another Host is another destination.
    one = parse_target(make_mocked_request("GET", "/v1", headers={"Host": "one.example"}))
    two = parse_target(make_mocked_request("GET", "/v1", headers={"Host": "two.example:81"}))
    assert (one.host, one.port, two.host, two.port) == ("one.example", None, "two.example", 81)
    assert parse_target(make_mocked_request("GET", "/v1", headers={"Host": "one.example"})) is one
    # A malformed one is refused every time, never remembered.
    for _ in range(2):
        with pytest.raises(BadRequest):
            parse_target(make_mocked_request("GET", "/v1", headers={"Host": "bad host"}))


def test_the_target_cache_is_bounded_and_long_targets_are_parsed_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target_module, "_CACHE_MAX", 64)  # (4096 mocked requests took 7 s)
    target_module._absolute.clear()
    for i in range(target_module._CACHE_MAX + 10):
        parse_target(make_mocked_request("GET", f"http://api.example/n{i}"))
    assert len(target_module._absolute) <= target_module._CACHE_MAX
    long_path = "/q?" + "x" * target_module._CACHE_KEY_MAX
    target = parse_target(make_mocked_request("GET", f"http://api.example{long_path}"))
    assert target.path_qs == long_path and f"http://api.example{long_path}" not in target_module._absolute
