"""Walking PyYAML's node tree: every problem gets the file, the 1-based line and the YAML path.

``compose`` turns the text into a node tree (syntax errors become ``ConfigErrors``);
``Walk`` is one load in progress and collects every problem instead of stopping at the
first; ``CheckedMapping`` reports unknown keys (with a did-you-mean), duplicate keys and
applies ``<<`` merges. Section builders (``sections``, ``vendors``) read values through
``CheckedMapping.get`` with a leaf parser from ``values``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeAlias, TypeVar

import yaml
import yaml.constructor

from proxy.policy.durations import show
from proxy.policy.errors import ConfigError, ConfigErrors

if TYPE_CHECKING:
    from proxy.ca.authority import CertificateAuthority

T = TypeVar("T")
Leaf: TypeAlias = Callable[[str, object], T]
"""Parses one scalar value; ``key`` is there for messages like ``rate must be a positive number``."""
Build: TypeAlias = Callable[["Walk", yaml.Node, str], T]
"""Builds one section (a mapping or a list) from its node and YAML path."""

_PLAIN_KEY_RE: Final = re.compile(r"[A-Za-z0-9_-]+")
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"
_NULL_TAG: Final = "tag:yaml.org,2002:null"
_MAP_TAG: Final = "tag:yaml.org,2002:map"


def compose(text: str, source: str) -> yaml.Node:
    """The document's root node; ConfigErrors for syntax errors and an empty document."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise ConfigErrors([ConfigError(source, line, "", _yaml_message(exc))]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow, e.g. a NUL byte
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigErrors([ConfigError(source, line, "", f"invalid character: {exc.reason}")]) from None
    if root is None or is_null(root):
        raise ConfigErrors([ConfigError(source, 1, "", "the policy is empty")])
    return root


def _yaml_message(exc: yaml.MarkedYAMLError) -> str:
    """PyYAML's problem and context, without its own "in <file>, line N" lines."""
    problem = exc.problem or "invalid YAML"
    if not exc.context:
        return f"invalid YAML: {problem}"
    where = f" at line {exc.context_mark.line + 1}" if exc.context_mark is not None else ""
    if problem.startswith("but "):  # "expected a single document in the stream, but found another document"
        return f"invalid YAML: {exc.context}{where}, {problem}"
    return f"invalid YAML: {problem} ({exc.context}{where})"


class Shape:
    """Stands for a mapping or a list where a scalar was expected; messages only need its name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


_A_MAPPING: Final = Shape("a mapping")
_A_LIST: Final = Shape("a list")


def line_of(node: yaml.Node) -> int:
    mark = node.start_mark
    return mark.line + 1 if mark is not None else 1


def _join(path: str, key: str) -> str:
    # Tenant names may hold "." or spaces; quoting keeps the path unambiguous.
    step = key if _PLAIN_KEY_RE.fullmatch(key) else show(key)
    return f"{path}.{step}" if path else step


def is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL_TAG


class Walk:
    """One load in progress: where the text came from and every problem found so far."""

    def __init__(self, source: str, base_dir: Path, *, check_ca: bool = True) -> None:
        self.source = source
        self.base_dir = base_dir
        self.check_ca = check_ca
        self.ca: CertificateAuthority | None = None
        """The interception CA, once loaded: intercepted hosts must be within its name constraints."""
        self.found: list[tuple[int, ConfigError]] = []
        """(column, problem) pairs; the column orders problems that share a line."""
        self.warnings: list[ConfigError] = []
        """What deserves the operator's attention without stopping the load (in file order)."""
        self._constructor = yaml.constructor.SafeConstructor()

    def error(self, node: yaml.Node, path: str, message: str) -> None:
        column = node.start_mark.column if node.start_mark is not None else 0
        self.found.append((column, ConfigError(self.source, line_of(node), path, message)))

    def warn(self, node: yaml.Node, path: str, message: str) -> None:
        """A problem that does not stop the load: ``check`` prints it, ``run`` logs it."""
        self.warnings.append(ConfigError(self.source, line_of(node), path, message))

    def errors(self) -> list[ConfigError]:
        """Every problem once (an anchor merged twice reports once), in file order."""
        ordered = sorted(dict.fromkeys(self.found), key=lambda found: (found[1].line or 0, found[0]))
        return [error for _, error in ordered]

    def mark(self) -> int:
        """A checkpoint for ``clean_since``: cross-checks only compare values that parsed."""
        return len(self.found)

    def clean_since(self, mark: int) -> bool:
        return len(self.found) == mark

    def value(self, node: yaml.Node) -> object:
        """A scalar's Python value (YAML 1.1 safe types); collections become a Shape."""
        if isinstance(node, yaml.MappingNode):
            return _A_MAPPING
        if isinstance(node, yaml.SequenceNode):
            return _A_LIST
        try:
            return self._constructor.construct_object(node)
        except yaml.constructor.ConstructorError as exc:
            raise ValueError(exc.problem or "unreadable value") from None

    def describe(self, node: yaml.Node) -> str:
        """What the node holds, for "expected X, got Y" messages."""
        try:
            return show(self.value(node))
        except ValueError:
            return f"a value tagged {node.tag}"

    def leaf(self, node: yaml.Node, path: str, key: str, parse: Leaf[T], default: T) -> T:
        try:
            return parse(key, self.value(node))
        except ValueError as exc:
            self.error(node, path, str(exc))
            return default

    def distinct(self, items: list[yaml.Node], path: str, key: str, parse: Leaf[T]) -> tuple[T, ...]:
        """The values of a list's ``items`` (each a leaf ``key`` read by ``parse``), in order:
        one that cannot be read, or that is listed twice, is an error and left out."""
        found: list[T] = []
        for i, item in enumerate(items):
            where = f"{path}[{i}]"
            value = self.leaf(item, where, key, parse, None)
            if value is None:  # (unreadable: leaf said so)
                continue
            if value in found:
                self.error(item, where, f'{key} "{value}" is listed twice')
                continue
            found.append(value)
        return tuple(found)

    def mapping(self, node: yaml.Node, path: str, allowed: Collection[str] | None) -> CheckedMapping | None:
        """The node as a checked mapping; null counts as empty, so a section whose keys are
        all commented out means "defaults"."""
        if is_null(node):
            empty = yaml.MappingNode(_MAP_TAG, [], node.start_mark, node.end_mark)
            return CheckedMapping(self, empty, path, allowed)
        if not isinstance(node, yaml.MappingNode):
            self.error(node, path, f"expected a mapping, got {self.describe(node)}")
            return None
        return CheckedMapping(self, node, path, allowed)

    def sequence(self, node: yaml.Node, path: str) -> list[yaml.Node] | None:
        """The node's items; null counts as an empty list."""
        if is_null(node):
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.error(node, path, f"expected a list, got {self.describe(node)}")
            return None
        return list(node.value)


@dataclass
class Entry:
    key_node: yaml.Node
    value_node: yaml.Node


class CheckedMapping:
    """A YAML mapping whose keys were checked: unknown and duplicate keys are reported, ``<<``
    merges are applied (explicit keys win, then earlier merges), values are looked up by key."""

    def __init__(
        self,
        walk: Walk,
        node: yaml.MappingNode,
        path: str,
        allowed: Collection[str] | None,
        merging: frozenset[int] = frozenset(),
    ) -> None:
        self.walk = walk
        self.node = node
        self.path = path
        self.entries: dict[str, Entry] = {}
        merged: list[tuple[str, Entry]] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                merged.extend(self._merged(value_node, allowed, merging | {id(node)}))
                continue
            key = self._key(key_node, allowed)
            if key is None:
                continue
            if key in self.entries:
                walk.error(key_node, self.child(key), f'duplicate key "{key}"')
            else:
                self.entries[key] = Entry(key_node, value_node)
        for key, entry in merged:
            self.entries.setdefault(key, entry)

    def _key(self, key_node: yaml.Node, allowed: Collection[str] | None) -> str | None:
        if not isinstance(key_node, yaml.ScalarNode):
            self.walk.error(key_node, self.path, f"expected a string key, got {self.walk.describe(key_node)}")
            return None
        key = str(key_node.value)  # the text as written: `123:` names tenant "123"
        if allowed is not None and key not in allowed:
            hint = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
            suffix = f' (did you mean "{hint[0]}"?)' if hint else ""
            self.walk.error(key_node, self.child(key), f'unknown key "{key}"{suffix}')
            return None
        return key

    def _merged(
        self, node: yaml.Node, allowed: Collection[str] | None, merging: frozenset[int]
    ) -> Iterator[tuple[str, Entry]]:
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                self.walk.error(source, self.path, "<< merges a mapping or a list of mappings")
            elif id(source) not in merging:  # a mapping merging itself would never end
                yield from CheckedMapping(self.walk, source, self.path, allowed, merging).entries.items()

    def child(self, key: str) -> str:
        return _join(self.path, key)

    def has(self, key: str) -> bool:
        return key in self.entries

    def node_of(self, key: str) -> yaml.Node | None:
        entry = self.entries.get(key)
        return entry.value_node if entry is not None else None

    def get(self, key: str, parse: Leaf[T], default: T) -> T:
        """The parsed value, or ``default`` when absent (or wrong, which is reported)."""
        node = self.node_of(key)
        return default if node is None else self.walk.leaf(node, self.child(key), key, parse, default)

    def require(self, key: str, parse: Leaf[T], placeholder: T) -> T:
        return self.get(key, parse, placeholder) if self._present(key) else placeholder

    def unique_name(self, key: str, parse: Leaf[str], seen: dict[str, int], what: str) -> str:
        """A required name that must be unique among its siblings (``seen``: name → line of
        its first use): a second use is reported on its own line, naming the first. ``""``
        when missing or wrong."""
        name = self.require(key, parse, "")
        if not name:
            return name
        node = self.node_of(key) or self.node
        first = seen.get(name)
        if first is None:
            seen[name] = line_of(node)
        else:
            self.walk.error(node, self.child(key), f'duplicate {what} name "{name}" (first at line {first})')
        return name

    def section(self, key: str, build: Build[T], default: T) -> T:
        """A nested section built by ``build``, or ``default`` when absent."""
        node = self.node_of(key)
        return default if node is None else build(self.walk, node, self.child(key))

    def require_section(self, key: str, build: Build[T], placeholder: T) -> T:
        return self.section(key, build, placeholder) if self._present(key) else placeholder

    def _present(self, key: str) -> bool:
        if self.has(key):
            return True
        self.walk.error(self.node, self.path, f'missing required key "{key}"')
        return False
