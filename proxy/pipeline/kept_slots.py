"""Which slot a request claims: the slots kept for deferred calls (acquire.lua, "Kept slots").

A deferred call's slot is kept in the store under a claim the store made up; the proxy
must send that claim with the call's retry. What tells a retry from a new call:

- the worker's connection: a worker whose SDK retries sends the retry on the connection
  the refusal came on (``Request.kept_slots``): early or not, it is the slot's owner. So
  is another call on it (the worker moved on: it re-enqueued the call, or gave up): a
  slot its owner leaves behind is nobody's, and its time passes unused;
- else the call itself, remembered on this replica for as long as its slot can be
  claimed: HTTP clients drop connections that sat idle for a few seconds (httpx after
  5 s), and a re-enqueued job comes back on another worker's connection. With an
  ``Idempotency-Key`` (Stripe's SDK puts one on every POST, the same on every retry of
  it) the same call is its owner, early or not; without one, two calls with the same
  target are told apart by nothing, so it claims the slot only once the slot has matured
  (whichever of them comes first is served then, the other is given a slot of its own);

A call of none of these kinds claims nothing itself; the store gives it a slot whose
owner is late, if there is one (``owner``): at once when it comes as a retry would (the
first request of a connection, or one after a wait), and only ``FOLLOW_UP`` after the
slot matured when it comes right after an answer on its connection, as a worker's next
call does. Such calls come in a stream, a few ms after each grant: under load, one would
otherwise take the slot its owner is a few ms from claiming, again and again the same
slower worker's (a worker of forty at 95/s served nothing in 8 s).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Final, NamedTuple

from proxy.clock import Clock
from proxy.limiter.store import AcquireResult, Reserve
from proxy.wire.headers import IDEMPOTENCY_KEY

FOLLOW_UP: Final = 0.05
"""Seconds: a request this soon after its connection's last answer is a worker's next call,
which may take a slot its owner has not claimed only this long after the slot matured."""

CALLS_MAX: Final = 65_536
"""Deferred calls remembered per replica (their slots live no longer than answers_max_wait)."""

WEAK: Final = "?"
"""Before a claim the store honours only once its slot has matured (acquire.lua, ARGV[9])."""

_Call = tuple[str, str, str, str]  # (bucket set's kept key, method, target, Idempotency-Key)


class _Kept(NamedTuple):
    claim: str
    until: float
    """When (the clock's) the slot can no longer be claimed: it matured ``life`` ago."""


class KeptSlots:
    """The slots kept for this replica's deferred calls, by call (see the module's doc)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._calls: OrderedDict[_Call, _Kept] = OrderedDict()
        self._sets: dict[str, int] = {}  # kept key -> calls remembered with a slot of that bucket set

    def __len__(self) -> int:
        return len(self._calls)

    def waiting(self, kept: str) -> bool:
        """Does a call of bucket set ``kept`` have a slot here (its retry is the general path's)?"""
        if kept not in self._sets:
            return False
        now = self.clock.monotonic()
        calls = self._calls
        while calls:  # forget the slots no longer claimable (oldest first: roughly those)
            call, first = next(iter(calls.items()))
            if first.until > now:
                break
            self._drop(call)
        return kept in self._sets

    def claim(self, kept: str, connection: Mapping[str, str] | None, call: _Call) -> str:
        """The claim to send for ``call`` (of bucket set ``kept``; see the module's doc), ""
        for none; a weak one (``WEAK``) is honoured only once its slot has matured."""
        mine = None if connection is None else connection.get(kept)
        if mine:
            return mine
        found = self._calls.get(call)
        if found is not None:
            if found.until > self.clock.monotonic():
                return found.claim if call[3] else WEAK + found.claim
            self._drop(call)
        return ""

    def kept(
        self,
        kept: str,
        connection: dict[str, str] | None,
        call: _Call,
        sent: str,
        result: AcquireResult,
        reserve: Reserve | None,
    ) -> None:
        """What the store said of the claim ``sent`` (a slot kept for the request, or none
        now: claimed, refused without one, or gone with the store's state)."""
        claim = result.reserved
        if connection is not None:
            if claim:
                connection[kept] = claim
            elif sent and (mine := connection.get(kept)) is not None and sent.endswith(mine):
                del connection[kept]  # claimed (or gone): the connection's slot no more
        if claim and reserve is not None:
            self._drop(call)
            self._calls[call] = _Kept(claim, self.clock.monotonic() + result.wait + reserve.life)
            self._sets[kept] = self._sets.get(kept, 0) + 1
            while len(self._calls) > CALLS_MAX:
                self._drop(next(iter(self._calls)))
        elif sent or call in self._calls:
            self._drop(call)

    def _drop(self, call: _Call) -> None:
        if self._calls.pop(call, None) is not None:
            left = self._sets[call[0]] - 1
            if left:
                self._sets[call[0]] = left
            else:
                del self._sets[call[0]]


class Caller(NamedTuple):
    """Who asks (handler.admit): what tells its retry from a new call."""

    connection: dict[str, str] | None
    """The worker's connection's slots (``Request.kept_slots``)."""
    method: str
    target: str
    headers: Mapping[str, str]
    follows: float | None = None
    """Seconds since its connection's last answer (``Request.follows``)."""

    @property
    def owner(self) -> float:
        """How long after a slot matured this caller may take it, its owner late (see the module's doc)."""
        follows = self.follows
        return FOLLOW_UP if follows is not None and follows < FOLLOW_UP else 0.0

    def call(self, kept: str) -> _Call:
        """What makes a request the same call as another (see the module's doc)."""
        return (kept, self.method, self.target, self.headers.get(IDEMPOTENCY_KEY, ""))
