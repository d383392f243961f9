"""Anthropic-shaped answers of the mock vendor, enough for anthropic-python and plain HTTP clients.

    POST /v1/messages   a ``message``: ``{"id": "msg_...", "type": "message", "role": "assistant",
                        "model", "content": [{"type": "text", "text"}], "stop_reason",
                        "stop_sequence": null, "usage": {"input_tokens", "output_tokens"}}``;
                        ``stream: true``: its events, as Anthropic documents them:
                        ``message_start`` (the message, no content yet, ``usage.output_tokens``
                        1), ``content_block_start``, ``ping``, a ``content_block_delta`` a word,
                        ``content_block_stop``, ``message_delta`` (``stop_reason``,
                        ``usage.output_tokens``: the total), ``message_stop``

The reply is ``REPLY``, or, when the request asks for a size with the mock-only header
``X-Mock-Output-Tokens: N`` (a positive integer; else a 400), made-up text of ``N`` tokens as
``count_tokens`` counts them, streamed in runs of words (``mockvendor_shapes``); either is cut
short by a smaller ``max_tokens`` (``stop_reason: "max_tokens"``, else ``"end_turn"``).
``usage.input_tokens`` counts the prompt as the proxy's estimate ``anthropic_input`` does (the
characters of ``system``, messages and tools / 4, rounded up; at least 1), ``output_tokens`` the
reply (``count_tokens``). Bad input is Anthropic's 400
``{"type": "error", "error": {"type": "invalid_request_error", "message"}}`` (``model``,
``max_tokens`` and ``messages`` required; roles ``user``/``assistant``; content a string or
blocks, not empty but in a final assistant turn); another method than POST is a 405. Answers
carry ``request-id`` and Anthropic's request quota headers (``anthropic-ratelimit-requests-*``,
the reset an RFC 3339 instant); the request quota's 429 is Anthropic's ``rate_limit_error`` with
``retry-after``. No API key or ``anthropic-version`` is checked.

With token quotas (``AnthropicTokens``: ``MockVendor(input_tokens_per_minute=I,
output_tokens_per_minute=O)``, ``--input-tokens-per-minute``, ``--output-tokens-per-minute``),
input and output tokens are counted apart, each in its strict sliding window
(``mockvendor_tokens``), as Anthropic does: at arrival, the input by the ``anthropic_input``
estimate and the output as ``max_tokens``; a request that does not fit in either is refused
(``rate_limit_error`` naming the limit, ``retry-after``; none when it can never fit). Once the
answer is produced (a stream: written) both become its ``usage``. Every answer then carries
``anthropic-ratelimit-{input,output}-tokens-{limit,remaining,reset}``: the limit per minute,
what the window has left (exact, where Anthropic rounds to the thousand), the instant it is
empty again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Final

from aiohttp import web

from proxy.devtools.mockvendor_quota import format_number, retry_after, rfc3339_in
from proxy.devtools.mockvendor_shapes import (
    BadInput,
    asked_output,
    json_answer,
    made_up_id,
    pieces,
    read_json_object,
    reply,
    write_events,
)
from proxy.devtools.mockvendor_tokens import Demand, Refused, Reservation, TokenWindow
from proxy.quota.estimates import Estimate

__all__ = ["INPUT", "OUTPUT", "AnthropicShape", "AnthropicTokens"]

INPUT: Final = "input_tokens"
OUTPUT: Final = "output_tokens"
_PATH: Final = "/v1/messages"
_INPUT_ESTIMATE: Final = Estimate("anthropic_input")
_OUTPUT_ESTIMATE: Final = Estimate("anthropic_output")
_LIMITS_PAGE: Final = (
    "For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for "
    "current usage. Please reduce the prompt length or the maximum tokens requested, or try again later."
)


class _Invalid(Exception):
    """A request Anthropic would refuse with a 400; the message is its."""


def _error(kind: str, message: str) -> dict[str, object]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _per_minute(value: float) -> str:
    return f"{int(value):,}" if value == int(value) else f"{value:,g}"


def _rate_limited(limit: str, headers: dict[str, str], wait: float | None) -> web.Response:
    message = f"This request would exceed the rate limit for your organization of {limit} per minute. {_LIMITS_PAGE}"
    extra = {"request-id": made_up_id("req_", 24)}
    if wait is not None:
        extra["retry-after"] = str(retry_after(wait))
    return json_answer(429, _error("rate_limit_error", message), {**headers, **extra})


class AnthropicTokens:
    """Anthropic's input and output tokens per minute (see the module docstring), a ``ShapeMeter``
    with one window per currency it counts (either, or both).

    The input estimate is the proxy's own ``estimate: anthropic_input`` and the output one its
    ``anthropic_output`` (``proxy.quota.estimates``), reused, not copied: the mock and the proxy
    count a request alike, to the token."""

    def __init__(self, input_window: TokenWindow | None = None, output_window: TokenWindow | None = None) -> None:
        self.input = input_window
        self.output = output_window
        self.windows = tuple(w for w in (input_window, output_window) if w is not None)

    def estimate(self, body: bytes | None, content_type: str | None, path: str) -> Demand:
        # A body it cannot read costs nothing: its 400 follows.
        tokens = {
            INPUT: _INPUT_ESTIMATE.cost(body, 0.0, content_type=content_type),
            OUTPUT: _OUTPUT_ESTIMATE.cost(body, 0.0, content_type=content_type),
        }
        return Demand(tuple(math.ceil(tokens[w.currency]) for w in self.windows), body)

    def headers(self, now: float) -> dict[str, str]:
        told: dict[str, str] = {}
        for window in self.windows:
            prefix = f"anthropic-ratelimit-{window.currency.replace('_', '-')}-"
            told[prefix + "limit"] = format_number(window.per_minute)
            told[prefix + "remaining"] = str(window.remaining(now))
            told[prefix + "reset"] = rfc3339_in(window.full_in(now))
        return told

    def refusal(self, refused: Refused, headers: dict[str, str]) -> web.Response:
        window = refused.binding[0]  # the input's, when both refuse
        limit = f"{_per_minute(window.per_minute)} {window.currency.replace('_', ' ')}"
        return _rate_limited(limit, headers, None if math.isinf(refused.wait) else refused.wait)


class AnthropicShape:
    """Anthropic's Messages API; see the module docstring."""

    name: Final = "anthropic"
    quota_headers: Final = "anthropic"

    def __init__(self, meter: AnthropicTokens | None = None) -> None:
        self.meter = meter

    def owns(self, path: str) -> bool:
        return path == _PATH

    def reset(self) -> None:
        for window in () if self.meter is None else self.meter.windows:
            window.reset()

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        limit = f"{headers.get('anthropic-ratelimit-requests-limit', 'its')} requests"
        return _rate_limited(limit, headers, float(retry_after))

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        headers = {**headers, "request-id": made_up_id("req_", 24)}
        used = {INPUT: 0, OUTPUT: 0}  # the answer's usage: what the token windows keep of it
        try:
            if request.method != "POST":
                message = f"Method Not Allowed: {request.method} {request.path}"
                return json_answer(405, _error("invalid_request_error", message), {**headers, "Allow": "POST"})
            raw = await request.read()
            body = await read_json_object(request)
            asked = asked_output(request)
            message_made, stream = _message(body, raw, request.headers.get("Content-Type"), asked)
            used = dict(message_made["usage"])
            if not stream:
                return json_answer(200, message_made, headers)
            return await write_events(request, headers, _events(message_made))
        except BadInput as exc:
            return json_answer(400, _error("invalid_request_error", str(exc)), headers)
        except _Invalid as exc:
            return json_answer(400, _error("invalid_request_error", str(exc)), headers)
        finally:
            reservation.settle(**used)  # the answer is produced (a stream: written)


def _message(
    body: dict[str, Any], raw: bytes, content_type: str | None, asked: int | None = None
) -> tuple[dict[str, Any], bool]:
    """The message answering ``body`` (checked as Anthropic checks it), and whether to stream it;
    ``asked``: the reply's size ``X-Mock-Output-Tokens`` asks for."""
    model = body.get("model")
    if model is None:
        raise _Invalid("model: Field required")
    if not isinstance(model, str) or not model:
        raise _Invalid("model: Input should be a valid string")
    cap = body.get("max_tokens")
    if cap is None:
        raise _Invalid("max_tokens: Field required")
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise _Invalid("max_tokens: Input should be a valid integer")
    if cap < 1:
        raise _Invalid("max_tokens: Input should be greater than or equal to 1")
    _check_messages(body.get("messages"))
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise _Invalid("system: Input should be a valid string or a list of text blocks")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _Invalid("stream: Input should be a valid boolean")
    text, output, cut = reply(cap, asked)
    # Input as the vendor counted it at arrival (the proxy's estimate): the window keeps it as is.
    read = max(1, math.ceil(_INPUT_ESTIMATE.cost(raw, 0.0, content_type=content_type)))
    made = {
        "id": made_up_id("msg_", 24),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "max_tokens" if cut else "end_turn",
        "stop_sequence": None,
        "usage": {INPUT: read, OUTPUT: output},
    }
    return made, stream


def _check_messages(messages: object) -> None:
    if messages is None:
        raise _Invalid("messages: Field required")
    if not isinstance(messages, list):
        raise _Invalid("messages: Input should be a valid list")
    if not messages:
        raise _Invalid("messages: at least one message is required")
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _Invalid(f"messages.{i}: Input should be a valid dictionary")
        if message.get("role") not in ("user", "assistant"):
            raise _Invalid(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        if content is None:
            raise _Invalid(f"messages.{i}.content: Field required")
        if isinstance(content, list):
            if not all(isinstance(block, dict) and isinstance(block.get("type"), str) for block in content):
                raise _Invalid(f"messages.{i}.content: each block must be an object with a 'type'")
        elif not isinstance(content, str):
            raise _Invalid(f"messages.{i}.content: Input should be a valid string or a list of blocks")
        if not content and not (i == last and message["role"] == "assistant"):
            raise _Invalid(
                f"messages.{i}: all messages must have non-empty content "
                "except for the optional final assistant message"
            )


def _events(made: dict[str, Any]) -> Iterator[tuple[str | None, object]]:
    """The message as Anthropic streams it: named events, each ``data`` carrying its ``type``."""
    (block,) = made["content"]
    usage = made["usage"]
    start = {**made, "content": [], "stop_reason": None, "stop_sequence": None}
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {**start, "usage": {INPUT: usage[INPUT], OUTPUT: 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
    ]
    for piece in pieces(block["text"]):
        events.append({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}})
    events += [
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": made["stop_reason"], "stop_sequence": None},
            "usage": {OUTPUT: usage[OUTPUT]},  # cumulative: the whole answer's
        },
        {"type": "message_stop"},
    ]
    for event in events:
        yield event["type"], event
