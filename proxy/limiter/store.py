"""The storage contract every bucket store honours (memory:// and redis://).

A bucket is a token bucket with reservations: its level may go negative while
holds have reserved tokens that have not matured, and a vendor block pushes its
refill start into the future. All times a store returns are relative (seconds
from "now" on the store's own clock), so callers never compare clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, NamedTuple, Protocol

Scope = Literal["tenant", "endpoint", "global"]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket as a store sees it."""

    key: str
    rate: float
    """Refill, tokens per second."""
    burst: float
    """Capacity, tokens."""
    scope: Scope
    label: str
    """For people: e.g. ``tenant acme 20/1s burst 20``."""
    field: str = ""
    """Empty: the bucket is the hash ``key`` itself (expiring once full again). Else
    the bucket lives in the hash ``key`` (a vendor's state) under ``<field>:t`` and
    ``<field>:ts``, so it cannot be lost without the state's counter (acquire.lua)."""
    ident: str = dataclasses.field(init=False, repr=False, compare=False)
    """One name for the bucket, whichever way it is stored (made once: looked up per request)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ident", f"{self.key}#{self.field}" if self.field else self.key)


class StateGuard(NamedTuple):
    """What lets a store notice it lost its state (acquire.lua, "Lost state"). A tuple,
    not a frozen dataclass: one is made per acquire, and a tuple is made at half the cost."""

    key: str
    """The vendor's state key."""
    seen: int
    """The highest ``seq`` the caller has seen for this vendor; 0 before any."""
    debt: float
    """Seconds after a loss during which reservations granted before it may still be
    outstanding (the vendor's longest hold)."""


@dataclass(frozen=True, slots=True)
class LeaseSet:
    """Requests in flight to a vendor (or an endpoint class), fleet-wide, at most ``cap``."""

    key: str
    cap: int
    label: str
    """For people: e.g. ``concurrency 50`` or ``endpoint search concurrency 5``."""


class Leases(NamedTuple):
    """The leases one request asks for with its tokens (acquire.lua, "Leases"). (A tuple:
    one is made per request with a cap, at half a frozen dataclass's cost.)"""

    id: str
    """Unique per request: what release and renew name."""
    life: float
    """Seconds a lease lives past the reservation's maturity unless renewed: the
    vendor's connect + read timeouts, after which a dead replica's slot is free."""
    sets: tuple[LeaseSet, ...]


SLOT_LIFE: Final = 1.0
"""Seconds a kept slot outlives its maturity by default: what rounding a wait up to
``Retry-After``'s whole seconds adds (an SDK's own jitter on top of it is its preset's
``retry_jitter``)."""
STANDBY: Final = 0.05
"""Seconds after a slot left by its owner matures that a caller offered it asks (acquire.lua,
"Standby"): the owner's head start, should it come back after all."""


class Reserve(NamedTuple):
    """A deferral that keeps its slot (acquire.lua, "Kept slots"): refused with a wait of at
    most ``horizon``, the caller's tokens are taken as a hold's and the slot is kept for it
    in the bucket set's reservation set ``key`` until it comes back and claims it."""

    key: str
    claim: str
    """The slot this caller was given before ("" = none): granted once it has matured,
    refused with the same slot before (never a new one). After a ``?``: a slot it may
    claim once it has matured, but that it is not told again before (kept_slots.py)."""
    horizon: float
    """Seconds: a refusal whose wait is at most this keeps its slot (a caller told to retry)."""
    owner: float = 0.0
    """Seconds after it matures a slot is its owner's alone; then any request of the bucket
    set without a slot of its own may claim it (the owner's retry came to another replica
    or on a new connection, its job went elsewhere, or it never comes back). None by
    default: precise retriers come back within a few ms of their slot, before the next
    slot matures, and a slot taken by another caller is still spent, not lost (its owner
    is given a slot of its own)."""
    life: float = SLOT_LIFE
    """Seconds after it matures a slot nobody claimed is dropped (its tenant buckets given
    their tokens back; its time, and with it the vendor-side token, has passed)."""
    tenants: int = 0
    """How many of the buckets (the first) are the tenant's own: when they are what refuses,
    only they are taken for the slot (the vendor-side ones when it is claimed)."""
    standby: float = STANDBY

    @property
    def left(self) -> str:
        """The key of the set of its slots whose owners left (``left_key``)."""
        return left_key(self.key)

    @property
    def shifts(self) -> str:
        """The key of the moves of its late slots (acquire.lua, "Late slots")."""
        return self.key + "/shifts"

    @property
    def offers(self) -> str:
        """The key of the slots left behind offered to a refusal (``offers_key``)."""
        return offers_key(self.key)


def left_key(kept: str) -> str:
    """The set of reservation set ``kept``'s slots whose owners left (acquire.lua, "Standby"):
    beside it (a tenant name never holds ``/``)."""
    return kept + "/left"


def offers_key(kept: str) -> str:
    """Reservation set ``kept``'s slots left behind offered to a refusal, by the member of the
    refused caller's own slot (acquire.lua, "Standby"): offered again should that caller leave."""
    return kept + "/offers"


class ShareAsk(NamedTuple):
    """A request of a vendor with ``share:`` (SPEC §13; acquire.lua, "Share"): its class and
    tenant weight, and the keys of the vendor's (partition's) schedule, which every replica's
    grants follow. Made once per (bucket set, class): the limiter's ``Buckets.share``."""

    keys: tuple[str, ...]
    """The schedule's hash, its expiry set, then per class its waiting set and its tag set."""
    klass: int
    """0-based index in the vendor's classes, 0 = the highest priority."""
    classes: int
    member: str
    """``<weight>|<tenant>``: the tenant's name in the class's sets."""
    weight: float
    min_share: float
    """Fraction of the quota a lower class with requests waiting always receives."""
    first_global: int
    """0-based index of the first of the request's buckets that is a vendor's global one."""
    metered: int = 0
    """How many of the request's buckets, the last, are its meters' (SPEC §14): the schedule
    divides the global request buckets, before them."""


class AcquireResult(NamedTuple):
    granted: bool
    """True: ``cost`` was taken from every bucket. False: from none."""
    wait: float
    """Seconds. Granted: until the reservation matures (0 = go now; a kept slot claimed by its
    owner after it matured: how long ago, negative, so that the write is paced as granted
    then; a late slot taken by another caller: as much, but half the schedule's interval at
    most, the rest of its move fitted by the store: acquire.lua, "Late slots").
    Refused: until every bucket could grant without waiting."""
    binding: int
    """Index of the bucket with the longest wait, -1 when none waits."""
    levels: tuple[float, ...]
    """Tokens in each bucket now, after the take when granted."""
    hint: float = 0.0
    """Seconds. Refused: when to retry, at least ``wait``: the caller's slot in the
    deferral queue, so callers refused together come back spread over the refill,
    not as a herd. Granted (or no queue): the same as ``wait``. Refused by a full lease
    set (``full``): how long that set's oldest lease has been out."""
    seq: int = 0
    """The vendor state's counter after this call (0 without a state guard)."""
    lost: bool = False
    """This call found that the store had lost its state (and applied the debt)."""
    full: int = -1
    """Index of a lease set at its cap (then nothing was taken), -1 when none is."""
    inflight: tuple[int, ...] = ()
    """Live leases in each lease set after this call."""
    ttl: float = 0.0
    """Seconds the vendor's state lives from now (0 without a state guard)."""
    reserved: str = ""
    """Refused with its slot kept (``Reserve``): the claim to send when it comes back (its
    slot matures in ``wait`` seconds); "" when none is kept."""
    claimed: bool = False
    """Granted on a slot kept earlier (its tokens were taken then)."""

    @property
    def retry_after(self) -> float:
        """When to retry: the queue slot (``hint``), never before every bucket could grant; a
        slot kept: its time, or a slot its owner left, earlier (acquire.lua, "Standby")."""
        return self.hint if self.reserved else max(self.hint, self.wait)


class BlockResult(NamedTuple):
    until: float
    """Seconds from now until the blocked buckets grant again (0 for a drain)."""
    levels: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Lesson:
    """What a vendor's quota headers teach about one bucket (feedback.lua, mode "learn").

    The bucket then refills at the lower of its policy's rate and ``rate``, up to the
    lower of its policy's burst and ``burst``, for ``ttl`` seconds unless taught again."""

    rate: float | None = None
    """Tokens per second the vendor allows; None: leave what the bucket learned as it is."""
    burst: float | None = None
    """Tokens; given with ``rate``."""
    forget: bool = False
    """The vendor allows the policy's limit or more: forget what was learned (the policy applies)."""
    remaining: float | None = None
    """What the vendor says remains: the most the bucket may hold now (less while settling
    after a lower rate); None: the level is left alone. A level is never raised."""
    window: float = 0.0
    """Seconds the vendor counts over: how long requests granted before a lower rate
    stay in its count (the settling period)."""
    ttl: float = 60.0
    """Seconds the learned rate and burst live unless learned again."""


class LearnResult(NamedTuple):
    levels: tuple[float, ...]
    """Tokens in each bucket now, after the lesson."""
    rates: tuple[float, ...]
    """Tokens per second each bucket refills at now (the lower of policy and learned)."""
    bursts: tuple[float, ...]
    settling: tuple[float, ...]
    """Seconds left of each bucket's settling period after a lower learned rate (0 = none)."""


class StoreUnavailable(Exception):
    """The store could not answer in time; the caller must not forward."""


Answered = Callable[[AcquireResult | None, BaseException | None], None]
Settled = Callable[[tuple[float, ...] | None, BaseException | None], None]
"""What hears a settlement's levels after, or why there are none (``settle_then``)."""
"""What a straight call's answer goes to: ``(result, None)``, or ``(None, why)`` when none came."""


class Pending(Protocol):
    """A straight call on its way: ``cancel`` when its caller gives up (its answer is dropped)."""

    def cancel(self) -> bool: ...


class StraightCall(Protocol):
    """One bucket set's acquire, prepared once (its keys, rates, bursts, caps and the
    command's fixed bytes) and sent per request without a coroutine: the straight path's
    (pipeline/lane.py) one store call per request."""

    def send(
        self, seen: int, leases: Leases | None, then: Answered, costs: tuple[float, ...] | None = None
    ) -> Pending | None:
        """Send the acquire, ``seen`` (the state's counter the caller has seen), ``leases``
        (its concurrency leases, None: none) and ``costs`` (a metered call's, one per bucket
        as ``acquire`` takes them; None: the call's own cost) being the call's own. ``then``
        gets the decoded result, or why none came (``StoreUnavailable`` for the store's
        failures), from the callback that read it; maybe before ``send`` returns (a store
        in this process). None: nothing was sent (the store's connection is not open) and
        ``then`` is never called."""


class BucketStore(Protocol):
    """Where bucket state lives. Every method is one atomic step on the store's clock."""

    async def acquire(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None = None,
        guard: StateGuard | None = None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        """Take ``cost`` from every bucket and a lease in every lease set, or nothing.

        Granted when every bucket has ``cost`` tokens now, or will have within
        ``max_wait`` seconds (a reservation: the caller waits ``wait``). Refused with a
        ``queue`` key: the caller is given the next free slot of that deferral queue
        as its ``hint`` (the queue takes nothing from any bucket). With a ``guard``, a
        store that finds it lost its state (Redis restarted empty, flushed, failed over
        to a lagging replica) restarts the buckets owing what may still be outstanding,
        never full. With ``leases``, a lease set at its cap refuses (``full``), taking nothing.
        With ``reserve`` (and a ``queue``), a refusal within its horizon keeps the caller's
        slot (``reserved``), and a claim or a slot whose owner is late is granted without
        taking tokens again (``claimed``); see ``Reserve``. With ``share``, the vendor's
        schedule (SPEC §13, acquire.lua "Share") decides too: a request that is not its
        tenant's or class's turn is refused with its turn, taking nothing, and a grant is
        reserved at most ``share.HORIZON`` ahead. With ``costs`` (one per bucket: a meter's
        buckets take the request's estimate, SPEC §14), bucket i takes ``costs[i]`` instead
        (``cost`` is still the request's, as its share's turn counts it); no slot is kept.
        """

    def straight(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None,
        guard: StateGuard,
        sets: tuple[LeaseSet, ...] = (),
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
    ) -> StraightCall | None:
        """``acquire`` of this bucket set, guarded by ``guard``'s state, with leases in
        ``sets``, no claim, prepared for the straight path to send per request; None when
        the store has no such call (a client that answers only in a coroutine: then
        ``acquire``, in a task)."""

    async def block(self, buckets: tuple[BucketSpec, ...], seconds: float, channel: str) -> BlockResult:
        """Grant nothing for ``seconds`` (or until outstanding reservations mature),
        then refill from empty; announce the block on ``channel`` if the store can."""

    async def drain(self, buckets: tuple[BucketSpec, ...]) -> BlockResult:
        """Drop every positive level to zero now; reservations are kept."""

    async def learn(self, buckets: tuple[BucketSpec, ...], lessons: tuple[Lesson, ...]) -> LearnResult:
        """Apply one lesson per bucket (what the vendor's quota headers say): set or forget
        its learned rate and burst, and lower its level to what the vendor says remains
        (feedback.lua, mode "learn"). Never raises a level, never exceeds the policy."""

    async def refund(self, buckets: tuple[BucketSpec, ...], cost: float) -> tuple[float, ...]:
        """Give ``cost`` back to every bucket (a hold that never went out), never above
        its burst; a missing bucket is left alone. Levels after."""

    async def settle(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float = 0.0
    ) -> tuple[float, ...]:
        """Settle a metered request (SPEC §14): give ``amounts[i]`` back to bucket i (its
        estimate less the actual amount), never above its burst, or take it as debt (a
        negative amount: later requests wait it out), on the store's clock. A bucket that is
        missing (full) is left alone by a refund and owes a debt from its burst. With
        ``since`` (seconds since the request took its tokens), a refund is no more than the
        bucket's history allows: the tokens given back were not spent, and a bucket that stood
        above empty meanwhile would have overflowed some (acquire.lua's ``z`` and ``zh``: half
        its burst at most, or none above half). Levels after."""

    def settle_then(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float, then: Settled
    ) -> bool:
        """``settle`` without a coroutine, as ``release_then``: ``then(levels, None)`` or
        ``then(None, why)``; False: nothing was sent, and ``settle`` is the caller's to await."""

    async def peek(self, buckets: tuple[BucketSpec, ...]) -> tuple[float, ...]:
        """Levels now, taking nothing."""

    async def release(self, sets: tuple[LeaseSet, ...], lease_ids: tuple[str, ...], channel: str) -> tuple[int, ...]:
        """Give the leases ``lease_ids`` (one or more) back in every set and announce it on
        ``channel`` (if the store can); live leases per set after."""

    def release_then(
        self,
        sets: tuple[LeaseSet, ...],
        lease_ids: tuple[str, ...],
        channel: str,
        then: Callable[[tuple[int, ...] | None, BaseException | None], None],
    ) -> bool:
        """``release`` without a coroutine: ``then(counts, None)`` or ``then(None, why)``
        from the callback that read the reply (maybe before this returns: a store in this
        process). False: nothing was sent (no such call, or the connection is not open),
        ``then`` is never called, and ``release`` is the caller's to await."""

    async def renew(self, leases: tuple[tuple[LeaseSet, str], ...], life: float) -> int:
        """Extend each (set, lease id) to ``life`` seconds from now; how many were still live."""

    async def inflight(self, sets: tuple[LeaseSet, ...]) -> tuple[int, ...]:
        """Live leases per set now."""

    async def publish(self, channel: str, data: str) -> None:
        """Tell other processes ``data`` on ``channel`` (a replica's write lag, pacing.py);
        best effort. Raises StoreUnavailable. A single-process store does nothing."""

    async def watch(self, pattern: str, on_message: Callable[[str, str], None]) -> None:
        """Call ``on_message(channel, data)`` for every message other processes announce on
        channels matching ``pattern`` (blocks and lease releases from the scripts, write
        lags from ``publish``); a ValueError it raises marks the message malformed (logged,
        skipped). Runs until cancelled; a single-process store returns at once."""

    async def left(self, kept: str, claims: tuple[str, ...]) -> int:
        """The slots ``claims`` of reservation set ``kept`` were left by their owner (its
        connection closed): each is offered to one later refusal as its hint (acquire.lua,
        "Standby"; leave.lua). Returns how many were still kept."""

    async def announce(self, key: str, member: str, stale: float, leave: bool = False) -> int:
        """Record ``member`` (a replica) alive now in the replica set ``key``, or remove it
        (``leave``); returns how many members announced within the last ``stale`` seconds
        (presence.lua). What a replica's share is when the store fails (degraded.py)."""

    async def ping(self, probes: tuple[str, ...] = ()) -> None:
        """Raise StoreUnavailable unless the store answers, and takes a scripted write
        to each of the ``probes`` keys (what every grant needs: a read-only replica, a
        full ``noeviction`` memory or paused writes still answer PING)."""

    async def close(self) -> None: ...
