"""A request's actual cost for a meter, read from the vendor's answer (SPEC section 14): it
replaces the estimate (``estimates.py``) in every bucket the request took.

The forms a policy writes (``settle_from_policy``):

    openai              usage.total_tokens (else input + output, else prompt + completion)
    anthropic_input     usage.input_tokens + usage.cache_creation_input_tokens
    anthropic_output    usage.output_tokens
    {json: /pointer}    the number at the pointer in a JSON answer (Shopify:
                        /extensions/cost/actualQueryCost)
    {header: Name}      the number in an answer header

Where each preset finds it, and why:

- ``openai``: OpenAI's tokens-per-minute limit counts input and output together, so the amount
  is ``usage.total_tokens`` of a chat completion, completion, embeddings or Responses answer
  (else ``input_tokens + output_tokens``, then ``prompt_tokens + completion_tokens``). A chat
  or completions stream states it only with ``stream_options.include_usage``: the last chunk
  (``choices: []``) carries a non-null ``usage``. A Responses stream states it in its final
  event, ``response.completed`` (or ``response.incomplete``, ``response.failed``), as
  ``response.usage``.
- ``anthropic_input``: Anthropic's input-tokens-per-minute limit counts ``input_tokens`` and
  ``cache_creation_input_tokens``, but not ``cache_read_input_tokens`` (its rate-limit page:
  cached reads do not count for current models), so the amount is the first two. A stream
  states them in ``message_start``'s ``message.usage``; a ``message_delta`` that restates them
  (cumulative) replaces them.
- ``anthropic_output``: ``usage.output_tokens``. A stream's ``message_delta`` events carry the
  cumulative count, the last one wins. ``message_start`` carries only a first count (a token
  or so): a stream cut before any ``message_delta`` did generate more, unknown, so it says
  nothing (the estimate, ``max_tokens``, stays) unless ``message_stop`` closed it.

An amount is a number from 0 to ``MAX_AMOUNT``; anything else (a missing field, a wrong type,
a negative or huge number, truncated JSON, an error body) is ``None``: the answer did not say,
and the caller keeps the estimate. Nothing here raises on what a vendor sends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, Protocol, cast, get_args

from proxy.quota.json_pointer import JsonPointer, json_number, load_json

__all__ = ["MAX_AMOUNT", "PRESETS", "Settle", "SettleKind", "UsageReader", "settle_from_policy"]

SettleKind = Literal["openai", "anthropic_input", "anthropic_output", "json", "header"]
Preset = Literal["openai", "anthropic_input", "anthropic_output"]
PRESETS: Final[tuple[str, ...]] = get_args(Preset)

MAX_AMOUNT: Final = float(2**53)
"""The largest amount believed: a float still exact at every integer up to it."""

_FORMS: Final = "openai, anthropic_input, anthropic_output, {json: /pointer} or {header: Name}"
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 field name
_DECIMAL: Final = re.compile(r"[0-9]{1,20}(?:\.[0-9]{1,20})?")
_RESPONSE_ENDS: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ANTHROPIC_EVENTS: Final = frozenset({"message_start", "message_delta", "message_stop"})


class UsageReader(Protocol):
    """Reads a streamed answer's events as they are relayed."""

    def feed(self, event_name: str, data: str) -> None:
        """One event: its name (``message`` when unnamed) and its data."""
        ...

    def amount(self) -> float | None:
        """The amount the events so far state; ``None``: they did not say (yet)."""
        ...


@dataclass(frozen=True, slots=True)
class Settle:
    """Where a meter finds a request's actual cost in the vendor's answer."""

    kind: SettleKind
    pointer: JsonPointer | None = None
    """``json``: where the amount is in a JSON answer (or in a streamed event's JSON data)."""
    header: str = ""
    """``header``: the answer header that states the amount."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(SettleKind):
            raise ValueError(f"unknown settle {self.kind!r}: one of {_FORMS}")
        if (self.kind == "json") != (self.pointer is not None):
            raise ValueError("a pointer goes with, and only with, a json settle")
        if (self.kind == "header") != bool(self.header) or (self.header and not _TOKEN.fullmatch(self.header)):
            raise ValueError(f"a header settle names one header field, not {self.header!r}")

    @property
    def reads_body(self) -> bool:
        """Whether the amount is in the answer's body (every form but a header)."""
        return self.kind != "header"

    def from_json(self, body: bytes) -> float | None:
        """The amount a whole (not streamed) JSON answer states."""
        return None if self.kind == "header" else self.from_document(load_json(body))

    def from_document(self, document: object) -> float | None:
        """The amount a whole JSON answer states, parsed (``load_json``: None if it is not JSON)."""
        if self.kind == "header":
            return None
        if self.kind == "json":
            assert self.pointer is not None  # __post_init__
            return _amount(self.pointer.resolve(document))
        if not isinstance(document, dict):
            return None
        if self.kind == "openai":
            return _openai(document)
        usage = document.get("usage")
        if not isinstance(usage, dict):
            return None
        if self.kind == "anthropic_input":
            return _anthropic_input(usage)
        return _amount(usage.get("output_tokens"))

    def from_headers(self, headers: Mapping[str, str]) -> float | None:
        """The amount an answer's header states (a header form only)."""
        if self.kind != "header":
            return None
        value = headers.get(self.header)
        if value is None:  # a plain dict: field names are case-insensitive
            wanted = self.header.lower()
            value = next((v for k, v in headers.items() if k.lower() == wanted), None)
        if not isinstance(value, str) or not _DECIMAL.fullmatch(value.strip(" \t")):
            return None
        return _amount(float(value))

    def stream(self) -> UsageReader:
        """A reader for one streamed answer's events."""
        if self.kind == "openai":
            return _OpenAIStream()
        if self.kind in ("anthropic_input", "anthropic_output"):
            return _AnthropicStream(output=self.kind == "anthropic_output")
        if self.kind == "json":
            assert self.pointer is not None  # __post_init__
            return _PointerStream(self.pointer)
        return _Silent()


def settle_from_policy(value: object) -> Settle:
    """A policy's ``settle:``, checked; ValueError naming the forms allowed otherwise."""
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(f"unknown settle preset {value!r}: one of {_FORMS}")
        return Settle(cast(Preset, value))
    if isinstance(value, dict) and set(value) == {"json"}:
        return Settle("json", pointer=JsonPointer.parse(value["json"]))
    if isinstance(value, dict) and set(value) == {"header"}:
        name = value["header"]
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            raise ValueError(f"settle header must be a header field name such as X-Cost, not {_show(name)}")
        return Settle("header", header=name)
    raise ValueError(f"a settle is one of {_FORMS}, not {_show(value)}")


def _show(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return repr(value)


def _amount(value: object) -> float | None:
    """A JSON value as an amount: a number from 0 to MAX_AMOUNT, else None."""
    number = json_number(value)
    return number if number is not None and number <= MAX_AMOUNT else None


def _openai(document: dict[str, object]) -> float | None:
    """A chat, completions, embeddings or Responses answer, or one streamed event of one."""
    usage = document.get("usage")
    if usage is None and document.get("type") in _RESPONSE_ENDS:
        response = document.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
    if not isinstance(usage, dict):
        return None
    total = _amount(usage.get("total_tokens"))
    if total is not None:
        return total
    for first, second in (("input_tokens", "output_tokens"), ("prompt_tokens", "completion_tokens")):
        a, b = _amount(usage.get(first)), _amount(usage.get(second))
        if a is not None and b is not None:
            return _amount(a + b)
    return None


def _anthropic_input(usage: dict[str, object]) -> float | None:
    """``input_tokens`` + ``cache_creation_input_tokens`` (absent or null: 0); a cache read
    does not count against Anthropic's input-token limit."""
    uncached = _amount(usage.get("input_tokens"))
    created = usage.get("cache_creation_input_tokens")
    written = 0.0 if created is None else _amount(created)
    if uncached is None or written is None:
        return None
    return _amount(uncached + written)


def _restated(value: object, previous: float | None) -> float | None:
    """A cumulative count a later event may restate: the new one when it is an amount."""
    found = _amount(value)
    return previous if found is None else found


class _OpenAIStream:
    """The last usage a chat, completions or Responses stream states."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: float | None = None

    def feed(self, event_name: str, data: str) -> None:
        # Most chunks: no usage, or (include_usage) a null one: skip the parse.
        if '"usage"' not in data or (data.count('"usage"') == 1 and '"usage":null' in data):
            return
        document = load_json(data)
        found = _openai(document) if isinstance(document, dict) else None
        if found is not None:
            self._last = found

    def amount(self) -> float | None:
        return self._last


class _AnthropicStream:
    """A Messages stream's input (``message_start``, restated by ``message_delta``) or output
    (the last ``message_delta``)."""

    __slots__ = ("_delta_output", "_output", "_start_output", "_stopped", "_uncached", "_written")

    def __init__(self, *, output: bool) -> None:
        self._output = output
        self._uncached: float | None = None  # input_tokens
        self._written: float | None = 0.0  # cache_creation_input_tokens
        self._start_output: float | None = None
        self._delta_output: float | None = None
        self._stopped = False

    def feed(self, event_name: str, data: str) -> None:
        kind = event_name
        if kind not in _ANTHROPIC_EVENTS:
            if kind != "message" or '"message_' not in data:  # content_block_delta, ping, ...
                return
            kind = ""  # unnamed: the data's "type" says
        if kind == "message_stop":
            self._stopped = True
            return
        document = load_json(data)
        if not isinstance(document, dict):
            return
        kind = kind or str(document.get("type"))
        if kind == "message_start":
            message = document.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                created = usage.get("cache_creation_input_tokens")
                self._uncached = _amount(usage.get("input_tokens"))
                self._written = 0.0 if created is None else _amount(created)
                self._start_output = _amount(usage.get("output_tokens"))
        elif kind == "message_delta":
            usage = document.get("usage")
            if not isinstance(usage, dict):
                return
            # Cumulative counts: each one stated replaces the last; null means "not restated".
            self._delta_output = _restated(usage.get("output_tokens"), self._delta_output)
            self._uncached = _restated(usage.get("input_tokens"), self._uncached)
            self._written = _restated(usage.get("cache_creation_input_tokens"), self._written)
        elif kind == "message_stop":
            self._stopped = True

    def amount(self) -> float | None:
        if not self._output:
            if self._uncached is None or self._written is None:
                return None
            return _amount(self._uncached + self._written)
        if self._delta_output is not None:
            return self._delta_output
        return self._start_output if self._stopped else None


class _PointerStream:
    """The last number the pointer finds in a streamed event's JSON data."""

    __slots__ = ("_hint", "_last", "_pointer")

    def __init__(self, pointer: JsonPointer) -> None:
        self._pointer = pointer
        self._last: float | None = None
        last = pointer.tokens[-1] if pointer.tokens else ""
        # An event without the pointer's last key in its text cannot hold it: skip the parse.
        # Only for a key JSON writes as is (an encoder may escape other characters).
        self._hint = last if last.isascii() and last.isprintable() and not set(last) & {'"', "\\"} else ""

    def feed(self, event_name: str, data: str) -> None:
        if self._hint and self._hint not in data:
            return
        found = _amount(self._pointer.resolve(load_json(data)))
        if found is not None:
            self._last = found

    def amount(self) -> float | None:
        return self._last


class _Silent:
    """A header form: the events say nothing (the answer's head did)."""

    __slots__ = ()

    def feed(self, event_name: str, data: str) -> None:
        return None

    def amount(self) -> float | None:
        return None
