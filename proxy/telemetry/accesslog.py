"""One canonical JSON line per request, so a single grep answers "what happened to it".

The path is logged without its query string: queries carry API keys too often.

Lines are written in batches (at most ``FLUSH_INTERVAL`` late, and on shutdown):
one write per request cost as much CPU as the limiter itself. They bypass the
logging module for the same reason; the process's other logs go through it.
"""

from __future__ import annotations

import asyncio
import json
import time
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING, NamedTuple, TextIO

if TYPE_CHECKING:
    from proxy.policy.model import Share

FLUSH_INTERVAL = 0.1  # seconds a line may wait in the buffer
_MAX_BUFFERED = 256  # lines; a full buffer is written at once

# Field names, kept stable for log pipelines.
TIME = "ts"
METHOD = "method"
HOST = "host"
PATH = "path"
VENDOR = "vendor"
TENANT = "tenant"
OUTCOME = "outcome"
STATUS = "status"
UPSTREAM_STATUS = "upstream_status"
HOLD_MS = "hold_ms"
DURATION_MS = "duration_ms"
DETAIL = "detail"
METERS = "meters"
ENDPOINT = "endpoint"
"""The vendor's endpoint class (SPEC §10), when the request matched one."""
PARTITION = "partition"
"""The first digits of the partition's hash (partitions.py), never the header's value; absent for the default."""


class AccessLog:
    """Where access lines go: a stream (None: nowhere), written in batches. One per
    process, made by whoever owns the process's streams and handed to the Runtime;
    whether a request is logged is its policy's ``access_log`` switch."""

    def __init__(self, stream: TextIO | None = None, worker: int | None = None) -> None:
        self._stream = stream
        # A worker of ``run --workers N`` ends each line with its index (the lines of all
        # the workers reach the supervisor's stderr together).
        self._end = "}" if worker is None else f',"worker":{int(worker)}}}'
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def writes(self) -> bool:
        """Do lines go anywhere?"""
        return self._stream is not None

    def emit(self, record: AccessRecord) -> None:
        if self._stream is not None:
            self.add(record.line()[:-1])

    def add(self, opened: str) -> None:
        """One line, as ``AccessRecord.line`` writes it but for its closing brace (this log
        ends it: a worker of ``run --workers N`` adds its index first)."""
        self._lines.append(opened + self._end)
        if len(self._lines) >= _MAX_BUFFERED:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(FLUSH_INTERVAL, self.flush)
            except RuntimeError:  # no loop: write at once
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        if self._stream is not None:
            try:
                self._stream.write("\n".join(lines) + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # a closed or broken stream must not break requests
                pass


_NOT_HELD = 0.0
"""``hold`` of a request never held: this very object, so its text is known ("0.0")."""


class AccessRecord:
    """Filled in along the request path, written once at the end."""

    __slots__ = (
        "detail",
        "duration",
        "endpoint",
        "hold",
        "host",
        "metered",
        "method",
        "outcome",
        "partition",
        "path",
        "shared",
        "status",
        "tenant",
        "upstream_status",
        "vendor",
    )

    def __init__(self, method: str, host: str, path: str) -> None:
        self.method = method
        self.host = host
        self.path = path
        self.vendor: str | None = None
        self.tenant: str | None = None
        self.outcome = "error"
        self.status: int | None = None
        self.upstream_status: int | None = None
        self.hold = _NOT_HELD
        self.duration = 0.0
        self.detail: str | None = None
        self.endpoint: str | None = None
        self.partition: str | None = None
        self.shared: tuple[Share, int, float] | None = None
        """Under ``share:``: the vendor's share, the request's class and cost (counted by
        class when it ends, not logged)."""
        self.metered: tuple[tuple[str, float, float | None], ...] = ()
        """Per meter of its vendor (SPEC §14): its name, the request's estimate and what the
        answer said it cost (None: not said, or not yet)."""

    def line(self) -> str:
        """The record as one JSON line: exactly what ``json.dumps`` makes of ``fields``
        (same keys, order, escaping and number text), but built directly: json.dumps
        took most of a line's CPU. A value whose text only json can promise (not a
        str, an int, or an everyday float) sends the line through json."""
        now = time.time()
        try:
            return self._direct(now)
        except (_Unusual, TypeError):  # TypeError: the escaping of a non-str
            return json.dumps(self.fields(now), separators=(",", ":"))

    def fields(self, now: float) -> dict[str, object]:
        fields: dict[str, object] = {
            TIME: round(now, 3),
            METHOD: self.method,
            HOST: self.host,
            PATH: logged_path(self.path),
            VENDOR: self.vendor,
            TENANT: self.tenant,
            OUTCOME: self.outcome,
            STATUS: self.status,
            UPSTREAM_STATUS: self.upstream_status,
            HOLD_MS: round(self.hold * 1000, 1),
            DURATION_MS: round(self.duration * 1000, 2),
        }
        if self.endpoint is not None:
            fields[ENDPOINT] = self.endpoint
        if self.partition is not None:
            fields[PARTITION] = self.partition
        if self.detail:
            fields[DETAIL] = self.detail
        if self.metered:
            fields[METERS] = meters_field(self.metered)
        return fields

    def _direct(self, now: float) -> str:
        if self.metered:
            raise _Unusual  # (rare enough for json.dumps)
        vendor, tenant, hold = self.vendor, self.tenant, self.hold
        text = (
            f'{{"ts":{_rounded(now, ".3f", 1e9, 1e11)},"method":{_quoted(self.method)},'
            f'"host":{_quoted(self.host)},"path":{_quoted(logged_path(self.path))},'
            f'"vendor":{"null" if vendor is None else _quoted(vendor)},'
            f'"tenant":{"null" if tenant is None else _quoted(tenant)},'
            f'"outcome":{_quoted(self.outcome)},"status":{_integer(self.status)},'
            f'"upstream_status":{_integer(self.upstream_status)},'
            f'"hold_ms":{"0.0" if hold is _NOT_HELD else _rounded(hold * 1000, ".1f", 0.0, 1e9)},'
            f'"duration_ms":{_rounded(self.duration * 1000, ".2f", 0.0, 1e9)}'
        )
        text += line_end(self.endpoint, self.partition)
        if self.detail:
            text += f',"detail":{_quoted(self.detail)}'
        return text + "}"


_quoted = encode_basestring_ascii
"""json.dumps's own string escaping (ensure_ascii); TypeError for anything but a str."""

_PATH_MAX = 256


def logged_path(path: str) -> str:
    """What the log says of a request's path: without its query (queries carry API keys
    too often), at most 256 characters."""
    return path.split("?", 1)[0][:_PATH_MAX]


def line_end(endpoint: str | None, partition: str | None) -> str:
    """A line's fields after ``duration_ms``, ``detail`` aside."""
    text = "" if endpoint is None else f',"endpoint":{_quoted(endpoint)}'
    return text if partition is None else f'{text},"partition":{_quoted(partition)}'


class ForwardedLine(NamedTuple):
    """The constant parts of the line of a request forwarded without a hold or a detail, of
    one method, host, vendor, tenant, endpoint class and partition (the straight path's:
    routes.py), in ``AccessRecord.line``'s order and text."""

    head: str
    mid: str
    end: str

    @classmethod
    def of(
        cls, method: str, host: str, vendor: str, tenant: str, endpoint: str | None, partition: str | None
    ) -> ForwardedLine:
        return cls(
            f',"method":{_quoted(method)},"host":{_quoted(host)},"path":',
            f',"vendor":{_quoted(vendor)},"tenant":{_quoted(tenant)},"outcome":"forwarded","status":',
            line_end(endpoint, partition),
        )

    def line(
        self, path: str, status: int, duration: float, metered: tuple[tuple[str, float, float | None], ...] = ()
    ) -> str:
        """The line but for its closing brace (``AccessLog.add``); ``path``: ``logged_path``'s,
        quoted (``quoted_path``); ``metered``: ``AccessRecord.metered``."""
        ts = round(time.time(), 3)
        ms = round(duration * 1000, 2)
        # json's own text for each value (float repr, the quoting).
        text = (
            f'{{"ts":{ts!r}{self.head}{path}{self.mid}{status},"upstream_status":{status}'
            f',"hold_ms":0.0,"duration_ms":{ms!r}{self.end}'
        )
        if metered:
            text += f',"{METERS}":{json.dumps(meters_field(metered), separators=(",", ":"))}'
        return text


def meters_field(metered: tuple[tuple[str, float, float | None], ...]) -> dict[str, dict[str, float | None]]:
    """What a line says of a metered request (SPEC §14): per meter, its estimate and what the
    answer said it cost."""
    return {name: {"estimated": e, "settled": s} for name, e, s in metered}


def quoted_path(path: str) -> str:
    """``logged_path`` as JSON text."""
    return _quoted(logged_path(path))


class _Unusual(Exception):
    """A value whose JSON text only ``json.dumps`` should decide."""


def _integer(value: object) -> str:
    if value is None:
        return "null"
    if type(value) is not int:  # json prints a bool true, and an IntEnum's repr may differ
        raise _Unusual
    return int.__repr__(value)


def _rounded(value: object, places: str, low: float, high: float) -> str:
    """``repr(round(value, n))`` as json prints it, from the correctly rounded n-place
    decimal that ``round`` itself computes. Between ``low`` and ``high`` the nearest
    float prints as that decimal without its trailing zeros (no exponent, decimal
    steps far wider than the float's); outside, NaN, or not a float: json decides."""
    if type(value) is not float or not low <= value < high:
        raise _Unusual
    text = format(value, places).rstrip("0")
    return text + "0" if text[-1] == "." else text
