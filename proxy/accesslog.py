"""One canonical JSON line per request, so a single grep answers "what happened to it".

The path is logged without its query string: queries carry API keys too often.
"""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("quota_proxy.access")

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


def enable(on: bool) -> None:
    """The policy's ``access_log`` switch."""
    log.disabled = not on


class AccessRecord:
    """Filled in along the request path, written once at the end."""

    __slots__ = ("detail", "duration", "hold", "host", "method", "outcome", "path", "status", "tenant",
                 "upstream_status", "vendor")

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
        if self.detail:
            fields[DETAIL] = self.detail
        return json.dumps(fields, separators=(",", ":"))

    def emit(self) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info(self.line())
