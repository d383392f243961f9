"""The ``vendors:`` section: each vendor's hosts, route, limits, tenant limits, answers
when limited, feedback, CONNECT mode, timeouts, the dialect of the proxy's own answers, and
its quota shapes (endpoint classes, concurrency cap, partition: built in ``shapes``), how
its quota is shared among waiting tenants and priority classes (``share_policy``) and what
it counts besides requests (``meters``).

A vendor needs ``limits`` unless it has ``meters``: a vendor that counts only its own
currency (Shopify's query-cost points) need not count requests too.

Names, hosts and routes are claimed as they are read (``_Claims``), so a second vendor
that reuses one is reported on its own line, naming the vendor that had it first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import yaml

import proxy.policy.shapes as shapes
import proxy.policy.values as values
from proxy.names import host_caution, split_host_port
from proxy.policy.answer_presets import Presets, build_answers
from proxy.policy.durations import format_duration
from proxy.policy.limits import build_tenant_limits, optional_limits, required_limits
from proxy.policy.meters import build_meters
from proxy.policy.model import (
    ACTIONS,
    CONNECT_MODES,
    HEADER_FEEDBACK,
    Action,
    ConnectMode,
    Feedback,
    Limit,
    OnLimit,
    TenantLimits,
    TenantSettings,
    Timeouts,
    TlsSettings,
    Vendor,
    format_number,
)
from proxy.policy.share_policy import build_share
from proxy.policy.walker import CheckedMapping, Walk, is_null
from proxy.policy.worst_case import beyond

_VENDOR: Final = Vendor(name="")
_ON_LIMIT: Final = OnLimit()
_FEEDBACK: Final = Feedback()
_TIMEOUTS: Final = Timeouts()

_VENDOR_KEYS: Final = (
    "name", "hosts", "route", "upstream", "limits", "tenant_limits", "on_limit", "feedback", "connect",
    "timeouts", "max_tunnels", "answers", "answers_max_wait", "ratelimit_headers", "endpoints", "concurrency",
    "partition", "vendor_limit", "share", "meters",
)  # fmt: skip
_ON_LIMIT_KEYS: Final = ("action", "max_hold")
_FEEDBACK_KEYS: Final = ("remaining_header", "low_watermark", "retry_after_default", "max_retry_after", "headers")
_TIMEOUTS_KEYS: Final = ("connect", "read")


@dataclass
class _Claims:
    """What vendors have claimed so far: names, hosts and routes must not be shared."""

    names: dict[str, int] = field(default_factory=dict)
    """Vendor name → line of its first use."""
    hosts: dict[str, list[tuple[str, _Owner]]] = field(default_factory=dict)
    """Host name without port → (normalised entry, owner) pairs."""
    routes: dict[str, _Owner] = field(default_factory=dict)


@dataclass(frozen=True)
class _Owner:
    """A vendor as claims see it: by position, since two vendors may (wrongly) share a name."""

    path: str
    name: str


def build_vendors(
    walk: Walk, node: yaml.Node, path: str, tls: TlsSettings, tenant: TenantSettings, presets: Presets
) -> tuple[Vendor, ...]:
    """The ``vendors:`` list; ``tls`` decides the default ``connect`` mode, ``tenant``
    names the tenant header (stripped, so it cannot be a partition header), and
    ``presets`` are the policy's own answer presets."""
    items = walk.sequence(node, path)
    if items is None:
        return ()
    if not items:
        walk.error(node, path, "at least one vendor is required")
    claims = _Claims()
    vendors = (_vendor(walk, item, f"{path}[{i}]", tls, tenant, presets, claims) for i, item in enumerate(items))
    return tuple(v for v in vendors if v is not None)


def _vendor(
    walk: Walk,
    node: yaml.Node,
    path: str,
    tls: TlsSettings,
    tenant: TenantSettings,
    presets: Presets,
    claims: _Claims,
) -> Vendor | None:
    m = walk.mapping(node, path, _VENDOR_KEYS)
    if m is None:
        return None
    name = m.unique_name("name", values.vendor_name, claims.names, "vendor")
    hosts, route = _targets(m, _Owner(path, name or path), claims)
    connect = _connect(m, tls)
    if connect == "intercept":
        _check_constraints(m, hosts)
    metered = m.has("meters")
    limits: tuple[Limit, ...] = (
        m.section("limits", optional_limits, ()) if metered else m.require_section("limits", required_limits, ())
    )
    vendor_limit: tuple[Limit, ...] = m.section("vendor_limit", required_limits, ())
    _warn_worst_cases(m, limits, vendor_limit)
    tenant_limits = m.section("tenant_limits", build_tenant_limits, TenantLimits())
    cap = m.get("concurrency", shapes.concurrency, _VENDOR.concurrency)
    enclosing = shapes.Enclosing(limits, tenant_limits, cap)
    return Vendor(
        name=name,
        hosts=hosts,
        route=route,
        upstream=m.get("upstream", values.nullable(values.upstream), None),
        limits=limits,
        vendor_limit=vendor_limit,
        tenant_limits=tenant_limits,
        on_limit=m.section("on_limit", _on_limit, _ON_LIMIT),
        feedback=m.section("feedback", _feedback, _FEEDBACK),
        connect=connect,
        timeouts=m.section("timeouts", _timeouts, _TIMEOUTS),
        max_tunnels=m.get("max_tunnels", values.integer_at_least(1), _VENDOR.max_tunnels),
        answers=m.section("answers", lambda w, n, p: build_answers(w, n, p, presets), _VENDOR.answers),
        answers_max_wait=m.get("answers_max_wait", values.positive_duration, _VENDOR.answers_max_wait),
        ratelimit_headers=m.get("ratelimit_headers", values.boolean, _VENDOR.ratelimit_headers),
        endpoints=m.section("endpoints", lambda w, n, p: shapes.build_endpoints(w, n, p, enclosing), ()),
        concurrency=cap,
        partition=m.section("partition", lambda w, n, p: shapes.build_partition(w, n, p, tenant.header), None),
        share=m.section("share", lambda w, n, p: build_share(w, n, p, not _absent(m.node_of("limits"))), None),
        meters=m.section("meters", build_meters, ()),
    )


def _warn_worst_cases(m: CheckedMapping, limits: tuple[Limit, ...], stated: tuple[Limit, ...]) -> None:
    """What a vendor counting requests in a sliding window may see from the whole fleet,
    against what the policy says it allows (``vendor_limit``): any excess is a warning (the
    limits' bursts fill on top of their rates). A metered vendor without ``limits`` does not
    count its requests at all."""
    if stated and m.has("meters") and _absent(m.node_of("limits")):
        message = (
            "vendor_limit counts requests, and this vendor has no limits: nothing keeps the fleet's requests"
            " within it (only its meters are counted)"
        )
        m.walk.warn(m.node_of("vendor_limit") or m.node, m.child("vendor_limit"), message)
    for allowed, worst in beyond(limits, stated):
        m.walk.warn(
            m.node_of("vendor_limit") or m.node,
            m.child("vendor_limit"),
            f"the fleet may send {worst} requests in any {allowed.window}, more than the vendor's "
            f"{format_number(allowed.rate)} (the limits' bursts fill on top of their rates): "
            "lower a burst or a rate",
        )


def _targets(m: CheckedMapping, owner: _Owner, claims: _Claims) -> tuple[tuple[str, ...], str | None]:
    """The vendor's hosts and route, each claimed for this vendor alone."""
    hosts = m.section("hosts", lambda w, n, p: _hosts(w, n, p, owner, claims), _VENDOR.hosts)
    route = m.get("route", values.nullable(values.route), None)
    if route is not None:
        _claim_route(m, route, owner, claims)
        if not m.has("upstream"):  # origin-form requests name no origin to fall back on
            m.walk.error(m.node_of("route") or m.node, m.child("route"), f'route "{route}" needs an upstream')
    # Judged on what was written, so a malformed route or hosts list is reported only once.
    if _absent(m.node_of("route")) and _absent(m.node_of("hosts")):
        m.walk.error(m.node, m.path, "a vendor needs hosts or a route")
    return hosts, route


def _connect(m: CheckedMapping, tls: TlsSettings) -> ConnectMode:
    default: ConnectMode = "intercept" if tls.ca_cert is not None else "deny"
    connect: ConnectMode = m.get("connect", values.choice(CONNECT_MODES), default)
    # Only an explicit intercept is reported here; a half-set CA is already a tls error.
    if connect == "intercept" and (tls.ca_cert is None or tls.ca_key is None) and m.has("connect"):
        m.walk.error(m.node_of("connect") or m.node, m.child("connect"), _INTERCEPT_NEEDS_CA)
    return connect


_INTERCEPT_NEEDS_CA = "connect: intercept needs tls.ca_cert and tls.ca_key"


def _check_constraints(m: CheckedMapping, hosts: tuple[str, ...]) -> None:
    """An intercepted host the CA may not vouch for would only show up as failed
    handshakes: say so here, on the host's own line."""
    ca = m.walk.ca
    node = m.node_of("hosts")
    if ca is None or not isinstance(node, yaml.SequenceNode):
        return
    for i, (entry, item) in enumerate(zip(hosts, node.value, strict=False)):
        outside = ca.outside(split_host_port(entry)[0])
        if outside is not None:
            m.walk.error(item, f"{m.child('hosts')}[{i}]", outside)


def _absent(node: yaml.Node | None) -> bool:
    return node is None or is_null(node) or (isinstance(node, yaml.SequenceNode) and not node.value)


def _claim_route(m: CheckedMapping, route: str, owner: _Owner, claims: _Claims) -> None:
    other = claims.routes.setdefault(route, owner)
    if other != owner:
        node = m.node_of("route") or m.node
        m.walk.error(node, m.child("route"), f'route "{route}" already belongs to vendor "{other.name}"')


def _hosts(walk: Walk, node: yaml.Node, path: str, owner: _Owner, claims: _Claims) -> tuple[str, ...]:
    items = walk.sequence(node, path)
    hosts: list[str] = []
    for i, item in enumerate(items or ()):
        host = walk.leaf(item, f"{path}[{i}]", "host", values.vendor_host, None)
        if host is None:
            continue
        if _claim_host(walk, item, f"{path}[{i}]", host, owner, claims):
            hosts.append(host)
            caution = host_caution(split_host_port(host)[0])
            if caution is not None:
                walk.warn(item, f"{path}[{i}]", f'"{host}" {caution}')
    return tuple(hosts)


def _claim_host(walk: Walk, node: yaml.Node, path: str, host: str, owner: _Owner, claims: _Claims) -> bool:
    """A host without a port matches the default ports (80 plain, 443 CONNECT and https),
    so it overlaps an entry for the same name on either of them."""
    name, port = split_host_port(host)
    for entry, other in claims.hosts.get(name, []):
        if other == owner and entry == host:
            walk.error(node, path, f'host "{host}" is listed twice')
            return False
        if other != owner and _ports(port) & _ports(split_host_port(entry)[1]):
            walk.error(node, path, f'host "{host}" already belongs to vendor "{other.name}"')
            return False
    claims.hosts.setdefault(name, []).append((host, owner))
    return True


def _ports(port: str | None) -> frozenset[int]:
    """The ports a host entry matches: its own, or both default ports without one."""
    return _DEFAULT_PORTS if port is None else frozenset((int(port),))


_DEFAULT_PORTS: Final = frozenset((80, 443))


def _on_limit(walk: Walk, node: yaml.Node, path: str) -> OnLimit:
    m = walk.mapping(node, path, _ON_LIMIT_KEYS)
    if m is None:
        return _ON_LIMIT
    action: Action = m.get("action", values.choice(ACTIONS), _ON_LIMIT.action)
    return OnLimit(action=action, max_hold=m.get("max_hold", values.duration, _ON_LIMIT.max_hold))


def _feedback(walk: Walk, node: yaml.Node, path: str) -> Feedback:
    m = walk.mapping(node, path, _FEEDBACK_KEYS)
    if m is None:
        return _FEEDBACK
    mark = walk.mark()
    retry_after_default = m.get("retry_after_default", values.positive_duration, _FEEDBACK.retry_after_default)
    max_retry_after = m.get("max_retry_after", values.positive_duration, _FEEDBACK.max_retry_after)
    if walk.clean_since(mark) and retry_after_default > max_retry_after:
        key = "retry_after_default" if m.has("retry_after_default") else "max_retry_after"
        message = (
            f"retry_after_default ({format_duration(retry_after_default)}) exceeds "
            f"max_retry_after ({format_duration(max_retry_after)})"
        )
        walk.error(m.node_of(key) or m.node, m.child(key), message)
    return Feedback(
        remaining_header=m.get("remaining_header", values.nullable(values.header_name), _FEEDBACK.remaining_header),
        low_watermark=m.get("low_watermark", values.non_negative_number, _FEEDBACK.low_watermark),
        retry_after_default=retry_after_default,
        max_retry_after=max_retry_after,
        headers=m.get("headers", values.choice(HEADER_FEEDBACK), _FEEDBACK.headers),
    )


def _timeouts(walk: Walk, node: yaml.Node, path: str) -> Timeouts:
    m = walk.mapping(node, path, _TIMEOUTS_KEYS)
    if m is None:
        return _TIMEOUTS
    return Timeouts(
        connect=m.get("connect", values.positive_duration, _TIMEOUTS.connect),
        read=m.get("read", values.positive_duration, _TIMEOUTS.read),
    )
