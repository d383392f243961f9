"""``vendors[].meters`` (SPEC §14): what a vendor counts besides requests (LLM tokens,
query-cost points), each currency with buckets of its own, how a request's cost is
estimated before it goes, and where the answer says what it really cost.

    meters:
      tokens:                                 # the meter's name: letters, digits, _ and -
        limits: [{rate: 200000, per: 1m}]     # required, the limit grammar
        tenant_limits: {default: [...]}       # as a vendor's
        estimate: openai                      # required: a preset, {fixed: N} or {json: /pointer, default: N}
        settle: openai                        # a preset, {json: /pointer}, {header: Name} or none (the default)
        default: 4000                         # a preset's cost for a body it cannot read

A settle preset reads the amount its own estimate preset estimates (``anthropic_input`` the
input tokens, ...), so it needs that estimate. ``default`` serves the presets only: a fixed
estimate never reads the body and a json one has its own default (both keep it, unused).
An estimate or default larger than the burst of one of the meter's buckets is only a
warning: a tenant's bucket, or a default, concerns some requests, not all.
"""

from __future__ import annotations

import difflib
from typing import Final, TypeVar

import yaml

import proxy.policy.values as values
from proxy.policy.durations import show
from proxy.policy.limits import build_tenant_limits, required_limits
from proxy.policy.model import (
    ESTIMATE_PRESETS,
    SETTLE_PRESETS,
    Limit,
    Meter,
    MeterEstimate,
    MeterSettle,
    TenantLimits,
    format_number,
)
from proxy.policy.walker import CheckedMapping, Leaf, Walk, is_null

K = TypeVar("K", bound=str)

_METER_KEYS: Final = ("limits", "tenant_limits", "estimate", "settle", "default")
_ESTIMATE_KEYS: Final = ("fixed", "json", "default")
_SETTLE_KEYS: Final = ("json", "header")
_ESTIMATE_FORMS: Final = "openai, anthropic_input, anthropic_output, {fixed: N} or {json: /pointer, default: N}"
_SETTLE_FORMS: Final = "openai, anthropic_input, anthropic_output, none, {json: /pointer} or {header: Name}"
_NO_SETTLE: Final = MeterSettle()
MAX_AMOUNT: Final = float(2**53)
"""The largest cost a policy may state: a float is exact at every integer up to it (the
estimates and settlements of ``quota/`` hold to the same bound)."""


def _amount(parse: Leaf[float]) -> Leaf[float]:
    return values.bounded(parse, lambda n: n <= MAX_AMOUNT, f"must be at most {MAX_AMOUNT:.0f}")


_fixed: Final = _amount(values.positive_number)
_default: Final = _amount(values.non_negative_number)


def build_meters(walk: Walk, node: yaml.Node, path: str) -> tuple[Meter, ...]:
    """The vendor's ``meters:``, in file order; a meter whose name is wrong is still read,
    so that every problem of it is reported at once."""
    m = walk.mapping(node, path, None)
    if m is None:
        return ()
    if is_null(node) or not node.value:
        walk.error(node, path, "at least one meter is required (leave meters out to count requests only)")
    meters: list[Meter] = []
    for name, entry in m.entries.items():
        sub = m.child(name)
        meter = _meter(walk, entry.value_node, sub, name)
        try:
            values.meter_name("meter", name)
        except ValueError as exc:
            walk.error(entry.key_node, sub, str(exc))
            continue
        if meter is not None:
            meters.append(meter)
    return tuple(meters)


def _meter(walk: Walk, node: yaml.Node, path: str, name: str) -> Meter | None:
    m = walk.mapping(node, path, _METER_KEYS)
    if m is None:
        return None
    mark = walk.mark()
    limits: tuple[Limit, ...] = m.require_section("limits", required_limits, ())
    estimate: MeterEstimate | None = m.require_section("estimate", _estimate, None)
    settle = m.section("settle", _settle, _NO_SETTLE)
    meter = Meter(
        name=name,
        limits=limits,
        estimate=estimate or MeterEstimate("fixed", 1.0),  # a placeholder: the load fails anyway
        settle=settle,
        tenant_limits=m.section("tenant_limits", build_tenant_limits, TenantLimits()),
        default=m.get("default", _default, None),
    )
    if walk.clean_since(mark):  # cross-checks compare only what parsed
        _check_settle(m, meter)
        _warn_unreachable(m, meter)
    return meter


def _estimate(walk: Walk, node: yaml.Node, path: str) -> MeterEstimate | None:
    if not isinstance(node, yaml.MappingNode):
        kind = walk.leaf(node, path, "estimate", _preset("estimate", ESTIMATE_PRESETS, _ESTIMATE_FORMS), None)
        return None if kind is None else MeterEstimate(kind)
    mark = walk.mark()
    m = walk.mapping(node, path, _ESTIMATE_KEYS)
    if m is None or not _one_form(m, ("fixed", "json"), mark, "estimate", "{fixed: N} or {json: /pointer, default: N}"):
        return None
    if m.has("fixed"):
        if m.has("default"):
            message = "default goes with json: a fixed estimate costs its amount whatever the body"
            walk.error(m.node_of("default") or m.node, m.child("default"), message)
        return MeterEstimate("fixed", amount=m.get("fixed", _fixed, 1.0))
    pointer = m.get("json", values.json_pointer, "")
    return MeterEstimate("json", amount=m.require("default", _default, 0.0), pointer=pointer)


def _settle(walk: Walk, node: yaml.Node, path: str) -> MeterSettle:
    """``settle:``; null is ``none``, as leaving it out is."""
    if is_null(node):
        return _NO_SETTLE
    if not isinstance(node, yaml.MappingNode):
        kind = walk.leaf(node, path, "settle", _preset("settle", (*SETTLE_PRESETS, "none"), _SETTLE_FORMS), None)
        return _NO_SETTLE if kind is None else MeterSettle(kind)
    mark = walk.mark()
    m = walk.mapping(node, path, _SETTLE_KEYS)
    if m is None or not _one_form(m, _SETTLE_KEYS, mark, "settle", "{json: /pointer} or {header: Name}"):
        return _NO_SETTLE
    if m.has("json"):
        return MeterSettle("json", pointer=m.get("json", values.json_pointer, ""))
    return MeterSettle("header", header=m.get("header", values.header_name, ""))


def _preset(what: str, presets: tuple[K, ...], forms: str) -> Leaf[K]:
    """A preset's name (with a did-you-mean when it is almost one), else the forms allowed."""

    def parse_preset(key: str, value: object) -> K:
        for preset in presets:
            if value == preset:
                return preset
        if not isinstance(value, str):
            raise ValueError(f"{what} must be one of {forms}, got {show(value)}")
        hint = difflib.get_close_matches(value, presets, n=1, cutoff=0.6)
        suffix = f' (did you mean "{hint[0]}"?)' if hint else ""
        raise ValueError(f"unknown {what} {show(value)}{suffix}: one of {forms}")

    return parse_preset


def _one_form(m: CheckedMapping, keys: tuple[str, str], mark: int, what: str, forms: str) -> bool:
    """Whether the mapping holds exactly one of ``keys``, the keys of its forms; a mapping
    whose keys were already reported (unknown, duplicate) is not reported again."""
    found = [key for key in keys if m.has(key)]
    if len(found) == 1:
        return True
    if m.walk.clean_since(mark):
        if found:
            message = f"{found[0]} and {found[1]} are two forms of {what}, give one: {forms}"
        else:
            message = f"{what} needs {keys[0]} or {keys[1]}: {forms}"
        m.walk.error(m.node, m.path, message)
    return False


def estimate_form(estimate: MeterEstimate) -> str:
    """The estimate as a policy writes it: ``openai``, ``{fixed: 100}``, ``{json: /n, default: 5}``."""
    if estimate.kind == "fixed":
        return f"{{fixed: {format_number(estimate.amount)}}}"
    if estimate.kind == "json":
        return f"{{json: {show(estimate.pointer)}, default: {format_number(estimate.amount)}}}"
    return estimate.kind


def _check_settle(m: CheckedMapping, meter: Meter) -> None:
    """A settle preset reads the amount its own estimate preset estimates (total tokens, input
    tokens or output tokens): with another estimate it would settle another currency."""
    kind = meter.settle.kind
    if kind in SETTLE_PRESETS and meter.estimate.kind != kind:
        message = (
            f"settle {kind} goes with estimate {kind} (a preset settles what its own estimate counts),"
            f" not with estimate {estimate_form(meter.estimate)}"
        )
        m.walk.error(m.node_of("settle") or m.node, m.child("settle"), message)


def _warn_unreachable(m: CheckedMapping, meter: Meter) -> None:
    """A cost above the burst of a bucket it is taken from is never granted there: a fixed
    estimate means no request ever is, a default that the requests costing it are refused at
    once. Warnings, since a tenant's bucket, or a default, concerns only some requests."""
    estimate = meter.estimate
    node = m.node_of("estimate") or m.node
    if estimate.kind == "fixed":
        where = (node, m.child("estimate"), f"estimate {estimate_form(estimate)}")
        _warn_above(m, meter, estimate.amount, where, "no request{whose} can ever be granted")
    elif estimate.kind == "json":
        what = f"default {format_number(estimate.amount)}"
        where = (_value_node(node, "default"), f"{m.child('estimate')}.default", what)
        unread = f"a request{{whose}} whose body has no number at {show(estimate.pointer)}"
        _warn_above(m, meter, estimate.amount, where, f"{unread} would be refused at once")
    if meter.default is not None and estimate.kind in ESTIMATE_PRESETS:  # fixed and json have their own
        where = (m.node_of("default") or m.node, m.child("default"), f"default {format_number(meter.default)}")
        unread = "a request{whose} whose body cannot be read"
        _warn_above(m, meter, meter.default, where, f"{unread} would be refused at once")


def _warn_above(
    m: CheckedMapping, meter: Meter, amount: float, where: tuple[yaml.Node, str, str], consequence: str
) -> None:
    """Warn on ``where`` (node, path, what) when ``amount`` exceeds the smallest burst of the
    meter's buckets, naming that bucket; ``consequence`` says for whose requests."""
    tenants = meter.tenant_limits
    buckets = [
        *(("the meter's limit", "", limit) for limit in meter.limits),
        *(("the default tenant limit", " of a tenant without an override", limit) for limit in tenants.default),
        *(
            (f'tenant "{tenant}"\'s limit', f' of tenant "{tenant}"', limit)
            for tenant, limits in tenants.overrides
            for limit in limits
        ),
    ]
    too_small = [bucket for bucket in buckets if bucket[2].burst < amount]
    if not too_small:
        return
    scope, whose, limit = min(too_small, key=lambda bucket: bucket[2].burst)
    node, path, what = where
    message = f"{what} is more than the burst of {scope} {limit.label}: " + consequence.replace("{whose}", whose)
    m.walk.warn(node, path, message)


def _value_node(node: yaml.Node, key: str) -> yaml.Node:
    """The value of ``key`` in a mapping node as written (for a warning's line), else the node."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value in node.value:
            if getattr(key_node, "value", None) == key and isinstance(value, yaml.Node):
                return value
    return node
