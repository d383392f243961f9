"""``vendors[].share`` (SPEC §13): how a vendor's global buckets are divided among the
tenants and priority classes waiting for them.

    share:
      weights: {default: 1, acme: 4}   # per tenant; `default`: every tenant not listed (1)
      classes: [checkout, batch]       # priority order, highest first (one class "default")
      default_class: batch             # a request's class without one of its own (the last)
      tenant_class: {acme: checkout}   # a tenant's class
      min_share: 10%                   # what a waiting lower class always keeps (or 0.1)

``share: {}`` divides the quota equally among waiting tenants, in one class; ``share: null``
is the same as no ``share`` (first come, first served). Every problem is reported with its
YAML path and line: unknown keys, a weight that is not a positive number, a tenant or class
name that could not travel in a header or a metric label, a class named twice or not
listed (with a did-you-mean), a ``min_share`` that would leave the top class nothing.
"""

from __future__ import annotations

import difflib
import re
from typing import Final

import yaml

import proxy.policy.values as values
from proxy.policy.durations import show
from proxy.policy.model import Share
from proxy.policy.walker import CheckedMapping, Leaf, Walk, is_null

_SHARE_KEYS: Final = ("weights", "classes", "default_class", "tenant_class", "min_share")
_SHARE: Final = Share()
_BOOL_TAG: Final = "tag:yaml.org,2002:bool"
_CLASS_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_PERCENT_RE: Final = re.compile(r"(\d+(?:\.\d+)?|\.\d+)%")
MAX_MIN_SHARE: Final = 0.5
"""The most a single lower class may be guaranteed."""
MAX_GUARANTEED: Final = 0.9
"""The most all lower classes together may be guaranteed: the top class keeps the rest."""

class_name: Final = values.matching(
    _CLASS_RE, "{value} is not a valid class name (letters, digits and _.-, at most 64)"
)
"""A class travels in the ``X-Quota-Priority`` header and in the ``class`` metric label."""
weight: Final = values.positive_number


def min_share(key: str, value: object) -> float:
    """A fraction from 0 to 0.5: ``0.1`` or ``10%``."""
    fraction: float | None = None
    if isinstance(value, str) and (match := _PERCENT_RE.fullmatch(value.strip())):
        fraction = float(match[1]) / 100
    elif isinstance(value, int | float) and not isinstance(value, bool):
        fraction = float(value)
    if fraction is None or not 0 <= fraction <= MAX_MIN_SHARE:  # NaN fails the comparison too
        raise ValueError(f"min_share must be from 0 to 0.5 (a fraction) or 0% to 50%, got {show(value)}")
    return fraction


def build_share(walk: Walk, node: yaml.Node, path: str, has_limits: bool) -> Share | None:
    """The vendor's ``share:``; null: no share. ``has_limits``: whether the vendor wrote
    ``limits`` to divide (their absence is reported by the vendor too)."""
    if is_null(node):
        return None
    if isinstance(node, yaml.ScalarNode) and node.tag == _BOOL_TAG:  # `share: true` turns nothing on
        walk.error(node, path, f"expected a mapping (share: {{}} for equal weights in one class), got {node.value}")
        return None
    m = walk.mapping(node, path, _SHARE_KEYS)
    if m is None:
        return None
    if not has_limits:
        walk.error(node, path, "share divides the vendor's limits, and this vendor has none")
    weights = m.section("weights", _weights, (_SHARE.weights, _SHARE.default_weight))
    mark = walk.mark()
    classes: tuple[str, ...] = m.section("classes", _classes, _SHARE.classes)
    known = walk.clean_since(mark)  # a wrong list would make every name look unknown
    default_class = m.get("default_class", _member(classes, known), classes[-1] if classes else "")
    tenant_class: tuple[tuple[str, str], ...] = m.section(
        "tenant_class", lambda w, n, p: _tenant_class(w, n, p, classes, known), ()
    )
    mark = walk.mark()
    share = m.get("min_share", min_share, _SHARE.min_share)
    if walk.clean_since(mark) and known:
        _check_guarantees(m, share, classes)
        if len(classes) == 1 and m.has("min_share"):
            message = "min_share has no effect with one class: it is what a waiting lower class keeps"
            walk.warn(m.node_of("min_share") or m.node, m.child("min_share"), message)
    return Share(
        weights=weights[0],
        default_weight=weights[1],
        classes=classes or _SHARE.classes,
        default_class=default_class or (classes or _SHARE.classes)[-1],
        tenant_class=tenant_class,
        min_share=share,
    )


def _weights(walk: Walk, node: yaml.Node, path: str) -> tuple[tuple[tuple[str, float], ...], float]:
    """``{default: 1, acme: 4}`` → ((tenant, weight) pairs in file order, the default weight)."""
    m = walk.mapping(node, path, None)
    if m is None:
        return _SHARE.weights, _SHARE.default_weight
    default = _SHARE.default_weight
    found: list[tuple[str, float]] = []
    for tenant, entry in m.entries.items():
        sub = m.child(tenant)
        if tenant == "default":
            default = walk.leaf(entry.value_node, sub, "weight", weight, default)
        elif _tenant_ok(walk, entry.key_node, sub, tenant):
            found.append((tenant, walk.leaf(entry.value_node, sub, "weight", weight, 1.0)))
    return tuple(found), default


def _classes(walk: Walk, node: yaml.Node, path: str) -> tuple[str, ...]:
    items = walk.sequence(node, path)
    if items is None:
        return _SHARE.classes
    if not items:
        walk.error(node, path, 'at least one class is required (leave classes out for one class, "default")')
    return walk.distinct(items, path, "class", class_name)


def _member(classes: tuple[str, ...], known: bool) -> Leaf[str]:
    """A class name that must be one of ``classes`` (unchecked when they are unknown)."""

    def parse_member(key: str, value: object) -> str:
        name = class_name(key, value)
        if known and name not in classes:
            hint = difflib.get_close_matches(name, classes, n=1, cutoff=0.6)
            suffix = f' (did you mean "{hint[0]}"?)' if hint else f" (classes: {', '.join(classes)})"
            raise ValueError(f'"{name}" is not one of the classes{suffix}')
        return name

    return parse_member


def _tenant_class(
    walk: Walk, node: yaml.Node, path: str, classes: tuple[str, ...], known: bool
) -> tuple[tuple[str, str], ...]:
    """``{acme: checkout}`` → (tenant, class) pairs in file order."""
    m = walk.mapping(node, path, None)
    if m is None:
        return ()
    member = _member(classes, known)
    found: list[tuple[str, str]] = []
    for tenant, entry in m.entries.items():
        sub = m.child(tenant)
        if _tenant_ok(walk, entry.key_node, sub, tenant):
            name = walk.leaf(entry.value_node, sub, "class", member, "")
            if name:
                found.append((tenant, name))
    return tuple(found)


def _tenant_ok(walk: Walk, node: yaml.Node, path: str, tenant: str) -> bool:
    try:
        values.tenant_name("tenant", tenant)
    except ValueError as exc:
        walk.error(node, path, str(exc))
        return False
    return True


def _check_guarantees(m: CheckedMapping, share: float, classes: tuple[str, ...]) -> None:
    """Every lower class is guaranteed ``min_share``: together at most 90%, so the top
    class keeps something. Reported on ``min_share``, or on ``classes`` when it is the
    default 10% that eleven classes or more exceed."""
    lower = len(classes) - 1
    if share * lower <= MAX_GUARANTEED + 1e-9:  # 9 * 0.1 is 0.9000000000000001
        return
    key = "min_share" if m.has("min_share") else "classes"
    message = (
        f"min_share {_percent(share)} for each of the {lower} lower classes guarantees them "
        f"{_percent(share * lower)} of the quota together: at most {_percent(MAX_GUARANTEED)}, "
        "so the top class keeps some (lower min_share, or use fewer classes)"
    )
    m.walk.error(m.node_of(key) or m.node, m.child(key), message)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"
