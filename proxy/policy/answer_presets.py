"""``vendors[].answers`` and ``answer_presets:``: which preset a vendor's own answers follow,
and what a policy changes in it (presets.py has the presets and what the keys mean).

    answer_presets:              # presets of this policy, by name (each based on another)
      acme:
        preset: generic          # the base: a built-in preset or one defined above
        body: {errors: [{message: "{message}", code: "{code}"}]}
    vendors:
      - name: github
        answers: github          # a preset's name...
      - name: payments
        answers:                 # ...or a mapping: a preset and what changes in it
          preset: stripe
          shed: {status: 409}    # per kind: status (defer, long_defer, shed), headers, body
          headers: {X-Trace: "{code}"}   # for every kind (a kind's own win)

Every key is checked at load: unknown keys and placeholders, a status outside 400-599,
headers the proxy owns, a body that is not a JSON object, each with its YAML path and line.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Final

import yaml

import proxy.policy.values as values
from proxy.policy.durations import show
from proxy.policy.presets import (
    BUILT_IN,
    GENERIC,
    KINDS,
    STATUS_KINDS,
    AnswerKind,
    AnswerPreset,
    AnswerTemplate,
    placeholder_problem,
)
from proxy.policy.walker import Walk, is_null
from proxy.wire.headers import HOP_BY_HOP, QUOTA_PREFIX

_PRESET_KEYS: Final = ("preset", "headers", "body", *KINDS)
_KIND_KEYS: Final = ("status", "headers", "body")
_FRAMING: Final = frozenset({"content-length", "content-type", "transfer-encoding", *HOP_BY_HOP})
"""Fields the proxy writes for the body it sends: a preset cannot set or remove them."""

Presets = Mapping[str, AnswerPreset]


def build_answer_presets(walk: Walk, node: yaml.Node, path: str) -> dict[str, AnswerPreset]:
    """``answer_presets:``: name → preset, each based on a built-in one or one named before it."""
    m = walk.mapping(node, path, None)
    found: dict[str, AnswerPreset] = {}
    if m is None:
        return found
    for name, entry in m.entries.items():
        where = m.child(name)
        if name in BUILT_IN:
            walk.error(
                entry.key_node,
                where,
                f'"{name}" is a built-in preset: pick another name, or change it in a vendor\'s answers',
            )
            continue
        try:
            values.preset_name(name, name)
        except ValueError as exc:
            walk.error(entry.key_node, where, str(exc))
            continue
        preset = _preset(walk, entry.value_node, where, name, found)
        if preset is not None:
            found[name] = preset
    return found


def build_answers(walk: Walk, node: yaml.Node, path: str, presets: Presets) -> AnswerPreset:
    """A vendor's ``answers``: a preset's name, or a mapping that names one and changes it."""
    if isinstance(node, yaml.MappingNode) or is_null(node):
        return _preset(walk, node, path, None, presets) or GENERIC
    return _named(walk, node, path, presets) or GENERIC


def _named(walk: Walk, node: yaml.Node, path: str, presets: Presets) -> AnswerPreset | None:
    try:
        name = walk.value(node)
    except ValueError as exc:
        walk.error(node, path, str(exc))
        return None
    known = {**BUILT_IN, **presets}
    if isinstance(name, str) and name in known:
        return known[name]
    hint = difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6)
    suffix = f' (did you mean "{hint[0]}"?)' if hint else ""
    walk.error(node, path, f"unknown answer preset {show(name)}{suffix}: one of {', '.join(known)}")
    return None


def _preset(walk: Walk, node: yaml.Node, path: str, name: str | None, presets: Presets) -> AnswerPreset | None:
    m = walk.mapping(node, path, _PRESET_KEYS)
    if m is None:
        return None
    base = GENERIC
    base_node = m.node_of("preset")
    if base_node is not None:
        base = _named(walk, base_node, m.child("preset"), presets) or GENERIC
    headers = m.section("headers", _headers, None)
    body = m.section("body", _body, None)
    kinds: list[AnswerTemplate] = []
    for kind in KINDS:
        template = base.kind(kind)
        if headers is not None:
            template = replace(template, headers=_merged(template.headers, headers))
        if body is not None:
            template = replace(template, body=body)
        own = m.section(kind, lambda w, n, p, k=kind: _kind(w, n, p, k), None)  # type: ignore[misc]
        if own is not None:
            status, own_headers, own_body = own
            if status is not None:
                template = replace(template, status=status)
            if own_headers is not None:
                template = replace(template, headers=_merged(template.headers, own_headers))
            if own_body is not None:
                template = replace(template, body=own_body)
        kinds.append(template)
    return AnswerPreset(name or f"{base.name}+", tuple(kinds), base.retry_jitter)


_Kind = tuple[int | None, tuple[tuple[str, str | None], ...] | None, str | None]


def _kind(walk: Walk, node: yaml.Node, path: str, kind: AnswerKind) -> _Kind | None:
    m = walk.mapping(node, path, _KIND_KEYS)
    if m is None:
        return None
    status: int | None = None
    status_node = m.node_of("status")
    if status_node is not None:
        if kind not in STATUS_KINDS:
            walk.error(
                status_node,
                m.child("status"),
                f"the status of {kind} answers is the refusal's own (only {', '.join(STATUS_KINDS)} may change theirs)",
            )
        else:
            status = m.get("status", _status, None)
    return status, m.section("headers", _headers, None), m.section("body", _body, None)


def _status(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 400 <= value <= 599:
        raise ValueError(f"status must be an HTTP error status, 400 to 599, got {show(value)}")
    return value


def _headers(walk: Walk, node: yaml.Node, path: str) -> tuple[tuple[str, str | None], ...]:
    m = walk.mapping(node, path, None)
    if m is None:
        return ()
    out: list[tuple[str, str | None]] = []
    for name, entry in m.entries.items():
        where = m.child(name)
        lower = name.lower()
        try:
            values.header_name(name, name)
        except ValueError as exc:
            walk.error(entry.key_node, where, str(exc))
            continue
        if lower.startswith(QUOTA_PREFIX):
            walk.error(entry.key_node, where, f"{name} is the proxy's own header: a preset cannot set or remove it")
        elif lower in _FRAMING:
            walk.error(entry.key_node, where, f"{name} frames the answer: the proxy writes it")
        elif is_null(entry.value_node):
            out.append((name, None))  # removes the proxy's header of that name
        else:
            value = walk.leaf(entry.value_node, where, name, _header_value, None)
            if value is not None:
                out.append((name, value))
    return tuple(out)


def _header_value(key: str, value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, str | int | float):
        raise ValueError(f"the value of {key} must be text (or null to remove it), got {show(value)}")
    text = str(value)
    if any(c in text for c in "\r\n\0"):
        raise ValueError(f"the value of {key} must be one line")
    problem = placeholder_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


def _body(walk: Walk, node: yaml.Node, path: str) -> str | None:
    if not isinstance(node, yaml.MappingNode):
        walk.error(node, path, f"body must be a JSON object (a mapping), got {walk.describe(node)}")
        return None
    mark = walk.mark()
    value = _json(walk, node, path)
    return json.dumps(value, separators=(",", ":")) if walk.clean_since(mark) else None


def _json(walk: Walk, node: yaml.Node, path: str) -> object:
    """A YAML node as JSON data; strings' placeholders checked where they are written."""
    if isinstance(node, yaml.MappingNode):
        m = walk.mapping(node, path, None)
        if m is None:
            return {}
        out: dict[str, object] = {}
        for key, entry in m.entries.items():
            problem = placeholder_problem(key)
            if problem is not None:
                walk.error(entry.key_node, m.child(key), problem)
            out[key] = _json(walk, entry.value_node, m.child(key))
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_json(walk, item, f"{path}[{i}]") for i, item in enumerate(node.value)]
    try:
        value = walk.value(node)
    except ValueError as exc:
        walk.error(node, path, str(exc))
        return None
    if isinstance(value, str):
        problem = placeholder_problem(value)
        if problem is not None:
            walk.error(node, path, problem)
        return value
    if value is None or isinstance(value, bool | int | float):
        return value
    walk.error(node, path, f"{show(value)} is not a JSON value (quote it to make it text)")
    return None


def _merged(
    base: tuple[tuple[str, str | None], ...], changes: tuple[tuple[str, str | None], ...]
) -> tuple[tuple[str, str | None], ...]:
    """``base`` with ``changes``: a header of the same name (any case) replaced."""
    names = {name.lower() for name, _ in changes}
    return tuple((n, v) for n, v in base if n.lower() not in names) + changes
