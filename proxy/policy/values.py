"""Leaf parsers: one YAML scalar → one typed value, or ValueError with the message an operator sees.

Every parser has the shape ``(key, value) -> T`` (``walker.Leaf``); ``key`` names the
field in messages such as ``rate must be a positive number``. Most are built by three
factories: ``bounded`` (a parsed value that must pass a check), ``matching`` (a string
that must match a pattern) and ``choice`` (one of a Literal's values).

``parse_address``, ``parse_store_url``, ``parse_admin_token`` and ``mask_password`` are
also public: the command line's ``--listen``, ``--store`` and ``QUOTA_PROXY_ADMIN_TOKEN``
obey the file's rules.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar
from urllib.parse import unquote_plus, urlsplit

from proxy.names import TENANT_NAME, format_authority, parse_host, parse_host_port, parse_port, split_host_port
from proxy.policy.durations import parse_duration, show
from proxy.policy.model import Address
from proxy.policy.walker import Leaf, Shape
from proxy.wire.headers import HOP_BY_HOP, QUOTA_PREFIX

T = TypeVar("T")
N = TypeVar("N", int, float)

_STORE_SCHEMES: Final = ("memory", "redis", "rediss", "redis+cluster")
_TOKEN_RE: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token: header names, methods
_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # vendor and endpoint names: metric labels
_METER_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a metric label and a store key's field
_POINTER_TILDE_RE: Final = re.compile(r"~(?![01])")  # RFC 6901: "~" only as "~0" or "~1"
_ROUTE_SEGMENT_RE: Final = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@%-]+")


# ---------------------------------------------------------------- shared with the command line


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
    """The URL with every credential redis-py would read replaced by ``***``: the password
    of ``user:pass@`` or ``:pass@``, and secret query arguments (``?password=``,
    ``ssl_password``...). Usernames stay. Used wherever a store URL is shown (messages,
    the summary, the ready line, /status), so it errs on the side of hiding: a userinfo
    that holds the URL's own delimiters (a password pasted unencoded) is hidden whole.
    """
    scheme, sep, rest = url.partition("://")
    prefix = scheme + sep if sep else ""
    if not sep:
        rest = url
    end = _userinfo_end(rest)
    if end >= 0:
        userinfo, rest = rest[:end], rest[end + 1 :]
        user, colon, _ = userinfo.partition(":")
        if any(c in userinfo for c in "/?#"):
            prefix += "***@"
        else:
            prefix += f"{user}:***@" if colon else f"{user}@"
    return prefix + _mask_query(rest)


_SECRET_ARGUMENT: Final = re.compile(r"pass|secret|token|credential|auth", re.IGNORECASE)
"""Query arguments that hold a credential; redis-py passes unknown ones on as keywords."""


def _userinfo_end(rest: str) -> int:
    """Where the userinfo ends (its ``@``), or -1: the last ``@`` that is not inside a
    ``name=value`` argument of the query."""
    query = rest.find("?")
    for at in range(len(rest) - 1, -1, -1):
        if rest[at] != "@":
            continue
        if query < 0 or at < query:
            return at
        item = max(rest.rfind("&", query, at), query) + 1
        if "=" not in rest[item:at]:
            return at
    return -1


def _mask_query(rest: str) -> str:
    """``rest`` with the values of its secret query arguments replaced by ``***``."""
    path, sep, query = rest.partition("?")
    if not sep:
        return rest
    query, hash_sign, fragment = query.partition("#")
    items = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        items.append(f"{name}=***" if eq and _SECRET_ARGUMENT.search(unquote_plus(name)) else item)
    return f"{path}?{'&'.join(items)}{hash_sign}{fragment}"


ADMIN_TOKEN_MIN: Final = 16
_BEARER_TOKEN: Final = re.compile(r"[A-Za-z0-9._~+/-]+=*")  # RFC 6750 b64token


def parse_admin_token(text: str) -> str:
    """An admin bearer token (RFC 6750 ``b64token``, at least 16 characters); ValueError
    otherwise. Messages never repeat the token.

    Shared with the command line, whose ``QUOTA_PROXY_ADMIN_TOKEN`` obeys the file's rules.
    """
    if len(text) < ADMIN_TOKEN_MIN:
        raise ValueError(f"the admin token must be at least {ADMIN_TOKEN_MIN} characters long, it has {len(text)}")
    if not _BEARER_TOKEN.fullmatch(text):
        raise ValueError("the admin token may hold only letters, digits and -._~+/ (and = at the end)")
    return text


# ---------------------------------------------------------------- factories


def bounded(parse: Leaf[N], ok: Callable[[N], bool], problem: str) -> Leaf[N]:
    """``parse``, then ``ok`` on the result; ``{key} {problem}`` when it fails."""

    def parse_bounded(key: str, value: object) -> N:
        result = parse(key, value)
        if not ok(result):
            raise ValueError(f"{key} {problem}")
        return result

    return parse_bounded


def matching(pattern: re.Pattern[str], message: str) -> Leaf[str]:
    """A string ``pattern`` matches in full; otherwise ``message``, whose ``{value}`` is the string as written."""

    def parse_matching(key: str, value: object) -> str:
        text = string(key, value)
        if not pattern.fullmatch(text):
            raise ValueError(message.format(value=show(text)))
        return text

    return parse_matching


def choice(options: tuple[T, ...]) -> Leaf[T]:
    """One of a Literal's values, e.g. ``hold | defer | shed``."""

    def parse_choice(key: str, value: object) -> T:
        for option in options:
            if value == option:
                return option
        listed = ", ".join(str(o) for o in options[:-1]) + f" or {options[-1]}"
        raise ValueError(f"{key} must be {listed}, got {show(value)}")

    return parse_choice


def nullable(parse: Leaf[T]) -> Leaf[T | None]:
    """``parse``, except that null stays None."""

    def parse_nullable(key: str, value: object) -> T | None:
        return None if value is None else parse(key, value)

    return parse_nullable


# ---------------------------------------------------------------- scalars


def string(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {show(value)}")
    return value


def boolean(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {show(value)}")
    return value


def number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {show(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {show(value)}")
    return float(value)


def integer(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {show(value)}")
    return value


def duration(key: str, value: object) -> float:
    if isinstance(value, Shape):
        raise ValueError(f"expected a duration, got {value}")
    return parse_duration(value)


positive_number: Final = bounded(number, lambda n: n > 0, "must be a positive number")
non_negative_number: Final = bounded(number, lambda n: n >= 0, "must not be negative")
burst: Final = bounded(number, lambda n: n >= 1, "must be at least 1")
"""A bucket smaller than one token could never grant a request."""
positive_duration: Final = bounded(duration, lambda seconds: seconds > 0, "must be greater than 0")


def integer_at_least(minimum: int) -> Leaf[int]:
    return bounded(integer, lambda n: n >= minimum, f"must be at least {minimum}")


def version(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value != 1:
        raise ValueError(f"version must be 1, got {show(value)}")
    return 1


# ---------------------------------------------------------------- names


key_prefix: Final = matching(
    re.compile(r"[A-Za-z0-9_.:-]+"),  # no "{}": the vendor hash tag must stay the only one
    "key_prefix must be letters, digits and _.:- only, got {value}",
)
header_name: Final = matching(_TOKEN_RE, "{value} is not a valid header name")
tenant_name: Final = matching(
    TENANT_NAME, "{value} is not a valid tenant name (letters, digits and ._:@-, at most 128)"
)
vendor_name: Final = matching(_NAME_RE, "{value} is not a valid vendor name (letters, digits and _.-, at most 64)")
preset_name: Final = matching(_NAME_RE, "{value} is not a valid preset name (letters, digits and _.-, at most 64)")
endpoint_name: Final = matching(_NAME_RE, "{value} is not a valid endpoint name (letters, digits and _.-, at most 64)")
meter_name: Final = matching(_METER_NAME_RE, "{value} is not a valid meter name (letters, digits, _ and -, at most 64)")


def json_pointer(key: str, value: object) -> str:
    """An RFC 6901 pointer: ``""`` (the whole document) or ``/``-separated keys, a ``~`` in a
    key written ``~0`` and a ``/`` written ``~1``."""
    text = string(key, value)
    if text and not text.startswith("/"):
        raise ValueError(f'{show(text)} is not a JSON pointer: it starts with "/" (e.g. /usage/total_tokens)')
    if _POINTER_TILDE_RE.search(text):
        raise ValueError(f'{show(text)} is not a JSON pointer: "~" is written "~0" in it, and "/" in a key "~1"')
    return text


def http_method(key: str, value: object) -> str:
    """A request method, upper-cased (``get`` is ``GET``); never CONNECT, which opens a
    tunnel rather than asking for a path (a tunnel's requests are matched one by one)."""
    text = string(key, value)
    if not _TOKEN_RE.fullmatch(text):
        raise ValueError(f"{show(text)} is not an HTTP method")
    method = text.upper()
    if method == "CONNECT":
        raise ValueError(
            "CONNECT cannot be matched: it opens a tunnel (the vendor's connect), and the requests inside an"
            " intercepted tunnel are matched like any other"
        )
    return method


_NOT_PARTITION: Final = frozenset({"host", *HOP_BY_HOP})


def partition_header(key: str, value: object) -> str:
    """A request header the vendor's quota is kept per value of: one the vendor receives,
    so not ``Host``, a hop-by-hop or ``Proxy-*`` header, nor the proxy's own ``X-Quota-*``."""
    name = header_name(key, value)
    low = name.lower()
    if low in _NOT_PARTITION or low.startswith("proxy-") or low.startswith(QUOTA_PREFIX):
        raise ValueError(
            f"{show(name)} cannot partition a vendor's quota: Host, hop-by-hop, Proxy-* and X-Quota-* headers"
            " never reach the vendor as the worker sent them"
        )
    return name


def path_glob(key: str, value: object) -> str:
    """A glob on the path the vendor is sent, without the query: ``*`` (any run of
    characters, ``/`` included), ``?`` (any one character), ``[...]``. A request path holds
    no ``?`` of its own (the query starts there and is never matched), so ``?`` can only be
    the wildcard, and ``#`` never reaches a server."""
    text = string(key, value)
    if not text.startswith("/"):
        raise ValueError(f'path {show(text)} must start with "/"')
    if "#" in text or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError(f"path {show(text)} may not hold a fragment (#), spaces or control characters")
    return text


# ---------------------------------------------------------------- where things are


def address(key: str, value: object) -> Address:
    return parse_address(string(key, value))


def admin_token(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("the admin token must be a string (quote it)")  # never echoed: it is a secret
    return parse_admin_token(value)


def host(key: str, value: object) -> str:
    """A host name or IP literal without a port, normalised."""
    return parse_host(string(key, value))


def store_url(key: str, value: object) -> str:
    return parse_store_url(string(key, value))


def vendor_host(key: str, value: object) -> str:
    """``host`` or ``host:port``, lower-cased; IPv6 always in brackets (``[::1]``, ``[::1]:8443``)."""
    return format_authority(*parse_host_port(string(key, value)))


def route(key: str, value: object) -> str:
    text = string(key, value)
    if not text.startswith("/"):
        raise ValueError(f'route {show(text)} must start with "/"')
    if text.endswith("/"):
        raise ValueError(f'route {show(text)} must not end with "/"')
    segments = text[1:].split("/")
    if any(s in ("", ".", "..") or not _ROUTE_SEGMENT_RE.fullmatch(s) for s in segments):
        raise ValueError(f"route {show(text)} is not a plain path prefix")
    return text


def upstream(key: str, value: object) -> str:
    """``scheme://host[:port]``, lower-cased, trailing slash dropped."""
    text = string(key, value)
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


def file_path(base_dir: Path, *, must_exist: bool) -> Leaf[str | None]:
    """A path relative to the policy file's directory, stored absolute; null stays None."""

    def parse_file_path(key: str, value: object) -> str:
        text = string(key, value)
        if not text:
            raise ValueError(f"{key} must be a path or null, got an empty string")
        resolved = os.path.abspath(base_dir / os.path.expanduser(text))
        if must_exist and not os.path.isfile(resolved):
            raise ValueError(f"{show(text)} is not a file (looked at {resolved})")
        return resolved

    return nullable(parse_file_path)
