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
from typing import TextIO

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
ENDPOINT = "endpoint"
"""The vendor's endpoint class (SPEC §10), when the request matched one."""
PARTITION = "partition"
"""The first digits of the partition's hash (partitions.py), never the header's value; absent for the default."""


class AccessLog:
    """Where access lines go: a stream (None: nowhere), written in batches. One per
    process, made by whoever owns the process's streams and handed to the Runtime;
    whether a request is logged is its policy's ``access_log`` switch."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def emit(self, record: AccessRecord) -> None:
        if self._stream is None:
            return
        self._lines.append(record.line())
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


class AccessRecord:
    """Filled in along the request path, written once at the end."""

    __slots__ = (
        "detail",
        "duration",
        "endpoint",
        "hold",
        "host",
        "method",
        "outcome",
        "partition",
        "path",
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
        self.hold = 0.0
        self.duration = 0.0
        self.detail: str | None = None
        self.endpoint: str | None = None
        self.partition: str | None = None

    def line(self) -> str:
        fields: dict[str, object] = {
            TIME: round(time.time(), 3),
            METHOD: self.method,
            HOST: self.host,
            PATH: self.path.split("?", 1)[0][:256],
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
        return json.dumps(fields, separators=(",", ":"))
