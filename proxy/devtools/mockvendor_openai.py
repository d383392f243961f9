"""OpenAI-shaped answers of the mock vendor, enough for openai-python and plain HTTP clients.

    POST /v1/chat/completions   ``chat.completion``; ``stream: true``: ``chat.completion.chunk``
                                events, then ``data: [DONE]``
    POST /v1/completions        ``text_completion``, streamed the same way
    POST /v1/embeddings         a list of ``embedding`` (``encoding_format`` float or base64,
                                ``dimensions``, default 16): the same text, the same vector
    POST /v1/responses          a ``response``; ``stream: true``: its typed events
                                (``response.created`` ... ``response.completed``)

Every answer reports ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``;
``input_tokens``/``output_tokens`` for responses), counted as one token per four characters,
at least one per text: not a tokenizer, a stand-in that grows with the input. A stream
reports it in a last chunk (``choices: []``) when ``stream_options.include_usage`` is set.
The reply is ``REPLY``, or, when the request asks for a size with the mock-only header
``X-Mock-Output-Tokens: N`` (a positive integer; else a 400), made-up text of ``N`` tokens as
``count_tokens`` counts them, streamed in runs of words (``mockvendor_shapes``), each of the ``n``
choices alike: ``usage.completion_tokens`` is ``n x N`` (``output_tokens`` for responses;
embeddings ignore the header). Answers carry ``x-request-id`` and OpenAI's quota headers,
``x-ratelimit-limit-requests`` (per minute), ``-remaining-requests``, ``-reset-requests``;
the quota's 429 is OpenAI's ``rate_limit_exceeded`` error with ``Retry-After``. Bad input is
OpenAI's 400 ``invalid_request_error`` naming the parameter; another method than POST is a
405. No API key is checked. A completion cap (``max_completion_tokens``, ``max_tokens``,
``max_output_tokens``: a positive integer) below the reply's tokens cuts it short, as a model
does: ``finish_reason: "length"`` (a response: ``status: "incomplete"``); so ``N`` above the cap
gets the cap.

With a token quota (``OpenAITokens``: ``MockVendor(tokens_per_minute=N)``, ``--tokens-per-minute``)
the vendor counts tokens as OpenAI does, in a strict sliding window (``mockvendor_tokens``) of
``N x window / 60`` tokens besides the requests. A request is admitted by OpenAI's estimate at
arrival: ceil(the prompt's characters / 4) + the completion cap x ``n`` (``DEFAULT_COMPLETION_CAP``,
4096, when it states none; embeddings generate nothing); refused otherwise with OpenAI's 429 for
tokens (``type: "tokens"``, ``code: "rate_limit_exceeded"``, "Rate limit reached for MODEL ... on
tokens per min (TPM): Limit L, Used U, Requested R. Please try again in 1.5s.", ``Retry-After``; a
request whose estimate exceeds the window's limit gets "Request too large ..." and no
``Retry-After``, since waiting will not help). Once the answer is produced (a stream: written) its
estimate in the window becomes its ``usage.total_tokens``, streamed with ``include_usage`` or not.
Every answer then carries ``x-ratelimit-limit-tokens`` (per minute), ``-remaining-tokens`` (what the
window has left) and ``-reset-tokens`` (until the window is empty again).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
from collections.abc import Iterator
from typing import Any, Final

from aiohttp import web

from proxy.devtools.mockvendor_quota import format_number, go_duration, retry_after
from proxy.devtools.mockvendor_shapes import (
    REPLY,
    BadInput,
    asked_output,
    count_tokens,
    json_answer,
    made_up_id,
    model_of,
    pieces,
    read_json_object,
    reply,
    write_events,
)
from proxy.devtools.mockvendor_tokens import Demand, Refused, Reservation, TokenWindow
from proxy.quota.estimates import DEFAULT_COMPLETION_CAP, Estimate

__all__ = ["REPLY", "OpenAIShape", "OpenAITokens", "count_tokens"]

_PATHS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_DIMENSIONS: Final = 16
_MAX_DIMENSIONS: Final = 4096
_CAPS: Final = ("max_completion_tokens", "max_tokens", "max_output_tokens")  # the estimate's order
_ESTIMATE: Final = Estimate("openai")
_LIMITS_PAGE: Final = "Visit https://platform.openai.com/account/rate-limits to learn more."


class _Invalid(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _error(message: str, kind: str, code: str | None, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _texts(value: object, param: str) -> list[str]:
    """A string, or a list of strings (or of token ids, counted as one text each)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(isinstance(v, int) for v in value):
            return [" " * 4 * len(value)]  # token ids: as many tokens as ids
        if all(isinstance(v, list) and all(isinstance(i, int) for i in v) for v in value):
            return [" " * 4 * len(v) for v in value]
    raise _Invalid(f"'{param}' must be a string or a non-empty array of strings or token ids", param)


def _content_text(content: object) -> str:
    """A message's content: a string, or parts whose ``text`` counts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _messages(value: object, param: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"'{param}' must be a non-empty array of messages", param)
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Invalid(f"'{param}[{i}]' must be an object with a 'role'", f"{param}[{i}]")
    return [_content_text(m.get("content")) for m in value]


def _choices(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
        raise _Invalid("'n' must be an integer from 1 to 128", "n")
    return n


def _cap(body: dict[str, Any]) -> int | None:
    """The completion cap the request states, the first of ``_CAPS`` given, as the estimate reads it."""
    for name in _CAPS:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            kind = type(value).__name__
            raise _Invalid(f"Invalid type for '{name}': expected an integer, but got {kind} instead.", name)
        if value < 1:
            raise _Invalid(
                f"Invalid '{name}': integer below minimum value. Expected a value >= 1, but got {value} instead.", name
            )
        return value
    return None


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _Invalid("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise _Invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _Invalid("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    return True, bool(options.get("include_usage", False))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _vector(model: str, text: str, dimensions: int) -> list[float]:
    """A unit vector that depends only on (model, text)."""
    raw = b""
    counter = 0
    while len(raw) < 4 * dimensions:
        raw += hashlib.sha256(f"{model}\0{counter}\0{text}".encode()).digest()
        counter += 1
    values = [(v / 2**31) - 1.0 for v in struct.unpack(f"<{dimensions}I", raw[: 4 * dimensions])]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


class OpenAITokens:
    """OpenAI's tokens-per-minute quota (see the module docstring), a ``ShapeMeter``.

    The estimate is the proxy's own ``estimate: openai`` (``proxy.quota.estimates``), reused, not
    copied: the mock and the proxy count a request's prompt characters, tools and cap alike, to
    the token, so a proxy that admits by its estimate never sends what the vendor would refuse.
    """

    def __init__(self, window: TokenWindow) -> None:
        self.window = window
        self.windows = (window,)

    def estimate(self, body: bytes | None, content_type: str | None, path: str) -> Demand:
        cost = _ESTIMATE.cost(body, 0.0, content_type=content_type, completion_cap=DEFAULT_COMPLETION_CAP, path=path)
        return Demand((math.ceil(cost),), body)  # a body it cannot read costs nothing: its 400 follows

    def headers(self, now: float) -> dict[str, str]:
        window = self.window
        return {
            "x-ratelimit-limit-tokens": format_number(window.per_minute),
            "x-ratelimit-remaining-tokens": str(window.remaining(now)),
            "x-ratelimit-reset-tokens": go_duration(window.full_in(now)),
        }

    def refusal(self, refused: Refused, headers: dict[str, str]) -> web.Response:
        (requested,), (used,) = refused.demand.tokens, refused.used
        limit = self.window.limit
        where = f"{model_of(refused.demand.body) or 'the model'} in organization org-mock on tokens per min (TPM)"
        extra = {"x-request-id": made_up_id("req_", 32)}
        if math.isinf(refused.wait):
            message = (
                f"Request too large for {where}: Limit {limit}, Requested {requested}. "
                f"The input or output tokens must be reduced in order to run successfully. {_LIMITS_PAGE}"
            )
        else:
            message = (
                f"Rate limit reached for {where}: Limit {limit}, Used {used}, Requested {requested}. "
                f"Please try again in {go_duration(refused.wait)}. {_LIMITS_PAGE}"
            )
            extra["Retry-After"] = str(retry_after(refused.wait))
        return json_answer(429, _error(message, "tokens", "rate_limit_exceeded"), {**headers, **extra})


class OpenAIShape:
    """OpenAI's completions, embeddings and responses; see the module docstring."""

    name: Final = "openai"
    quota_headers: Final = "openai"

    def __init__(self, meter: OpenAITokens | None = None) -> None:
        self.meter = meter

    def owns(self, path: str) -> bool:
        return path in _PATHS

    def reset(self) -> None:
        if self.meter is not None:
            self.meter.window.reset()

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        message = "Rate limit reached for requests. Please try again later."
        extra = {"Retry-After": str(retry_after), "x-request-id": made_up_id("req_", 32)}
        return json_answer(429, _error(message, "requests", "rate_limit_exceeded", "requests"), {**headers, **extra})

    async def answer(
        self, request: web.BaseRequest, headers: dict[str, str], reservation: Reservation
    ) -> web.StreamResponse:
        headers = {**headers, "x-request-id": made_up_id("req_", 32), "openai-processing-ms": "1"}
        used = 0  # the answer's usage.total_tokens: what the token window keeps of it
        try:
            if request.method != "POST":
                message = f"Invalid method for URL ({request.method} {request.path})"
                return json_answer(405, _error(message, "invalid_request_error", None), {**headers, "Allow": "POST"})
            body = await read_json_object(request)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise _Invalid("you must provide a model parameter", "model")
            path = request.path
            if path == "/v1/embeddings":
                made = self._embeddings(body, model)
                used = made["usage"]["total_tokens"]
                return json_answer(200, made, headers)
            stream, include_usage = _stream_flags(body)
            created = int(time.time())
            cap = _cap(body)
            if path == "/v1/responses":
                made = self._response(body, model, created, cap, asked_output(request))
                used = made["usage"]["total_tokens"]
                if not stream:
                    return json_answer(200, made, headers)
                return await write_events(request, headers, _response_events(made))
            chat = path == "/v1/chat/completions"
            prompts = _messages(body.get("messages"), "messages") if chat else _texts(body.get("prompt"), "prompt")
            n = _choices(body)
            text, tokens, cut = reply(cap, asked_output(request))
            usage = _usage(sum(count_tokens(t) for t in prompts), n * tokens)
            used = usage["total_tokens"]
            made_id = made_up_id("chatcmpl-" if chat else "cmpl-", 29)
            head = {"id": made_id, "created": created, "model": model, "system_fingerprint": "fp_mock"}
            finish = "length" if cut else "stop"
            if not stream:
                return json_answer(200, _completion(chat, head, n, usage, text, finish), headers)
            events = _chunks(chat, head, n, usage if include_usage else None, text, finish)
            return await write_events(request, headers, events)
        except BadInput as exc:
            return json_answer(400, _error(str(exc), "invalid_request_error", None), headers)
        except _Invalid as exc:
            return json_answer(400, _error(exc.message, "invalid_request_error", None, exc.param), headers)
        finally:
            reservation.settle(tokens=used)  # the answer is produced (a stream: written)

    def _embeddings(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        texts = _texts(body.get("input"), "input")
        dimensions = body.get("dimensions", _DIMENSIONS)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= _MAX_DIMENSIONS:
            raise _Invalid(f"'dimensions' must be an integer from 1 to {_MAX_DIMENSIONS}", "dimensions")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise _Invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        data = []
        for index, text in enumerate(texts):
            vector = _vector(model, text, dimensions)
            # base64: the little-endian float32 array the SDK decodes (its default request)
            packed = base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
            value: object = vector if encoding == "float" else packed
            data.append({"object": "embedding", "index": index, "embedding": value})
        tokens = sum(count_tokens(t) for t in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": model, "usage": usage}

    def _response(
        self, body: dict[str, Any], model: str, created: int, cap: int | None, asked: int | None
    ) -> dict[str, Any]:
        given = body.get("input")
        texts = _messages(given, "input") if isinstance(given, list) and given and isinstance(given[0], dict) else None
        prompt = sum(count_tokens(t) for t in (texts if texts is not None else _texts(given, "input")))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _Invalid("'instructions' must be a string", "instructions")
        if instructions:
            prompt += count_tokens(instructions)
        said, completion, cut = reply(cap, asked)
        status = "incomplete" if cut else "completed"
        text = {"type": "output_text", "text": said, "annotations": [], "logprobs": []}
        message = {"type": "message", "id": made_up_id("msg_", 32), "status": status, "role": "assistant"}
        return {
            "id": made_up_id("resp_", 32),
            "object": "response",
            "created_at": created,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": model,
            "output": [{**message, "content": [text]}],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            },
        }


def _completion(
    chat: bool, head: dict[str, Any], n: int, usage: dict[str, int], text: str, finish: str
) -> dict[str, Any]:
    if chat:
        message = {"role": "assistant", "content": text, "refusal": None}
        choices = [{"index": i, "message": message, "logprobs": None, "finish_reason": finish} for i in range(n)]
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage}
    choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish} for i in range(n)]
    return {**head, "object": "text_completion", "choices": choices, "usage": usage}


def _chunks(
    chat: bool, head: dict[str, Any], n: int, usage: dict[str, int] | None, text: str, finish: str
) -> Iterator[tuple[str | None, object]]:
    """A streamed completion: every choice's pieces, its finish, the usage chunk if asked, [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {} if usage is None else {"usage": None}  # with include_usage every chunk has the key

    def chunk(index: int, piece: str | None, first: bool, finish: str | None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {} if piece is None else {"content": piece}
            if first:
                delta = {"role": "assistant", "content": "", "refusal": None}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {**head, "object": kind, "choices": [choice], **extra}

    for index in range(n):
        if chat:
            yield None, chunk(index, None, True, None)
        for piece in pieces(text):
            yield None, chunk(index, piece, False, None)
        yield None, chunk(index, None, False, finish)
    if usage is not None:
        yield None, {**head, "object": kind, "choices": [], "usage": usage}
    yield None, "[DONE]"


def _response_events(made: dict[str, Any]) -> Iterator[tuple[str | None, object]]:
    """A streamed response as the Responses API sends it: typed events, no [DONE]."""
    (item,) = made["output"]
    (part,) = item["content"]
    pending = {**made, "status": "in_progress", "output": [], "usage": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": pending},
        {"type": "response.in_progress", "response": pending},
        {"type": "response.output_item.added", "output_index": 0}
        | {"item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", "item_id": item["id"], "output_index": 0, "content_index": 0}
        | {"part": {**part, "text": ""}},
    ]
    for piece in pieces(part["text"]):
        events.append(
            {"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0, "content_index": 0}
            | {"delta": piece, "logprobs": []}
        )
    events += [
        {"type": "response.output_text.done", "item_id": item["id"], "output_index": 0, "content_index": 0}
        | {"text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", "item_id": item["id"], "output_index": 0, "content_index": 0}
        | {"part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed" if made["status"] == "completed" else "response.incomplete"} | {"response": made},
    ]
    for number, event in enumerate(events):
        yield event["type"], {**event, "sequence_number": number}
