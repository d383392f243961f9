"""A mock third-party vendor API that enforces its own quota and answers like a real one.

Used by ``quota-proxy mock-vendor``, by the test suite and by the benchmarks. It keeps a
token bucket (capacity ``burst``, refilled at ``rate`` per second) or, with ``window``, a
strict sliding window (at most ``floor(rate x window)`` requests accepted in *any*
interval of ``window`` seconds, each counted at its arrival, as a vendor that keeps a
log of request times does), and answers every normal request either ``200`` with a
small JSON body or ``429`` with ``Retry-After``. It records what arrived so a test can
check the rate the proxy let through and the headers it forwarded.

Normal requests (any method, any path not under ``/__mock/``) take one token. Every
answer to them carries ``X-RateLimit-Limit`` (the rate), ``X-RateLimit-Remaining``
(whole tokens left after this request) and ``X-RateLimit-Reset`` (whole seconds until
the quota grows again, rounded up), unless the vendor is unlimited: then it sends no
quota headers at all, because any number would be made up. With a window, the limit
is the window's (requests per window), the remaining count what the window has left
and the reset is when the oldest request counted leaves it. A refusal is ``429``,
``Retry-After: <whole seconds, >= 1>`` and ``{"error": "rate_limited"}``.

``quota_headers`` picks the family the quota is told in (SPEC §10): ``x-ratelimit``
(the default, above); ``ietf`` (``RateLimit-Policy: "default";q=LIMIT;w=WINDOW`` and
``RateLimit: "default";r=REMAINING;t=RESET``, the window 1 s for a bucket); ``openai``
(``x-ratelimit-limit-requests`` per minute, ``-remaining-requests``,
``-reset-requests`` as ``6m0s``/``1s``/``20ms``: time until full again); ``shopify``
(``X-Shopify-Shop-Api-Call-Limit: USED/CAPACITY``); ``none``.

Special paths, quota-limited like any other:

- ``/echo``: streams the request body back chunk by chunk (never buffered whole);
  the request's ``Content-Length``, if any, comes back in ``X-Request-Content-Length``
  and as the response's own ``Content-Length``.
- ``/bytes/{n}``: ``n`` bytes of a repeating ``bytes(range(256))`` pattern, streamed in
  64 KiB chunks with ``Content-Length: n``.
- ``/sha256`` (POST/PUT): reads the body in chunks; ``{"sha256": hex, "bytes": n}``.
- ``/delay/{ms}``: answers ``200`` after ``ms`` milliseconds (in flight meanwhile).
- ``/status/{code}``: answers ``code`` (200-599), with the quota headers.

Control endpoints (never quota-limited, never recorded):

- ``GET /__mock/stats``: ``{"accepted", "rejected", "arrivals", "rejections", "rate",
  "burst", "tokens", "scripted", "window", "window_limit", "window_max", "in_flight",
  "max_in_flight"}`` (``burst`` and ``tokens`` are null with a window, the ``window*``
  keys null without one).
- ``GET /__mock/requests``: recorded requests, ``[{"method", "path_qs", "headers"}]``.
- ``POST /__mock/reset``: clears counters, arrivals, recorded requests and pending
  scripts; refills the bucket.
- ``POST /__mock/config`` ``{"rate": r, "burst": b, "window": w}``: a new quota (``null``
  or ``0`` rate = unlimited; ``window`` in seconds, ``null`` = a token bucket; a missing
  key keeps its value, except that ``burst`` follows a new ``rate`` when not given, and
  an unlimited vendor has no window). The bucket starts full, the window empty.
- ``POST /__mock/limit`` ``{"rate": r}``: the quota changes mid-run, as a vendor that
  lowers or raises an account's limit: the same kind (bucket or window), what it
  counted kept (a lower window limit refuses until enough requests have left it; the
  bucket keeps its tokens, capped at the new burst, ``burst`` = the rate unless given).
- ``POST /__mock/script`` ``{"status": 429, "retry_after": "2", "remaining": 3,
  "count": 1}``: the next ``count`` normal requests get that answer. Scripts queue in
  order of arrival.

Accounting. ``accepted`` counts normal requests answered with anything but 429 and
``arrivals`` holds their arrival times (the ``clock``, ``time.monotonic()`` by
default); ``rejected`` counts those answered 429 (by the quota, by a script or by
``/status/429``) and ``rejections`` holds their arrival times. A scripted answer
replaces the whole answer and takes no token (and no place in the window).
``window_max`` is the largest number of requests that arrived in any one window,
accepted or refused: above ``window_limit``, the window was overrun by that many.
``in_flight`` is the number of normal requests being handled now (from arrival until
the handler returns, so a ``/delay`` counts while it waits) and ``max_in_flight`` the
most at once since the start or the last reset.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import math
import signal
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypedDict

from aiohttp import web
from aiohttp.http import HttpVersion11
from yarl import URL

from proxy.names import format_authority
from proxy.wire.aiohttp_internals import send_continue

__all__ = [
    "MAX_ARRIVALS",
    "MAX_RECORDED",
    "MOCK_VENDOR_KEY",
    "MockVendor",
    "RecordedRequest",
    "serve",
]

MAX_RECORDED: Final = 10_000
MAX_ARRIVALS: Final = 200_000

_CHUNK_SIZE: Final = 64 * 1024
_PATTERN: Final = bytes(range(256)) * (_CHUNK_SIZE // 256)
# A bucket refilled by float arithmetic can sit a hair below a whole token when a
# client paces at exactly the rate; a real vendor's integer clock would not refuse it.
_EPSILON: Final = 1e-9
_GRANT_AT: Final = 1.0 - _EPSILON

_LIMIT: Final = "X-RateLimit-Limit"
_REMAINING: Final = "X-RateLimit-Remaining"
QUOTA_HEADERS: Final = ("x-ratelimit", "ietf", "openai", "shopify", "none")
_JSON: Final = "application/json"
_RATE_LIMITED_BODY: Final = b'{"error": "rate_limited"}'
_CONTROL_PREFIX: Final = "/__mock/"

Clock = Callable[[], float]
_Raw = tuple[tuple[bytes, bytes], ...]


class RecordedRequest(TypedDict):
    method: str
    path_qs: str
    headers: dict[str, str]


class Stats(TypedDict):
    accepted: int
    rejected: int
    arrivals: list[float]
    rejections: list[float]
    rate: float | None
    burst: float | None
    tokens: float | None
    scripted: int
    window: float | None
    window_limit: int | None
    window_max: int | None
    in_flight: int
    max_in_flight: int


@dataclass(slots=True)
class _Script:
    status: int
    retry_after: str | None
    remaining: int | None
    count: int


class _BadRequest(Exception):
    """A control request or a special path that cannot be served as asked."""


def _format_number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _json(status: int, payload: object, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type=_JSON, headers=headers)


def _decode_headers(raw: _Raw) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name_b, value_b in raw:
        name = name_b.decode("latin-1").lower()
        value = value_b.decode("latin-1")
        previous = headers.get(name)
        headers[name] = value if previous is None else f"{previous}, {value}"
    return headers


async def _continue(request: web.BaseRequest) -> None:
    """Send ``100 Continue`` when the client waits for it; only before reading a body."""
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        await send_continue(request)


async def _no_expect_handler(request: web.Request) -> None:
    """The vendor decides itself whether to send ``100 Continue`` (only when it reads the body)."""
    return None


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
    limit = math.floor(rate * window + _EPSILON)
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


class MockVendor:
    """A vendor API with a token-bucket or sliding-window quota; see the module docstring
    for the endpoints.

    ``rate`` is requests per second (``None``: unlimited); ``burst`` is the bucket's
    capacity, by default the rate (at least 1). ``window`` (seconds) replaces the bucket
    with a strict sliding window of ``floor(rate x window)`` requests (no ``burst`` then).
    ``clock`` returns seconds; it drives the quota and stamps ``arrivals``, so tests can
    pass a clock they move by hand.

    Attributes: ``accepted``, ``rejected`` (counters), ``arrivals`` and ``rejections``
    (deques of arrival times of accepted and refused requests, the last
    ``max_arrivals``), ``requests`` (recorded requests, the last ``max_recorded``),
    ``window_max``, ``in_flight``, ``max_in_flight``, ``rate``, ``burst``, ``window``,
    ``window_limit``.
    """

    def __init__(
        self,
        rate: float | None,
        burst: float | None = None,
        clock: Clock = time.monotonic,
        *,
        window: float | None = None,
        max_recorded: int = MAX_RECORDED,
        max_arrivals: int = MAX_ARRIVALS,
        quota_headers: str = "x-ratelimit",
    ) -> None:
        if quota_headers not in QUOTA_HEADERS:
            raise ValueError(f"quota_headers must be one of {', '.join(QUOTA_HEADERS)}, not {quota_headers!r}")
        self.quota_headers = quota_headers
        self._clock = clock
        self.accepted = 0
        self.rejected = 0
        self.arrivals: deque[float] = deque(maxlen=max_arrivals)
        self.rejections: deque[float] = deque(maxlen=max_arrivals)
        self.in_flight = 0
        self.max_in_flight = 0
        self.window_max = 0
        self._window: float | None = None
        self._window_limit = 0
        self._in_window: deque[float] = deque()  # accepted arrivals within the last window
        self._arrived_in_window: deque[float] = deque()  # every arrival within it, refused ones too
        self._recorded: deque[tuple[str, URL, _Raw]] = deque(maxlen=max_recorded)
        self._scripts: deque[_Script] = deque()
        self._rate: float | None = None
        self._burst: float | None = None
        self._tokens = 0.0
        self._stamp = clock()
        self._limit_header = ""
        self.configure(rate, burst, window)

    # -- quota -------------------------------------------------------------------------

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
            self._limit_header = str(limit) if self._window is not None else _format_number(self._rate)
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

    def _quota(self, left: float, now: float) -> dict[str, str]:
        """The quota headers of an answer, in the vendor's family (limited vendors only)."""
        family = self.quota_headers
        remaining = str(max(int(left), 0))
        reset = self._reset(now)
        whole = str(math.ceil(reset - _EPSILON)) if reset > _EPSILON else "0"
        if family == "x-ratelimit":
            return {_LIMIT: self._limit_header, _REMAINING: remaining, "X-RateLimit-Reset": whole}
        if family == "ietf":
            window = _format_number(self._window if self._window is not None else 1.0)
            return {
                "RateLimit-Policy": f'"default";q={self._limit_header};w={window}',
                "RateLimit": f'"default";r={remaining};t={whole}',
            }
        if family == "openai":
            assert self._rate is not None
            return {
                "x-ratelimit-limit-requests": _format_number(round(self._rate * 60.0, 3)),
                "x-ratelimit-remaining-requests": remaining,
                "x-ratelimit-reset-requests": _go_duration(reset),
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
        self._limit_header = _format_number(new_rate)

    # -- in-process helpers ------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """The recorded requests, oldest first: method, path with query, lower-cased headers.

        A header sent more than once appears once, its values joined with ``", "``.
        """
        return [
            {"method": method, "path_qs": str(url), "headers": _decode_headers(raw)}
            for method, url, raw in self._recorded
        ]

    def stats(self) -> Stats:
        tokens = self.tokens()
        windowed = self._window is not None
        return {
            "accepted": self.accepted,
            "rejected": self.rejected,
            "arrivals": list(self.arrivals),
            "rejections": list(self.rejections),
            "rate": self._rate,
            "burst": self._burst,
            "tokens": tokens,
            "scripted": sum(s.count for s in self._scripts),
            "window": self._window,
            "window_limit": self.window_limit,
            "window_max": self.window_max if windowed else None,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
        }

    def reset(self) -> None:
        """Clear counters, arrivals, recorded requests and pending scripts; refill the bucket
        (empty the window); ``max_in_flight`` starts again from the requests in flight now."""
        self.accepted = 0
        self.rejected = 0
        self.arrivals.clear()
        self.rejections.clear()
        self.window_max = 0
        self.max_in_flight = self.in_flight
        self._recorded.clear()
        self._scripts.clear()
        if self._rate is not None:
            self._refill_full()

    def script(
        self,
        status: int = 429,
        retry_after: str | float | None = None,
        remaining: int | None = None,
        count: int = 1,
    ) -> None:
        """Answer the next ``count`` normal requests with ``status``, taking no token.

        ``Retry-After`` is sent only when ``retry_after`` is not ``None``; ``remaining``
        overrides ``X-RateLimit-Remaining`` (sent even by an unlimited vendor).
        Several calls queue up and are served in order.
        """
        if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
            raise ValueError(f"status must be an integer in 200..599, not {status!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, not {count!r}")
        if remaining is not None and (isinstance(remaining, bool) or not isinstance(remaining, int)):
            raise ValueError(f"remaining must be an integer or None, not {remaining!r}")
        if retry_after is not None and not isinstance(retry_after, str):
            if isinstance(retry_after, bool) or not isinstance(retry_after, int | float):
                raise ValueError(f"retry_after must be a string, a number or None, not {retry_after!r}")
            retry_after = _format_number(retry_after)
        self._scripts.append(_Script(status, retry_after, remaining, count))

    def measured_rate(self, since: float | None = None, until: float | None = None) -> float:
        """Accepted requests per second among the arrivals in ``[since, until]``.

        Computed as ``(n - 1) / (last - first)`` over the ``n`` arrivals in the window:
        the mean inter-arrival rate, which does not depend on where the window's edges
        fall between two arrivals (``n / window`` would be off by up to one request per
        window). Pass ``since`` after the initial burst to measure the steady rate.
        Returns 0.0 with fewer than two arrivals and ``inf`` if they all share one instant.
        """
        arrivals = list(self.arrivals)
        lo = 0 if since is None else bisect.bisect_left(arrivals, since)
        hi = len(arrivals) if until is None else bisect.bisect_right(arrivals, until)
        n = hi - lo
        if n < 2:
            return 0.0
        span = arrivals[hi - 1] - arrivals[lo]
        if span <= 0:
            return math.inf
        return (n - 1) / span

    # -- serving -----------------------------------------------------------------------

    def app(self) -> web.Application:
        """An application answering every path with :meth:`handle`."""
        app = web.Application()
        app[MOCK_VENDOR_KEY] = self
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_expect_handler)
        return app

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The whole vendor; usable as a low-level ``web.Server`` handler."""
        path = request.path
        if path.startswith(_CONTROL_PREFIX):
            return await self._control(request, path)
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        try:
            return await self._serve(request, path)
        finally:
            self.in_flight -= 1

    async def _serve(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        now = self._clock()
        self._recorded.append((request.method, request.rel_url, request.raw_headers))
        if self._scripts:
            return self._scripted(request, now)

        headers: dict[str, str]
        if self._rate is None:
            headers = {}
        else:
            left, wait = self._admit(now)
            if wait > 0:
                self._reject(now)
                return web.Response(
                    status=429,
                    body=_RATE_LIMITED_BODY,
                    content_type=_JSON,
                    headers={"Retry-After": str(max(1, math.ceil(wait - _EPSILON))), **self._quota(0.0, now)},
                )
            headers = self._quota(left, now)

        if path == "/echo":
            self._accept(now)
            return await self._echo(request, headers)
        if path.startswith("/bytes/"):
            return await self._bytes(request, path[7:], headers, now)
        if path == "/sha256":
            return await self._sha256(request, headers, now)
        if path.startswith("/delay/"):
            return await self._delay(request, path[7:], headers, now)
        if path.startswith("/status/"):
            return self._status(request, path[8:], headers, now)
        self._accept(now)
        return _json(200, {"ok": True, "method": request.method, "path": path, "n": self.accepted}, headers)

    def _accept(self, now: float) -> None:
        self.accepted += 1
        self.arrivals.append(now)

    def _reject(self, now: float) -> None:
        self.rejected += 1
        self.rejections.append(now)

    def _scripted(self, request: web.BaseRequest, now: float) -> web.Response:
        script = self._scripts[0]
        script.count -= 1
        if script.count <= 0:
            self._scripts.popleft()
        headers: dict[str, str] = {}
        if self._rate is not None:
            left = self._left(now) if script.remaining is None else script.remaining
            headers.update(self._quota(left, now))
        elif script.remaining is not None:
            headers[_REMAINING] = str(script.remaining)
        if script.retry_after is not None:
            headers["Retry-After"] = script.retry_after
        status = script.status
        if status == 429:
            self._reject(now)
            return web.Response(status=429, body=_RATE_LIMITED_BODY, content_type=_JSON, headers=headers)
        self._accept(now)
        if status in (204, 304):
            return web.Response(status=status, headers=headers)
        payload = {
            "ok": status < 400,
            "scripted": True,
            "status": status,
            "method": request.method,
            "path": request.path,
            "n": self.accepted,
        }
        return _json(status, payload, headers)

    async def _echo(self, request: web.BaseRequest, headers: dict[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(headers=headers)
        response.headers["Content-Type"] = request.headers.get("Content-Type", "application/octet-stream")
        length = request.content_length
        if length is not None:
            response.headers["X-Request-Content-Length"] = str(length)
            response.content_length = length
        if request.method == "HEAD":
            await response.prepare(request)
            await response.write_eof()
            return response
        await _continue(request)
        await response.prepare(request)
        async for chunk in request.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response

    async def _bytes(
        self, request: web.BaseRequest, arg: str, headers: dict[str, str], now: float
    ) -> web.StreamResponse:
        self._accept(now)
        if not (arg.isascii() and arg.isdigit()):
            return _json(400, {"error": "bad_request", "detail": "/bytes/{n} needs a whole number"}, headers)
        n = int(arg)
        response = web.StreamResponse(headers=headers)
        response.content_type = "application/octet-stream"
        response.content_length = n
        await response.prepare(request)
        if request.method != "HEAD":
            pattern = memoryview(_PATTERN)
            while n >= _CHUNK_SIZE:
                await response.write(pattern)
                n -= _CHUNK_SIZE
            if n:
                await response.write(pattern[:n])
        await response.write_eof()
        return response

    async def _sha256(self, request: web.BaseRequest, headers: dict[str, str], now: float) -> web.Response:
        self._accept(now)
        if request.method not in ("POST", "PUT"):
            headers["Allow"] = "POST, PUT"
            return _json(405, {"error": "method_not_allowed"}, headers)
        await _continue(request)
        digest = hashlib.sha256()
        size = 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
        return _json(200, {"sha256": digest.hexdigest(), "bytes": size}, headers)

    async def _delay(self, request: web.BaseRequest, arg: str, headers: dict[str, str], now: float) -> web.Response:
        self._accept(now)
        try:
            ms = float(arg)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms >= 0):
            return _json(400, {"error": "bad_request", "detail": "/delay/{ms} needs milliseconds"}, headers)
        await asyncio.sleep(ms / 1000.0)
        payload = {
            "ok": True,
            "method": request.method,
            "path": request.path,
            "delay_ms": ms,
            "n": self.accepted,
        }
        return _json(200, payload, headers)

    def _status(self, request: web.BaseRequest, arg: str, headers: dict[str, str], now: float) -> web.Response:
        code = int(arg) if arg.isascii() and arg.isdigit() and len(arg) == 3 else 0
        if not 200 <= code <= 599:
            self._accept(now)
            return _json(400, {"error": "bad_request", "detail": "/status/{code} needs 200..599"}, headers)
        if code == 429:
            self._reject(now)
        else:
            self._accept(now)
        if code in (204, 304):
            return web.Response(status=code, headers=headers)
        return _json(code, {"ok": code < 400, "status": code, "method": request.method}, headers)

    # -- control -----------------------------------------------------------------------

    async def _control(self, request: web.BaseRequest, path: str) -> web.Response:
        name = path[len(_CONTROL_PREFIX) :]
        method = request.method
        allowed = _CONTROL_METHODS.get(name)
        if allowed is None:
            return _json(404, {"error": "not_found", "path": path})
        if method != allowed:
            return _json(405, {"error": "method_not_allowed", "allow": allowed}, {"Allow": allowed})
        try:
            if name == "stats":
                return _json(200, self.stats())
            if name == "requests":
                return _json(200, self.requests)
            if name == "reset":
                self.reset()
                return _json(200, {"ok": True})
            body = await _read_json_object(request)
            if name == "config":
                self._configure_from(body)
                return _json(200, {"ok": True, "rate": self._rate, "burst": self._burst})
            if name == "limit":
                unknown = set(body) - {"rate", "burst"}
                if unknown or "rate" not in body:
                    raise _BadRequest('POST /__mock/limit takes {"rate": r} and optionally "burst"')
                rate = _get(body, "rate", (int, float), None)
                burst = _get(body, "burst", (int, float), None)
                if rate is None:
                    raise _BadRequest("rate: a number of requests per second")
                self.set_limit(float(rate), None if burst is None else float(burst))
                return _json(200, {"ok": True, "rate": self._rate, "burst": self._burst, "window": self._window})
            self.script(
                status=_get(body, "status", int, 429),
                retry_after=_get(body, "retry_after", (str, int, float), None),
                remaining=_get(body, "remaining", int, None),
                count=_get(body, "count", int, 1),
            )
            return _json(200, {"ok": True, "scripted": sum(s.count for s in self._scripts)})
        except (_BadRequest, ValueError) as exc:
            return _json(400, {"error": "bad_request", "detail": str(exc)})

    def _configure_from(self, body: dict[str, Any]) -> None:
        unknown = set(body) - {"rate", "burst", "window"}
        if unknown:
            raise _BadRequest(f"unknown keys: {', '.join(sorted(unknown))}")
        rate = _get(body, "rate", (int, float), self._rate) if "rate" in body else self._rate
        if rate == 0:
            rate = None
        window = _get(body, "window", (int, float), None) if "window" in body else self._window
        if rate is None and "window" not in body:
            window = None  # an unlimited vendor counts nothing
        if "burst" in body:
            burst = _get(body, "burst", (int, float), None)
        else:
            burst = None if "rate" in body or window is not None else self._burst
        self.configure(
            None if rate is None else float(rate),
            None if burst is None else float(burst),
            None if window is None else float(window),
        )


_CONTROL_METHODS: Final[dict[str, str]] = {
    "stats": "GET",
    "requests": "GET",
    "reset": "POST",
    "config": "POST",
    "limit": "POST",
    "script": "POST",
}


def _go_duration(seconds: float) -> str:
    """OpenAI's way of writing a delay: ``6m0s``, ``1s``, ``20ms``."""
    ms = max(round(seconds * 1000), 0)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms / 1000.0, 60.0)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


async def _read_json_object(request: web.BaseRequest) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest("body must be a JSON object")
    return body


def _get(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _BadRequest(f"{key}: unexpected value {value!r}")
    return value


MOCK_VENDOR_KEY: Final = web.AppKey("mock_vendor", MockVendor)


# -- serving until a signal ----------------------------------------------------------------


async def _limits_at(vendor: MockVendor, schedule: tuple[tuple[float, float], ...]) -> None:
    """Change the limit at each (seconds after start, rate) of ``schedule``."""
    started = time.monotonic()
    for at, rate in sorted(schedule):
        await asyncio.sleep(max(started + at - time.monotonic(), 0.0))
        vendor.set_limit(rate)
        print(f"mock-vendor: limit now {_format_number(rate)}/s", flush=True)


async def _serve(
    vendor: MockVendor,
    host: str,
    port: int,
    schedule: tuple[tuple[float, float], ...] = (),
    tls: ssl.SSLContext | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    runner = web.ServerRunner(web.Server(vendor.handle, access_log=None), shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=1024, ssl_context=tls)
        try:
            await site.start()
        except OSError as exc:
            print(f"mock-vendor: cannot listen on {format_authority(host, port)}: {exc}", file=sys.stderr)
            return 1
        bound_port = runner.addresses[0][1]
        if vendor.rate is None:
            quota = "rate unlimited, burst unlimited"
        elif vendor.window is not None:
            quota = (
                f"rate {_format_number(vendor.rate)}/s, sliding window {_format_number(vendor.window)}s: "
                f"at most {vendor.window_limit} requests in any window"
            )
        else:
            assert vendor.burst is not None
            quota = f"rate {_format_number(vendor.rate)}/s, burst {_format_number(vendor.burst)}"
        scheme = "http" if tls is None else "https"
        print(f"mock-vendor listening on {scheme}://{format_authority(host, bound_port)} ({quota})", flush=True)
        changes = asyncio.ensure_future(_limits_at(vendor, schedule))
        try:
            await stop.wait()
        finally:
            changes.cancel()
        return 0
    finally:
        await runner.cleanup()
        for sig in signals:
            loop.remove_signal_handler(sig)


def serve(
    vendor: MockVendor,
    host: str,
    port: int,
    schedule: tuple[tuple[float, float], ...] = (),
    tls: ssl.SSLContext | None = None,
) -> int:
    """Serve ``vendor`` on ``host:port`` until SIGTERM or SIGINT, then return 0 (1 if it cannot listen).

    ``schedule``: (seconds after start, rate) pairs at which the limit changes (``set_limit``);
    ``tls``: serve HTTPS with this context (``https://`` in the line below).

    Prints ``mock-vendor listening on http://HOST:PORT (rate R/s, burst B)`` once bound
    (``(rate R/s, sliding window Ws: at most N requests in any window)`` with a window).
    """
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop
    except ImportError:
        pass
    else:
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(_serve(vendor, host, port, schedule, tls))
