"""Header names the proxy reads or writes, the hop-by-hop set (RFC 9110 §7.6.1), and
whether a request is safe to send twice."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Final, NamedTuple

from multidict import CIMultiDict, CIMultiDictProxy

ON_LIMIT = "X-Quota-On-Limit"
MAX_HOLD = "X-Quota-Max-Hold"
PRIORITY = "X-Quota-Priority"
QUOTA_PREFIX = "x-quota-"

ACTION = "X-Quota-Action"
LIMITER = "X-Quota-Limiter"
REASON = "X-Quota-Reason"
RETRY_AFTER_MS = "X-Quota-Retry-After-Ms"
SCOPE = "X-Quota-Scope"
ERROR = "X-Quota-Error"
RETRY_AFTER = "Retry-After"
HINT_MS = "retry-after-ms"  # the retry hint in ms, read first by OpenAI's and Stainless-generated SDKs
SHOULD_RETRY = "x-should-retry"  # obeyed by OpenAI's and Stainless-generated SDKs (Anthropic's, ...)
STRIPE_SHOULD_RETRY = "Stripe-Should-Retry"  # obeyed by Stripe's SDKs, which otherwise retry every 5xx
IDEMPOTENCY_KEY = "Idempotency-Key"
PROXY_AUTHORIZATION = "Proxy-Authorization"  # hop-by-hop: read by the proxy, never forwarded
PROXY_AUTHENTICATE = "Proxy-Authenticate"

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})

# Connection-specific: meaningful for one hop only, never forwarded either way.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def _connection_tokens(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> set[str]:
    tokens: set[str] = set()
    for value in headers.getall("Connection", ()):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


Fields = list[tuple[str, str]]
"""Header fields in their order, as the data plane writes them."""

# What the answer filter does with a field (``_kind``; ``LENGTH`` and ``DATE``: the answer's writer only).
KEEP, DROP, LENGTH, DATE, CONNECTION = 0, 1, 2, 3, 4


def upstream_request_lines(raw: list[tuple[bytes, bytes]], tenant_header: str) -> list[str]:
    """What a vendor is sent of the worker's fields (``raw``, in their order, as they came),
    as the lines the data plane writes (``"Name: value\r\n"``): those ``learn_request_kind``
    calls ``PLAIN``, which is the worker-facing parser's own rule for the straight path's
    ``Request.lines`` (every field but the hop-by-hop ones, ``Host``, ``Content-Length``,
    ``Expect``, the tenant header and ``X-Quota-*``), less any a ``Connection`` field names."""
    kinds = request_kinds(tenant_header)
    kept: list[tuple[bytes, bytes]] = []
    named: set[bytes] | None = None
    for name, value in raw:
        kind = kinds.get(name)
        if kind is None:
            kind = learn_request_kind(kinds, name, tenant_header)
        if kind == PLAIN:
            kept.append((name, value))
        elif kind == CONNECTION_FIELD and not only_this_hop(value):
            named = named or set()
            named.update(t.strip() for t in value.lower().split(b",") if t.strip())
    if named:
        kept = [(name, value) for name, value in kept if name.lower() not in named]
    return [f"{name.decode('latin-1')}: {value.decode('latin-1')}\r\n" for name, value in kept]


def downstream_response_headers(headers: CIMultiDictProxy[str]) -> Fields:
    """The vendor's headers minus hop-by-hop ones and any ``X-Quota-*`` header, for the worker.

    ``X-Quota-*`` is the proxy's namespace: a worker must be able to trust that
    ``X-Quota-Action`` came from the proxy, so a vendor's 429 never carries it (SPEC §5)."""
    return _without(headers, HOP_BY_HOP)


_KINDS: dict[frozenset[str], dict[str, int]] = {}
"""Per drop set, what the filters do with a field name (as spelled): the same few names come
in every message, and lower-casing and testing each cost 2 µs a request."""
_KEPT_MAX = 4096  # names remembered per drop set; past that it starts over


def _without(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> Fields:
    """``headers`` minus the names in ``drop``, those its ``Connection`` field names and
    every ``X-Quota-*`` header, in their order."""
    if "Connection" in headers:  # the fields it names are dropped too: no memo for those
        dropped = drop | _connection_tokens(headers)
        return [
            (name, value)
            for name, value in headers.items()
            if not ((low := name.lower()) in dropped or low.startswith(QUOTA_PREFIX))
        ]
    kinds = _kinds(drop)
    out = []
    for name, value in headers.items():
        kind = kinds.get(name)
        if kind is None:
            kind = _learn(kinds, drop, name)
        if kind == KEEP:
            out.append((name, value))
    return out


def _kinds(drop: frozenset[str]) -> dict[str, int]:
    kinds = _KINDS.get(drop)
    if kinds is None:
        kinds = _KINDS[drop] = {}
    return kinds


def _learn(kinds: dict[str, int], drop: frozenset[str], name: str) -> int:
    kind = _kind(name.lower(), drop)
    if len(kinds) >= _KEPT_MAX:
        kinds.clear()
    kinds[name] = kind
    return kind


def _kind(low: str, drop: frozenset[str]) -> int:
    """What a filter dropping ``drop`` does with a field named ``low`` (lower case): the
    ``Connection`` field (never kept, and it may name more), dropped, or kept."""
    if low == "connection":
        return CONNECTION
    return DROP if low in drop or low.startswith(QUOTA_PREFIX) else KEEP


# The fields of a vendor answer the relay does not simply copy (``answer_lines``): this hop's
# framing and options, the proxy's own namespace, and those it reads.
_ANSWER_READ: Final = ("content-length", "date")


class AnswerFields(NamedTuple):
    """``answer_fields``: the two patterns ``answer_lines`` runs over an answer's lines."""

    read: re.Pattern[bytes]
    """The lines it looks at: ``Content-Length``, ``Date``, the hop-by-hop fields,
    ``X-Quota-*`` and the watched field, name and value."""
    others: re.Pattern[bytes]
    """The same but ``Content-Length`` and ``Date``: none of them (the usual answer), and
    two searches for those two do."""


@functools.lru_cache(maxsize=64)
def answer_fields(*watched: str) -> AnswerFields:
    """What ``answer_lines`` looks for in the lines of an answer head's field block
    (``Response.block``), ``watched`` (lower case) being fields whose presence needs the
    general path's relay (feedback reads them, or the proxy's fields go beside them). The
    patterns run over the block lowered with a CRLF in front, so that they start with a
    literal (the regex engine skips to each line's start) and need no case folding."""

    def pattern(names: set[str]) -> re.Pattern[bytes]:
        ordered = sorted(names, key=len, reverse=True)
        alternatives = b"|".join(re.escape(name.encode("latin-1")) for name in ordered)
        return re.compile(rb"\r\n(" + alternatives + rb"|x-quota-[^:\r\n]*):[ \t]*([^\r]*)")

    others = {*HOP_BY_HOP, *watched}
    return AnswerFields(pattern({*_ANSWER_READ, *others}), pattern(others))


def answer_lines(block: bytes, fields: AnswerFields, straight: bool) -> tuple[bytes, int, bool] | None:
    """What the worker is sent of a vendor answer's fields (``block``, the head's lines):
    every line but this hop's framing and options and any ``X-Quota-*`` (the proxy's
    namespace: a worker must be able to trust that ``X-Quota-Action`` came from the proxy,
    so a vendor's 429 never carries it, SPEC §5), as the vendor wrote them; with the
    ``Content-Length`` value (-1: none) and whether a ``Date`` is among them. ``fields``:
    ``answer_fields``. None when the lines cannot be copied so: a ``Connection`` field that
    names more fields to drop than this hop's own options (``downstream_response_headers``
    then); and, ``straight`` (the straight path's relay, lane.py, which sends the body it
    got with the length it says), no number for a ``Content-Length``, a
    ``Transfer-Encoding``, or the watched field."""
    # A line at offset p of the block is at p of ``low`` (the CRLF before it), and its own
    # CRLF ends at the end of its match there (where the next line's CRLF is in ``low``).
    low = b"\r\n" + block.lower()
    if fields.others.search(low) is None:  # the usual answer: its length's line out, the rest copied
        date = b"\r\ndate:" in low
        at = low.find(b"\r\ncontent-length:")
        if at < 0:
            return None if straight else (block, -1, date)
        end = low.find(b"\r", at + 2)
        if low.find(b"\r\ncontent-length:", end) < 0:  # (two of them: as the general loop reads them)
            value = low[at + 17 : end].strip()
            if value.isdigit():
                return block[:at] + block[end:], int(value), date
            if straight:
                return None
            return block[:at] + block[end:], -1, date
    return _answer_lines(block, low, fields.read, straight)


def _answer_lines(
    block: bytes, low: bytes, fields: re.Pattern[bytes], straight: bool
) -> tuple[bytes, int, bool] | None:
    length = -1
    date = False
    kept: list[bytes] | None = None
    at = 0
    for line in fields.finditer(low):
        name = line.group(1)
        if name == b"date":
            date = True
            continue  # copied
        if name == b"content-length":  # dropped: the relay writes the framing
            value = line.group(2).strip()
            if value.isdigit():
                length = int(value)
            elif straight:
                return None
        elif name == b"connection":
            value = line.group(2)
            if value not in THIS_HOP_VALUES and not only_this_hop(value):
                return None
        elif name in _HOP_BYTES or name.startswith(b"x-quota-"):
            if straight and name == b"transfer-encoding":
                return None
        elif straight:
            return None  # the watched field: feedback reads it
        else:
            continue
        if kept is None:
            kept = []
        kept.append(block[at : line.start()])  # the lines before this one, copied; this one dropped
        at = line.end()
    if straight and length < 0:
        return None
    if kept is None:
        return block, length, date
    kept.append(block[at:])
    return b"".join(kept), length, date


_HOP_BYTES: Final = frozenset(name.encode("latin-1") for name in HOP_BY_HOP)


# What the worker's parser notes of each request field (``request_kinds``): most are
# ``PLAIN`` (forwarded as they came); the others the proxy reads, or drops, or both.
PLAIN, HOST, LENGTH_FIELD, TRANSFER, EXPECT, CONNECTION_FIELD, HOP, QUOTA, TENANT = 0, 1, 2, 3, 4, 5, 6, 7, 8
WISH_ACTION, WISH_HOLD = 9, 10  # X-Quota-On-Limit, X-Quota-Max-Hold: read, never forwarded
WISH_CLASS = 11  # X-Quota-Priority (SPEC §13): read, never forwarded

_ON_LIMIT_LOW: Final = ON_LIMIT.lower()
_MAX_HOLD_LOW: Final = MAX_HOLD.lower()
_PRIORITY_LOW: Final = PRIORITY.lower()
_REQUEST_KINDS: dict[str, dict[bytes, int]] = {}
"""Per tenant header (lower case), what each request field name (as spelled) is."""


def request_kinds(tenant_header: str) -> dict[bytes, int]:
    """The memo the worker-facing parser classifies request fields with (``learn_request_kind``
    fills it): one dict lookup per field, the same few names in every request."""
    low = tenant_header.lower()
    kinds = _REQUEST_KINDS.get(low)
    if kinds is None:
        if len(_REQUEST_KINDS) >= 64:  # reloads that rename the tenant header
            _REQUEST_KINDS.clear()
        kinds = _REQUEST_KINDS[low] = {}
    return kinds


def learn_request_kind(kinds: dict[bytes, int], name: bytes, tenant_header: str) -> int:
    """What request field ``name`` is, remembered in ``kinds`` (bounded: names are the
    workers' to choose)."""
    low = name.decode("latin-1").lower()
    if low == "host":
        kind = HOST
    elif low == "content-length":
        kind = LENGTH_FIELD
    elif low == "transfer-encoding":
        kind = TRANSFER
    elif low == "expect":
        kind = EXPECT
    elif low == "connection":
        kind = CONNECTION_FIELD
    elif low == _ON_LIMIT_LOW:
        kind = WISH_ACTION
    elif low == _MAX_HOLD_LOW:
        kind = WISH_HOLD
    elif low == _PRIORITY_LOW:
        kind = WISH_CLASS
    elif low.startswith(QUOTA_PREFIX):
        kind = QUOTA
    elif low == tenant_header.lower():
        kind = TENANT
    elif low in HOP_BY_HOP:
        kind = HOP
    else:
        kind = PLAIN
    if len(kinds) >= _KEPT_MAX:
        kinds.clear()
    kinds[name] = kind
    return kind


_THIS_HOP: Final = frozenset({b"keep-alive", b"close"})
THIS_HOP_VALUES: Final = frozenset({b"keep-alive", b"Keep-Alive", b"close", b"Close"})
"""``Connection`` values naming only this hop's options, as they are usually spelled."""


def only_this_hop(connection: bytes) -> bool:
    """Does a ``Connection`` field's value name nothing but this hop's own options
    (``keep-alive``, ``close``)? Then dropping the field drops all it names."""
    low = connection.lower()
    if low in _THIS_HOP:
        return True
    return all(token.strip() in _THIS_HOP for token in low.split(b",") if token.strip())


def idempotent(method: str, headers: Mapping[str, str]) -> bool:
    """Whether sending the request twice does no more than sending it once: an idempotent
    method (RFC 9110 §9.2.2, TRACE aside), or a request carrying an ``Idempotency-Key``
    (the vendor deduplicates it)."""
    return method.upper() in IDEMPOTENT_METHODS or IDEMPOTENCY_KEY in headers
