"""tenancy.py: the tenant of a request or a CONNECT, from the header or from proxy credentials."""

from __future__ import annotations

import base64
import hashlib

import pytest
from multidict import CIMultiDict

from proxy.policy import Policy
from proxy.quota.tenancy import NO_CLAIM, Claim, Tenancy
from proxy.wire.refusals import BadRequest, ProxyAuthRequired, UnknownTenant
from tests.conftest import make_policy

SECRET = "s3cret"
DIGEST = hashlib.sha256(SECRET.encode()).hexdigest()


def policy(tenant: str) -> Policy:
    return make_policy(f"""
        version: 1
        tenant: {tenant}
        vendors:
          - name: a
            hosts: [api.example]
            limits: [{{rate: 1}}]
            tenant_limits: {{overrides: {{acme: [{{rate: 1}}]}}}}
    """)


ZEROS = "0" * 64
AUTH = Tenancy(policy(f"{{from: proxy_auth, credentials: {{acme: {{sha256: {DIGEST}}}, b: {{sha256: '{ZEROS}'}}}}}}"))


def basic(raw: bytes) -> CIMultiDict[str]:
    return CIMultiDict({"Proxy-Authorization": "Basic " + base64.b64encode(raw).decode()})


def test_basic_credentials_name_the_tenant_and_the_header_is_ignored() -> None:
    headers = basic(f"acme:{SECRET}".encode())
    headers["X-Tenant-Id"] = "b"
    assert AUTH.of_request(headers) == "acme"
    # The scheme is case-insensitive; the secret may hold colons (the user ends at the first one).
    colon = Tenancy(
        policy(f"{{from: proxy_auth, credentials: {{acme: {{sha256: {hashlib.sha256(b'a:b').hexdigest()}}}}}}}")
    )
    assert colon.of_request(CIMultiDict({"Proxy-Authorization": "basic " + base64.b64encode(b"acme:a:b").decode()}))


@pytest.mark.parametrize(
    ("headers", "detail"),
    [
        (CIMultiDict(), "proxy credentials required"),
        (basic(b"acme:wrong"), "proxy credentials not accepted"),  # as for an unknown user
        (basic(b"nobody:" + SECRET.encode()), "proxy credentials not accepted"),
        (basic(b"acme"), "proxy credentials are not valid Basic credentials"),
        (basic(b"\xff:" + SECRET.encode()), "proxy credentials are not valid Basic credentials"),
        (CIMultiDict({"Proxy-Authorization": "Basic !!!"}), "proxy credentials are not valid Basic credentials"),
        (CIMultiDict({"Proxy-Authorization": "Bearer abc"}), "proxy credentials must be Basic"),
        (CIMultiDict({"Proxy-Authorization": "Basic"}), "proxy credentials must be Basic"),
        (
            CIMultiDict([("Proxy-Authorization", basic(f"acme:{SECRET}".encode())["Proxy-Authorization"])] * 2),
            "more than one Proxy-Authorization header",
        ),
    ],
)
def test_what_gets_407(headers: CIMultiDict[str], detail: str) -> None:
    with pytest.raises(ProxyAuthRequired) as refused:
        AUTH.of_request(headers)
    assert refused.value.detail == detail
    assert SECRET not in detail


def test_a_connect_binds_its_tunnel_until_the_policy_changes_the_secret() -> None:
    claim = AUTH.of_connect(basic(f"acme:{SECRET}".encode()))
    assert claim == Claim("acme", hashlib.sha256(SECRET.encode()).digest())
    inside = CIMultiDict({"X-Tenant-Id": "b"})  # requests inside carry no credentials of their own
    assert AUTH.of_request(inside, claim) == "acme"
    assert AUTH.of_request(basic(b"b:whatever"), claim) == "acme"  # the tunnel's binding wins
    rotated = Tenancy(policy(f"{{from: proxy_auth, credentials: {{acme: {{sha256: '{'1' * 64}'}}}}}}"))
    revoked = Tenancy(policy(f"{{from: proxy_auth, credentials: {{b: {{sha256: {DIGEST}}}}}}}"))
    for reloaded in (rotated, revoked):
        with pytest.raises(ProxyAuthRequired):
            reloaded.of_request(inside, claim)
    # A tunnel opened under the header rules proves nothing once credentials are required.
    with pytest.raises(ProxyAuthRequired):
        AUTH.of_request(inside, Claim("acme"))


def test_header_tenants_the_tunnels_and_the_default() -> None:
    rules = Tenancy(policy("{header: X-Tenant-Id, default: fallback}"))
    assert rules.of_request(CIMultiDict({"X-Tenant-Id": " b "})) == "b"
    assert rules.of_request(CIMultiDict()) == "fallback"
    assert rules.of_request(CIMultiDict(), Claim("from-connect")) == "from-connect"
    assert rules.of_request(CIMultiDict({"X-Tenant-Id": "own"}), Claim("from-connect")) == "own"
    assert rules.of_connect(CIMultiDict()) == NO_CLAIM
    assert rules.of_connect(CIMultiDict({"X-Tenant-Id": "b"})) == Claim("b")
    with pytest.raises(BadRequest):
        Tenancy(policy("{default: null}")).of_request(CIMultiDict())
    assert rules.named == frozenset({"fallback", "acme"})


def test_known_only_accepts_the_tenants_the_policy_names() -> None:
    rules = Tenancy(policy("{known_only: true}"))
    assert rules.of_request(CIMultiDict({"X-Tenant-Id": "acme"})) == "acme"
    assert rules.of_request(CIMultiDict()) == "default"
    for headers in (CIMultiDict({"X-Tenant-Id": "sprayed-1"}),):
        with pytest.raises(UnknownTenant) as refused:
            rules.of_request(headers)
        assert (refused.value.status, refused.value.code) == (400, "unknown_tenant")
        with pytest.raises(UnknownTenant):
            rules.of_connect(headers)
