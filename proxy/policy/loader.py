"""YAML policy → the frozen ``Policy`` model, validated once at the boundary.

The loader walks PyYAML's node tree (``yaml.compose``) instead of loaded Python
objects, so every problem names the 1-based line of the offending node as well
as its path (``vendors[0].limits[1].per``). It never stops at the first problem:
all of them are collected and raised together as ``ConfigErrors``, sorted by line.

Each section has a builder ``(walk, node, path) -> model object`` that falls back
to the model's defaults where a value is missing or wrong; a wrong value has
already been recorded by then, so the fallback never reaches a running proxy.
Leaf values go through small parsers ``(key, value) -> T`` that raise ValueError
with the message an operator sees.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeVar
from urllib.parse import urlsplit

import yaml
import yaml.constructor

from proxy.names import TENANT_NAME, format_authority, parse_host, parse_host_port, parse_port, split_host_port
from proxy.policy.durations import format_duration, parse_duration, show
from proxy.policy.errors import ConfigError, ConfigErrors
from proxy.policy.model import (
    ACTIONS,
    CONNECT_MODES,
    FAILURE_MODES,
    Action,
    Address,
    Breaker,
    ConnectMode,
    FailureMode,
    Feedback,
    Limit,
    OnLimit,
    Policy,
    StoreSettings,
    TenantLimits,
    TenantSettings,
    Timeouts,
    TlsSettings,
    Vendor,
)

if TYPE_CHECKING:
    from proxy.tlsca import CertificateAuthority

__all__ = ["load_policy", "mask_password", "parse_address", "parse_policy", "parse_store_url"]

T = TypeVar("T")
Leaf = Callable[[str, object], T]
"""Parses one scalar value; ``key`` is there for messages like ``rate must be a positive number``."""

# Defaults live in the model; these instances are how the loader reads them
# (slots dataclasses keep no class-level defaults).
_POLICY: Final = Policy()
_STORE: Final = StoreSettings()
_BREAKER: Final = Breaker()
_TENANT: Final = TenantSettings()
_TLS: Final = TlsSettings()
_VENDOR: Final = Vendor(name="")
_ON_LIMIT: Final = OnLimit()
_FEEDBACK: Final = Feedback()
_TIMEOUTS: Final = Timeouts()
_DEFAULT_PER: Final = 1.0

_ROOT_KEYS = (
    "version", "listen", "admin_listen", "store", "tenant", "vendors", "tls", "drain_timeout", "access_log",
)  # fmt: skip
_STORE_KEYS = ("url", "timeout", "on_failure", "key_prefix", "breaker")
_BREAKER_KEYS = ("failures", "cooloff")
_TENANT_KEYS = ("header", "default")
_TLS_KEYS = ("upstream_verify", "upstream_ca_file", "ca_cert", "ca_key", "leaf_validity")
_VENDOR_KEYS = (
    "name", "hosts", "route", "upstream", "limits", "tenant_limits", "on_limit", "feedback", "connect",
    "timeouts", "max_tunnels",
)  # fmt: skip
_LIMIT_KEYS = ("rate", "per", "burst")
_TENANT_LIMITS_KEYS = ("default", "overrides")
_ON_LIMIT_KEYS = ("action", "max_hold")
_FEEDBACK_KEYS = ("remaining_header", "low_watermark", "retry_after_default", "max_retry_after")
_TIMEOUTS_KEYS = ("connect", "read")

_STORE_SCHEMES = ("memory", "redis", "rediss", "redis+cluster")
_VENDOR_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEADER_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token
_KEY_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]+")  # no "{}": the vendor hash tag must stay the only one
_ROUTE_SEGMENT_RE = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@%-]+")
_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NULL_TAG = "tag:yaml.org,2002:null"
_MAP_TAG = "tag:yaml.org,2002:map"


# ---------------------------------------------------------------- entry points


def load_policy(path: str | os.PathLike[str], *, check_ca: bool = True) -> Policy:
    """Read and validate a policy file; ConfigErrors lists every problem found.

    ``check_ca=False`` skips loading the files ``tls.ca_cert`` and ``tls.ca_key`` name
    (``quota-proxy ca init -c`` reads the policy to create them).
    """
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        message = f"cannot read policy: {exc.strerror or exc}"
        raise ConfigErrors([ConfigError(source, None, "", message)]) from None
    except UnicodeDecodeError as exc:
        message = f"cannot read policy: not UTF-8 ({exc.reason} at byte {exc.start})"
        raise ConfigErrors([ConfigError(source, None, "", message)]) from None
    return parse_policy(text, source, check_ca=check_ca)


def parse_policy(
    text: str, source: str, *, base_dir: str | os.PathLike[str] | None = None, check_ca: bool = True
) -> Policy:
    """Validate policy text; ``source`` names it in messages and becomes ``Policy.source``.

    Relative TLS file paths resolve against ``base_dir``, by default the directory of ``source``.
    When both ``tls.ca_cert`` and ``tls.ca_key`` are set, the files must hold a usable CA
    (``proxy.tlsca.CertificateAuthority.load``), unless ``check_ca`` is false.
    """
    root = _compose(text, source)
    walk = _Walk(source, Path(base_dir) if base_dir is not None else Path(source).parent, check_ca=check_ca)
    policy = _policy(walk, root)
    errors = walk.errors()
    if errors:
        raise ConfigErrors(errors)
    return policy


def parse_address(text: str) -> Address:
    """``HOST:PORT`` or ``[IPv6]:PORT`` → Address (port 0 = any free port); ValueError otherwise.

    Shared with the command line, whose ``--listen`` flags must obey the file's rules.
    """
    host, port = split_host_port(text)
    if not host or port is None:
        raise ValueError(f"{show(text)} is not HOST:PORT (e.g. 127.0.0.1:8080 or [::1]:8080)")
    return Address(parse_host(host), parse_port(port, text, minimum=0))


def parse_store_url(text: str) -> str:
    """Check a ``memory://``, ``redis://``, ``rediss://`` or ``redis+cluster://`` URL; ValueError otherwise.

    Returned unchanged (credentials included, the store needs them); messages mask the password.
    """
    shown = show(mask_password(text))
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(f"store url {shown} is not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in _STORE_SCHEMES or not text[len(scheme) :].startswith("://"):
        raise ValueError(f"url must be memory://, redis://, rediss:// or redis+cluster://, got {shown}")
    if scheme == "memory":
        if text[len("memory://") :]:
            raise ValueError(f"url {shown}: memory:// takes no host, path or options")
        return text
    if not parts.hostname:
        raise ValueError(f"url {shown} needs a host")
    if port == 0:
        raise ValueError(f"url {shown} has an invalid port")
    database = parts.path.strip("/")
    cluster = scheme == "redis+cluster"  # a cluster has database 0 only
    if database and not (database == "0" or (database.isdigit() and not cluster)):
        raise ValueError(f"url {shown}: the path must be a database number (0 for a cluster)")
    return text


def mask_password(url: str) -> str:
    """The URL with its password, if any, replaced by ``***``: messages and summaries get printed."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hostpart}"


def _compose(text: str, source: str) -> yaml.Node:
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
    if root is None or _is_null(root):
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


# ---------------------------------------------------------------- walking nodes


class _Shape:
    """Stands for a mapping or a list where a scalar was expected; messages only need its name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name

    __repr__ = __str__


_A_MAPPING: Final = _Shape("a mapping")
_A_LIST: Final = _Shape("a list")


def _line(node: yaml.Node) -> int:
    mark = node.start_mark
    return mark.line + 1 if mark is not None else 1


def _join(path: str, key: str) -> str:
    # Tenant names may hold "." or spaces; quoting keeps the path unambiguous.
    step = key if _PLAIN_KEY_RE.fullmatch(key) else show(key)
    return f"{path}.{step}" if path else step


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL_TAG


class _Walk:
    """One load in progress: where the text came from and every problem found so far."""

    def __init__(self, source: str, base_dir: Path, *, check_ca: bool = True) -> None:
        self.source = source
        self.base_dir = base_dir
        self.check_ca = check_ca
        self.ca: CertificateAuthority | None = None
        """The interception CA, once loaded: intercepted hosts must be within its name constraints."""
        self.found: list[tuple[int, ConfigError]] = []
        """(column, problem) pairs; the column orders problems that share a line."""
        self._constructor = yaml.constructor.SafeConstructor()

    def error(self, node: yaml.Node, path: str, message: str) -> None:
        column = node.start_mark.column if node.start_mark is not None else 0
        self.found.append((column, ConfigError(self.source, _line(node), path, message)))

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
        """A scalar's Python value (YAML 1.1 safe types); collections become a _Shape."""
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

    def mapping(self, node: yaml.Node, path: str, allowed: Collection[str] | None) -> _Mapping | None:
        """The node as a checked mapping; null counts as empty, so a section whose keys are
        all commented out means "defaults"."""
        if _is_null(node):
            empty = yaml.MappingNode(_MAP_TAG, [], node.start_mark, node.end_mark)
            return _Mapping(self, empty, path, allowed)
        if not isinstance(node, yaml.MappingNode):
            self.error(node, path, f"expected a mapping, got {self.describe(node)}")
            return None
        return _Mapping(self, node, path, allowed)

    def sequence(self, node: yaml.Node, path: str) -> list[yaml.Node] | None:
        """The node's items; null counts as an empty list."""
        if _is_null(node):
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.error(node, path, f"expected a list, got {self.describe(node)}")
            return None
        return list(node.value)


@dataclass
class _Entry:
    key_node: yaml.Node
    value_node: yaml.Node


class _Mapping:
    """A YAML mapping whose keys were checked: unknown and duplicate keys are reported, ``<<``
    merges are applied (explicit keys win, then earlier merges), values are looked up by key."""

    def __init__(
        self,
        walk: _Walk,
        node: yaml.MappingNode,
        path: str,
        allowed: Collection[str] | None,
        merging: frozenset[int] = frozenset(),
    ) -> None:
        self.walk = walk
        self.node = node
        self.path = path
        self.entries: dict[str, _Entry] = {}
        merged: list[tuple[str, _Entry]] = []
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
                self.entries[key] = _Entry(key_node, value_node)
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
    ) -> Iterator[tuple[str, _Entry]]:
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        for source in sources:
            if not isinstance(source, yaml.MappingNode):
                self.walk.error(source, self.path, "<< merges a mapping or a list of mappings")
            elif id(source) not in merging:  # a mapping merging itself would never end
                yield from _Mapping(self.walk, source, self.path, allowed, merging).entries.items()

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
        if not self.has(key):
            self.walk.error(self.node, self.path, f'missing required key "{key}"')
            return placeholder
        return self.get(key, parse, placeholder)

    def require_section(self, key: str, build: Callable[[_Walk, yaml.Node, str], T], placeholder: T) -> T:
        if not self.has(key):
            self.walk.error(self.node, self.path, f'missing required key "{key}"')
            return placeholder
        return self.section(key, build, placeholder)

    def section(self, key: str, build: Callable[[_Walk, yaml.Node, str], T], default: T) -> T:
        node = self.node_of(key)
        return default if node is None else build(self.walk, node, self.child(key))


# ---------------------------------------------------------------- leaf parsers


def _string(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {show(value)}")
    return value


def _boolean(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {show(value)}")
    return value


def _number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {show(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {show(value)}")
    return float(value)


def _positive_number(key: str, value: object) -> float:
    number = _number(key, value)
    if number <= 0:
        raise ValueError(f"{key} must be a positive number")
    return number


def _non_negative_number(key: str, value: object) -> float:
    number = _number(key, value)
    if number < 0:
        raise ValueError(f"{key} must not be negative")
    return number


def _burst(key: str, value: object) -> float:
    # A bucket smaller than one token could never grant a request.
    number = _number(key, value)
    if number < 1:
        raise ValueError(f"{key} must be at least 1")
    return number


def _integer_at_least(minimum: int) -> Leaf[int]:
    def parse(key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {show(value)}")
        if value < minimum:
            raise ValueError(f"{key} must be at least {minimum}")
        return value

    return parse


def _duration(key: str, value: object) -> float:
    if isinstance(value, _Shape):
        raise ValueError(f"expected a duration, got {value}")
    return parse_duration(value)


def _positive_duration(key: str, value: object) -> float:
    seconds = _duration(key, value)
    if seconds <= 0:
        raise ValueError(f"{key} must be greater than 0")
    return seconds


def _choice(options: tuple[T, ...]) -> Leaf[T]:
    """One of a Literal's values, e.g. ``hold | defer | shed``."""

    def parse(key: str, value: object) -> T:
        for option in options:
            if value == option:
                return option
        listed = ", ".join(str(o) for o in options[:-1]) + f" or {options[-1]}"
        raise ValueError(f"{key} must be {listed}, got {show(value)}")

    return parse


def _nullable(parse: Leaf[T]) -> Leaf[T | None]:
    def nullable(key: str, value: object) -> T | None:
        return None if value is None else parse(key, value)

    return nullable


def _version(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value != 1:
        raise ValueError(f"version must be 1, got {show(value)}")
    return 1


def _address(key: str, value: object) -> Address:
    return parse_address(_string(key, value))


def _store_url(key: str, value: object) -> str:
    return parse_store_url(_string(key, value))


def _key_prefix(key: str, value: object) -> str:
    text = _string(key, value)
    if not _KEY_PREFIX_RE.fullmatch(text):
        raise ValueError(f"key_prefix must be letters, digits and _.:- only, got {show(text)}")
    return text


def _header_name(key: str, value: object) -> str:
    text = _string(key, value)
    if not _HEADER_RE.fullmatch(text):
        raise ValueError(f"{show(text)} is not a valid header name")
    return text


def _tenant_name(key: str, value: object) -> str:
    text = _string(key, value)
    if not TENANT_NAME.fullmatch(text):
        raise ValueError(f"{show(text)} is not a valid tenant name (letters, digits and ._:@-, at most 128)")
    return text


def _vendor_name(key: str, value: object) -> str:
    text = _string(key, value)
    if not _VENDOR_NAME_RE.fullmatch(text):
        raise ValueError(f"{show(text)} is not a valid vendor name (letters, digits and _.-, at most 64)")
    return text


def _route(key: str, value: object) -> str:
    text = _string(key, value)
    if not text.startswith("/"):
        raise ValueError(f'route {show(text)} must start with "/"')
    if text.endswith("/"):
        raise ValueError(f'route {show(text)} must not end with "/"')
    segments = text[1:].split("/")
    if any(s in ("", ".", "..") or not _ROUTE_SEGMENT_RE.fullmatch(s) for s in segments):
        raise ValueError(f"route {show(text)} is not a plain path prefix")
    return text


def _upstream(key: str, value: object) -> str:
    """``scheme://host[:port]``, lower-cased, trailing slash dropped."""
    text = _string(key, value)
    not_origin = f"upstream {show(text)} must be an http:// or https:// origin"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError(not_origin) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ValueError(not_origin)
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"upstream {show(text)} must not carry credentials")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in text or "#" in text:
        raise ValueError(f"{not_origin}, without a path, query or fragment")
    return f"{scheme}://{format_authority(parse_host(parts.hostname), port)}"


def _vendor_host(key: str, value: object) -> str:
    """``host`` or ``host:port``, lower-cased; IPv6 always in brackets (``[::1]``, ``[::1]:8443``)."""
    return format_authority(*parse_host_port(_string(key, value)))


def _file_path(base_dir: Path, *, must_exist: bool) -> Leaf[str | None]:
    """A path relative to the policy file's directory, stored absolute; null stays None."""

    def parse(key: str, value: object) -> str | None:
        if value is None:
            return None
        text = _string(key, value)
        if not text:
            raise ValueError(f"{key} must be a path or null, got an empty string")
        resolved = os.path.abspath(base_dir / os.path.expanduser(text))
        if must_exist and not os.path.isfile(resolved):
            raise ValueError(f"{show(text)} is not a file (looked at {resolved})")
        return resolved

    return parse


# ---------------------------------------------------------------- sections


def _policy(walk: _Walk, root: yaml.Node) -> Policy:
    m = walk.mapping(root, "", _ROOT_KEYS)
    if m is None:
        return Policy(source=walk.source)
    version = m.require("version", _version, 1)
    listeners = walk.mark()
    listen = m.get("listen", _address, _POLICY.listen)
    admin_listen = m.get("admin_listen", _address, _POLICY.admin_listen)
    if walk.clean_since(listeners):
        _check_listeners(m, listen, admin_listen)
    tls = m.section("tls", _tls, _TLS)
    return Policy(
        version=version,
        listen=listen,
        admin_listen=admin_listen,
        store=m.section("store", _store, _STORE),
        tenant=m.section("tenant", _tenant, _TENANT),
        vendors=m.require_section("vendors", lambda w, n, p: _vendors(w, n, p, tls), ()),
        tls=tls,
        drain_timeout=m.get("drain_timeout", _duration, _POLICY.drain_timeout),
        access_log=m.get("access_log", _boolean, _POLICY.access_log),
        source=walk.source,
    )


def _check_listeners(m: _Mapping, listen: Address, admin: Address) -> None:
    """Both servers cannot bind one port (0 = the OS picks, so never a clash)."""
    if listen.port == 0 or listen.port != admin.port:
        return
    wildcard = {"0.0.0.0", "::"}
    if listen.host == admin.host or listen.host in wildcard or admin.host in wildcard:
        key = "admin_listen" if m.has("admin_listen") else "listen"
        node = m.node_of(key) or m.node
        m.walk.error(node, m.child(key), f"listen {listen} and admin_listen {admin} use the same port")


def _store(walk: _Walk, node: yaml.Node, path: str) -> StoreSettings:
    m = walk.mapping(node, path, _STORE_KEYS)
    if m is None:
        return _STORE
    on_failure: FailureMode = m.get("on_failure", _choice(FAILURE_MODES), _STORE.on_failure)
    return StoreSettings(
        url=m.get("url", _store_url, _STORE.url),
        timeout=m.get("timeout", _positive_duration, _STORE.timeout),
        on_failure=on_failure,
        key_prefix=m.get("key_prefix", _key_prefix, _STORE.key_prefix),
        breaker=m.section("breaker", _breaker, _BREAKER),
    )


def _breaker(walk: _Walk, node: yaml.Node, path: str) -> Breaker:
    m = walk.mapping(node, path, _BREAKER_KEYS)
    if m is None:
        return _BREAKER
    return Breaker(
        failures=m.get("failures", _integer_at_least(1), _BREAKER.failures),
        cooloff=m.get("cooloff", _positive_duration, _BREAKER.cooloff),
    )


def _tenant(walk: _Walk, node: yaml.Node, path: str) -> TenantSettings:
    m = walk.mapping(node, path, _TENANT_KEYS)
    if m is None:
        return _TENANT
    return TenantSettings(
        header=m.get("header", _header_name, _TENANT.header),
        default=m.get("default", _nullable(_tenant_name), _TENANT.default),
    )


def _tls(walk: _Walk, node: yaml.Node, path: str) -> TlsSettings:
    m = walk.mapping(node, path, _TLS_KEYS)
    if m is None:
        return _TLS
    ca_cert = m.get("ca_cert", _file_path(walk.base_dir, must_exist=False), _TLS.ca_cert)
    ca_key = m.get("ca_key", _file_path(walk.base_dir, must_exist=False), _TLS.ca_key)
    if (ca_cert is None) != (ca_key is None):
        key = "ca_cert" if ca_cert is not None else "ca_key"
        walk.error(m.node_of(key) or m.node, m.child(key), "ca_cert and ca_key must be set together")
    elif ca_cert is not None and ca_key is not None and walk.check_ca:
        _check_ca_files(m, ca_cert, ca_key)
    return TlsSettings(
        upstream_verify=m.get("upstream_verify", _boolean, _TLS.upstream_verify),
        upstream_ca_file=m.get("upstream_ca_file", _file_path(walk.base_dir, must_exist=True), _TLS.upstream_ca_file),
        ca_cert=ca_cert,
        ca_key=ca_key,
        leaf_validity=m.get("leaf_validity", _positive_duration, _TLS.leaf_validity),
    )


def _check_ca_files(m: _Mapping, ca_cert: str, ca_key: str) -> None:
    """The CA must load as the proxy will load it; each problem goes on the line of the file
    it is about, and a bad certificate does not hide a bad key."""
    from proxy.tlsca import CAError, CertificateAuthority, load_ca_key  # cryptography only when a CA is set

    def report(exc: CAError) -> None:
        key = "ca_key" if exc.role == "key" else "ca_cert"
        m.walk.error(m.node_of(key) or m.node, m.child(key), f"{exc.path}: {exc.problem}")

    try:
        m.walk.ca = CertificateAuthority.load(ca_cert, ca_key)
    except CAError as exc:
        report(exc)
        if exc.role == "certificate":
            try:
                load_ca_key(ca_key)
            except CAError as key_exc:
                report(key_exc)


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


def _vendors(walk: _Walk, node: yaml.Node, path: str, tls: TlsSettings) -> tuple[Vendor, ...]:
    items = walk.sequence(node, path)
    if items is None:
        return ()
    if not items:
        walk.error(node, path, "at least one vendor is required")
    claims = _Claims()
    vendors = (_vendor(walk, item, f"{path}[{i}]", tls, claims) for i, item in enumerate(items))
    return tuple(v for v in vendors if v is not None)


def _vendor(walk: _Walk, node: yaml.Node, path: str, tls: TlsSettings, claims: _Claims) -> Vendor | None:
    m = walk.mapping(node, path, _VENDOR_KEYS)
    if m is None:
        return None
    name = m.require("name", _vendor_name, "")
    if name:
        _claim_name(m, name, claims)
    hosts, route = _targets(m, _Owner(path, name or path), claims)
    connect = _connect(m, tls)
    if connect == "intercept":
        _check_constraints(m, hosts)
    return Vendor(
        name=name,
        hosts=hosts,
        route=route,
        upstream=m.get("upstream", _nullable(_upstream), None),
        limits=m.require_section("limits", _vendor_limits, ()),
        tenant_limits=m.section("tenant_limits", _tenant_limits, TenantLimits()),
        on_limit=m.section("on_limit", _on_limit, _ON_LIMIT),
        feedback=m.section("feedback", _feedback, _FEEDBACK),
        connect=connect,
        timeouts=m.section("timeouts", _timeouts, _TIMEOUTS),
        max_tunnels=m.get("max_tunnels", _integer_at_least(1), _VENDOR.max_tunnels),
    )


def _targets(m: _Mapping, owner: _Owner, claims: _Claims) -> tuple[tuple[str, ...], str | None]:
    """The vendor's hosts and route, each claimed for this vendor alone."""
    hosts = m.section("hosts", lambda w, n, p: _hosts(w, n, p, owner, claims), _VENDOR.hosts)
    route = m.get("route", _nullable(_route), None)
    if route is not None:
        _claim_route(m, route, owner, claims)
        if not m.has("upstream"):  # origin-form requests name no origin to fall back on
            m.walk.error(m.node_of("route") or m.node, m.child("route"), f'route "{route}" needs an upstream')
    # Judged on what was written, so a malformed route or hosts list is reported only once.
    if _absent(m.node_of("route")) and _absent(m.node_of("hosts")):
        m.walk.error(m.node, m.path, "a vendor needs hosts or a route")
    return hosts, route


def _connect(m: _Mapping, tls: TlsSettings) -> ConnectMode:
    default: ConnectMode = "intercept" if tls.ca_cert is not None else "deny"
    connect: ConnectMode = m.get("connect", _choice(CONNECT_MODES), default)
    # Only an explicit intercept is reported here; a half-set CA is already a tls error.
    if connect == "intercept" and (tls.ca_cert is None or tls.ca_key is None) and m.has("connect"):
        m.walk.error(m.node_of("connect") or m.node, m.child("connect"), _INTERCEPT_NEEDS_CA)
    return connect


_INTERCEPT_NEEDS_CA = "connect: intercept needs tls.ca_cert and tls.ca_key"


def _check_constraints(m: _Mapping, hosts: tuple[str, ...]) -> None:
    """An intercepted host the CA may not vouch for would only show up as failed
    handshakes: say so here, on the host's own line."""
    ca = m.walk.ca
    node = m.node_of("hosts")
    if ca is None or not isinstance(node, yaml.SequenceNode):
        return
    for i, (entry, item) in enumerate(zip(hosts, node.value, strict=False)):
        host = split_host_port(entry)[0]
        if not ca.permits(host):
            m.walk.error(item, f"{m.child('hosts')}[{i}]",
                         f'host "{host}" is outside the name constraints of the CA in tls.ca_cert '
                         "(re-create it with: quota-proxy ca init -c POLICY)")


def _claim_name(m: _Mapping, name: str, claims: _Claims) -> None:
    node = m.node_of("name") or m.node
    first = claims.names.get(name)
    if first is None:
        claims.names[name] = _line(node)
    else:
        m.walk.error(node, m.child("name"), f'duplicate vendor name "{name}" (first at line {first})')


def _absent(node: yaml.Node | None) -> bool:
    return node is None or _is_null(node) or (isinstance(node, yaml.SequenceNode) and not node.value)


def _claim_route(m: _Mapping, route: str, owner: _Owner, claims: _Claims) -> None:
    other = claims.routes.setdefault(route, owner)
    if other != owner:
        node = m.node_of("route") or m.node
        m.walk.error(node, m.child("route"), f'route "{route}" already belongs to vendor "{other.name}"')


def _hosts(walk: _Walk, node: yaml.Node, path: str, owner: _Owner, claims: _Claims) -> tuple[str, ...]:
    items = walk.sequence(node, path)
    hosts: list[str] = []
    for i, item in enumerate(items or ()):
        host = walk.leaf(item, f"{path}[{i}]", "host", _vendor_host, None)
        if host is None:
            continue
        if _claim_host(walk, item, f"{path}[{i}]", host, owner, claims):
            hosts.append(host)
    return tuple(hosts)


def _claim_host(walk: _Walk, node: yaml.Node, path: str, host: str, owner: _Owner, claims: _Claims) -> bool:
    """A host without a port matches every port, so it overlaps any entry for the same name."""
    name, port = split_host_port(host)
    for entry, other in claims.hosts.get(name, []):
        other_port = split_host_port(entry)[1]
        if other == owner and entry == host:
            walk.error(node, path, f'host "{host}" is listed twice')
            return False
        if other != owner and (port is None or other_port is None or port == other_port):
            walk.error(node, path, f'host "{host}" already belongs to vendor "{other.name}"')
            return False
    claims.hosts.setdefault(name, []).append((host, owner))
    return True


def _vendor_limits(walk: _Walk, node: yaml.Node, path: str) -> tuple[Limit, ...]:
    return _limits(walk, node, path, required=True)


def _limits(walk: _Walk, node: yaml.Node, path: str, *, required: bool) -> tuple[Limit, ...]:
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


def _limit(walk: _Walk, node: yaml.Node, path: str) -> Limit | None:
    m = walk.mapping(node, path, _LIMIT_KEYS)
    if m is None:
        return None
    rate = m.require("rate", _positive_number, 1.0)
    per = m.get("per", _positive_duration, _DEFAULT_PER)
    # Burst defaults to the rate, but a bucket below one token would never grant.
    burst = m.get("burst", _burst, max(rate, 1.0))
    return Limit(rate=rate, per=per, burst=burst)


def _tenant_limits(walk: _Walk, node: yaml.Node, path: str) -> TenantLimits:
    m = walk.mapping(node, path, _TENANT_LIMITS_KEYS)
    if m is None:
        return TenantLimits()
    return TenantLimits(
        default=m.section("default", _optional_limits, ()),
        overrides=m.section("overrides", _overrides, ()),
    )


def _optional_limits(walk: _Walk, node: yaml.Node, path: str) -> tuple[Limit, ...]:
    """Tenant limits may be empty: an override of ``[]`` exempts a tenant from tenant buckets."""
    return _limits(walk, node, path, required=False)


def _overrides(walk: _Walk, node: yaml.Node, path: str) -> tuple[tuple[str, tuple[Limit, ...]], ...]:
    m = walk.mapping(node, path, None)
    if m is None:
        return ()
    overrides: list[tuple[str, tuple[Limit, ...]]] = []
    for tenant, entry in m.entries.items():
        sub = m.child(tenant)
        try:
            _tenant_name("tenant", tenant)
        except ValueError as exc:
            walk.error(entry.key_node, sub, str(exc))
            continue
        overrides.append((tenant, _optional_limits(walk, entry.value_node, sub)))
    return tuple(overrides)


def _on_limit(walk: _Walk, node: yaml.Node, path: str) -> OnLimit:
    m = walk.mapping(node, path, _ON_LIMIT_KEYS)
    if m is None:
        return _ON_LIMIT
    action: Action = m.get("action", _choice(ACTIONS), _ON_LIMIT.action)
    return OnLimit(action=action, max_hold=m.get("max_hold", _duration, _ON_LIMIT.max_hold))


def _feedback(walk: _Walk, node: yaml.Node, path: str) -> Feedback:
    m = walk.mapping(node, path, _FEEDBACK_KEYS)
    if m is None:
        return _FEEDBACK
    mark = walk.mark()
    retry_after_default = m.get("retry_after_default", _positive_duration, _FEEDBACK.retry_after_default)
    max_retry_after = m.get("max_retry_after", _positive_duration, _FEEDBACK.max_retry_after)
    if walk.clean_since(mark) and retry_after_default > max_retry_after:
        key = "retry_after_default" if m.has("retry_after_default") else "max_retry_after"
        message = (
            f"retry_after_default ({format_duration(retry_after_default)}) exceeds "
            f"max_retry_after ({format_duration(max_retry_after)})"
        )
        walk.error(m.node_of(key) or m.node, m.child(key), message)
    return Feedback(
        remaining_header=m.get("remaining_header", _nullable(_header_name), _FEEDBACK.remaining_header),
        low_watermark=m.get("low_watermark", _non_negative_number, _FEEDBACK.low_watermark),
        retry_after_default=retry_after_default,
        max_retry_after=max_retry_after,
    )


def _timeouts(walk: _Walk, node: yaml.Node, path: str) -> Timeouts:
    m = walk.mapping(node, path, _TIMEOUTS_KEYS)
    if m is None:
        return _TIMEOUTS
    return Timeouts(
        connect=m.get("connect", _positive_duration, _TIMEOUTS.connect),
        read=m.get("read", _positive_duration, _TIMEOUTS.read),
    )
