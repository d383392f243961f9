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

``quota_headers`` picks the family the quota is told in (SPEC §10): ``x-ratelimit`` (the
default, above), ``ietf``, ``openai``, ``anthropic``, ``shopify`` or ``none``; ``mockvendor_quota`` keeps
the quota and writes those headers.

Vendors' own paths are answered in their vendor's shape (``mockvendor_shapes``): Stripe's
``/v1/customers`` and ``/v1/payment_intents`` (``mockvendor_stripe``), OpenAI's
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` and ``/v1/responses``
(``mockvendor_openai``), Anthropic's ``/v1/messages`` (``mockvendor_anthropic``). They take
from the same quota, one token a request, and their answers, refusals included, are the
vendor's: its body, its headers, its family of quota headers (none for Stripe, OpenAI's for
OpenAI, Anthropic's for Anthropic, whatever ``quota_headers`` says).

Token quotas, as the LLM vendors count them (``mockvendor_tokens``): ``tokens_per_minute``
(OpenAI's paths; ``--tokens-per-minute N``), ``input_tokens_per_minute`` and
``output_tokens_per_minute`` (Anthropic's; ``--input-tokens-per-minute N``,
``--output-tokens-per-minute N``), each a strict sliding window of ``token_window`` seconds
(``--token-window DURATION``, default 60 s) holding ``per_minute x token_window / 60`` tokens;
none unless asked. Such a shape's request is read whole before it is admitted, and
admitted only when both the request quota and every token window have room (it takes from all,
or from none): the tokens by the vendor's own estimate at arrival, which the answer's usage
replaces once it is produced. A token refusal is the vendor's 429 for tokens; see the shapes.

Special paths, quota-limited like any other:

- ``/echo``: streams the request body back chunk by chunk (never buffered whole);
  the request's ``Content-Length``, if any, comes back in ``X-Request-Content-Length``
  and as the response's own ``Content-Length``.
- ``/bytes/{n}``: ``n`` bytes of a repeating ``bytes(range(256))`` pattern, streamed in
  64 KiB chunks with ``Content-Length: n``.
- ``/sha256`` (POST/PUT): reads the body in chunks; ``{"sha256": hex, "bytes": n}``.
- ``/delay/{ms}``: answers ``200`` after ``ms`` milliseconds (in flight meanwhile).
- ``/status/{code}``: answers ``code`` (200-599), with the quota headers.

Control endpoints under ``/__mock/`` (``stats``, ``requests``, ``reset``, ``config``,
``limit``, ``script``; never quota-limited, never recorded) are ``mockvendor_control``'s;
``mockvendor_serve.serve`` serves a vendor on its own until a signal.

Accounting. ``accepted`` counts normal requests answered with anything but 429 and
``arrivals`` holds their arrival times (the ``clock``, ``time.monotonic()`` by
default); ``rejected`` counts those answered 429 (by the quota, by a script or by
``/status/429``) and ``rejections`` holds their arrival times. A scripted answer
replaces the whole answer and takes no token (and no place in the window).
``window_max`` is the largest number of requests that arrived in any one window,
accepted or refused: above ``window_limit``, the window was overrun by that many. A token
window's counts are in ``stats()["token_windows"][shape][currency]`` (``TokenWindow.stats``:
``limit``, ``used``, ``tokens_window_max``, ``tokens_accepted``, ``rejected``...); a request
refused for tokens counts in ``rejected`` too, and takes no place in the request quota.
``in_flight`` is the number of normal requests being handled now (from arrival until
the handler returns, so a ``/delay`` counts while it waits) and ``max_in_flight`` the
most at once since the start or the last reset.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Final, TypedDict

from aiohttp import web
from aiohttp.http import HttpVersion11
from yarl import URL

from proxy.devtools.mockvendor_anthropic import INPUT, OUTPUT, AnthropicShape, AnthropicTokens
from proxy.devtools.mockvendor_chat import GitHubShape, SlackShape
from proxy.devtools.mockvendor_control import CONTROL_PREFIX, JSON_TYPE, control, json_response
from proxy.devtools.mockvendor_openai import OpenAIShape, OpenAITokens
from proxy.devtools.mockvendor_quota import REMAINING_HEADER, Clock, VendorQuota, format_number, retry_after
from proxy.devtools.mockvendor_shapes import Shape
from proxy.devtools.mockvendor_shopify import DEFAULT_RESTORE, DEFAULT_SIZE, GraphqlStats, ShopifyShape
from proxy.devtools.mockvendor_stripe import StripeShape
from proxy.devtools.mockvendor_tokens import (
    DEFAULT_TOKEN_WINDOW,
    Refused,
    Reservation,
    TokenStats,
    TokenWindow,
    arrived_refused,
    reserve,
)
from proxy.wire.aiohttp_internals import send_continue

__all__ = ["MAX_ARRIVALS", "MAX_RECORDED", "MOCK_VENDOR_KEY", "MockVendor", "RecordedRequest"]

MAX_RECORDED: Final = 10_000
MAX_ARRIVALS: Final = 200_000

_CHUNK_SIZE: Final = 64 * 1024
_PATTERN: Final = bytes(range(256)) * (_CHUNK_SIZE // 256)
_RATE_LIMITED_BODY: Final = b'{"error": "rate_limited"}'

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
    token_windows: dict[str, dict[str, TokenStats]]
    graphql: GraphqlStats


@dataclass(slots=True)
class _Script:
    status: int
    retry_after: str | None
    remaining: int | None
    count: int


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


class MockVendor(VendorQuota):
    """A vendor API with a token-bucket or sliding-window quota; see the module docstring
    (and ``mockvendor_control``'s) for the endpoints.

    ``rate`` is requests per second (``None``: unlimited); ``burst`` is the bucket's
    capacity, by default the rate (at least 1). ``window`` (seconds) replaces the bucket
    with a strict sliding window of ``floor(rate x window)`` requests (no ``burst`` then).
    ``clock`` returns seconds; it drives the quotas and stamps ``arrivals``, so tests can
    pass a clock they move by hand. ``tokens_per_minute`` (OpenAI's paths),
    ``input_tokens_per_minute`` and ``output_tokens_per_minute`` (Anthropic's) turn token
    quotas on, each a strict sliding window of ``token_window`` seconds (module docstring).

    Attributes: ``accepted``, ``rejected`` (counters), ``arrivals`` and ``rejections``
    (deques of arrival times of accepted and refused requests, the last
    ``max_arrivals``), ``requests`` (recorded requests, the last ``max_recorded``),
    ``scripted`` (answers scripted and not yet given), ``window_max``, ``in_flight``,
    ``max_in_flight``, ``rate``, ``burst``, ``window``, ``window_limit``.
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
        tokens_per_minute: float | None = None,
        input_tokens_per_minute: float | None = None,
        output_tokens_per_minute: float | None = None,
        token_window: float = DEFAULT_TOKEN_WINDOW,
        graphql_points: float = DEFAULT_SIZE,
        graphql_restore: float = DEFAULT_RESTORE,
    ) -> None:
        super().__init__(rate, burst, clock, window=window, quota_headers=quota_headers)

        def tokens(currency: str, per_minute: float | None) -> TokenWindow | None:
            return None if per_minute is None else TokenWindow(currency, per_minute, token_window)

        openai = tokens("tokens", tokens_per_minute)
        said_in, said_out = tokens(INPUT, input_tokens_per_minute), tokens(OUTPUT, output_tokens_per_minute)
        anthropic = None if said_in is None and said_out is None else AnthropicTokens(said_in, said_out)
        self.accepted = 0
        self.rejected = 0
        self.arrivals: deque[float] = deque(maxlen=max_arrivals)
        self.rejections: deque[float] = deque(maxlen=max_arrivals)
        self.in_flight = 0
        self.max_in_flight = 0
        self._recorded: deque[tuple[str, URL, _Raw]] = deque(maxlen=max_recorded)
        self._scripts: deque[_Script] = deque()
        self._released = asyncio.Event()  # ends every /delay wait (``release_delays``)
        self.shapes: tuple[Shape, ...] = (
            StripeShape(),
            OpenAIShape(None if openai is None else OpenAITokens(openai)),
            AnthropicShape(anthropic),
        )
        self.shopify = ShopifyShape(clock, graphql_points, graphql_restore)
        self.shapes += (self.shopify, GitHubShape(), SlackShape())
        """The vendors imitated, each owning its paths (the first that owns a path answers it)."""

    # -- in-process helpers ------------------------------------------------------------

    def release_delays(self) -> None:
        """Answer every ``/delay`` waiting now, and any asked later, at once (a test's end:
        the proxy's stop would wait for the answers it is still hearing out)."""
        self._released.set()

    @property
    def requests(self) -> list[RecordedRequest]:
        """The recorded requests, oldest first: method, path with query, lower-cased headers.

        A header sent more than once appears once, its values joined with ``", "``.
        """
        return [
            {"method": method, "path_qs": str(url), "headers": _decode_headers(raw)}
            for method, url, raw in self._recorded
        ]

    @property
    def scripted(self) -> int:
        """Normal requests still to be answered by a script."""
        return sum(s.count for s in self._scripts)

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
            "scripted": self.scripted,
            "window": self._window,
            "window_limit": self.window_limit,
            "window_max": self.window_max if windowed else None,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "token_windows": self.token_stats(),
            "graphql": self.shopify.stats(),
        }

    def token_stats(self) -> dict[str, dict[str, TokenStats]]:
        """Each shape's token windows now, by shape and currency (only those counted)."""
        now = self._clock()
        return {
            shape.name: {w.currency: w.stats(now) for w in shape.meter.windows}
            for shape in self.shapes
            if shape.meter is not None
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
        for shape in self.shapes:
            shape.reset()
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
            retry_after = format_number(retry_after)
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
        if path.startswith(CONTROL_PREFIX):
            return await control(self, request, path)
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        try:
            return await self._serve(request, path)
        finally:
            self.in_flight -= 1

    def shape_for(self, path: str) -> Shape | None:
        """The vendor whose path this is, if the mock imitates one."""
        return next((shape for shape in self.shapes if shape.owns(path)), None)

    async def _serve(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        shape = self.shape_for(path)
        body: bytes | None = None
        if shape is not None and shape.meter is not None:
            await _continue(request)
            body = await request.read()  # the token estimate needs it before admission
        now = self._clock()
        self._recorded.append((request.method, request.rel_url, request.raw_headers))
        if self._scripts:
            return self._scripted(request, now, shape)
        if shape is not None:
            return await self._serve_shape(request, shape, body, now)

        headers: dict[str, str] = {}
        if self._rate is not None:
            left, wait = self._admit(now)
            if wait > 0:
                self._reject(now)
                return web.Response(
                    status=429,
                    body=_RATE_LIMITED_BODY,
                    content_type=JSON_TYPE,
                    headers={"Retry-After": str(retry_after(wait)), **self._quota(0.0, now)},
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
        return json_response(200, {"ok": True, "method": request.method, "path": path, "n": self.accepted}, headers)

    async def _serve_shape(
        self, request: web.BaseRequest, shape: Shape, body: bytes | None, now: float
    ) -> web.StreamResponse:
        """A vendor's path: admitted by the request quota and, when the shape counts tokens, by
        its token windows too (from all or none), then answered in the vendor's shape."""
        family, meter = shape.quota_headers, shape.meter
        demand = None if meter is None else meter.estimate(body, request.headers.get("Content-Type"), request.path)
        headers: dict[str, str] = {}
        if self._rate is not None:
            left, wait = self._admit(now)
            if wait > 0:
                self._reject(now)
                if meter is not None and demand is not None:
                    arrived_refused(meter.windows, demand, now)
                told = {} if meter is None else meter.headers(now)
                return shape.refusal(retry_after(wait), {**self._quota(0.0, now, family), **told})
            headers = self._quota(left, now, family)
        reservation = Reservation(self._clock)
        if meter is not None and demand is not None:
            taken = reserve(meter.windows, demand, now, self._clock)
            if isinstance(taken, Refused):
                if self._rate is not None:
                    self._give_back()  # refused for tokens: the request takes no place either
                    headers = self._quota(self._left(now), now, family)
                self._reject(now)
                return meter.refusal(taken, {**headers, **meter.headers(now)})
            reservation = taken
            headers.update(meter.headers(now))
        self._accept(now)
        return await shape.answer(request, headers, reservation)

    def _accept(self, now: float) -> None:
        self.accepted += 1
        self.arrivals.append(now)

    def _reject(self, now: float) -> None:
        self.rejected += 1
        self.rejections.append(now)

    def _scripted(self, request: web.BaseRequest, now: float, shape: Shape | None) -> web.Response:
        script = self._scripts[0]
        script.count -= 1
        if script.count <= 0:
            self._scripts.popleft()
        headers: dict[str, str] = {}
        if self._rate is not None:
            left = self._left(now) if script.remaining is None else script.remaining
            headers.update(self._quota(left, now, None if shape is None else shape.quota_headers))
        elif script.remaining is not None:
            headers[REMAINING_HEADER] = str(script.remaining)
        if script.retry_after is not None:
            headers["Retry-After"] = script.retry_after
        status = script.status
        if status == 429:
            self._reject(now)
            return web.Response(status=429, body=_RATE_LIMITED_BODY, content_type=JSON_TYPE, headers=headers)
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
        return json_response(status, payload, headers)

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
            return json_response(400, {"error": "bad_request", "detail": "/bytes/{n} needs a whole number"}, headers)
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
            return json_response(405, {"error": "method_not_allowed"}, headers)
        await _continue(request)
        digest = hashlib.sha256()
        size = 0
        async for chunk in request.content.iter_any():
            digest.update(chunk)
            size += len(chunk)
        return json_response(200, {"sha256": digest.hexdigest(), "bytes": size}, headers)

    async def _delay(self, request: web.BaseRequest, arg: str, headers: dict[str, str], now: float) -> web.Response:
        self._accept(now)
        try:
            ms = float(arg)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms >= 0):
            return json_response(400, {"error": "bad_request", "detail": "/delay/{ms} needs milliseconds"}, headers)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._released.wait(), ms / 1000.0)
        payload = {
            "ok": True,
            "method": request.method,
            "path": request.path,
            "delay_ms": ms,
            "n": self.accepted,
        }
        return json_response(200, payload, headers)

    def _status(self, request: web.BaseRequest, arg: str, headers: dict[str, str], now: float) -> web.Response:
        code = int(arg) if arg.isascii() and arg.isdigit() and len(arg) == 3 else 0
        if not 200 <= code <= 599:
            self._accept(now)
            return json_response(400, {"error": "bad_request", "detail": "/status/{code} needs 200..599"}, headers)
        if code == 429:
            self._reject(now)
        else:
            self._accept(now)
        if code in (204, 304):
            return web.Response(status=code, headers=headers)
        return json_response(code, {"ok": code < 400, "status": code, "method": request.method}, headers)


MOCK_VENDOR_KEY: Final = web.AppKey("mock_vendor", MockVendor)
