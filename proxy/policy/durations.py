"""Durations in the policy: one parser and one error message for every field.

A duration is a non-negative number of seconds (``2``, ``0.25``) or a string
with a unit: ``250ms``, ``1s``, ``1.5s``, ``1m``, ``1h``, ``1d``. A bare
numeric string (``"2"``) means seconds, like the number.
"""

from __future__ import annotations

import json
import math
import re

_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(?P<number>\d+(?:\.\d+)?|\.\d+)(?P<unit>ms|s|m|h|d)?")


def parse_duration(value: object) -> float:
    """Seconds as a float; ValueError (``"1x" is not a duration``) for anything else."""
    # bool is an int subclass; `per: true` is a typo, not one second.
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.fullmatch(value.strip())):
        seconds = float(match["number"]) * _UNITS[match["unit"] or "s"]
    else:
        raise ValueError(f"{show(value)} is not a duration")
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"{show(value)} is not a duration")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact unit form, e.g. ``500ms``, ``30s``, ``1m``, ``90s``; ``0s`` for zero."""
    if seconds == 0:
        return "0s"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    millis = round(seconds * 1000, 6)  # 0.07 * 1000 is 70.00000000000001
    return f"{int(millis)}ms" if millis.is_integer() else f"{seconds!r}s"


def show(value: object) -> str:
    """A value as an operator wrote it in YAML, for messages: ``"1x"``, ``12``, ``null``, ``true``."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
