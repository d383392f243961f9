"""RESP encoding for the hot path, byte for byte what ``hiredis.pack_command`` writes.

hiredis spends ~8 µs packing an acquire's ~25 arguments, most of it formatting floats
(rates, bursts) that are the same in every call of a bucket set. The acquire's command
is therefore packed in parts (redis_store.py): what never changes for a bucket set once,
the few arguments that do per call with ``bulk``, which remembers the floats it saw
(costs, waits, debts: a handful of values).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import hiredis

_FLOATS_MAX = 4096  # distinct floats remembered; values come from the policy, a flood only clears it
_floats: dict[float, bytes] = {}


def _encoded(text: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(text), text)


_ZERO = _encoded(b"0.0")
_NEGATIVE_ZERO = _encoded(b"-0.0")


def bulk(value: str | int | float) -> bytes:
    """One argument as a RESP bulk string."""
    if type(value) is float:
        if value == 0.0:  # 0.0 == -0.0 as dict keys, not as text
            return _ZERO if math.copysign(1.0, value) > 0 else _NEGATIVE_ZERO
        out = _floats.get(value)
        if out is None:
            out = _encoded(repr(value).encode())
            if value == value:  # NaN never finds itself: never remembered
                if len(_floats) >= _FLOATS_MAX:
                    _floats.clear()
                _floats[value] = out
        return out
    if type(value) is str:
        return _encoded(value.encode())
    if type(value) is int:
        return _encoded(b"%d" % value)
    return bulks((value,))  # anything else (a bool...): as hiredis has it


def bulks(args: Sequence[str | int | float]) -> bytes:
    """Arguments as consecutive bulk strings (hiredis), without the array's header."""
    if not args:
        return b""
    packed: bytes = hiredis.pack_command(tuple(args))  # type: ignore[arg-type]
    return packed[packed.index(b"\r\n") + 2 :]


def header(count: int) -> bytes:
    """The array header of a command of ``count`` arguments."""
    return b"*%d\r\n" % count
