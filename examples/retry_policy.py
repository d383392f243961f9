"""One retry policy for every job queue: what a job does with each classified answer.

Shared by the Celery and the Dramatiq examples so both honour the proxy the same way:

=====================  ==========  =====================================================
outcome                budget      decision
=====================  ==========  =====================================================
ok                     —           done
deferred (proxy 429)   deferred    retry after ≥ ``Retry-After`` + jitter
vendor_throttled       throttled   retry after the vendor's ``Retry-After`` + jitter
error, transient       transient   retry after exponential backoff (5xx, timeouts, ...)
shed (proxy 503)       —           dead-letter at once, never retried
error, permanent       —           dead-letter at once (a 4xx will not heal by itself)
any budget used up     —           dead-letter
=====================  ==========  =====================================================

Each kind has its **own budget**. A job queue's built-in retry counter counts every retry
alike, so a job deferred ten times by a busy (healthy!) proxy would have no retries left
for a real outage. Deferrals are cheap and expected (nothing reached the vendor), so their
budget is large; vendor 429s mean the limiter was not tight enough and get a smaller one;
transient errors the usual handful.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from examples.quota_client import Kind, Outcome, backoff, retry_delay

__all__ = ["BUDGETS", "Decision", "RetryPolicy", "attempt_record"]

Budget = Literal["deferred", "throttled", "transient"]
BUDGETS: tuple[Budget, ...] = ("deferred", "throttled", "transient")


@dataclass(frozen=True, slots=True)
class Decision:
    action: Literal["done", "retry", "dead_letter"]
    budget: Budget | None = None
    """The budget a retry is charged to."""
    delay: float | None = None
    """Seconds until the retry."""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_deferrals: int = 100
    max_throttled: int = 10
    max_transient: int = 5
    backoff_base: float = 1.0
    """First transient retry after 0.5-1 s, then doubling ..."""
    backoff_cap: float = 300.0
    """... up to 150-300 s."""
    rng: random.Random | None = field(default=None, compare=False)

    def limit(self, budget: Budget) -> int:
        return {"deferred": self.max_deferrals, "throttled": self.max_throttled, "transient": self.max_transient}[
            budget
        ]

    def decide(self, outcome: Outcome, used: Mapping[str, int]) -> Decision:
        """What to do after ``outcome``, given the retries ``used`` so far per budget."""
        if outcome.kind is Kind.OK:
            return Decision("done")
        if outcome.kind is Kind.SHED:
            return Decision("dead_letter", reason="shed by the proxy")
        budget: Budget
        if outcome.kind is Kind.DEFERRED:
            budget = "deferred"
        elif outcome.kind is Kind.VENDOR_THROTTLED:
            budget = "throttled"
        elif outcome.transient:
            budget = "transient"
        else:
            return Decision("dead_letter", reason=f"permanent error (status {outcome.status}, {outcome.reason})")
        count = used.get(budget, 0)
        if count >= self.limit(budget):
            return Decision("dead_letter", budget, reason=f"{budget} budget of {self.limit(budget)} retries used up")
        if budget == "transient":
            delay = backoff(count, base=self.backoff_base, cap=self.backoff_cap, rng=self.rng)
        else:
            delay = retry_delay(outcome, rng=self.rng)
        return Decision("retry", budget, delay, reason=str(outcome.kind))


def attempt_record(attempt: int, started: float, outcome: Outcome, decision: Decision) -> dict[str, Any]:
    """One line of a job's attempt history (JSON-safe): carried from retry to retry, returned
    with the result and put in the dead-letter record, so the path a job took is visible."""
    return {
        "attempt": attempt,
        "at": started,
        "finished": time.time(),
        **outcome.as_dict(),
        "decision": decision.action,
        "budget": decision.budget,
        "delay": decision.delay,
    }
