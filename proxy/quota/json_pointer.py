"""A JSON body read for a meter, and an RFC 6901 pointer into it: what ``estimates.py`` (the
request) and ``usage.py`` (the answer) both read with, so they read alike.

Nothing here raises on a body: bytes that are not JSON (malformed, not UTF-8, nested past the
interpreter's depth, ``NaN`` or ``Infinity``, an integer of thousands of digits) read as
``None``, as JSON ``null`` does; either way the meter falls back on its default.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Final

import orjson

__all__ = ["JsonPointer", "json_number", "load_json"]

_INDEX: Final = re.compile(r"0|[1-9][0-9]*")


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity by default


_DECODER: Final = json.JSONDecoder(parse_constant=_refuse_constant)
"""One decoder for what orjson does not read: ``json.loads`` given an option makes a decoder
(and its scanner) per call, most of a small body's parse."""


def load_json(body: bytes | str | None) -> object:
    """``body`` (a body's bytes, or an event's data) parsed as JSON, or ``None`` when there is
    none or it is not JSON."""
    if not body:
        return None
    try:  # UTF-8 JSON, most bodies: orjson reads a 2 KB one in a third of json's time
        return orjson.loads(body)
    except orjson.JSONDecodeError:  # json reads what orjson refuses: UTF-16 or -32, a BOM, a lone surrogate
        pass
    try:
        if not isinstance(body, str):  # (as json.loads reads bytes: UTF-8, -16 or -32)
            body = body.decode(json.detect_encoding(body), "surrogatepass")
        return _DECODER.decode(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def json_number(value: object) -> float | None:
    """A non-negative JSON number as a float (``inf`` when an integer is too large for one);
    ``None`` for anything else: a negative number, a boolean, a string, null."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float's range
        number = math.inf if value > 0 else -math.inf
    return number if number >= 0 else None  # NaN fails the test too


@dataclass(frozen=True, slots=True)
class JsonPointer:
    """An RFC 6901 pointer: ``""`` is the whole document, ``/a/0/b~1c`` is key ``a``, its
    first item, then key ``b/c``."""

    text: str
    tokens: tuple[str, ...]

    @classmethod
    def parse(cls, text: object) -> JsonPointer:
        """ValueError when ``text`` is not a pointer."""
        if not isinstance(text, str):
            raise ValueError(f"a JSON pointer is a string such as /usage/total_tokens, not {text!r}")
        if text and not text.startswith("/"):
            raise ValueError(f'JSON pointer "{text}" must start with "/" (e.g. /usage/total_tokens)')
        tokens = text.split("/")[1:]
        for token in tokens:
            if re.search(r"~(?![01])", token):
                raise ValueError(f'JSON pointer "{text}": "~" must be written "~0" and "/" as "~1"')
        # "~1" first, then "~0": "~01" is the key "~1", as RFC 6901 section 4 orders it.
        return cls(text, tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens))

    def resolve(self, document: object) -> object:
        """The value the pointer names in ``document``, or ``None`` when it names nothing."""
        value = document
        for token in self.tokens:
            if isinstance(value, dict):
                if token not in value:
                    return None
                value = value[token]
            elif isinstance(value, list):
                if not _INDEX.fullmatch(token) or len(token) > 18 or int(token) >= len(value):
                    return None  # "-" (past the end) names nothing to read
                value = value[int(token)]
            else:
                return None
        return value

    def __str__(self) -> str:
        return self.text
