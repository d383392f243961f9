"""Which vendor and tenant a request belongs to, the origin it goes to, and (SPEC §10)
its vendor's endpoint class and partition.

Built once per policy: host lookups are dict hits, route prefixes a short scan. A vendor
without endpoints or partition costs two attribute checks more.

A request that came through an intercepted tunnel carries where the tunnel leads
(``Interception``, the tag tls/intercept.py gives its connections; ``interception_of``):
both paths read it here, below the TLS layer that sets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.limiter.partitions import DEFAULT, partition_hash
from proxy.names import default_port, format_origin, parse_authority
from proxy.pipeline.target import RequestTarget
from proxy.policy.model import Endpoint, Policy, Vendor
from proxy.quota.endpoints import endpoint_for
from proxy.quota.tenancy import NO_CLAIM, Claim, Tenancy
from proxy.wire.headers import PRIORITY
from proxy.wire.refusals import BadRequest, Denied, Refusal
from proxy.wire.request import Request

_MATCHES_MAX = 4096
_KEY_MAX = 512


@dataclass(frozen=True, slots=True)
class Interception:
    """Where an intercepted connection leads; requests inside it go there."""

    vendor: Vendor
    host: str
    port: int
    claim: Claim
    """Who the CONNECT said it was: the tenant for requests inside that name none, or
    (with proxy credentials) the tenant of every request inside."""


def interception_of(request: Request) -> Interception | None:
    """Where the tunnel ``request`` came through leads (None for a plain request)."""
    tag = request.tag
    return tag if isinstance(tag, Interception) else None


@dataclass(frozen=True, slots=True)
class Match:
    vendor: Vendor
    tenant: str
    origin: str
    """``scheme://host[:port]`` the request is sent to."""
    path_qs: str
    """The path and query sent to the vendor (a route prefix stripped)."""
    endpoint: Endpoint | None = None
    """The vendor's endpoint class the request belongs to (first match), None for none."""
    partition: str = DEFAULT
    """The hash of the vendor's partition header's value (partitions.py); "" = the default partition."""
    klass: int | None = None
    """Under ``share:`` (SPEC §13), the class ``X-Quota-Priority`` names (an index of the
    vendor's classes); None: the tenant's class (or no share)."""


class Router:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._by_host: dict[str, Vendor] = {}
        self._by_host_port: dict[tuple[str, int], Vendor] = {}
        self._routes: list[tuple[str, Vendor]] = []
        for vendor in policy.vendors:
            for entry in vendor.hosts:
                host, port = parse_authority(entry)
                if port is None:
                    self._by_host[host] = vendor
                else:
                    self._by_host_port[(host, port)] = vendor
            if vendor.route:
                self._routes.append((vendor.route, vendor))
        # Longest prefix first, so /api/v2 wins over /api.
        self._routes.sort(key=lambda rv: len(rv[0]), reverse=True)
        self.tenancy = Tenancy(policy)
        self._matches: dict[tuple[RequestTarget, str, str], Match] = {}
        """(target, method, tenant) → its Match, for vendors without a partition (whose
        Match depends on nothing else); one Router per policy, so a reload starts afresh."""

    def vendor_for_host(self, host: str, port: int | None, scheme: str = "http") -> Vendor | None:
        """The vendor of ``scheme://host[:port]``: a host listed with a port matches that
        port only; one listed without matches the scheme's default port only (80, or 443
        for https and CONNECT), so no vendor entry reaches another service on its host."""
        default = default_port(scheme)
        if port is None:
            port = default
        vendor = self._by_host_port.get((host, port))
        if vendor is None and port == default:
            vendor = self._by_host.get(host)
        return vendor

    def vendor_for_connect(self, host: str, port: int) -> Vendor | None:
        """The vendor a ``CONNECT host:port`` is for (a host listed without a port: 443)."""
        return self.vendor_for_host(host, port, "https")

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant of a blind tunnel's CONNECT (tenancy.Tenancy.of_request); raises the refusal."""
        return self.tenancy.of_request(headers)

    def match(
        self, target: RequestTarget, headers: Mapping[str, str], tunnel: Claim = NO_CLAIM, method: str = "GET"
    ) -> Match:
        """The vendor and tenant of a request (inside a tunnel bound by ``tunnel``), its
        endpoint class (by ``method`` and the path sent to the vendor, without the query)
        and its partition; raises the refusal. Proxy credentials are checked before anything
        else is said (407 first), so an unauthenticated client cannot learn which hosts are vendors."""
        tenant = self.tenancy.of_request(headers, tunnel) if self.tenancy.authenticates else None
        known = tenant
        if known is None and self._matches:
            # Telling the tenant first is safe when it is not refused: a refusal waits until
            # the vendor is known (no vendor is 403 before a tenant's 400).
            try:
                known = self.tenancy.of_request(headers, tunnel)
            except Refusal:
                known = None
        if known is not None:
            found = self._matches.get((target, method, known))
            if found is not None:
                return found if found.vendor.share is None else self._classed(found, headers)
        vendor: Vendor | None = None
        path_qs = target.path_qs
        if not target.absolute:
            path = path_qs.split("?", 1)[0]
            for prefix, candidate in self._routes:
                if path == prefix or path.startswith(prefix + "/"):
                    vendor = candidate
                    rest = path_qs[len(prefix) :]
                    path_qs = rest if rest.startswith("/") else "/" + rest
                    break
        if vendor is None and target.host:
            vendor = self.vendor_for_host(target.host, target.port, target.scheme)
        if vendor is None:
            shown = target.host + (f":{target.port}" if target.port else "")
            raise Denied(f"no vendor in the policy matches {shown or target.path_qs[:100]!r}", shown)
        if tenant is None:
            tenant = known if known is not None else self.tenancy.of_request(headers, tunnel)
        endpoint = endpoint_for(vendor, method, path_qs.split("?", 1)[0]) if vendor.endpoints else None
        partition = DEFAULT
        if vendor.partition is not None:
            value = headers.get(vendor.partition.header)
            if value:  # absent or empty: the default partition
                partition = partition_hash(value)
        match = Match(vendor, tenant, self._origin(vendor, target), path_qs, endpoint, partition)
        if vendor.partition is None and len(target.path_qs) <= _KEY_MAX:  # (a partition: the request's own)
            if len(self._matches) >= _MATCHES_MAX:
                self._matches.clear()
            self._matches[(target, method, tenant)] = match
        return match if vendor.share is None else self._classed(match, headers)

    @staticmethod
    def _classed(match: Match, headers: Mapping[str, str]) -> Match:
        """``match`` in the class its request's ``X-Quota-Priority`` names (SPEC §13), if any."""
        asked = headers.get(PRIORITY)
        share = match.vendor.share
        if asked is None or share is None:
            return match
        klass = share.class_of(match.tenant, asked.strip())
        if klass is None:
            raise BadRequest(f"unknown {PRIORITY} {asked.strip()[:40]!r}: expected one of {', '.join(share.classes)}")
        return dataclasses.replace(match, klass=klass)

    @staticmethod
    def _origin(vendor: Vendor, target: RequestTarget) -> str:
        if vendor.upstream:
            return vendor.upstream
        return format_origin(target.scheme, target.host, target.port)
