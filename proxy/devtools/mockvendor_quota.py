"""The mock vendor's quota: a token bucket or a strict sliding window, and the headers that tell it.

``VendorQuota`` is ``MockVendor``'s base: it admits or refuses one request at a time
(``_admit``), changes the quota on demand (``configure``, ``set_limit``) and writes the
quota headers of an answer (``_quota``) in the family ``quota_headers`` names (SPEC §10):
``x-ratelimit`` (``X-RateLimit-Limit``, ``-Remaining``, ``-Reset``); ``ietf``
(``RateLimit-Policy: "default";q=LIMIT;w=WINDOW`` and ``RateLimit: "default";r=REMAINING;t=RESET``,
the window 1 s for a bucket); ``openai`` (``x-ratelimit-limit-requests`` per minute,
``-remaining-requests``, ``-reset-requests`` as ``6m0s``/``1s``/``20ms``: time until full
again); ``anthropic`` (``anthropic-ratelimit-requests-limit`` per minute, ``-remaining``,
``-reset`` as an RFC 3339 instant: when full again); ``shopify``
(``X-Shopify-Shop-Api-Call-Limit: USED/CAPACITY``); ``none``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

__all__ = [
    "EPSILON",
    "QUOTA_HEADERS",
    "REMAINING_HEADER",
    "Clock",
    "VendorQuota",
    "format_number",
    "go_duration",
    "retry_after",
    "rfc3339_in",
]

# A bucket refilled by float arithmetic can sit a hair below a whole token when a
# client paces at exactly the rate; a real vendor's integer clock would not refuse it.
EPSILON: Final = 1e-9
_GRANT_AT: Final = 1.0 - EPSILON

_LIMIT: Final = "X-RateLimit-Limit"
REMAINING_HEADER: Final = "X-RateLimit-Remaining"
QUOTA_HEADERS: Final = ("x-ratelimit", "ietf", "openai", "anthropic", "shopify", "none")

Clock = Callable[[], float]


def format_number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def go_duration(seconds: float) -> str:
    """OpenAI's way of writing a delay: ``6m0s``, ``1s``, ``20ms``."""
    ms = max(round(seconds * 1000), 0)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms / 1000.0, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def rfc3339_in(seconds: float) -> str:
    """Anthropic's way of writing a reset: the wall-clock instant ``seconds`` from now, in RFC 3339,
    rounded up to the whole second (never earlier than the quota really resets)."""
    at = math.ceil(time.time() + max(seconds, 0.0))
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def retry_after(wait: float) -> int:
    """A ``Retry-After`` for a wait of ``wait`` seconds: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(wait - EPSILON))


def _check_window(rate: float | None, burst: float | None, window: float | None) -> int:
    """The most requests a window accepts (0 without a window)."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int | float) or not math.isfinite(window) or window <= 0:
        raise ValueError(f"window must be a positive number of seconds or None, not {window!r}")
    if rate is None:
        raise ValueError("a window needs a rate (requests per second)")
    if burst is not None:
        raise ValueError("burst is a token bucket's: a window accepts rate x window requests, no burst")
    limit = math.floor(rate * window + EPSILON)
    if limit < 1:
        raise ValueError(f"rate x window must be at least 1 request, not {rate * window:g}")
    return limit


def _check_quota(rate: float | None, burst: float | None) -> tuple[float | None, float | None]:
    if rate is None:
        return None, None
    if not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a positive number or None, not {rate!r}")
    if burst is None:
        burst = max(rate, 1.0)
    if not math.isfinite(burst) or burst < 1:
        raise ValueError(f"burst must be at least 1 (one request), not {burst!r}")
    return float(rate), float(burst)


class VendorQuota:
    """A vendor's quota, token bucket or sliding window; see ``MockVendor`` for the arguments.

    ``window_max`` is the largest number of requests that arrived in any one window.
    """

    def __init__(
        self,
        rate: float | None,
        burst: float | None = None,
        clock: Clock = time.monotonic,
        *,
        window: float | None = None,
        quota_headers: str = "x-ratelimit",
    ) -> None:
        if quota_headers not in QUOTA_HEADERS:
            raise ValueError(f"quota_headers must be one of {', '.join(QUOTA_HEADERS)}, not {quota_headers!r}")
        self.quota_headers = quota_headers
        self._clock = clock
        self.window_max = 0
        self._window: float | None = None
        self._window_limit = 0
        self._in_window: deque[float] = deque()  # accepted arrivals within the last window
        self._arrived_in_window: deque[float] = deque()  # every arrival within it, refused ones too
        self._rate: float | None = None
        self._burst: float | None = None
        self._tokens = 0.0
        self._stamp = clock()
        self._limit_header = ""
        self.configure(rate, burst, window)

    @property
    def rate(self) -> float | None:
        return self._rate

    @property
    def burst(self) -> float | None:
        return self._burst

    @property
    def window(self) -> float | None:
        return self._window

    @property
    def window_limit(self) -> int | None:
        """The most requests any window accepts (None without a window)."""
        return self._window_limit if self._window is not None else None

    def configure(self, rate: float | None, burst: float | None = None, window: float | None = None) -> None:
        """Set a new quota; the bucket starts full, the window empty. Raises ``ValueError``
        on a bad quota."""
        limit = _check_window(rate, burst, window)
        if window is None:
            self._rate, self._burst = _check_quota(rate, burst)
        else:
            self._rate, self._burst = _check_quota(rate, 1.0)[0], None
        self._window = None if window is None else float(window)
        self._window_limit = limit
        if self._rate is None:
            self._limit_header = ""
        else:
            self._limit_header = str(limit) if self._window is not None else format_number(self._rate)
        self._refill_full()

    def _refill_full(self) -> None:
        self._tokens = self._burst if self._burst is not None else 0.0
        self._stamp = self._clock()
        self._in_window.clear()
        self._arrived_in_window.clear()

    def _refill(self, now: float) -> float:
        """Bring the bucket to ``now`` and return its tokens (limited vendors only)."""
        assert self._rate is not None and self._burst is not None
        tokens = self._tokens
        elapsed = now - self._stamp
        if elapsed > 0:
            tokens += elapsed * self._rate
            if tokens > self._burst:
                tokens = self._burst
            self._tokens = tokens
            self._stamp = now
        return tokens

    def tokens(self) -> float | None:
        """Tokens in the bucket now (``None`` when unlimited or with a window)."""
        if self._rate is None or self._window is not None:
            return None
        return self._refill(self._clock())

    def _left(self, now: float) -> float:
        """What the quota has left at ``now``, taking nothing (limited vendors only)."""
        if self._window is None:
            return self._refill(now)
        edge = now - self._window
        return float(self._window_limit - sum(1 for t in self._in_window if t > edge))

    def _admit(self, now: float) -> tuple[float, float]:
        """Take one request from the quota: (what is left after it, 0.0) when accepted, else
        (0.0, seconds until a place frees up). Limited vendors only."""
        window = self._window
        if window is None:
            tokens = self._refill(now)
            if tokens < _GRANT_AT:
                assert self._rate is not None
                return 0.0, (1.0 - tokens) / self._rate
            self._tokens = tokens = tokens - 1.0 if tokens > 1.0 else 0.0
            return tokens, 0.0
        edge = now - window  # a window is [start, start + window): an arrival at `edge` is out
        arrived, accepted = self._arrived_in_window, self._in_window
        while arrived and arrived[0] <= edge:
            arrived.popleft()
        while accepted and accepted[0] <= edge:
            accepted.popleft()
        arrived.append(now)
        if len(arrived) > self.window_max:
            self.window_max = len(arrived)
        if len(accepted) >= self._window_limit:
            return 0.0, accepted[0] - edge
        accepted.append(now)
        return float(self._window_limit - len(accepted)), 0.0

    def _give_back(self) -> None:
        """Undo the last request ``_admit`` accepted (another quota refused it): the bucket gets
        its token back, the window its place; the arrival stays counted in ``window_max``."""
        if self._window is not None:
            self._in_window.pop()
        elif self._burst is not None:
            self._tokens = min(self._tokens + 1.0, self._burst)

    def _reset(self, now: float) -> float:
        """Seconds until the quota grows again: the bucket full, or the oldest request
        counted out of the window (limited vendors only)."""
        window = self._window
        if window is None:
            assert self._rate is not None and self._burst is not None
            return max(self._burst - self._refill(now), 0.0) / self._rate
        edge = now - window
        oldest = next((t for t in self._in_window if t > edge), None)
        return 0.0 if oldest is None else oldest - edge

    def _quota(self, left: float, now: float, family: str | None = None) -> dict[str, str]:
        """The quota headers of an answer, in ``family`` (default: the vendor's; limited vendors only)."""
        family = family or self.quota_headers
        remaining = str(max(int(left), 0))
        reset = self._reset(now)
        whole = str(math.ceil(reset - EPSILON)) if reset > EPSILON else "0"
        if family == "x-ratelimit":
            return {_LIMIT: self._limit_header, REMAINING_HEADER: remaining, "X-RateLimit-Reset": whole}
        if family == "ietf":
            window = format_number(self._window if self._window is not None else 1.0)
            return {
                "RateLimit-Policy": f'"default";q={self._limit_header};w={window}',
                "RateLimit": f'"default";r={remaining};t={whole}',
            }
        if family == "openai":
            assert self._rate is not None
            return {
                "x-ratelimit-limit-requests": format_number(round(self._rate * 60.0, 3)),
                "x-ratelimit-remaining-requests": remaining,
                "x-ratelimit-reset-requests": go_duration(reset),
            }
        if family == "anthropic":
            assert self._rate is not None
            return {
                "anthropic-ratelimit-requests-limit": format_number(round(self._rate * 60.0, 3)),
                "anthropic-ratelimit-requests-remaining": remaining,
                "anthropic-ratelimit-requests-reset": rfc3339_in(reset),
            }
        if family == "shopify":
            capacity = self._window_limit if self._window is not None else int(self._burst or 0)
            return {"X-Shopify-Shop-Api-Call-Limit": f"{capacity - max(int(left), 0)}/{capacity}"}
        return {}

    def set_limit(self, rate: float, burst: float | None = None) -> None:
        """Change the quota mid-run, keeping what it counted (see ``POST /__mock/limit``).
        Raises ``ValueError`` on a bad quota or an unlimited vendor."""
        if self._rate is None:
            raise ValueError("an unlimited vendor has no limit to change: configure a quota first")
        now = self._clock()
        if self._window is not None:
            if burst is not None:
                raise ValueError("burst is a token bucket's: a window accepts rate x window requests, no burst")
            self._window_limit = _check_window(rate, None, self._window)
            self._rate = float(rate)
            self._limit_header = str(self._window_limit)
            return
        tokens = self._refill(now)
        new_rate, new_burst = _check_quota(rate, burst)
        assert new_rate is not None and new_burst is not None
        self._rate, self._burst = new_rate, new_burst
        self._tokens = min(tokens, new_burst)
        self._stamp = now
        self._limit_header = format_number(new_rate)
