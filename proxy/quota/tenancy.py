"""Which tenant a request (or a CONNECT) belongs to: from the tenant header, or from the
worker's proxy credentials (SPEC §12).

``from: header`` (the default): the tenant header names the tenant, else the tunnel's
tenant (named on its CONNECT), else ``tenant.default`` (None: 400). With ``known_only``
a tenant the policy does not name is refused (400, ``unknown_tenant``).

``from: proxy_auth``: ``Proxy-Authorization: Basic`` (what ``HTTP_PROXY=http://acme:SECRET@
proxy:8080`` makes every client send) must name a tenant of ``tenant.credentials`` and
the secret whose SHA-256 is listed there; otherwise 407 with a Basic challenge. The
tenant header is ignored (it is still stripped before forwarding). The credentials on a
CONNECT bind the connection: every request inside an intercepted tunnel is that tenant's,
checked again against the current policy (a reload that revokes or rotates the secret
ends the binding), and a blind tunnel's token is that tenant's.

Secrets are compared as SHA-256 digests in constant time (``hmac.compare_digest``), an
unknown user against a stand-in digest, and a wrong secret is answered like an unknown
user, so neither timing nor words tell which users exist; neither a secret nor a user
name that failed ever reaches a log line or an answer.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from multidict import istr

from proxy.names import is_tenant_name
from proxy.policy.model import Policy
from proxy.wire.headers import PROXY_AUTHORIZATION
from proxy.wire.refusals import BadRequest, ProxyAuthRequired, UnknownTenant

_STAND_IN: Final = hashlib.sha256(b"quota-proxy: no such user").digest()


@dataclass(frozen=True, slots=True)
class Claim:
    """Who a CONNECT said it was, binding the requests of its tunnel."""

    tenant: str | None
    """The tenant named on the CONNECT (None: none was)."""
    proof: bytes | None = None
    """With proxy credentials: the SHA-256 of the secret they carried (never the secret)."""


NO_CLAIM: Final = Claim(None)


class Tenancy:
    """The tenant rules of one policy."""

    def __init__(self, policy: Policy) -> None:
        settings = policy.tenant
        self.header = settings.header
        self._key = istr(settings.header)  # looked up in every request: a key that is case-folded once
        self.default = settings.default
        self.authenticates = settings.from_ == "proxy_auth"
        self.known_only = settings.known_only
        self.named = settings.named(policy.vendors)
        """The tenants the policy names: never refused for being new, never seat-limited."""
        self._digests = dict(settings.credentials)

    # -- a request ---------------------------------------------------------------

    def of_request(self, headers: Mapping[str, str], tunnel: Claim = NO_CLAIM) -> str:
        """The tenant of a request (or of a blind tunnel's CONNECT); raises the refusal."""
        if self.authenticates:
            if tunnel.proof is not None and tunnel.tenant is not None:
                if self._still_valid(tunnel.tenant, tunnel.proof):
                    return tunnel.tenant
                raise ProxyAuthRequired(f"the credentials of this tunnel's tenant {tunnel.tenant} changed")
            return self._authenticated(headers)[0]
        value = headers.get(self._key)
        if value is None:
            if tunnel.tenant is not None:
                return tunnel.tenant
            if self.default is None:
                raise BadRequest(f"missing {self.header} header (this policy has no default tenant)")
            return self.default
        return self._named(value)

    # -- a CONNECT about to be intercepted ----------------------------------------

    def of_connect(self, headers: Mapping[str, str]) -> Claim:
        """What a CONNECT binds its tunnel's requests to: the authenticated tenant, or
        the tenant its header names (requests inside may name their own)."""
        if self.authenticates:
            tenant, proof = self._authenticated(headers)
            return Claim(tenant, proof)
        value = headers.get(self._key)
        return NO_CLAIM if value is None else Claim(self._named(value))

    # -- the two sources ------------------------------------------------------------

    def _named(self, value: str) -> str:
        value = value.strip()
        if not is_tenant_name(value):
            raise BadRequest(f"bad {self.header} header: letters, digits and ._:@- only, at most 128")
        if self.known_only and value not in self.named:
            raise UnknownTenant(
                f"unknown tenant {value!r} in {self.header}: this policy accepts only the tenants it names "
                "(tenant.known_only)"
            )
        return value

    def _authenticated(self, headers: Mapping[str, str]) -> tuple[str, bytes]:
        """(tenant, SHA-256 of the secret) from ``Proxy-Authorization: Basic``; else 407."""
        values = _every(headers, PROXY_AUTHORIZATION)
        if not values:
            raise ProxyAuthRequired("proxy credentials required")
        if len(values) > 1:
            raise ProxyAuthRequired("more than one Proxy-Authorization header")
        user, secret = _basic(values[0])
        proof = hashlib.sha256(secret).digest()
        expected = self._digests.get(user)
        # Constant time, and the same work for an unknown user as for a known one.
        matched = hmac.compare_digest(proof, expected if expected is not None else _STAND_IN)
        if expected is None or not matched:  # one answer for both: which users exist is not told
            raise ProxyAuthRequired("proxy credentials not accepted")
        return user, proof

    def _still_valid(self, tenant: str, proof: bytes) -> bool:
        expected = self._digests.get(tenant)
        return hmac.compare_digest(proof, expected if expected is not None else _STAND_IN) and expected is not None


def _every(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header ``name`` (a multidict's, or a plain mapping's one)."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    value = headers.get(name)
    return [] if value is None else [value]


def _basic(value: str) -> tuple[str, bytes]:
    """``Basic base64(user:secret)`` → (user, secret bytes); 407 for anything else."""
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "basic" or not token.strip():
        raise ProxyAuthRequired("proxy credentials must be Basic")
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ProxyAuthRequired("proxy credentials are not valid Basic credentials") from None
    user, colon, secret = decoded.partition(b":")
    if not colon:
        raise ProxyAuthRequired("proxy credentials are not valid Basic credentials")
    try:
        name = user.decode("utf-8")
    except UnicodeDecodeError:
        raise ProxyAuthRequired("proxy credentials are not valid Basic credentials") from None
    return name, secret
