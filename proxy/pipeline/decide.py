"""What to do with a request, from the policy, the worker's X-Quota-* headers and the
store's answer. Pure: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from multidict import istr

from proxy.limiter.buckets import Buckets
from proxy.limiter.store import AcquireResult
from proxy.pipeline.pacing import Paced
from proxy.pipeline.ratelimit_fields import tightest
from proxy.policy.durations import parse_duration
from proxy.policy.model import ACTIONS, Limit, OnLimit, Wish
from proxy.wire import headers as h
from proxy.wire.ratelimit_item import QuotaItem
from proxy.wire.refusals import BadRequest, Limited


@dataclass(frozen=True, slots=True)
class Forward:
    pass


@dataclass(frozen=True, slots=True)
class Hold:
    wait: float


@dataclass(frozen=True, slots=True)
class Defer:
    retry_after: float
    """Seconds until every bucket could grant (the real wait)."""
    hint: float
    """Seconds until this caller's slot in the deferral queue: when to retry (>= retry_after)."""


@dataclass(frozen=True, slots=True)
class Shed:
    retry_after: float


Decision = Forward | Hold | Defer | Shed


class Admission(NamedTuple):
    """A request that took its tokens and may go. (A tuple: one is made per request, at a
    third of a frozen dataclass's cost.)"""

    outcome: Literal["forwarded", "held"]
    """How it is counted once sent."""
    quota: QuotaItem | None = None
    """Its tightest bucket, for the RateLimit fields of the forwarded answer (when the
    vendor asks for them and the store answered)."""
    pace: Paced | None = None
    """What its write is paced by (pacing.py); None when it went without the store
    (failing open)."""


FORWARD = Forward()

_DEFAULT_WISHES: dict[OnLimit, Wish] = {}
_ON_LIMIT, _MAX_HOLD = istr(h.ON_LIMIT), istr(h.MAX_HOLD)  # asked in every request: case-folded once


def request_wish(on_limit: OnLimit, headers: Mapping[str, str]) -> Wish:
    """The vendor's on_limit, overridden per request by X-Quota-On-Limit and
    X-Quota-Max-Hold (the latter capped by the vendor's max_hold)."""
    action_text = headers.get(_ON_LIMIT)
    hold_text = headers.get(_MAX_HOLD)
    if action_text is None and hold_text is None:
        wish = _DEFAULT_WISHES.get(on_limit)
        if wish is None:
            wish = _DEFAULT_WISHES[on_limit] = Wish(on_limit.action, on_limit.max_hold)
        return wish
    action = on_limit.action
    if action_text is not None:
        action_text = action_text.strip().lower()
        if action_text not in ACTIONS:
            raise BadRequest(f"bad {h.ON_LIMIT} {action_text[:40]!r}: expected hold, defer or shed")
        action = action_text
    max_hold = on_limit.max_hold
    if hold_text is not None:
        try:
            max_hold = min(parse_duration(hold_text.strip()), on_limit.max_hold)
        except ValueError:
            raise BadRequest(f"bad {h.MAX_HOLD} {hold_text[:40]!r}: expected a duration like 250ms") from None
    return Wish(action, max_hold)


def decide(result: AcquireResult, wish: Wish) -> Decision:
    if result.granted:
        return FORWARD if result.wait <= 0 else Hold(result.wait)
    if wish.action == "shed":
        return Shed(result.wait)
    # (hold falls back to defer when the wait exceeds max_hold). The real wait is the wait, or,
    # offered a slot its owner left (acquire.lua, "Standby"), that slot's time: served then
    # unless the owner claims it after all; its own slot stays kept meanwhile.
    return Defer(min(result.wait, result.retry_after), result.retry_after)


def refusal(
    decision: Defer | Shed,
    result: AcquireResult,
    buckets: Buckets,
    limits: Sequence[tuple[Limit, str]],
    reason: str = "",
) -> Limited:
    """The refusal a defer or shed makes, named by the bucket that refused (``result.binding``)
    and carrying its RateLimit item. ``limits``: the request's, as
    ``ratelimit_fields.request_limits`` lists them; ``reason``: a global bucket's, when the
    caller knows more (refusals.REASONS). ``check --answers`` shows its samples through here."""
    bucket = buckets.all[result.binding]
    return Limited(
        "shed" if isinstance(decision, Shed) else "defer",
        decision.retry_after,
        bucket.scope,
        bucket.label,
        decision.hint if isinstance(decision, Defer) else None,
        tightest(limits, result.levels, result.binding),
        reason=reason,
    )
