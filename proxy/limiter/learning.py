"""Learned limits (SPEC §10): what a vendor's own quota headers teach the shared buckets.

A report (proxy/limiter/quota_headers.py) is about one bucket of the vendor: the one whose
``per`` is the report's window when the vendor says it (IETF ``w=``, OpenAI's minute);
else the shortest bucket whose ``per`` covers the report's reset (else the longest).
A report with a window no bucket has is not used: the policy names the vendor's
windows (a daily quota is not a per-second one). A report with neither a window nor a
reset (Shopify's leaky bucket, ``X-RateLimit-*`` without a reset) says nothing about
what its limit is counted over: it only lowers the shortest bucket's level.

A limit ``L`` counted over the bucket's window ``W`` becomes a bucket of burst
``b = max(1, ceil(2% of L))`` refilling at just under ``(L + 1 - b) / (W + 10 ms)``: a token
bucket grants at most ``b + rate x W`` requests in any window of ``W``, a whole number, so
below ``L + 1`` is at most ``L``; and the vendor counts arrivals, not grants, which the way
there moves by a few ms each, so the bound holds for a window 10 ms longer than the vendor's
(``ARRIVAL_SPREAD``). (``(L - b) / W`` said the same of a bound that need not
be whole, and ran a vendor allowing 5 a second at 4: the limit less a whole request per
window.) Both are capped at
the policy's (only ever tightening); a vendor that allows at least what the policy can grant
in a window (its rate x W + burst) makes the bucket forget what it learned. What the vendor
says remains lowers the level.

Store calls: one per request stays the rule. This replica remembers, per bucket, what it
last taught the store and when, and the rate, burst and level the store answered; it calls
the store only when the lesson changes, when what it taught is half-way to expiring, or
when the vendor says fewer remain than the bucket holds (by more than one request).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.limiter.quota_headers import BucketReport, QuotaReport
from proxy.limiter.store import BucketSpec, LearnResult, Lesson
from proxy.policy.model import Limit

log = logging.getLogger("quota_proxy.limiter")

BURST_SHARE = 0.02
"""The learned burst, as a share of the vendor's limit (at least one request)."""
WINDOW_SLACK = 0.01
"""Requests per window the learned bucket stays under ``L + 1`` (a bound strictly below it)."""
ARRIVAL_SPREAD = 0.010
"""Seconds by which arrivals at the vendor may stand closer together than their grants (the
network, the vendor's own reading). Without it a learned 70-in-any-second bucket left 0.15 ms
to spare: a vendor on loopback, its process stamping arrivals behind a loaded machine's other
work, counted 71 arrivals in 0.9994 s about one run in three, and blocked the fleet for its
window (tests/test_learned_limits.py)."""
MIN_TTL = 60.0
TTL_WINDOWS = 10.0
"""Learned values live max(10 windows, 60 s) unless the vendor says so again: a vendor
that stops sending headers does not pin a low rate for ever."""
_SAME_WINDOW = 0.01  # relative tolerance between a report's window and a bucket's per
_SLACK = 1.0  # requests: a remaining this much below the bucket's level is worth a store call


def learned_values(limit: float, window: float) -> tuple[float, float]:
    """(rate per second, burst) of a bucket that never grants more than ``limit`` in any
    ``window + ARRIVAL_SPREAD`` seconds: ``burst + rate x (window + spread)`` stays under
    ``limit + 1``."""
    burst = max(1.0, math.ceil(BURST_SHARE * limit))
    return (math.floor(limit) + 1 - burst - WINDOW_SLACK) / (window + ARRIVAL_SPREAD), burst


def ttl_for(window: float) -> float:
    return max(TTL_WINDOWS * window, MIN_TTL)


def bucket_for(report: QuotaReport, pers: Sequence[float]) -> int | None:
    """The index of the bucket (by ``per``, seconds) a report is about; None: no bucket."""
    if not pers:
        return None
    if report.window is not None:
        for i, per in enumerate(pers):
            if math.isclose(per, report.window, rel_tol=_SAME_WINDOW):
                return i
        return None
    by_length = sorted(range(len(pers)), key=lambda i: pers[i])
    if report.reset is None:
        return by_length[0]
    for i in by_length:
        if pers[i] >= report.reset * (1 - _SAME_WINDOW):
            return i
    return by_length[-1]


@dataclass(frozen=True, slots=True)
class Teaching:
    """One bucket's lesson from one response, and where it came from."""

    index: int
    lesson: Lesson
    source: str
    vendor_limit: float | None
    window: float


def plan(reports: Sequence[QuotaReport], limits: Sequence[Limit]) -> dict[int, Teaching]:
    """Per bucket index, what the reports teach it (the tightest, when several are about one)."""
    out: dict[int, Teaching] = {}
    pers = [lim.per for lim in limits]
    for report in reports:
        i = bucket_for(report, pers)
        if i is None:
            continue
        lim = limits[i]
        # What remains, as a level: a bucket grants whole requests, floor(level) of them now
        # (and floor(level + rate x t) over t), so just under remaining + 1 is at most remaining.
        remaining = None if report.remaining is None else report.remaining + 1 - WINDOW_SLACK
        lesson = Lesson(remaining=remaining, window=lim.per, ttl=ttl_for(lim.per))
        counted = report.window is not None or report.reset is not None
        if counted and report.limit is not None and report.limit >= 1:
            if report.limit >= lim.rate + lim.burst:  # the most the policy grants in a window
                lesson = Lesson(forget=True, remaining=remaining, window=lim.per, ttl=lesson.ttl)
            else:
                rate, burst = learned_values(report.limit, lim.per)
                lesson = Lesson(
                    rate=min(rate, lim.per_second),
                    burst=min(burst, lim.burst),
                    remaining=remaining,
                    window=lim.per,
                    ttl=lesson.ttl,
                )
        source = report.source + (f" {report.name!r}" if report.name else "")
        teaching = Teaching(i, lesson, source, report.limit, lim.per)
        previous = out.get(i)
        out[i] = teaching if previous is None else _tighter(previous, teaching)
    return out


def bucket_plan(report: BucketReport, limits: Sequence[Limit]) -> dict[int, Teaching]:
    """Per bucket index, what a vendor's own bucket teaches it (Shopify's throttleStatus):
    never more than the vendor's size, refilling no faster than its restore rate, holding no
    more than it says remain; a bucket the vendor allows as much or more forgets a lesson."""
    out: dict[int, Teaching] = {}
    for i, lim in enumerate(limits):
        ttl = ttl_for(lim.per)
        if report.restore >= lim.per_second and report.size >= lim.burst:
            lesson = Lesson(forget=True, remaining=report.available, window=lim.per, ttl=ttl)
        else:
            rate, burst = min(report.restore, lim.per_second), min(report.size, lim.burst)
            lesson = Lesson(rate=rate, burst=burst, remaining=report.available, window=lim.per, ttl=ttl)
        out[i] = Teaching(i, lesson, report.source, report.restore * lim.per, lim.per)
    return out


def _tighter(a: Teaching, b: Teaching) -> Teaching:
    la, lb = a.lesson, b.lesson
    remaining = min((x for x in (la.remaining, lb.remaining) if x is not None), default=None)
    if la.rate is not None and (lb.rate is None or la.rate <= lb.rate):
        keep = a
    elif lb.rate is not None:
        keep = b
    else:
        keep = a if la.forget or not lb.forget else b
    return Teaching(keep.index, _with_remaining(keep.lesson, remaining), keep.source, keep.vendor_limit, keep.window)


def _with_remaining(lesson: Lesson, remaining: float | None) -> Lesson:
    return Lesson(lesson.rate, lesson.burst, lesson.forget, remaining, lesson.window, lesson.ttl)


@dataclass(slots=True)
class Memo:
    """What this replica knows of one bucket's learned limit."""

    taught: tuple[float, float] | None
    """The (rate, burst) this replica last taught the store; None: it taught it to forget."""
    taught_at: float
    ttl: float
    rate: float
    """Tokens per second the bucket refills at, as the store last answered."""
    burst: float
    settle_until: float
    level: float
    level_at: float
    source: str
    vendor_limit: float | None
    window: float
    label: str
    policy_rate: float

    def level_now(self, now: float) -> float:
        return min(self.burst, self.level + (now - self.level_at) * self.rate)

    def learned_rate(self, now: float) -> float | None:
        """The learned rate in force, as far as this replica knows; None: the policy's."""
        if self.taught is None or now >= self.taught_at + self.ttl or self.rate >= self.policy_rate:
            return None
        return self.rate


@dataclass(slots=True)
class LearnedLimits:
    """A replica's memory of what it taught the store, per bucket (by ident)."""

    memos: dict[str, Memo] = field(default_factory=dict)
    calls: int = 0
    """Store calls made to learn (for /status and the bench: ~0 per request when steady)."""
    reports: int = 0
    """Responses whose quota headers were read."""

    def needs_call(self, bucket: BucketSpec, t: Teaching, observed: float | None, now: float) -> bool:
        memo = self.memos.get(bucket.ident)
        lesson = t.lesson
        if memo is None:
            return lesson.rate is not None or lesson.forget or lesson.remaining is not None
        if lesson.forget and memo.taught is not None:
            return True
        if lesson.rate is not None and (
            memo.taught != (lesson.rate, lesson.burst) or now - memo.taught_at > memo.ttl / 2
        ):
            return True
        if lesson.remaining is None:
            return False
        level = memo.level_now(now)
        if observed is not None:
            level = observed
        cap = lesson.remaining - memo.rate * max(0.0, memo.settle_until - now)
        return cap < level - _SLACK

    def record(self, vendor: str, bucket: BucketSpec, t: Teaching, result: LearnResult, i: int, now: float) -> None:
        lesson = t.lesson
        memo = self.memos.get(bucket.ident)
        before = None if memo is None else memo.learned_rate(now)
        taught: tuple[float, float] | None
        if lesson.forget:
            taught = None
        elif lesson.rate is not None and lesson.burst is not None:
            taught = (lesson.rate, lesson.burst)
        else:
            taught = memo.taught if memo is not None else None
        taught_at = now if lesson.forget or lesson.rate is not None or memo is None else memo.taught_at
        memo = Memo(
            taught=taught,
            taught_at=taught_at,
            ttl=lesson.ttl,
            rate=result.rates[i],
            burst=result.bursts[i],
            settle_until=now + result.settling[i],
            level=result.levels[i],
            level_at=now,
            source=t.source if taught is not None or memo is None else memo.source,
            vendor_limit=t.vendor_limit if taught is not None or memo is None else memo.vendor_limit,
            window=t.window,
            label=bucket.label,
            policy_rate=bucket.rate,
        )
        self.memos[bucket.ident] = memo
        after = memo.learned_rate(now)
        if after is not None and (before is None or not math.isclose(before, after, rel_tol=1e-6)):
            log.info(
                "vendor %s says %s allows %g per %gs: %s now refills at %.4g/s, burst %g (policy %.4g/s)",
                vendor,
                t.source,
                t.vendor_limit if t.vendor_limit is not None else math.nan,
                t.window,
                bucket.label,
                memo.rate,
                memo.burst,
                bucket.rate,
            )
        elif after is None and before is not None:
            log.info(
                "vendor %s's learned limit on %s is cleared: the policy's %.4g/s applies",
                vendor,
                bucket.label,
                bucket.rate,
            )

    def tightest(self, idents: Sequence[str], now: float) -> float | None:
        """The lowest learned rate in force among these buckets (requests/s), None when none is."""
        rates = []
        for ident in idents:
            memo = self.memos.get(ident)
            rate = None if memo is None else memo.learned_rate(now)
            if rate is not None:
                rates.append(rate)
        return min(rates, default=None)

    def status(self, idents: Sequence[str], now: float) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for ident in idents:
            memo = self.memos.get(ident)
            if memo is None:
                continue
            rate = memo.learned_rate(now)
            expires = None if rate is None else round(max(memo.taught_at + memo.ttl - now, 0.0), 3)
            out.append(
                {
                    "bucket": memo.label,
                    "learned": rate is not None,
                    "rate_per_second": None if rate is None else round(rate, 6),
                    "burst": None if rate is None else memo.burst,
                    "source": memo.source,
                    "vendor_limit": memo.vendor_limit,
                    "window_seconds": memo.window,
                    "expires_in_seconds": expires,
                    "settling_seconds": round(max(memo.settle_until - now, 0.0), 3),
                }
            )
        return out
