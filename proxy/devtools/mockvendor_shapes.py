"""What a vendor's *shape* is to the mock vendor: the paths it owns, its answers, its refusal.

``MockVendor`` keeps the request quota (one request = one token, whatever the path) and hands a
request whose path a shape owns to that shape for the answer: Stripe's objects
(``mockvendor_stripe``), OpenAI's completions (``mockvendor_openai``), Anthropic's messages
(``mockvendor_anthropic``). A vendor the mock should imitate next is one more module with one
class that satisfies ``Shape``, added to ``MockVendor``'s list. A shape that counts tokens too
has a ``meter`` (``mockvendor_tokens.ShapeMeter``): ``MockVendor`` reads the body before
admitting the request, takes the meter's estimate from its windows, and the shape settles the
``Reservation`` it is handed to what its answer used.

The helpers here are what every shape writes with: JSON answers, server-sent events, a
request body read as a JSON object, made-up ids, and the LLM shapes' reply and token count.

The LLM shapes answer ``REPLY`` (7 tokens) unless the request asks for another size with the
mock-only header ``X-Mock-Output-Tokens: N`` (``OUTPUT_TOKENS_HEADER``; a positive integer, else
the shape's 400): the reply is then made-up text of exactly ``N`` tokens as ``count_tokens``
counts them (``4 x N`` characters), cut short by the call's completion cap like ``REPLY``, and
streamed in runs of words of about 64 characters. A real vendor ignores the header; it is how a
bench drives the answers' usage (issue 35: "actual output 5-100 % of the cap").
"""

from __future__ import annotations

import json
import math
import secrets
import string
from collections.abc import Iterable
from typing import Any, Final, Protocol

from aiohttp import web

from proxy.devtools.mockvendor_control import JSON_TYPE
from proxy.devtools.mockvendor_tokens import Reservation, ShapeMeter

__all__ = [
    "OUTPUT_TOKENS_HEADER",
    "REPLY",
    "BadInput",
    "Shape",
    "asked_output",
    "count_tokens",
    "json_answer",
    "made_up_id",
    "model_of",
    "pieces",
    "read_json_object",
    "reply",
    "sized_text",
    "write_events",
]

_ALNUM: Final = string.ascii_letters + string.digits

REPLY: Final = "Hello from the mock vendor."
"""What the LLM shapes answer (cut short by a smaller completion cap) unless the request asks for
another size with ``X-Mock-Output-Tokens``."""


OUTPUT_TOKENS_HEADER: Final = "X-Mock-Output-Tokens"
"""The request header that asks for a reply of so many tokens (see the module docstring)."""

_FILLER: Final = "The mock vendor writes as many tokens as the request asked it for, and no more. "
_WORD_BY_WORD: Final = 256  # a longer text (a sized reply) streams in runs of words ...
_PIECE: Final = 64  # ... of about this many characters


def count_tokens(text: str) -> int:
    """A stand-in for a tokenizer: one token per four characters, at least one."""
    return max(1, math.ceil(len(text) / 4))


def asked_output(request: web.BaseRequest) -> int | None:
    """The reply's size in tokens the request asks for with ``X-Mock-Output-Tokens``, or ``None``
    (no header: ``REPLY``); BadInput when it is not a positive integer."""
    raw = request.headers.get(OUTPUT_TOKENS_HEADER)
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or int(text) < 1:
        raise BadInput(f"{OUTPUT_TOKENS_HEADER} must be a positive integer (tokens), not {raw!r}")
    return int(text)


def sized_text(tokens: int) -> str:
    """Made-up text of exactly ``tokens`` tokens as ``count_tokens`` counts them: ``4 x tokens``
    characters of words."""
    size = 4 * tokens
    return (_FILLER * (size // len(_FILLER) + 1))[:size]


def reply(cap: int | None, asked: int | None = None) -> tuple[str, int, bool]:
    """The reply, as a model with at most ``cap`` tokens to give writes it: (text, its tokens,
    whether the cap cut it). ``asked``: the tokens ``X-Mock-Output-Tokens`` asks for (``None``:
    ``REPLY``)."""
    text = REPLY if asked is None else sized_text(asked)
    full = count_tokens(text)
    if cap is None or cap >= full:
        return text, full, False
    return text[: 4 * cap], cap, True  # 4 x cap characters: `cap` tokens exactly


def pieces(text: str) -> list[str]:
    """``text`` cut as a stream delivers it: word by word, spaces kept; a text longer than 256
    characters (a sized reply) in runs of whole words of about 64 characters, so that a long
    answer is not thousands of events."""
    words = text.split(" ")
    cut = [w if i == 0 else f" {w}" for i, w in enumerate(words)]
    if len(text) <= _WORD_BY_WORD:
        return cut
    runs: list[str] = []
    run = ""
    for word in cut:
        run += word
        if len(run) >= _PIECE:
            runs.append(run)
            run = ""
    if run:
        runs.append(run)
    return runs


class Shape(Protocol):
    """One vendor's API, imitated."""

    @property
    def name(self) -> str:
        """The vendor, e.g. ``stripe``."""
        ...

    @property
    def quota_headers(self) -> str:
        """The family of quota headers its answers carry (``mockvendor_quota.QUOTA_HEADERS``):
        the vendor's own, whatever ``--quota-headers`` says for the other paths."""
        ...

    def owns(self, path: str) -> bool:
        """Whether a request for ``path`` is this vendor's to answer."""
        ...

    @property
    def meter(self) -> ShapeMeter | None:
        """Its token quotas, or ``None`` when it counts none."""
        ...

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        """The answer to a request the quotas admitted; ``headers`` (the quotas') go on it.
        Bad input is the vendor's own 4xx, in its error format. ``reservation``: the tokens
        it took (none without a meter), settled to what the answer used once it is produced."""
        ...

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        """The vendor's own 429 when the quota refuses: its error body, its headers,
        ``Retry-After: retry_after`` and ``headers``."""
        ...

    def reset(self) -> None:
        """Forget what it stored (``POST /__mock/reset``)."""
        ...


class BadInput(Exception):
    """A request body the vendor cannot read; its message says why (a 400)."""


def made_up_id(prefix: str, length: int = 24) -> str:
    """``prefix`` then ``length`` random letters and digits, as vendors write ids."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


def model_of(body: bytes | None) -> str | None:
    """The ``model`` a JSON request body names, if any."""
    try:
        document = json.loads(body or b"")
    except (ValueError, UnicodeDecodeError):
        return None
    model = document.get("model") if isinstance(document, dict) else None
    return model if isinstance(model, str) and model else None


def json_answer(status: int, payload: object, headers: dict[str, str]) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type=JSON_TYPE, headers=headers)


async def read_json_object(request: web.BaseRequest) -> dict[str, Any]:
    """The body as a JSON object; BadInput otherwise."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadInput("We could not parse the JSON body of your request.") from None
    if not isinstance(body, dict):
        raise BadInput("The body of your request must be a JSON object.")
    return body


async def write_events(
    request: web.BaseRequest, headers: dict[str, str], events: Iterable[tuple[str | None, object]]
) -> web.StreamResponse:
    """A ``text/event-stream`` answer: each (event name or None, data) as one event, the data
    JSON-encoded unless it is a string (``[DONE]``), written and flushed one at a time."""
    response = web.StreamResponse(headers=headers)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    await response.prepare(request)
    for event, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        head = f"event: {event}\n" if event else ""
        await response.write(f"{head}data: {text}\n\n".encode())
    await response.write_eof()
    return response
