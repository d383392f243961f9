"""memory://'s twin of acquire.lua's "Share" section (SPEC §13): a vendor's schedule, its
waiting tenants' tags per class, the classes' busy times and credits. See acquire.lua for
why it works as it does; this module keeps the same arithmetic, in seconds."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.limiter.share import CLASS_GRACE, GRACE, HORIZON, TAU
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
        for (i, member), ends in list(s.ends.items()):  # tenants whose wait ended
            if ends <= now:
                del s.ends[(i, member)]
                if s.waiting[i].pop(member, None) is not None:
                    s.weights[i] -= float(member.split("|", 1)[0])
                if s.weights[i] <= 1e-9 or not s.waiting[i]:
                    s.weights[i] = 0.0
                    s.waiting[i].clear()
                    s.tags[i].clear()
        return s

    @staticmethod
    def gate(s: Schedule, ask: ShareAsk, cost: float, rate: float, now: float) -> Gate:
        """``rate``: the slowest of the vendor's global buckets, tokens per second."""
        c = ask.klass
        g = Gate()
        busy = max(s.busy[:c], default=0.0)
        class_rate = rate
        if busy <= now and s.credit[c] > 0:  # credit is for while a higher class waits, not to keep
            s.credit[c] = 0.0
        if busy > now:  # a higher class is waiting: this one takes only on credit
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
            ahead = g.tag - low - cost / ask.weight
            if ahead > 0:
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
        if g.low is not None or ask.member in s.waiting[c]:
            tag = g.tag + cost / ask.weight
            s.tags[c][ask.member] = tag
            if ask.member in s.waiting[c]:  # still waiting: its place moves on
                s.waiting[c][ask.member] = tag

    @staticmethod
    def waits(s: Schedule, ask: ShareAsk, g: Gate, retry: float, now: float, kept: bool = False) -> None:
        """A refusal by the schedule or the vendor's quota: the tenant waits (acquire.lua's
        ``share_waits``; ``kept``: a slot is kept for it, it comes back then)."""
        c = ask.klass
        member = ask.member
        tag = g.tag if g.low is not None else s.tags[c].get(member, 0.0)
        g.tag = tag
        waiting = s.waiting[c]
        if member not in waiting:
            waiting[member] = tag
            s.weights[c] += ask.weight
        elif tag > waiting[member]:
            waiting[member] = tag
        if tag > s.tags[c].get(member, -1.0):
            s.tags[c][member] = tag
        back = max(retry, 0.0) if kept else min(max(retry, 0.0), TAU)
        key = (c, member)
        s.ends[key] = max(s.ends.get(key, 0.0), now + back + GRACE)
        s.busy[c] = max(s.busy[c], now + back + CLASS_GRACE)


def horizon(gate: Gate, max_wait: float) -> float:
    """How far ahead a grant under a share may be reserved, for a caller that holds
    ``max_wait``: a request on credit (its class's min_share) as far as it holds."""
    return max_wait if gate.on_credit else min(max_wait, HORIZON)
