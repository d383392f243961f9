"""The token quotas of the mock vendor's LLM shapes (SPEC §14): a strict sliding window per
currency (OpenAI's tokens; Anthropic's input tokens and output tokens), taken at a request's
arrival by the vendor's own estimate, settled to what the answer used.

A window of ``window`` seconds accepts ``limit = floor(per_minute x window / 60)`` tokens. A
request is admitted when, in every currency its shape counts, the tokens the admitted requests
of the last ``window`` seconds hold plus its own estimate fit in ``limit``; then it takes its
estimate from each, or from none (``reserve``). It holds the estimate until its answer is
produced (a stream: until its last event is written), then what the answer used
(``Reservation.settle``), as OpenAI and Anthropic do; the window forgets it ``window`` seconds
after its arrival, whatever it holds. A request whose estimate exceeds ``limit`` can never fit.

Each window's ``stats``: ``per_minute``, ``window``, ``limit``, ``used`` (what the window holds
now), ``tokens_window_max`` (the most tokens that arrived in any one window: admitted requests
at what they hold, refused ones at their estimate, as ``window_max`` counts refused requests; above
``limit`` the vendor was overrun by that much, which a client that never meets a 429 keeps from
happening unless answers use more than their estimate), ``tokens_accepted`` (what admitted
requests hold, settled) and ``rejected`` (requests this currency refused with a 429).

Light on purpose: ``mockvendor_cli`` imports ``DEFAULT_TOKEN_WINDOW`` without aiohttp.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypedDict

from proxy.devtools.mockvendor_quota import EPSILON, Clock, format_number

if TYPE_CHECKING:
    from aiohttp import web

__all__ = [
    "DEFAULT_TOKEN_WINDOW",
    "Demand",
    "Refused",
    "Reservation",
    "ShapeMeter",
    "TokenStats",
    "TokenWindow",
    "arrived_refused",
    "reserve",
]

DEFAULT_TOKEN_WINDOW: Final = 60.0
"""Seconds a token window spans unless told: the minute both vendors count in."""


class TokenStats(TypedDict):
    per_minute: float
    window: float
    limit: int
    used: int
    tokens_window_max: int
    tokens_accepted: int
    rejected: int


class _Entry:
    """One request's tokens in a window: its estimate, then what its answer used."""

    __slots__ = ("admitted", "at", "live", "tokens")

    def __init__(self, at: float, tokens: int, admitted: bool) -> None:
        self.at, self.tokens, self.admitted = at, tokens, admitted
        self.live = True  # still within the window (sums count it)


class TokenWindow:
    """One currency's strict sliding window; see the module docstring."""

    def __init__(self, currency: str, per_minute: float, window: float = DEFAULT_TOKEN_WINDOW) -> None:
        for name, value in (("tokens per minute", per_minute), ("token window", window)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{currency}: {name} must be a positive number, not {value!r}")
        limit = math.floor(per_minute * window / 60.0 + EPSILON)
        if limit < 1:
            raise ValueError(
                f"{format_number(per_minute)} {currency.replace('_', ' ')} per minute over a "
                f"{format_number(window)}s window is less than 1 token: raise the rate or widen the window"
            )
        self.currency = currency
        self.per_minute = float(per_minute)
        self.window = float(window)
        self.limit = limit
        self._entries: deque[_Entry] = deque()  # every arrival within the window, oldest first
        self._held = 0  # what the admitted ones hold
        self._arrived = 0  # what they all hold, refused ones at their estimate
        self.window_max = 0
        self.accepted = 0
        self.rejected = 0

    def reset(self) -> None:
        """Empty the window and zero its counts."""
        for entry in self._entries:
            entry.live = False
        self._entries.clear()
        self._held = self._arrived = self.window_max = self.accepted = self.rejected = 0

    def _expire(self, now: float) -> None:
        edge = now - self.window  # a window is (now - window, now]: an arrival at `edge` is out
        entries = self._entries
        while entries and entries[0].at <= edge:
            entry = entries.popleft()
            entry.live = False
            self._arrived -= entry.tokens
            if entry.admitted:
                self._held -= entry.tokens

    def used(self, now: float) -> int:
        """Tokens the admitted requests of the last ``window`` seconds hold."""
        self._expire(now)
        return self._held

    def remaining(self, now: float) -> int:
        return max(self.limit - self.used(now), 0)

    def full_in(self, now: float) -> float:
        """Seconds until the window holds nothing: the newest admitted request leaves it."""
        self._expire(now)
        newest = next((e.at for e in reversed(self._entries) if e.admitted), None)
        return 0.0 if newest is None else newest + self.window - now

    def wait(self, now: float, tokens: int) -> float:
        """Seconds until ``tokens`` fit: 0.0 now, ``math.inf`` never (more than ``limit``)."""
        if tokens > self.limit:
            return math.inf
        self._expire(now)
        excess = self._held + tokens - self.limit
        if excess <= 0:
            return 0.0
        for entry in self._entries:  # the oldest leave first
            if entry.admitted:
                excess -= entry.tokens
                if excess <= 0:
                    return entry.at + self.window - now
        return math.inf  # not reached: with every admitted one gone, `tokens` <= `limit` fits

    def _arrive(self, now: float, tokens: int, admitted: bool) -> _Entry:
        self._expire(now)
        entry = _Entry(now, tokens, admitted)
        self._entries.append(entry)
        self._arrived += tokens
        if admitted:
            self._held += tokens
            self.accepted += tokens
        self.window_max = max(self.window_max, self._arrived)
        return entry

    def take(self, now: float, tokens: int) -> _Entry:
        """Admit ``tokens`` (``wait`` said they fit)."""
        return self._arrive(now, tokens, admitted=True)

    def refuse(self, now: float, tokens: int, *, binding: bool) -> None:
        """Count a refused request's arrival at its estimate; ``binding``: this currency refused it."""
        self._arrive(now, tokens, admitted=False)
        if binding:
            self.rejected += 1

    def settle(self, entry: _Entry, actual: int, now: float) -> None:
        """Replace what ``entry`` holds with ``actual``."""
        self._expire(now)
        delta = actual - entry.tokens
        entry.tokens = actual
        self.accepted += delta
        if entry.live:
            self._held += delta
            self._arrived += delta
            self.window_max = max(self.window_max, self._arrived)

    def stats(self, now: float) -> TokenStats:
        return {
            "per_minute": self.per_minute,
            "window": self.window,
            "limit": self.limit,
            "used": self.used(now),
            "tokens_window_max": self.window_max,
            "tokens_accepted": self.accepted,
            "rejected": self.rejected,
        }


class Reservation:
    """What one admitted request holds in its shape's windows until its answer settles it."""

    __slots__ = ("_clock", "_takes")

    def __init__(self, clock: Clock, takes: tuple[tuple[TokenWindow, _Entry], ...] = ()) -> None:
        self._clock = clock
        self._takes = takes

    def settle(self, **actual: int) -> None:
        """Replace each currency's estimate with what the answer used (``input_tokens=12``); a
        currency not named keeps its estimate. Only the first call counts."""
        if not self._takes:
            return
        now = self._clock()
        for window, entry in self._takes:
            used = actual.get(window.currency)
            if used is not None:
                window.settle(entry, used, now)
        self._takes = ()


@dataclass(frozen=True, slots=True)
class Demand:
    """A request's estimate in each of its shape's windows (in their order), at arrival."""

    tokens: tuple[int, ...]
    body: bytes | None
    """The request's body, for the words of a refusal (the model it named)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Why the token quota refused a request."""

    demand: Demand
    binding: tuple[TokenWindow, ...]
    """The windows it did not fit in, in the shape's order."""
    used: tuple[int, ...]
    """What each of the shape's windows held when it arrived."""
    wait: float
    """Seconds until it fits in all of them (``math.inf``: never)."""


class ShapeMeter(Protocol):
    """A shape's token quotas: its windows, its estimate, and how it tells them."""

    @property
    def windows(self) -> tuple[TokenWindow, ...]: ...

    def estimate(self, body: bytes | None, content_type: str | None, path: str) -> Demand:
        """The request's estimate in each window, by the vendor's own admission rule."""
        ...

    def headers(self, now: float) -> dict[str, str]:
        """The token quota headers every answer of the shape carries."""
        ...

    def refusal(self, refused: Refused, headers: dict[str, str]) -> web.Response:
        """The vendor's 429 for tokens, with ``headers`` (the quotas')."""
        ...


def reserve(windows: tuple[TokenWindow, ...], demand: Demand, now: float, clock: Clock) -> Reservation | Refused:
    """Take ``demand`` from every window, or, when one lacks room, from none (``Refused``)."""
    waits = [w.wait(now, tokens) for w, tokens in zip(windows, demand.tokens, strict=True)]
    wait = max(waits, default=0.0)
    if wait > 0:
        used = tuple(w.used(now) for w in windows)
        for w, tokens, its_wait in zip(windows, demand.tokens, waits, strict=True):
            w.refuse(now, tokens, binding=its_wait > 0)
        binding = tuple(w for w, its_wait in zip(windows, waits, strict=True) if its_wait > 0)
        return Refused(demand, binding, used, wait)
    return Reservation(clock, tuple((w, w.take(now, tokens)) for w, tokens in zip(windows, demand.tokens, strict=True)))


def arrived_refused(windows: tuple[TokenWindow, ...], demand: Demand, now: float) -> None:
    """Count the tokens of a request the request quota refused (not a token 429)."""
    for w, tokens in zip(windows, demand.tokens, strict=True):
        w.refuse(now, tokens, binding=False)
