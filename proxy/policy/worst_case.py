"""The most requests a set of token buckets lets through in any window of a given length.

A bucket of ``burst`` tokens refilled at ``rate/per`` grants at most ``burst + rate*W/per``
tokens in any window of length ``W``: it can be full when the window opens, and refills
at most ``rate*W/per`` while it lasts. A request takes ``cost`` from every bucket, so each
bucket bounds the count on its own and the tightest one wins. This is what a vendor that
counts requests in a sliding window of ``W`` may see from the whole fleet, holds and
cold start included: it is how an operator sees that 95/s with a burst of 10 overruns a
vendor allowing 100 in any second.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.policy.model import Limit

_EPSILON = 1e-9  # 0.1 * 3 is 0.30000000000000004: a bound of 3.0000000001 requests is 3


@dataclass(frozen=True, slots=True)
class WorstCase:
    """At most ``requests`` requests in any window of ``window`` seconds."""

    window: float
    requests: int


def most_requests(limits: Iterable[Limit], window: float, cost: float = 1.0) -> int | None:
    """The most requests of ``cost`` tokens that ``limits`` grant together in any window of
    ``window`` seconds; None when there is no limit (nothing bounds the count)."""
    if window < 0 or cost <= 0:
        raise ValueError("window must be >= 0 and cost > 0")
    tokens = [limit.burst + limit.rate * window / limit.per for limit in limits]
    if not tokens:
        return None
    return math.floor(min(tokens) / cost + _EPSILON)


def beyond(limits: Sequence[Limit], allowed: Iterable[Limit]) -> tuple[tuple[Limit, int], ...]:
    """Each of ``allowed`` (what the vendor says it allows: ``vendor_limit``, its bursts
    ignored) that ``limits`` may exceed in its window, with the worst case there."""
    found = []
    for limit in allowed:
        worst = most_requests(limits, limit.per)
        if worst is not None and worst > limit.rate + _EPSILON:
            found.append((limit, worst))
    return tuple(found)


def doubled(limits: Sequence[Limit]) -> tuple[tuple[Limit, int], ...]:
    """Each of ``limits`` that lets at least twice its own count through in its window (a
    burst as large as the rate, the default, fills on top of it: ``100000/24h`` lets 200000
    through in a day), with the worst case there."""
    found = []
    for limit in limits:
        worst = most_requests(limits, limit.per)
        if worst is not None and worst >= 2 * limit.rate:
            found.append((limit, worst))
    return tuple(found)


def worst_cases(own: Sequence[Limit], bounding: Sequence[Limit] = (), cost: float = 1.0) -> tuple[WorstCase, ...]:
    """The worst case for each distinct window length (``per``) of ``own``, shortest first,
    counting every bucket a request also takes from (``bounding``: an endpoint's requests
    are bounded by its vendor's buckets too)."""
    windows = sorted({limit.per for limit in own})
    cases: list[WorstCase] = []
    for window in windows:
        requests = most_requests((*own, *bounding), window, cost)
        if requests is not None:
            cases.append(WorstCase(window, requests))
    return tuple(cases)
