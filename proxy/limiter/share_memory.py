"""memory://'s twin of acquire.lua's "Share" section (SPEC §13): a vendor's schedule, its
waiting tenants' tags per class, the classes' busy times and credits. See acquire.lua for
why it works as it does; this module keeps the same arithmetic, in seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from proxy.limiter.share import CLASS_GRACE, GRACE, HORIZON, SLACK, TAU
from proxy.limiter.store import ShareAsk

_LIFE = 60.0  # seconds a schedule nobody touched is kept (acquire.lua's PEXPIRE)


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


class Schedules:
    """The memory store's schedules, by their hash key (``ShareAsk.keys[0]``)."""

    def __init__(self) -> None:
        self._all: dict[str, Schedule] = {}

    def __len__(self) -> int:
        return len(self._all)

    def sweep(self, now: float) -> None:
        for key in [k for k, s in self._all.items() if s.touched + _LIFE <= now]:
            del self._all[key]

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
                if s.waiting[i].pop(member, None) is not None:
                    s.weights[i] -= float(member.split("|", 1)[0])
                if s.weights[i] <= 1e-9 or not s.waiting[i]:
                    s.weights[i] = 0.0
                    s.waiting[i].clear()
                    s.tags[i].clear()
                else:  # a tag below the lowest waiting one counts as that one: not kept
                    low = min(s.waiting[i].values())
                    s.tags[i] = {m: tag for m, tag in s.tags[i].items() if tag >= low}
        s.first_end = min(s.ends.values(), default=math.inf)
        return s

    @staticmethod
    def gate(s: Schedule, ask: ShareAsk, cost: float, rate: float, now: float, level: float = 0.0) -> Gate:
        """``rate``: the slowest of the vendor's global buckets, tokens per second; ``level``:
        the fewest tokens in them now."""
        c = ask.klass
        g = Gate()
        busy = max(s.busy[:c], default=0.0)
        class_rate = rate
        if busy <= now and s.credit[c] > 0:  # credit is for while a higher class waits, not to keep
            s.credit[c] = 0.0
        if busy > now and level - 1 < cost:  # a higher class waits (and no token more than its): credit only
            credit = s.credit[c]
            last = s.credited[c]
            if last is not None and now - last < 1.0:
                credit += (now - last) * ask.min_share * rate
            credit = min(credit, max(cost, 1.0) + ask.min_share * rate * 0.05)  # (50 ms of it: asks come late)
            s.credit[c], s.credited[c] = credit, now
            class_rate = ask.min_share * rate
            if credit >= cost:
                g.on_credit = True
            else:
                g.ok = False
                g.wait = max(g.wait, busy - now)
                if ask.min_share > 0:
                    g.wait = min(g.wait, (cost - credit) / class_rate)
        waiting = s.waiting[c]
        if s.weights[c] > 0 and waiting:
            low = min(waiting.values())
            g.low = low
            g.tag = max(s.tags[c].get(ask.member, low), low)
            ahead = g.tag - low - max(cost, rate * SLACK) / ask.weight
            if ahead > 0 and level - 1 < cost:  # (tokens to spare: the one behind is not there for them)
                behind = ahead * s.weights[c] / max(class_rate, 1e-9)
                g.wait = max(g.wait, behind)
                g.ok = False
            g.step = cost * s.weights[c] / (ask.weight * max(class_rate, 1e-9))
        if not g.ok and ask.min_share > 0 and busy > now:
            g.step = max(g.step or 0.0, cost / class_rate)
        return g

    @staticmethod
    def granted(s: Schedule, ask: ShareAsk, g: Gate, cost: float, wait: float, now: float) -> None:
        c = ask.klass
        if g.on_credit:
            s.credit[c] -= cost
        if wait > 0:  # a hold waits: its class is busy
            s.busy[c] = max(s.busy[c], now + wait + CLASS_GRACE)
        if g.low is not None:
            tag = g.tag + cost / ask.weight
            s.tags[c][ask.member] = tag
            if ask.member in s.waiting[c]:  # still waiting: its place moves on
                s.waiting[c][ask.member] = tag

    @staticmethod
    def load(s: Schedule, ask: ShareAsk, g: Gate) -> None:
        """Its tag, when no one of its class was waiting (not read then)."""
        if g.low is None:
            g.tag = s.tags[ask.klass].get(ask.member, 0.0)

    @staticmethod
    def waits(s: Schedule, ask: ShareAsk, g: Gate, retry: float, now: float, kept: bool = False) -> None:
        """A refusal by the schedule or the vendor's quota: the tenant waits by its tag until
        it is expected back (acquire.lua's ``share_waits``; ``kept``: a slot is kept for it,
        it comes back then)."""
        c = ask.klass
        member = ask.member
        Schedules.load(s, ask, g)
        back = max(retry, 0.0) if kept else min(max(retry, 0.0), TAU)
        waiting = s.waiting[c]
        if member not in waiting:
            s.weights[c] += ask.weight
        waiting[member] = g.tag
        if g.tag > s.tags[c].get(member, -1.0):
            s.tags[c][member] = g.tag
        key = (c, member)
        s.ends[key] = ends = max(s.ends.get(key, 0.0), now + back + GRACE)
        s.first_end = min(s.first_end, ends)
        s.busy[c] = max(s.busy[c], now + back + CLASS_GRACE)

    @staticmethod
    def leaves(s: Schedule, ask: ShareAsk) -> None:
        """Refused by its own limit (or its endpoint's), not by the quota: not waiting on it."""
        c = ask.klass
        if s.waiting[c].pop(ask.member, None) is not None:
            s.ends.pop((c, ask.member), None)
            s.weights[c] -= ask.weight
            if s.weights[c] <= 1e-9 or not s.waiting[c]:
                s.weights[c] = 0.0
                s.waiting[c].clear()
                s.tags[c].clear()


class Turn:
    """One request's dealings with its vendor's schedule, in the order the store's ``take``
    meets them (acquire.lua's ``share_granted``, ``share_waits``, ``share_leaves``)."""

    __slots__ = ("ask", "cost", "gate", "now", "schedule")

    def __init__(self, schedules: Schedules, ask: ShareAsk, cost: float, rate: float, level: float, now: float) -> None:
        """``rate``: the slowest of the vendor's global buckets, tokens per second; ``level``:
        the fewest tokens in them now."""
        self.ask, self.cost, self.now = ask, cost, now
        self.schedule = schedules.of(ask, now)
        self.gate = Schedules.gate(self.schedule, ask, cost, rate, now, level)

    def horizon(self, max_wait: float) -> float:
        """How far ahead a grant may be reserved, for a caller that holds ``max_wait``: a
        request on credit (its class's min_share) as far as it holds."""
        return max_wait if self.gate.on_credit else min(max_wait, HORIZON)

    def granted(self, wait: float, own: list[float]) -> None:
        """Granted (``own``: its tenant's and endpoint's levels after the take)."""
        Schedules.granted(self.schedule, self.ask, self.gate, self.cost, wait, self.now)
        if any(level < self.cost for level in own):  # its own limit holds its next: it waits on that
            Schedules.leaves(self.schedule, self.ask)

    def kept(self, wait: float) -> None:
        """A slot kept for it: its turn, taken; it waits for it as a tenant refused does."""
        s, ask, g = self.schedule, self.ask, self.gate
        Schedules.load(s, ask, g)
        g.low = g.tag if g.low is None else g.low
        Schedules.granted(s, ask, g, self.cost, wait, self.now)
        g.tag += self.cost / ask.weight
        Schedules.waits(s, ask, g, wait, self.now, kept=True)

    def refused(self, wait: float, binding: int, step: float) -> tuple[float, int, float]:
        """A refusal's wait, binding bucket and deferral step: its turn's, when the schedule refused."""
        g = self.gate
        if not g.ok and (g.wait > wait or binding < 0):
            wait, binding = max(wait, g.wait), self.ask.first_global
        return wait, binding, g.step if g.step is not None and not g.ok else step

    def refused_with(self, binding: int, hint: float) -> None:
        """Refused with ``hint``: waiting on the quota, or held by its own limit."""
        if not self.gate.ok or binding >= self.ask.first_global:
            Schedules.waits(self.schedule, self.ask, self.gate, hint, self.now)
        else:
            Schedules.leaves(self.schedule, self.ask)
