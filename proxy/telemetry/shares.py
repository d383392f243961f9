"""How a vendor's shared quota (SPEC §13, ``share:``) was divided lately: per priority class
and per (tenant, class), over the last ``WINDOW_SECONDS`` complete seconds, for /status and
the live page.

What each request of a vendor with ``share:`` adds when it ends (``Tally.shared``):

- granted: its cost in tokens when it was forwarded (at once, or after a hold);
- waited: one when it had to wait (held, deferred or shed);
- refused: one when it was deferred or shed.

A tenant (of a class) is *active* when a request of it ended in the window. Its *fair share*
is its class's granted rate times its weight, divided by the sum of the weights of the
class's active tenants; a ratio (its rate over its fair share) below 1 matters for a tenant
that was waiting (a tenant that got all it asked for may well take less than its share).

Bounded: a count per second of the window per class and per (tenant, class); at most
``TENANTS_KEPT`` (tenant, class) pairs per vendor and ``CLASSES_KEPT`` classes. Tenants come
from workers' headers: past the cap, the pair whose last request is the oldest makes room,
in O(1); a steady tenant stays through a spray of ids unless more than ``TENANTS_KEPT`` new
ones come between two of its requests.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Final

from proxy.clock import Clock
from proxy.policy.model import Share

WINDOW_SECONDS: Final = 10
"""The complete seconds the rates are over (as /status's ``recent``)."""
TENANTS_KEPT: Final = 256
"""(tenant, class) pairs followed per vendor; past that the least recent makes room."""
TENANTS_SHOWN: Final = 20
"""Tenants /status lists per vendor, most active first (``?share_tenants=N``: up to ``TENANTS_KEPT``)."""
CLASSES_KEPT: Final = 64
"""Class names followed per vendor (the policy's; more only across reloads that rename them)."""

_GRANTED: Final = {"forwarded": False, "held": True}
"""Outcomes that took their tokens: whether the request waited first (held)."""
_REFUSED: Final = frozenset({"deferred", "shed"})
_NONE: Final = (-1, 0.0, 0, 0)


class Counts:
    """One class's or one (tenant, class)'s last seconds: cost granted, requests that waited
    and requests refused, added up for the current second, kept per second for the
    ``WINDOW_SECONDS`` before it."""

    __slots__ = ("granted", "past", "refused", "second", "waited")

    def __init__(self) -> None:
        self.second = -1
        """The second the counts below are of (the clock's, whole)."""
        self.granted = 0.0
        self.waited = 0
        self.refused = 0
        self.past: list[tuple[int, float, int, int]] = [_NONE] * WINDOW_SECONDS
        """(second, granted, waited, refused) of earlier seconds, in the slot ``second % WINDOW_SECONDS``."""

    def turn(self, second: int) -> None:
        """Keep the counts of the second gone by, start ``second``'s (once a second at most)."""
        if self.second >= 0:
            self.past[self.second % WINDOW_SECONDS] = (self.second, self.granted, self.waited, self.refused)
        self.second = second
        self.granted = 0.0
        self.waited = self.refused = 0

    def window(self, now: int) -> tuple[float, int, int]:
        """(cost granted, requests that waited, requests refused) in the ``WINDOW_SECONDS``
        complete seconds before ``now``."""
        granted = 0.0
        waited = refused = 0
        for second, g, w, r in (*self.past, (self.second, self.granted, self.waited, self.refused)):
            if 0 < now - second <= WINDOW_SECONDS:
                granted += g
                waited += w
                refused += r
        return granted, waited, refused


class ShareBook:
    """One vendor's recent grants and waits by class and by (tenant, class)."""

    __slots__ = ("_classes", "_clock", "_kept", "_tenants")

    def __init__(self, clock: Clock, kept: int = TENANTS_KEPT) -> None:
        self._clock = clock
        self._kept = kept
        self._classes: dict[str, Counts] = {}
        self._tenants: OrderedDict[tuple[str, str], Counts] = OrderedDict()
        """Least recent first."""

    def add(self, klass: str, tenant: str, outcome: str, cost: float = 1.0) -> None:
        """A request of ``tenant`` in class ``klass`` ended as ``outcome`` (Tally.ended's),
        having taken ``cost`` tokens if it was forwarded. (On every request of a vendor with
        ``share:``: a few attribute updates, no allocation but the key.)"""
        held = _GRANTED.get(outcome)
        if held is None and outcome not in _REFUSED:
            return  # denied, error: neither granted by the share nor waiting for it
        second = int(self._clock.monotonic())
        counts = self._classes.get(klass)
        if counts is None:
            counts = self._new_class(klass)
        tenants = self._tenants
        key = (tenant, klass)
        mine = tenants.get(key)
        if mine is None:
            mine = self._new_tenant(key)
        else:
            tenants.move_to_end(key)
        if counts.second != second:
            counts.turn(second)
        if mine.second != second:
            mine.turn(second)
        if held is None:  # refused
            counts.waited += 1
            counts.refused += 1
            mine.waited += 1
            mine.refused += 1
            return
        counts.granted += cost
        mine.granted += cost
        if held:
            counts.waited += 1
            mine.waited += 1

    def _new_class(self, klass: str) -> Counts:
        if len(self._classes) >= CLASSES_KEPT:
            del self._classes[next(iter(self._classes))]
        counts = self._classes[klass] = Counts()
        return counts

    def _new_tenant(self, key: tuple[str, str]) -> Counts:
        if len(self._tenants) >= self._kept:
            self._tenants.popitem(last=False)
        counts = self._tenants[key] = Counts()
        return counts

    def __len__(self) -> int:
        """(tenant, class) pairs followed."""
        return len(self._tenants)

    def status(self, share: Share, shown: int = TENANTS_SHOWN) -> dict[str, Any]:
        """/status's ``share`` of the vendor: its classes in priority order, and the ``shown``
        most active tenants (of the classes ``share`` has) with their fair shares."""
        now = int(self._clock.monotonic())
        classes = []
        for name in share.classes:
            counts = self._classes.get(name)
            granted, waited, refused = (0.0, 0, 0) if counts is None else counts.window(now)
            classes.append(
                {
                    "name": name,
                    "granted_per_second": granted / WINDOW_SECONDS,
                    "waiting": waited > 0,
                    "refused_per_second": refused / WINDOW_SECONDS,
                }
            )
        wanted = set(share.classes)
        tenants = []
        for (tenant, klass), counts in self._tenants.items():
            if klass not in wanted:
                continue
            granted, waited, refused = counts.window(now)
            if granted or waited:
                tenants.append(
                    {
                        "tenant": tenant,
                        "class": klass,
                        "weight": share.weight(tenant),
                        "granted_per_second": granted / WINDOW_SECONDS,
                        "waiting": waited > 0,
                        "refused_per_second": refused / WINDOW_SECONDS,
                    }
                )
        return finish(share.min_share, classes, tenants, shown)


def finish(
    min_share: float, classes: list[dict[str, Any]], tenants: list[dict[str, Any]], shown: int
) -> dict[str, Any]:
    """The ``share`` document from its raw figures (``classes`` in priority order; ``tenants``
    every active one): each class's part of the vendor's grants, each tenant's fair share and ratio, the
    ``shown`` most active tenants. Also what ``--workers N`` makes of the workers' figures
    summed (workers_admin.py)."""
    total = sum(c["granted_per_second"] for c in classes)
    by_class: dict[str, dict[str, Any]] = {}
    for index, c in enumerate(classes):
        c["share"] = _round(c["granted_per_second"] / total) if total > 0 else None
        c["min_share"] = min_share if index > 0 else None
        c["active_tenants"] = 0
        c["active_weight"] = 0.0
        by_class[c["name"]] = c
    for t in tenants:
        c = by_class[t["class"]]
        c["active_tenants"] += 1
        c["active_weight"] += t["weight"]
    for t in tenants:
        c = by_class[t["class"]]
        fair = c["granted_per_second"] * t["weight"] / c["active_weight"] if c["active_weight"] > 0 else 0.0
        t["fair_per_second"] = _round(fair)
        t["ratio"] = _round(t["granted_per_second"] / fair) if fair > 0 else None
    for c in classes:
        c["active_weight"] = _round(c["active_weight"])
        c["granted_per_second"] = _round(c["granted_per_second"])
        c["refused_per_second"] = _round(c["refused_per_second"])
    ranked = sorted(tenants, key=_busiest)
    for t in ranked:
        t["granted_per_second"] = _round(t["granted_per_second"])
        t["refused_per_second"] = _round(t["refused_per_second"])
    return {
        "window_seconds": WINDOW_SECONDS,
        "granted_per_second": _round(total),
        "min_share": min_share,
        "classes": classes,
        "active_tenants": len(tenants),
        "tenants": ranked[: max(shown, 0)],
    }


def _busiest(tenant: dict[str, Any]) -> tuple[float, str, str]:
    """Most active first: what it asked for (granted and refused), then by name."""
    return -(tenant["granted_per_second"] + tenant["refused_per_second"]), tenant["tenant"], tenant["class"]


def _round(x: float) -> float:
    return round(x, 3)
