"""The vendor's own answers, fed back into the fleet's shared buckets.

A 429 blocks the vendor's global buckets for its Retry-After (seconds or an
HTTP-date; ``retry_after_default`` when absent or unreadable, capped at
``max_retry_after``, 5 minutes by default: one vendor answer must not stop the
fleet for an hour). A remaining-quota header below ``low_watermark`` drains
them to empty. With ``feedback.headers: auto`` the vendor's own quota headers
teach the buckets its real limits (SPEC §10, proxy/limiter/learning.py), after
the above: a 429 still blocks.
"""

from __future__ import annotations

import contextlib
import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.limiter import Limiter
from proxy.limiter.quota_headers import read_meter_quota, read_quota
from proxy.policy.model import Endpoint, Feedback, Vendor
from proxy.telemetry.metrics import Metrics


def parse_retry_after(value: str | None, date: str | None = None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After value, or None if absent or unreadable.

    An HTTP-date is measured against the vendor's own Date header when it sent
    one, so a skewed clock on either side does not stretch or shrink the block.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    reference = now if now is not None else time.time()
    if date:
        with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
            reference = email.utils.parsedate_to_datetime(date).timestamp()
    return max(when - reference, 0.0)


def asked_block(feedback: Feedback, headers: Mapping[str, str]) -> float:
    """How long a vendor 429 with these headers asks to block the vendor (before the cap)."""
    seconds = parse_retry_after(headers.get("Retry-After"), headers.get("Date"))
    return feedback.retry_after_default if seconds is None else seconds


def block_seconds(feedback: Feedback, headers: Mapping[str, str]) -> float:
    """How long a vendor 429 with these headers blocks the vendor."""
    return min(asked_block(feedback, headers), feedback.max_retry_after)


def remaining_watched(feedback: Feedback) -> str | None:
    """The field that says the vendor's remaining quota, when a low one drains the buckets."""
    return feedback.remaining_header if feedback.low_watermark > 0 else None


def remaining_is_low(feedback: Feedback, headers: Mapping[str, str]) -> bool:
    name = remaining_watched(feedback)
    if name is None:
        return False
    raw = headers.get(name)
    if raw is None:
        return False
    try:
        remaining = float(raw.strip())
    except ValueError:
        return False
    return remaining < feedback.low_watermark


@dataclass(frozen=True, slots=True)
class Applied:
    """What a vendor response did to the shared state."""

    blocked_for: float = 0.0
    drained: bool = False
    added_retry_after: str | None = None
    """Retry-After the proxy adds to a vendor 429 that carried none."""
    capped_from: float | None = None
    """The block the vendor asked for, when ``max_retry_after`` cut it short."""


NOTHING = Applied()


class Answer(Protocol):
    """A vendor answer as feedback reads it (the data plane's ``Response``)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


def changes_nothing(vendor: Vendor, answer: Answer) -> bool:
    """Would ``apply_feedback`` do nothing with this answer (not a 429, quota not low, no
    quota headers to read)? Most answers: the caller then skips its coroutine, and the
    answer's fields are not looked up by name at all unless the quota left is watched."""
    feedback = vendor.feedback
    if answer.status == 429 or feedback.headers == "auto":
        return False
    return remaining_watched(feedback) is None or not remaining_is_low(feedback, answer.headers)


def learnt(
    limiter: Limiter,
    metrics: Metrics,
    vendor: Vendor,
    headers: Mapping[str, str],
    endpoint: Endpoint | None,
    partition: str,
) -> bool:
    """Would ``apply_feedback`` of an answer (not a 429) of a vendor that learns its limits
    (``headers: auto``) change nothing: its remaining quota not low, what its quota headers
    say known already? Then what it says is counted as learnt (the straight path relays it
    itself); else nothing is, and the caller feeds it back."""
    if remaining_is_low(vendor.feedback, headers):
        return False
    reports = read_quota(headers, time.time())
    if reports and not limiter.knows(vendor, reports, endpoint=endpoint, partition=partition):
        return False
    metrics.set_learned_rate(vendor.name, limiter.learned_rate(vendor))
    return True


async def apply_feedback(
    limiter: Limiter,
    vendor: Vendor,
    status: int,
    headers: Mapping[str, str],
    metrics: Metrics | None = None,
    *,
    partition: str = "",
    endpoint: Endpoint | None = None,
) -> Applied:
    """Feed one vendor response back (to the request's ``partition``: a credential's 429
    blocks that credential's quota only); costs a store call only on a 429, low quota, or
    when the vendor's quota headers (``feedback.headers: auto``) change what the buckets know.

    Learned limits go to the buckets the request counted against (``Limiter.learn``: its
    ``endpoint`` class's, or its partition's global ones); ``metrics`` gets ``ratelimit_learned_rate``."""
    feedback = vendor.feedback
    applied = await _block_or_drain(limiter, vendor, status, headers, partition)
    if feedback.headers == "auto":
        reports = read_quota(headers, time.time())
        if reports:
            await limiter.learn(vendor, reports, endpoint=endpoint, partition=partition)
        if vendor.meters:
            tokens = read_meter_quota(headers, time.time())
            if tokens:
                await limiter.learn_meters(vendor, tokens, partition)
        if metrics is not None:
            metrics.set_learned_rate(vendor.name, limiter.learned_rate(vendor))
    return applied


async def _block_or_drain(
    limiter: Limiter, vendor: Vendor, status: int, headers: Mapping[str, str], partition: str
) -> Applied:
    feedback = vendor.feedback
    if status == 429:
        asked = asked_block(feedback, headers)
        seconds = min(asked, feedback.max_retry_after)
        if seconds <= 0:
            await limiter.drain(vendor, partition=partition)
            return Applied(drained=True)
        until = await limiter.block(vendor, seconds, partition=partition)
        added = None if "Retry-After" in headers else str(max(1, math.ceil(until)))
        return Applied(blocked_for=until, added_retry_after=added, capped_from=asked if asked > seconds else None)
    if remaining_is_low(feedback, headers):
        await limiter.drain(vendor, partition=partition)
        return Applied(drained=True)
    return NOTHING
