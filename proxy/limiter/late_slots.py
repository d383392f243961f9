"""memory://'s kept slots that matured unclaimed (acquire.lua, "Late slots" and "Standby"):
the same rules as the script, on this process's dicts.

A late slot's units serve whoever asks next in its bucket set; used late, a slot moves a
request from its time to now, so the moves whose spans overlap carry together no more
than the tightest bucket's burst less what it holds now, and none moves past a time its
bucket stood above empty (every vendor window keeps within rate x window + burst).
A slot whose owner left (its connection closed) is offered to one later refusal as its hint,
and again should that caller leave too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from proxy.limiter.store import Reserve


class Slot(NamedTuple):
    """A slot kept for a deferred caller (acquire.lua's reservation set member)."""

    matures: float
    cost: float
    created: float
    scope: str
    """``a``: taken from every bucket; ``t``: from the tenant's own buckets alone."""
    left: bool = False
    """Its owner left (``left``) and no refusal has been offered it yet."""
    costs: tuple[float, ...] | None = None
    """A metered call's slot (or what is left of a slot, bucket by bucket): what each bucket
    took; None: ``cost`` in every bucket."""
    offered: str = ""
    """The slot left behind that its caller was offered (``standby``): offered again should it leave."""


STANDBY_GAIN: Final = 1.0
"""Seconds a slot left by its owner must gain a caller to be offered it, or ten of the
schedule's intervals if less (acquire.lua): many clients open a connection per call and come
back for their slot on a new one, and the refusal a standby may cost them (a retry of an
SDK's few) is worth that much gained, not less."""


def add_slot(kept: dict[str, Slot], slot: Slot) -> str:
    """Keeps ``slot`` under its member name (acquire.lua's ``<created>:<cost>:<scope>``, with
    ``:<k>`` after it should another hold it); returns the name, the caller's claim."""
    name = f"{slot.created:.3f}:{slot.cost:g}:{slot.scope}"
    member, k = name, 0
    while member in kept:
        k += 1
        member = f"{name}:{k}"
    kept[member] = slot
    return member


OFFERED: Final = "~"
"""Before the claim of a refusal beyond the horizon (no slot of its own): the slot it was
offered, which it claims nothing by but leaves with its connection (acquire.lua, "Standby")."""

Move = tuple[float, tuple[float, ...]]
"""A late slot used: (when its span ended: the grant, its units in each bucket)."""


def drop_stale(
    kept: dict[str, Slot], now: float, reserve: Reserve, void_before: float, levels: list[float], bursts: list[float]
) -> bool:
    """Drop the slots unclaimed ``life`` after their time: their tenant buckets (the first
    ``reserve.tenants`` of ``levels``) get their tokens back, the vendor-side ones do not
    (their time has passed). Returns whether a level changed."""
    refunded = False
    for member, slot in list(kept.items()):
        if slot.matures < now - reserve.life:
            del kept[member]
            if slot.created > void_before and reserve.tenants:
                for i in range(reserve.tenants):
                    levels[i] = min(bursts[i], levels[i] + (slot.cost if slot.costs is None else slot.costs[i]))
                refunded = True
    return refunded


def late_units(
    kept: dict[str, Slot],
    moves: list[Move],
    now: float,
    reserve: Reserve,
    costs: Sequence[float],
    void_before: float,
    levels: list[float],
    rates: list[float],
    bursts: list[float],
    above: list[tuple[float, float]],
    max_wait: float,
) -> tuple[float, list[float]] | None:
    """Late slots' units for a request taking ``costs`` (one per bucket): those of one scope,
    the latest matured first (the shortest moves: acquire.lua), in each bucket as many as the
    request needs and the moves' budget allows, the rest from the buckets if they have it
    within ``max_wait``. Takes the units (a slot keeps what is left of it) and returns the
    wait and what to take from each bucket; None (nothing touched) otherwise. ``above``: when
    each bucket last stood above empty, and above half its burst (acquire.lua, "Late slots")."""
    moves[:] = [m for m in moves if m[0] >= now - reserve.life]
    oldest, newest = now - reserve.life, now - reserve.owner
    late = sorted(((m.matures, k) for k, m in kept.items() if oldest <= m.matures <= newest), reverse=True)
    count = len(levels)
    got = [0.0] * count
    used: list[tuple[str, list[float]]] = []
    scope, first = "", 0.0
    for matures, member in late:
        slot = kept[member]
        if slot.created <= void_before:
            del kept[member]
            continue
        if scope and slot.scope != scope:
            continue
        last = reserve.tenants if slot.scope == "t" else count  # the buckets it took from
        takes = [0.0] * count
        for i in range(last):
            room = late_room(bursts[i], levels[i], above[i], matures)
            overlap = got[i] + sum(u[i] for end, u in moves if end > matures)
            held = slot.cost if slot.costs is None else slot.costs[i]
            takes[i] = max(min(held, costs[i] - got[i], room - overlap), 0.0)
        if not any(takes):
            continue  # its move would not fit: a later slot's may
        if not scope:
            scope, first = slot.scope, matures - now
        used.append((member, takes))
        got = [g + t for g, t in zip(got, takes, strict=True)]
        if all(got[i] >= costs[i] for i in range(last)):
            break
    if not scope:
        return None
    takes = [c - g for c, g in zip(costs, got, strict=True)]
    need = first
    for take, level, rate in zip(takes, levels, rates, strict=True):
        if take > 0:
            need = max(need, (take - level) / rate)
    if need > max_wait:
        return None
    for member, took in used:
        slot = kept.pop(member)
        holds = list(slot.costs) if slot.costs is not None else [slot.cost] * count
        last = reserve.tenants if slot.scope == "t" else count
        rest = [holds[i] - took[i] if i < last else 0.0 for i in range(count)]
        if any(r > 0 for r in rest):  # what the request did not need stays, maturing when it did
            even = slot.costs is None and all(r == rest[0] for r in rest[:last])
            add_slot(kept, slot._replace(cost=rest[0] if even else rest[-1], costs=None if even else tuple(rest)))
        moves.append((now + max(need, 0.0), tuple(took)))  # (its span ends when the request goes)
    return need, takes


def late_room(burst: float, level: float, above: tuple[float, float], matures: float) -> float:
    """What moves from a slot maturing at ``matures`` may carry in a bucket: its burst less
    what it holds now; half its burst at most if it stood above empty since; none if above half."""
    if above[1] >= matures:
        return 0.0
    room = burst - max(level, 0.0)
    return min(room, burst / 2) if above[0] >= matures else room


def standby(
    kept: dict[str, Slot], now: float, own: float, reserve: Reserve, mine: str, interval: float
) -> tuple[float, str]:
    """Seconds until the caller of slot ``mine`` ("" beyond the horizon: none), maturing at
    ``own``, should ask again: a slot left by its owner maturing at least ``STANDBY_GAIN`` (or
    ten of the schedule's ``interval`` if less) before it, each offered once, and again should
    that caller leave (``Slot.offered``, ``OFFERED``), its owner's head start at most half the
    interval (acquire.lua, "Standby"); else its own. And the slot offered ("" for none)."""
    head = min(max(reserve.standby, reserve.owner), interval / 2)
    latest = own - min(STANDBY_GAIN, 10 * interval) - head
    offered = [(m.matures, k) for k, m in kept.items() if m.left and now < m.matures < latest]
    if not offered:
        return own - now, ""
    matures, member = min(offered)
    kept[member] = kept[member]._replace(left=False)
    if mine in kept:
        kept[mine] = kept[mine]._replace(offered=member)
    return min(matures + head, own) - now, member


def interval(costs: Sequence[float], rates: Sequence[float]) -> float:
    """The schedule's interval: seconds between two slots of the binding bucket (cost / rate)."""
    i = slowest(costs, rates)
    return costs[i] / rates[i]


def slowest(costs: Sequence[float], rates: Sequence[float]) -> int:
    """The schedule's binding bucket: the one whose cost takes the longest to refill (the
    first of them, as acquire.lua's ``schedule_interval``)."""
    return max(range(len(costs)), key=lambda i: costs[i] / rates[i])


def left_behind(kept: dict[str, Slot], claims: tuple[str, ...]) -> int:
    """Slots whose owners' connection closed (leave.lua): each offered to a later refusal, and
    so is the slot each of their callers was offered (``Slot.offered``; a claim ``OFFERED``
    + slot names one offered beyond the horizon). Returns how many were still kept."""
    claims = tuple(c[len(OFFERED) :] if c.startswith(OFFERED) else c for c in claims)
    found = [claim for claim in claims if claim in kept]
    for claim in found:
        kept[claim] = kept[claim]._replace(left=True)
    for claim in found:
        offered = kept[claim].offered
        if offered in kept:
            kept[offered] = kept[offered]._replace(left=True)
    return len(found)


def leave(kept: dict[str, Slot], now: float, claim: str, owner: float) -> None:
    """The caller holding ``claim`` took a late slot instead: its own is nobody's, late from
    its maturity and offered to a later refusal."""
    slot = kept.get(claim)
    if slot is not None:
        kept[claim] = slot._replace(matures=slot.matures - owner, left=True)
