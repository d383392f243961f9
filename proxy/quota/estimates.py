"""A request's estimated cost for a meter (SPEC section 14), from its body: what the request
takes from the meter's buckets before it goes, until the answer settles it (``usage.py``).

The forms a policy writes (``estimate_from_policy``):

    openai                          ceil(prompt characters / 4) + completion cap x n
    anthropic_input                 ceil(input characters / 4)
    anthropic_output                max_tokens
    {fixed: N}                      N, whatever the body
    {json: /pointer, default: N}    the number at the pointer in the JSON body, else N

What the presets count, and why:

- ``openai`` follows OpenAI's admission rule: it estimates a request before tokenizing it,
  from the prompt's characters (about four to a token) plus the most the request may generate
  (the completion cap x ``n``). OpenAI does not publish which characters it counts; the preset
  counts every text the model is given, so it errs high, never low (the answer's usage
  replaces the estimate anyway). Counted: chat ``messages`` (a string ``content`` or its parts'
  ``text``, ``name``, the assistant's ``tool_calls`` and ``function_call``: function name and
  ``arguments``); completions' ``prompt`` and ``suffix``; the Responses API's ``instructions``
  and ``input`` (a string, or items: ``content`` as above, a ``function_call``'s name and
  ``arguments``, a ``function_call_output``'s ``output``); embeddings' ``input``; and tool and
  function definitions (``tools``, ``functions``) as their compact JSON, since the model reads
  them as prompt too. Token ids (a prompt or input given as integers) count one token each.
  Not counted: images, audio and files (their cost is not in their characters).
  The completion cap is ``max_completion_tokens``, else ``max_tokens``, else
  ``max_output_tokens``, else the caller's ``completion_cap``; x ``n`` (at least 1), or x
  ``best_of`` when that is larger (completions generate ``best_of`` and return ``n``).
  Embeddings generate nothing: a request is embeddings when its path ends in ``/embeddings``,
  or, without a path, when it has ``encoding_format`` or ``dimensions`` or its model's name
  says ``embedding``.
- ``anthropic_input``: Anthropic estimates input tokens when a request begins and corrects them
  from usage; the preset counts ``system`` (a string or its text blocks) and every message's
  content: a string, ``text`` blocks, ``tool_use`` (name and compact JSON ``input``),
  ``tool_result`` content (a string or its text blocks), ``document`` blocks whose source is
  plain text; and ``tools`` as compact JSON. Not counted: images, PDFs, ``thinking`` blocks
  (Anthropic drops earlier turns' thinking from the context).
- ``anthropic_output``: ``max_tokens`` (required by the Messages API), as Anthropic estimates
  output tokens; without a usable one, the meter's default.

An estimate is a non-negative number of at most ``MAX_ESTIMATE``: a larger one (a cap of
1e300) is held at it, which no meter can hold, so the request is refused, never let through
cheap. ``cost`` never raises: a body that is not JSON, not an object, or not read (``None``)
costs the meter's default.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Final, Literal, TypeGuard, cast, get_args

from proxy.quota.json_pointer import JsonPointer, json_number, load_json

__all__ = [
    "DEFAULT_COMPLETION_CAP",
    "MAX_ESTIMATE",
    "PRESETS",
    "Estimate",
    "EstimateKind",
    "estimate_from_policy",
    "request_document",
]

EstimateKind = Literal["openai", "anthropic_input", "anthropic_output", "fixed", "json"]
Preset = Literal["openai", "anthropic_input", "anthropic_output"]
PRESETS: Final[tuple[str, ...]] = get_args(Preset)

MAX_ESTIMATE: Final = float(2**53)
"""The largest estimate: a float still exact at every integer up to it."""

_UNREAD: Final = object()  # (Estimate.cost: the body not parsed yet)

DEFAULT_COMPLETION_CAP: Final = 4096.0
"""The completion cap of an OpenAI request that states none, unless the caller says otherwise:
OpenAI then allows up to the model's context, which the proxy does not know."""

_FORMS: Final = "openai, anthropic_input, anthropic_output, {fixed: N} or {json: /pointer, default: N}"
_CAPS: Final = ("max_completion_tokens", "max_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class Estimate:
    """How a meter estimates a request's cost."""

    kind: EstimateKind
    fixed: float = 0.0
    """``fixed``: the cost."""
    pointer: JsonPointer | None = None
    """``json``: where the cost is in the request's JSON body."""
    default: float | None = None
    """``json``: the cost when the pointer finds no number; ``None``: the meter's default."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(EstimateKind):
            raise ValueError(f"unknown estimate {self.kind!r}: one of {_FORMS}")
        for name, value in (("fixed", self.fixed), ("default", self.default)):
            if value is not None and not 0 <= value <= MAX_ESTIMATE:
                raise ValueError(f"estimate {name} must be a number from 0 to {MAX_ESTIMATE:.0f}, not {value}")
        if (self.kind == "json") != (self.pointer is not None):
            raise ValueError("a pointer goes with, and only with, a json estimate")

    @property
    def reads_body(self) -> bool:
        """Whether the cost depends on the body (a fixed one does not: no need to read it)."""
        return self.kind != "fixed"

    def cost(
        self,
        body: bytes | None,
        default: float,
        *,
        content_type: str | None = None,
        completion_cap: float = DEFAULT_COMPLETION_CAP,
        path: str = "",
        document: object = _UNREAD,
    ) -> float:
        """The request's estimated cost. ``body``: read whole, or ``None`` (too large or not
        read); ``default``: the meter's cost for a body it cannot read; ``content_type``: the
        request's (``None``: unknown, the body is tried as JSON); ``completion_cap``: an OpenAI
        request's cap when it states none; ``path``: the request's path, which tells an
        embeddings request (no completion) from a Responses one; ``document``: the body as
        ``request_document`` read it already (a vendor's meters read it once)."""
        if self.kind == "fixed":
            return self.fixed
        fallback = self.default if self.kind == "json" and self.default is not None else default
        if document is _UNREAD:
            document = request_document(body, content_type)
        if self.kind == "json":
            assert self.pointer is not None  # __post_init__
            found = json_number(self.pointer.resolve(document))
            return _held(fallback if found is None else found)
        if not isinstance(document, dict):
            return _held(fallback)
        if self.kind == "openai":
            if completion_cap != DEFAULT_COMPLETION_CAP:
                completion_cap = _held(completion_cap)
            return _held(_openai(document, completion_cap, path))
        if self.kind == "anthropic_input":
            return _held(_tokens(_anthropic_characters(document)))
        cap = json_number(document.get("max_tokens"))
        return _held(fallback if cap is None else cap)


def estimate_from_policy(value: object) -> Estimate:
    """A policy's ``estimate:``, checked; ValueError naming the forms allowed otherwise."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(f"unknown estimate preset {value!r}: one of {_FORMS}")
        return Estimate(cast(Preset, value))
    if not isinstance(value, dict) or not value:
        raise ValueError(f"an estimate is one of {_FORMS}, not {_show(value)}")
    keys = set(value)
    if keys == {"fixed"}:
        return Estimate("fixed", fixed=_policy_number(value["fixed"], "fixed"))
    if "json" in keys and keys <= {"json", "default"}:
        pointer = JsonPointer.parse(value["json"])
        default = _policy_number(value["default"], "default") if "default" in value else None
        return Estimate("json", pointer=pointer, default=default)
    raise ValueError(f"an estimate is one of {_FORMS}, not {_show(value)}")


def _policy_number(value: object, name: str) -> float:
    number = json_number(value)
    if number is None or number > MAX_ESTIMATE:
        raise ValueError(f"estimate {name} must be a number from 0 to {MAX_ESTIMATE:.0f}, not {_show(value)}")
    return number


def _show(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def _held(value: float) -> float:
    """A cost within [0, MAX_ESTIMATE]."""
    if 0.0 <= value <= MAX_ESTIMATE:  # (the usual one; NaN fails both)
        return value
    return min(max(value, 0.0), MAX_ESTIMATE) if value == value else MAX_ESTIMATE


def request_document(body: bytes | None, content_type: str | None) -> object:
    """A request body as an estimate reads it: its JSON (None: not JSON, or of a type that is
    not read: a form, a multipart upload)."""
    return load_json(body) if _json_type(content_type) else None


def _json_type(content_type: str | None) -> bool:
    """Whether a body of ``content_type`` may be JSON: unknown, ``application/json`` or
    ``...+json``; a form or a multipart upload is not read."""
    if content_type is None or content_type == "application/json":
        return True
    media = content_type.partition(";")[0].strip().lower()
    return media in ("", "application/json") or media.endswith("+json")


def _tokens(characters: int) -> int:
    return -(-characters // 4)


class _Prompt:
    """Characters and token ids of a prompt, counted as its parts are visited."""

    __slots__ = ("characters", "ids")

    def __init__(self) -> None:
        self.characters = 0
        self.ids = 0

    def text(self, value: object) -> None:
        if isinstance(value, str):
            self.characters += len(value)

    def compact(self, value: object) -> None:
        """A definition (tools, a tool call's input) as the model reads it: compact JSON."""
        if value is None:
            return
        with contextlib.suppress(TypeError, ValueError, RecursionError):  # parsed JSON always dumps
            self.characters += len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))

    def texts_or_ids(self, value: object) -> None:
        """A prompt or embeddings input: a string, strings, token ids, or lists of token ids."""
        if isinstance(value, str):
            self.characters += len(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    self.characters += len(item)
                elif _integer(item):
                    self.ids += 1
                elif isinstance(item, list):
                    self.ids += sum(1 for i in item if _integer(i))

    def parts(self, value: object, *fields: str) -> None:
        """A content: a string, or a list of parts whose ``fields`` (strings) count."""
        if isinstance(value, str):
            self.characters += len(value)
        elif isinstance(value, list):
            for part in value:
                if isinstance(part, str):
                    self.characters += len(part)
                elif isinstance(part, dict):
                    for field in fields:
                        self.text(part.get(field))

    def call(self, value: object) -> None:
        """A function call: its name and its ``arguments`` string."""
        if isinstance(value, dict):
            self.text(value.get("name"))
            self.text(value.get("arguments"))

    @property
    def tokens(self) -> int:
        return _tokens(self.characters) + self.ids


def _openai(body: dict[str, object], completion_cap: float, path: str) -> float:
    prompt = _Prompt()
    completes = True
    if "messages" in body:
        messages = body["messages"]
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, dict):  # (each field looked at only when there: most messages are a role and a text)
                content = message.get("content")
                if isinstance(content, str):
                    prompt.characters += len(content)
                elif content is not None:
                    prompt.parts(content, "text", "refusal")
                if "name" in message:
                    prompt.text(message["name"])
                if "function_call" in message:
                    prompt.call(message["function_call"])
                calls = message.get("tool_calls")
                for call in calls if isinstance(calls, list) else ():
                    if isinstance(call, dict):
                        prompt.call(call.get("function"))
    elif "prompt" in body and not isinstance(body["prompt"], dict):  # the Responses API's is an object
        prompt.texts_or_ids(body["prompt"])
        prompt.text(body.get("suffix"))
    elif _embeddings(body, path):
        prompt.texts_or_ids(body.get("input"))
        completes = False
    else:
        prompt.text(body.get("instructions"))
        _responses_input(prompt, body.get("input"))
    if "tools" in body:
        prompt.compact(body["tools"])
    if "functions" in body:
        prompt.compact(body["functions"])
    if not completes:
        return prompt.tokens
    cap = completion_cap
    for name in _CAPS:
        if name in body:
            found = json_number(body[name])
            if found is not None:
                cap = found
                break
    return prompt.tokens + cap * _choices(body)


def _integer(value: object) -> TypeGuard[int | float]:
    """Whether a JSON value is an integer: an int (not a bool), or a float of one past 64 bits
    (as orjson reads those: json_pointer.load_json)."""
    return type(value) is int or (type(value) is float and abs(value) >= _PAST_64_BITS and value.is_integer())


_PAST_64_BITS: Final = float(2**63)


def _choices(body: dict[str, object]) -> int:
    """How many completions the request generates: ``n``, or ``best_of`` when larger."""
    found = 1
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and _integer(value) and value > found:
            found = int(min(value, 2**53))  # the cost is held at MAX_ESTIMATE anyway
    return found


def _embeddings(body: dict[str, object], path: str) -> bool:
    if path:
        return path.partition("?")[0].rstrip("/").endswith("/embeddings")
    model = body.get("model")
    return "encoding_format" in body or "dimensions" in body or (isinstance(model, str) and "embedding" in model)


def _responses_input(prompt: _Prompt, value: object) -> None:
    if not isinstance(value, list):
        prompt.text(value)
        return
    for item in value:
        if isinstance(item, str):
            prompt.text(item)
        elif isinstance(item, dict):
            prompt.parts(item.get("content"), "text", "refusal")
            kind = item.get("type")
            if kind == "function_call":
                prompt.call(item)
            elif kind == "function_call_output":
                prompt.parts(item.get("output"), "text")


def _anthropic_characters(body: dict[str, object]) -> int:
    prompt = _Prompt()
    prompt.parts(body.get("system"), "text")
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if not isinstance(content, list):
            prompt.text(content)
            continue
        for block in content:
            if isinstance(block, str):
                prompt.text(block)
            elif isinstance(block, dict):
                _anthropic_block(prompt, block)
    prompt.compact(body.get("tools"))
    return prompt.characters


def _anthropic_block(prompt: _Prompt, block: dict[str, object]) -> None:
    kind = block.get("type")
    if kind == "text":
        prompt.text(block.get("text"))
    elif kind in ("tool_use", "server_tool_use"):
        prompt.text(block.get("name"))
        prompt.compact(block.get("input"))
    elif kind == "tool_result":
        prompt.parts(block.get("content"), "text")
    elif kind == "document":
        source = block.get("source")
        if isinstance(source, dict) and source.get("type") == "text":
            prompt.text(source.get("data"))
