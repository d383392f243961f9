"""What a vendor says about its own quota, read from its response headers (SPEC §10).

Every family vendors use in practice comes out as the same ``QuotaReport``: how many
requests its window allows (``limit``), how many are left (``remaining``), in how many
seconds the window is full again (``reset``) and, when the vendor says, the window's
length (``window``). Parsing is pure and forgiving: a header it cannot read is ignored,
never an error, because a vendor's header is not the operator's mistake.

    IETF draft-ietf-httpapi-ratelimit-headers, current form:
        RateLimit-Policy: "burst";q=100;w=1, "daily";q=1000;w=86400
        RateLimit: "burst";r=42;t=1
    its earlier forms:
        RateLimit: limit=100, remaining=42, reset=1        (draft 07)
        RateLimit-Limit: 100 / -Remaining: 42 / -Reset: 1  (drafts up to 06)
    X-RateLimit-Limit / -Remaining / -Reset                (reset: delta seconds, or epoch seconds
                                                           or milliseconds, as GitHub sends)
    OpenAI: x-ratelimit-limit-requests, x-ratelimit-remaining-requests,
            x-ratelimit-reset-requests: 6m0s               (requests per minute)
    Shopify: X-Shopify-Shop-Api-Call-Limit: 32/40          (a leaky bucket: 32 used of 40)

A vendor's meters (SPEC §14) have quotas of their own, in tokens: ``read_meter_quota``.

    OpenAI: x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens,
            x-ratelimit-reset-tokens: 1s                   (tokens per minute)
    Anthropic: anthropic-ratelimit-input-tokens-limit, -remaining,
               -reset: 2026-12-06T05:00:00Z                (input tokens per minute; RFC 3339)
               anthropic-ratelimit-output-tokens-*         (output tokens per minute)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

_EPOCH_SECONDS = 1_000_000_000  # a reset above this is an instant (2001 on), not a delay
_EPOCH_MILLIS = 1_000_000_000_000
_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_OPENAI_WINDOW = 60.0  # x-ratelimit-limit-requests is requests per minute


@dataclass(frozen=True, slots=True)
class QuotaReport:
    """One of the vendor's quotas as it reports it on a response."""

    source: str
    """The header family it was read from (for /status and logs)."""
    limit: float | None = None
    """Requests the window allows."""
    remaining: float | None = None
    """Requests left in the window, as the vendor counted when it answered."""
    reset: float | None = None
    """Seconds until the window is full again."""
    window: float | None = None
    """Seconds the limit is counted over, when the vendor says."""
    name: str = ""
    """The vendor's name for the quota (IETF policies), if any."""


def field(headers: Mapping[str, str], name: str) -> str:
    """A field's value, every line of a repeated field joined as one list (RFC 9110 §5.3)."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return ", ".join(getall(name, ()))
    return headers.get(name, "")


def read_quota(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    """Every quota the vendor reported on this response, most specific family first.

    ``now`` is the wall clock (seconds since the epoch), for resets sent as instants."""
    for family in (_ietf, _ietf_draft7, _ietf_draft6, _openai, _x_ratelimit, _shopify):
        reports = family(headers, now)
        if reports:
            return reports
    return ()


# -- IETF ---------------------------------------------------------------------------------


def _ietf(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    """``RateLimit: "name";r=..;t=..`` with ``RateLimit-Policy: "name";q=..;w=..``."""
    current = items(field(headers, "RateLimit"))
    if not current or not all("r" in params for _, params in current):
        return ()
    policies = dict(items(field(headers, "RateLimit-Policy")))
    reports = []
    for name, params in current:
        policy = policies.get(name, {})
        reports.append(
            QuotaReport(
                "RateLimit",
                limit=_number(policy.get("q")),
                remaining=_number(params.get("r")),
                reset=_number(params.get("t")),
                window=_positive(policy.get("w")),
                name=name,
            )
        )
    return tuple(reports)


def _ietf_draft7(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    """``RateLimit: limit=100, remaining=42, reset=1`` (draft 07's dictionary)."""
    fields = _dictionary(headers.get("RateLimit", ""))
    if "remaining" not in fields:
        return ()
    return (
        QuotaReport(
            "RateLimit",
            limit=_number(fields.get("limit")),
            remaining=_number(fields.get("remaining")),
            reset=_number(fields.get("reset")),
            window=_policy_window(headers.get("RateLimit-Policy", "")),
        ),
    )


def _ietf_draft6(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    """``RateLimit-Limit`` / ``-Remaining`` / ``-Reset`` (delta seconds), drafts up to 06."""
    remaining = _first_number(headers.get("RateLimit-Remaining"))
    if remaining is None:
        return ()
    limit_text = headers.get("RateLimit-Limit", "")
    return (
        QuotaReport(
            "RateLimit-Remaining",
            limit=_first_number(limit_text),
            remaining=remaining,
            reset=_first_number(headers.get("RateLimit-Reset")),
            window=_policy_window(headers.get("RateLimit-Policy", "")) or _policy_window(limit_text),
        ),
    )


# -- de facto families ---------------------------------------------------------------------


def _x_ratelimit(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    remaining = _first_number(headers.get("X-RateLimit-Remaining"))
    if remaining is None:
        return ()
    limit_text = headers.get("X-RateLimit-Limit", "")
    return (
        QuotaReport(
            "X-RateLimit",
            limit=_first_number(limit_text),
            remaining=remaining,
            reset=_reset(headers.get("X-RateLimit-Reset"), now),
            window=_policy_window(limit_text),
        ),
    )


def _openai(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    remaining = _first_number(headers.get("x-ratelimit-remaining-requests"))
    if remaining is None:
        return ()
    return (
        QuotaReport(
            "x-ratelimit-*-requests",
            limit=_first_number(headers.get("x-ratelimit-limit-requests")),
            remaining=remaining,
            reset=_go_duration(headers.get("x-ratelimit-reset-requests")),
            window=_OPENAI_WINDOW,
        ),
    )


def _shopify(headers: Mapping[str, str], now: float) -> tuple[QuotaReport, ...]:
    used, sep, capacity = headers.get("X-Shopify-Shop-Api-Call-Limit", "").partition("/")
    used_n, capacity_n = _number(used.strip()), _number(capacity.strip())
    if not sep or used_n is None or capacity_n is None or capacity_n <= 0:
        return ()
    return (QuotaReport("X-Shopify-Shop-Api-Call-Limit", limit=capacity_n, remaining=max(capacity_n - used_n, 0.0)),)


# -- pieces -----------------------------------------------------------------------------


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text.strip().strip('"'))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _positive(text: str | None) -> float | None:
    value = _number(text)
    return value if value else None


def _first_number(text: str | None) -> float | None:
    """The leading number of a field such as ``100`` or ``100, 100;w=60``."""
    if not text:
        return None
    return _number(re.split(r"[,;\s]", text.strip(), maxsplit=1)[0])


def _policy_window(text: str) -> float | None:
    """The ``w=`` of a policy such as ``100;w=60`` (the first one that has it)."""
    match = re.search(r"(?:^|[;,\s])w=(\d+(?:\.\d+)?)", text)
    return _positive(match.group(1)) if match else None


def _reset(text: str | None, now: float) -> float | None:
    """A reset as delta seconds, or an instant in epoch seconds or milliseconds."""
    value = _first_number(text)
    if value is None:
        return None
    if value >= _EPOCH_MILLIS:
        value = value / 1000.0
    if value >= _EPOCH_SECONDS:
        return max(value - now, 0.0)
    return value


def read_meter_quota(headers: Mapping[str, str], now: float) -> dict[str, QuotaReport]:
    """The token quotas the vendor reported on this response, by the meter estimate preset
    whose currency they count (``openai``, ``anthropic_input``, ``anthropic_output``)."""
    out: dict[str, QuotaReport] = {}
    remaining = _first_number(headers.get("x-ratelimit-remaining-tokens"))
    if remaining is not None:
        out["openai"] = QuotaReport(
            "x-ratelimit-*-tokens",
            limit=_first_number(headers.get("x-ratelimit-limit-tokens")),
            remaining=remaining,
            reset=_go_duration(headers.get("x-ratelimit-reset-tokens")),
            window=_OPENAI_WINDOW,
        )
    for side in ("input", "output"):
        prefix = f"anthropic-ratelimit-{side}-tokens-"
        remaining = _first_number(headers.get(prefix + "remaining"))
        if remaining is not None:
            out[f"anthropic_{side}"] = QuotaReport(
                f"{prefix}*",
                limit=_first_number(headers.get(prefix + "limit")),
                remaining=remaining,
                reset=_instant(headers.get(prefix + "reset"), now),
                window=_OPENAI_WINDOW,  # (per minute, as OpenAI's)
            )
    return out


def _instant(text: str | None, now: float) -> float | None:
    """Seconds until an RFC 3339 instant (Anthropic's resets); None if it is not one."""
    if not text:
        return None
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return max(at.timestamp() - now, 0.0)


def _go_duration(text: str | None) -> float | None:
    """OpenAI's ``6m0s``, ``1s``, ``20ms``, ``1h2m3.5s``."""
    if not text:
        return None
    text = text.strip()
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return _number(text)
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(number) * scale[unit] for number, unit in parts)


def items(text: str) -> list[tuple[str, dict[str, str]]]:
    """A Structured Fields list of items with parameters: ``"a";q=1;w=2, b;q=3``.

    Commas and semicolons inside quoted strings are kept; the item's value is its
    name (a string or a token)."""
    items: list[tuple[str, dict[str, str]]] = []
    for member in _split(text, ","):
        parts = _split(member, ";")
        if not parts or not parts[0]:
            continue
        name = parts[0].strip().strip('"')
        params: dict[str, str] = {}
        for param in parts[1:]:
            key, eq, value = param.partition("=")
            if eq and key.strip():
                params[key.strip().lower()] = value.strip()
        items.append((name, params))
    return items


def _dictionary(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for member in _split(text, ","):
        key, eq, value = member.partition("=")
        if eq and key.strip():
            out[key.strip().lower()] = _split(value, ";")[0].strip()
    return out


def _split(text: str, sep: str) -> list[str]:
    """``text`` cut at each ``sep`` outside a quoted string (Structured Field strings may
    hold commas, semicolons and escaped quotes), each part stripped, empty ones dropped."""
    parts, start, quoted, escaped = [], 0, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


@dataclass(frozen=True, slots=True)
class BucketReport:
    """A vendor's own bucket as its answer's body states it (SPEC §14): Shopify's GraphQL
    ``extensions.cost.throttleStatus``, a bucket of ``size`` points refilling at ``restore``
    per second and holding ``available`` when it answered."""

    source: str
    size: float
    available: float
    restore: float


SHOPIFY: Final = "shopify"
"""The currency key of Shopify's query-cost points (``read_body_quota``; teaching.py)."""


def read_body_quota(document: object) -> dict[str, BucketReport]:
    """The quotas a JSON answer states in its body, by currency: Shopify's ``throttleStatus``
    (``maximumAvailable``, ``currentlyAvailable``, ``restoreRate``). A field missing, of a
    wrong type, negative or not finite: nothing (the answer did not say)."""
    if not isinstance(document, dict):
        return {}
    extensions = document.get("extensions")
    cost = extensions.get("cost") if isinstance(extensions, dict) else None
    status = cost.get("throttleStatus") if isinstance(cost, dict) else None
    if not isinstance(status, dict):
        return {}
    numbers = [status.get(k) for k in ("maximumAvailable", "currentlyAvailable", "restoreRate")]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x < math.inf for x in numbers):
        return {}
    size, available, restore = (float(x) for x in numbers)  # type: ignore[arg-type]
    if size <= 0 or restore <= 0:
        return {}
    return {SHOPIFY: BucketReport("throttleStatus", size, min(available, size), restore)}
