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
The reply is always ``REPLY``. Answers carry ``x-request-id`` and OpenAI's quota headers,
``x-ratelimit-limit-requests`` (per minute), ``-remaining-requests``, ``-reset-requests``;
the quota's 429 is OpenAI's ``rate_limit_exceeded`` error with ``Retry-After``. Bad input is
OpenAI's 400 ``invalid_request_error`` naming the parameter; another method than POST is a
405. No API key is checked.
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

from proxy.devtools.mockvendor_shapes import BadInput, json_answer, made_up_id, read_json_object, write_events

__all__ = ["REPLY", "OpenAIShape", "count_tokens"]

REPLY: Final = "Hello from the mock vendor."
_PATHS: Final = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
_DIMENSIONS: Final = 16
_MAX_DIMENSIONS: Final = 4096


def count_tokens(text: str) -> int:
    """A stand-in for a tokenizer: one token per four characters, at least one."""
    return max(1, math.ceil(len(text) / 4))


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


def _pieces() -> list[str]:
    """REPLY cut as a stream delivers it: word by word, spaces kept."""
    words = REPLY.split(" ")
    return [w if i == 0 else f" {w}" for i, w in enumerate(words)]


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


class OpenAIShape:
    """OpenAI's completions, embeddings and responses; see the module docstring."""

    name: Final = "openai"
    quota_headers: Final = "openai"

    def owns(self, path: str) -> bool:
        return path in _PATHS

    def reset(self) -> None:
        return None  # it keeps nothing

    def refusal(self, retry_after: int, headers: dict[str, str]) -> web.Response:
        message = "Rate limit reached for requests. Please try again later."
        extra = {"Retry-After": str(retry_after), "x-request-id": made_up_id("req_", 32)}
        return json_answer(429, _error(message, "requests", "rate_limit_exceeded", "requests"), {**headers, **extra})

    async def answer(self, request: web.BaseRequest, headers: dict[str, str]) -> web.StreamResponse:
        headers = {**headers, "x-request-id": made_up_id("req_", 32), "openai-processing-ms": "1"}
        if request.method != "POST":
            message = f"Invalid method for URL ({request.method} {request.path})"
            return json_answer(405, _error(message, "invalid_request_error", None), {**headers, "Allow": "POST"})
        try:
            body = await read_json_object(request)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise _Invalid("you must provide a model parameter", "model")
            path = request.path
            if path == "/v1/embeddings":
                return json_answer(200, self._embeddings(body, model), headers)
            stream, include_usage = _stream_flags(body)
            created = int(time.time())
            if path == "/v1/responses":
                made = self._response(body, model, created)
                if not stream:
                    return json_answer(200, made, headers)
                return await write_events(request, headers, _response_events(made))
            chat = path == "/v1/chat/completions"
            prompts = _messages(body.get("messages"), "messages") if chat else _texts(body.get("prompt"), "prompt")
            n = _choices(body)
            usage = _usage(sum(count_tokens(t) for t in prompts), n * count_tokens(REPLY))
            made_id = made_up_id("chatcmpl-" if chat else "cmpl-", 29)
            head = {"id": made_id, "created": created, "model": model, "system_fingerprint": "fp_mock"}
            if not stream:
                return json_answer(200, _completion(chat, head, n, usage), headers)
            return await write_events(request, headers, _chunks(chat, head, n, usage if include_usage else None))
        except BadInput as exc:
            return json_answer(400, _error(str(exc), "invalid_request_error", None), headers)
        except _Invalid as exc:
            return json_answer(400, _error(exc.message, "invalid_request_error", None, exc.param), headers)

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

    def _response(self, body: dict[str, Any], model: str, created: int) -> dict[str, Any]:
        given = body.get("input")
        texts = _messages(given, "input") if isinstance(given, list) and given and isinstance(given[0], dict) else None
        prompt = sum(count_tokens(t) for t in (texts if texts is not None else _texts(given, "input")))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _Invalid("'instructions' must be a string", "instructions")
        if instructions:
            prompt += count_tokens(instructions)
        completion = count_tokens(REPLY)
        text = {"type": "output_text", "text": REPLY, "annotations": [], "logprobs": []}
        message = {"type": "message", "id": made_up_id("msg_", 32), "status": "completed", "role": "assistant"}
        return {
            "id": made_up_id("resp_", 32),
            "object": "response",
            "created_at": created,
            "status": "completed",
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


def _completion(chat: bool, head: dict[str, Any], n: int, usage: dict[str, int]) -> dict[str, Any]:
    if chat:
        message = {"role": "assistant", "content": REPLY, "refusal": None}
        choices = [{"index": i, "message": message, "logprobs": None, "finish_reason": "stop"} for i in range(n)]
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage}
    choices = [{"index": i, "text": REPLY, "logprobs": None, "finish_reason": "stop"} for i in range(n)]
    return {**head, "object": "text_completion", "choices": choices, "usage": usage}


def _chunks(
    chat: bool, head: dict[str, Any], n: int, usage: dict[str, int] | None
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
        for piece in _pieces():
            yield None, chunk(index, piece, False, None)
        yield None, chunk(index, None, False, "stop")
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
    for piece in _pieces():
        events.append(
            {"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0, "content_index": 0}
            | {"delta": piece, "logprobs": []}
        )
    events += [
        {"type": "response.output_text.done", "item_id": item["id"], "output_index": 0, "content_index": 0}
        | {"text": REPLY, "logprobs": []},
        {"type": "response.content_part.done", "item_id": item["id"], "output_index": 0, "content_index": 0}
        | {"part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": made},
    ]
    for number, event in enumerate(events):
        yield event["type"], {**event, "sequence_number": number}
