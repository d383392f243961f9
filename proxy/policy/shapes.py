"""A vendor's quota shapes (SPEC §10): its endpoint classes and its partition header.

An endpoint class is checked against every bucket its requests take from: a ``cost``
above the burst of any of them (the vendor's, its own, a tenant's) is a request that
could never be granted, so it is refused here, naming the bucket. What is only worth a
look is a warning: a class with nothing of its own (a label only), a cap above the
vendor's (which binds first), a class an earlier one always matches first, and a path
glob that seems to hold a query (never matched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import yaml

import proxy.policy.values as values
from proxy.policy.durations import show
from proxy.policy.limits import optional_limits
from proxy.policy.model import Endpoint, EndpointMatch, Limit, Partition, TenantLimits
from proxy.policy.walker import CheckedMapping, Walk, is_null

_ENDPOINT_KEYS: Final = ("name", "match", "limits", "concurrency", "cost")
_MATCH_KEYS: Final = ("methods", "path")
_PARTITION_KEYS: Final = ("header",)
_ENDPOINT: Final = Endpoint(name="")
concurrency: Final = values.nullable(values.integer_at_least(1))
"""A fleet-wide cap on requests in flight; null: no cap."""


@dataclass(frozen=True)
class Enclosing:
    """What an endpoint class is nested in: the buckets its requests also take from, and
    the vendor's own concurrency cap."""

    vendor_limits: tuple[Limit, ...]
    tenant_limits: TenantLimits
    concurrency: int | None


def build_endpoints(walk: Walk, node: yaml.Node, path: str, enclosing: Enclosing) -> tuple[Endpoint, ...]:
    items = walk.sequence(node, path)
    names: dict[str, int] = {}
    built: list[tuple[Endpoint, yaml.Node, str]] = []
    for i, item in enumerate(items or ()):
        endpoint = _endpoint(walk, item, f"{path}[{i}]", enclosing, names)
        if endpoint is not None:
            built.append((endpoint, item, f"{path}[{i}]"))
    _warn_shadowed(walk, built)
    return tuple(endpoint for endpoint, _, _ in built)


def _endpoint(walk: Walk, node: yaml.Node, path: str, enclosing: Enclosing, names: dict[str, int]) -> Endpoint | None:
    m = walk.mapping(node, path, _ENDPOINT_KEYS)
    if m is None:
        return None
    name = m.unique_name("name", values.endpoint_name, names, "endpoint")
    match = m.require_section("match", _match, EndpointMatch())
    mark = walk.mark()
    endpoint = Endpoint(
        name=name,
        match=match,
        limits=m.section("limits", optional_limits, ()),
        concurrency=m.get("concurrency", concurrency, None),
        cost=m.get("cost", values.positive_number, _ENDPOINT.cost),
    )
    if walk.clean_since(mark):
        _check_cost(m, endpoint, enclosing)
        _check_concurrency(m, endpoint, enclosing)
        if not endpoint.limits and endpoint.concurrency is None and endpoint.cost == _ENDPOINT.cost:
            message = (
                f'endpoint "{name}" has no limits, concurrency or cost of its own: its requests are limited'
                " like the vendor's others, only labelled with its name"
            )
            walk.warn(node, path, message)
    return endpoint


def _match(walk: Walk, node: yaml.Node, path: str) -> EndpointMatch:
    m = walk.mapping(node, path, _MATCH_KEYS)
    if m is None:
        return EndpointMatch()
    if not m.entries and (is_null(node) or not node.value):  # an unknown key is reported on its own
        walk.error(m.node, path, "match needs methods, a path or both")
    glob = m.get("path", values.path_glob, None)
    if glob is not None and "=" in glob.partition("?")[2]:
        message = (
            f'path {show(glob)} seems to hold a query: only the path is matched, never the query, and "?" '
            "matches any one character"
        )
        walk.warn(m.node_of("path") or m.node, m.child("path"), message)
    return EndpointMatch(methods=m.section("methods", _methods, ()), path=glob)


def _methods(walk: Walk, node: yaml.Node, path: str) -> tuple[str, ...]:
    items = walk.sequence(node, path)
    if items is None:
        return ()
    if not items:
        walk.error(node, path, "at least one method is required (leave methods out to match any method)")
    return walk.distinct(items, path, "method", values.http_method)


def _check_cost(m: CheckedMapping, endpoint: Endpoint, enclosing: Enclosing) -> None:
    """A request takes ``cost`` from every bucket it touches at once, so a bucket whose burst
    is smaller could never grant it: name the tightest such bucket."""
    tenants = enclosing.tenant_limits
    buckets = [
        *(("the vendor's limit", limit) for limit in enclosing.vendor_limits),
        *(("its own limit", limit) for limit in endpoint.limits),
        *(("the default tenant limit", limit) for limit in tenants.default),
        *((f'tenant "{tenant}"\'s limit', limit) for tenant, limits in tenants.overrides for limit in limits),
    ]
    too_small = [(scope, limit) for scope, limit in buckets if limit.burst < endpoint.cost]
    if not too_small:
        return
    scope, limit = min(too_small, key=lambda bucket: bucket[1].burst)
    message = (
        f"cost {endpoint.cost:g} is more than the burst of {scope} {limit.label}:"
        f' a request of "{endpoint.name}" could never be granted'
    )
    m.walk.error(m.node_of("cost") or m.node, m.child("cost"), message)


def _check_concurrency(m: CheckedMapping, endpoint: Endpoint, enclosing: Enclosing) -> None:
    cap, vendor_cap = endpoint.concurrency, enclosing.concurrency
    if cap is not None and vendor_cap is not None and cap > vendor_cap:
        message = f"concurrency {cap} is above the vendor's concurrency {vendor_cap}: the vendor's cap binds first"
        m.walk.warn(m.node_of("concurrency") or m.node, m.child("concurrency"), message)


def _warn_shadowed(walk: Walk, built: list[tuple[Endpoint, yaml.Node, str]]) -> None:
    """First match wins: a class whose every request an earlier class takes never matches."""
    for j, (endpoint, node, path) in enumerate(built):
        for i, (earlier, _, _) in enumerate(built[:j]):
            if _covers(earlier.match, endpoint.match):
                message = (
                    f'endpoint "{endpoint.name}" never matches: endpoints[{i}] ("{earlier.name}")'
                    " matches all its requests first"
                )
                walk.warn(node, path, message)
                break


def _covers(earlier: EndpointMatch, later: EndpointMatch) -> bool:
    """Whether ``earlier`` surely matches every request ``later`` does (a cheap, sure test:
    any or more methods, and any path or the same glob)."""
    methods = not earlier.methods or (bool(later.methods) and set(later.methods) <= set(earlier.methods))
    paths = earlier.path in (None, "/*", later.path)
    return methods and paths


def build_partition(walk: Walk, node: yaml.Node, path: str, tenant_header: str) -> Partition | None:
    """``{header: H}``; null: no partition."""
    if is_null(node):
        return None
    m = walk.mapping(node, path, _PARTITION_KEYS)
    if m is None:
        return None
    header = m.require("header", values.partition_header, "")
    if not header:
        return None
    if header.lower() == tenant_header.lower():
        message = (
            f'"{header}" is the tenant header, stripped before forwarding: it cannot partition the vendor\'s'
            " quota (tenant_limits keep buckets per tenant)"
        )
        walk.error(m.node_of("header") or m.node, m.child("header"), message)
    return Partition(header=header)
