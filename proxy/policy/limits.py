"""Lists of limits, ``[{rate, per, burst}, ...]``: one grammar for the vendor's global
buckets, its tenants' (``tenant_limits: {default, overrides}``), its endpoint classes' and its
meters'.

A limit listed twice is refused: both entries would name one store key, so one bucket.
"""

from __future__ import annotations

from typing import Final

import yaml

import proxy.policy.values as values
from proxy.policy.model import Limit, TenantLimits
from proxy.policy.walker import Walk

_LIMIT_KEYS: Final = ("rate", "per", "burst")
_TENANT_LIMITS_KEYS: Final = ("default", "overrides")
_DEFAULT_PER: Final = 1.0


def build_limits(walk: Walk, node: yaml.Node, path: str, *, required: bool) -> tuple[Limit, ...]:
    """The list at ``node``; ``required``: an empty list is an error."""
    items = walk.sequence(node, path)
    if items is None:
        return ()
    if required and not items:
        walk.error(node, path, "at least one limit is required")
    limits: list[Limit] = []
    for i, item in enumerate(items):
        mark = walk.mark()
        limit = _limit(walk, item, f"{path}[{i}]")
        if limit is None or not walk.clean_since(mark):
            continue
        if limit in limits:  # same store key: both would draw from one bucket
            walk.error(item, f"{path}[{i}]", f"limit {limit.label} is listed twice")
            continue
        limits.append(limit)
    return tuple(limits)


def optional_limits(walk: Walk, node: yaml.Node, path: str) -> tuple[Limit, ...]:
    """A list that may be empty: an override of ``[]`` exempts a tenant from tenant buckets."""
    return build_limits(walk, node, path, required=False)


def required_limits(walk: Walk, node: yaml.Node, path: str) -> tuple[Limit, ...]:
    return build_limits(walk, node, path, required=True)


def build_tenant_limits(walk: Walk, node: yaml.Node, path: str) -> TenantLimits:
    """``{default: [...], overrides: {tenant: [...]}}``: a vendor's or a meter's buckets per tenant."""
    m = walk.mapping(node, path, _TENANT_LIMITS_KEYS)
    if m is None:
        return TenantLimits()
    return TenantLimits(
        default=m.section("default", optional_limits, ()),
        overrides=m.section("overrides", _overrides, ()),
    )


def _overrides(walk: Walk, node: yaml.Node, path: str) -> tuple[tuple[str, tuple[Limit, ...]], ...]:
    m = walk.mapping(node, path, None)
    if m is None:
        return ()
    overrides: list[tuple[str, tuple[Limit, ...]]] = []
    for tenant, entry in m.entries.items():
        sub = m.child(tenant)
        try:
            values.tenant_name("tenant", tenant)
        except ValueError as exc:
            walk.error(entry.key_node, sub, str(exc))
            continue
        overrides.append((tenant, optional_limits(walk, entry.value_node, sub)))
    return tuple(overrides)


def _limit(walk: Walk, node: yaml.Node, path: str) -> Limit | None:
    m = walk.mapping(node, path, _LIMIT_KEYS)
    if m is None:
        return None
    rate = m.require("rate", values.positive_number, 1.0)
    per = m.get("per", values.positive_duration, _DEFAULT_PER)
    # Burst defaults to the rate, but a bucket below one token would never grant.
    burst = m.get("burst", values.burst, max(rate, 1.0))
    return Limit(rate=rate, per=per, burst=burst, per_text=_as_written(walk, m.node_of("per")))


def _as_written(walk: Walk, node: yaml.Node | None) -> str:
    """A ``per`` written with its unit (``24h``), as written; "" otherwise (a bare number of
    seconds, or none: the canonical form serves)."""
    if node is None:
        return ""
    try:
        value = walk.value(node)
    except ValueError:
        return ""
    return value.strip() if isinstance(value, str) else ""
