"""memory://'s twin of acquire.lua's "Share" section (SPEC §13): a vendor's schedule, its
waiting tenants' tags per class, the classes' busy times and credits. See acquire.lua for
why it works as it does; this module keeps the same arithmetic, in seconds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.limiter.share import CLASS_GRACE, GRACE, HORIZON, SLACK, TAU
from proxy.limiter.store import BucketSpec, ShareAsk

_LIFE = 60.0  # seconds a schedule nobody touched is kept (acquire.lua's PEXPIRE)


@dataclass(slots=True)
class Gate:
    """What the schedule says of one request before its buckets are looked at."""

    ok: bool = True
    wait: float = 0.0
    """Refused (``ok`` False): seconds until its turn."""
    step: float | None = None
    """Seconds between its tenant's turns (its deferral queue's step), when others wait."""
    tag: float = 0.0
    low: float | None = None
    """The lowest tag of its class's waiting tenants; None: none waits."""
    on_credit: bool = False


@dataclass(slots=True)
class Schedule:
    """One vendor's (partition's) schedule: acquire.lua's share hash and sets."""

    classes: int
    waiting: list[dict[str, float]] = field(default_factory=list)
    """Per class: the waiting tenants' members and tags."""
    tags: list[dict[str, float]] = field(default_factory=list)
    """Per class: every member's tag while anyone of the class waits."""
    weights: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    credit: list[float] = field(default_factory=list)
    credited: list[float | None] = field(default_factory=list)
    ends: dict[tuple[int, str], float] = field(default_factory=dict)
    """(class, member) -> when its wait ends."""
    touched: float = 0.0
    first_end: float = math.inf
    """The earliest of ``ends`` (or before it): none ends sooner (acquire.lua's ``x``)."""

    def __post_init__(self) -> None:
        k = self.classes
        self.waiting = [{} for _ in range(k)]
        self.tags = [{} for _ in range(k)]
        self.weights = [0.0] * k
        self.busy = [0.0] * k
        self.credit = [0.0] * k
        self.credited = [None] * k

    def gate(self, ask: ShareAsk, cost: float, rate: float, now: float, room: float = 0.0) -> Gate:
        """``cost`` in the schedule's unit, whose ``rate`` (per second) is the slowest of the
        vendor's global request buckets; ``room``: how many more of this request the
        tightest of the vendor's buckets holds after it (``Turn``)."""
        c = ask.klass
        g = Gate()
        busy = max(self.busy[:c], default=0.0)
        class_rate = rate
        if busy <= now and self.credit[c] > 0:  # credit is for while a higher class waits, not to keep
            self.credit[c] = 0.0
        if busy > now and room < 1:  # a higher class waits (and no token more than its): credit only
            credit = self.credit[c]
            last = self.credited[c]
            if last is not None and now - last < 1.0:
                credit += (now - last) * ask.min_share * rate
            credit = min(credit, max(cost, 1.0) + ask.min_share * rate * 0.05)  # (50 ms of it: asks come late)
            self.credit[c], self.credited[c] = credit, now
            class_rate = ask.min_share * rate
            if credit >= cost:
                g.on_credit = True
            else:
                g.ok = False
                g.wait = max(g.wait, busy - now)
                if ask.min_share > 0:
                    g.wait = min(g.wait, (cost - credit) / class_rate)
        waiting = self.waiting[c]
        if self.weights[c] > 0 and waiting:
            low = min(waiting.values())
            g.low = low
            g.tag = max(self.tags[c].get(ask.member, low), low)
            ahead = g.tag - low - max(cost, rate * SLACK) / ask.weight
            if ahead > 0 and room < 1:  # (tokens to spare: the one behind is not there for them)
                behind = ahead * self.weights[c] / max(class_rate, 1e-9)
                g.wait = max(g.wait, behind)
                g.ok = False
            g.step = cost * self.weights[c] / (ask.weight * max(class_rate, 1e-9))
        if not g.ok and ask.min_share > 0 and busy > now:
            g.step = max(g.step or 0.0, cost / class_rate)
        return g

    def granted(self, ask: ShareAsk, g: Gate, cost: float, wait: float, now: float) -> None:
        c = ask.klass
        if g.on_credit:
            self.credit[c] -= cost
        if wait > 0:  # a hold waits: its class is busy
            self.busy[c] = max(self.busy[c], now + wait + CLASS_GRACE)
        if g.low is not None:
            tag = g.tag + cost / ask.weight
            self.tags[c][ask.member] = tag
            if ask.member in self.waiting[c]:  # still waiting: its place moves on
                self.waiting[c][ask.member] = tag

    def load(self, ask: ShareAsk, g: Gate) -> None:
        """Its tag, when no one of its class was waiting (not read then)."""
        if g.low is None:
            g.tag = self.tags[ask.klass].get(ask.member, 0.0)

    def waits(self, ask: ShareAsk, g: Gate, retry: float, now: float, kept: bool = False) -> None:
        """A refusal by the schedule or the vendor's quota: the tenant waits by its tag until
        it is expected back (acquire.lua's ``share_waits``; ``kept``: a slot is kept for it,
        it comes back then)."""
        c = ask.klass
        member = ask.member
        self.load(ask, g)
        back = max(retry, 0.0) if kept else min(max(retry, 0.0), TAU)
        waiting = self.waiting[c]
        if member not in waiting:
            self.weights[c] += ask.weight
        waiting[member] = g.tag
        if g.tag > self.tags[c].get(member, -1.0):
            self.tags[c][member] = g.tag
        key = (c, member)
        self.ends[key] = ends = max(self.ends.get(key, 0.0), now + back + GRACE)
        self.first_end = min(self.first_end, ends)
        self.busy[c] = max(self.busy[c], now + back + CLASS_GRACE)

    def leaves(self, ask: ShareAsk) -> None:
        """Refused by its own limit (or its endpoint's), not by the quota: not waiting on it."""
        if ask.member in self.waiting[ask.klass]:
            self.ends.pop((ask.klass, ask.member), None)
            self.left(ask.klass, ask.member)

    def left(self, c: int, member: str) -> None:
        """``member`` waits no more in class ``c`` (acquire.lua's ``share_left``); its class's
        tags go once no one waits, and those below the lowest waiting one (they count as it)."""
        if self.waiting[c].pop(member, None) is not None:
            self.weights[c] -= float(member.split("|", 1)[0])
        if self.weights[c] <= 1e-9 or not self.waiting[c]:
            self.weights[c] = 0.0
            self.waiting[c].clear()
            self.tags[c].clear()
        else:
            low = min(self.waiting[c].values())
            self.tags[c] = {m: tag for m, tag in self.tags[c].items() if tag >= low}


class Schedules:
    """The memory store's schedules, by their hash key (``ShareAsk.keys[0]``)."""

    def __init__(self) -> None:
        self._all: dict[str, Schedule] = {}

    def __len__(self) -> int:
        return len(self._all)

    def sweep(self, now: float) -> None:
        for key in [k for k, s in self._all.items() if s.touched + _LIFE <= now]:
            del self._all[key]

    def quiet(self, ask: ShareAsk, now: float) -> bool:
        """Whether a request of ``ask`` granted at once, without a wait, leaves the schedule
        as ``Turn`` would (then the store grants it without one): no one of its class waits
        (so no tag is read or moved), no wait's end is due, no higher class is busy and its
        class has no credit (the gate would clear it). A schedule not there, or past its
        life, is an empty one."""
        s = self._all.get(ask.keys[0])
        if s is None or s.classes != ask.classes or s.touched + _LIFE <= now:
            return True
        c = ask.klass
        if s.waiting[c] or s.credit[c] > 0 or now >= s.first_end or (c and max(s.busy[:c]) > now):
            return False
        s.touched = now
        return True

    def of(self, ask: ShareAsk, now: float) -> Schedule:
        s = self._all.get(ask.keys[0])
        if s is None or s.classes != ask.classes or s.touched + _LIFE <= now:
            s = self._all[ask.keys[0]] = Schedule(ask.classes)
        s.touched = now
        if now < s.first_end:
            return s
        for (i, member), ends in list(s.ends.items()):  # tenants whose wait ended
            if ends <= now:
                del s.ends[(i, member)]
                s.left(i, member)
        s.first_end = min(s.ends.values(), default=math.inf)
        return s


class Turn:
    """One request's dealings with its vendor's schedule, in the order the store's ``take``
    meets them (acquire.lua's ``share_granted``, ``share_waits``, ``share_leaves``)."""

    __slots__ = ("ask", "cost", "gate", "now", "schedule")

    def __init__(
        self,
        schedules: Schedules,
        ask: ShareAsk,
        buckets: Sequence[BucketSpec],
        charge: Sequence[float],
        rates: Sequence[float],
        levels: Sequence[float],
        now: float,
    ) -> None:
        """A request taking ``charge`` (per bucket) of buckets at ``rates`` holding ``levels``
        now. The slowest of the vendor's global request buckets (a meter's first, without
        them) sets the schedule's unit; a metered call's turn counts the quota's part it takes
        most of (its cost in each meter bucket as that bucket's time, in units: weights divide
        each meter, SPEC §13); its room is how many more of it the tightest of those buckets
        holds after it (one request, or this estimate) (acquire.lua, "Share")."""
        first, last = ask.first_global, len(charge) - ask.metered
        rate, room, cost = min(rates[first:last], default=0.0), math.inf, charge[first] if first < last else 0.0
        for i in range(first, last):
            room = min(room, levels[i] - charge[i])
        if not rate:
            rate = rates[last] if last < len(rates) else 1.0
        for i in range(last, len(charge)):
            if charge[i] > 0 and buckets[i].scope == "global":  # (a meter's tenant buckets: their caps)
                cost, room = max(cost, charge[i] * rate / rates[i]), min(room, levels[i] / charge[i] - 1)
        self.ask, self.cost, self.now = ask, cost, now
        self.schedule = schedules.of(ask, now)
        self.gate = self.schedule.gate(ask, cost, rate, now, room)

    def horizon(self, max_wait: float) -> float:
        """How far ahead a grant may be reserved, for a caller that holds ``max_wait``: a
        request on credit (its class's min_share) as far as it holds."""
        return max_wait if self.gate.on_credit else min(max_wait, HORIZON)

    def granted(self, wait: float, own_bound: bool) -> None:
        """Granted (``own_bound``: its tenant's or endpoint's buckets hold less than it took)."""
        self.schedule.granted(self.ask, self.gate, self.cost, wait, self.now)
        if own_bound:  # its own limit holds its next: it waits on that
            self.schedule.leaves(self.ask)

    def kept(self, wait: float) -> None:
        """A slot kept for it: its turn, taken; it waits for it as a tenant refused does."""
        s, ask, g = self.schedule, self.ask, self.gate
        s.load(ask, g)
        g.low = g.tag if g.low is None else g.low
        s.granted(ask, g, self.cost, wait, self.now)
        g.tag += self.cost / ask.weight
        s.waits(ask, g, wait, self.now, kept=True)

    def refused(self, wait: float, binding: int, step: float) -> tuple[float, int, float]:
        """A refusal's wait, binding bucket and deferral step: its turn's, when the schedule refused."""
        g = self.gate
        if not g.ok and (g.wait > wait or binding < 0):
            wait, binding = max(wait, g.wait), self.ask.first_global
        return wait, binding, g.step if g.step is not None and not g.ok else step

    def refused_with(self, binding: int, hint: float) -> None:
        """Refused with ``hint``: waiting on the quota, or held by its own limit."""
        if not self.gate.ok or binding >= self.ask.first_global:
            self.schedule.waits(self.ask, self.gate, hint, self.now)
        else:
            self.schedule.leaves(self.ask)
