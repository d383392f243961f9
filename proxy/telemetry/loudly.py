"""Warnings that must be loud but cannot flood the log: at most one line per subject
per interval, the next line saying how many were held back meanwhile."""

from __future__ import annotations

import logging

from proxy.clock import Clock


class Loudly:
    """Rate-limited warnings on ``log``, timed by ``clock``."""

    def __init__(self, log: logging.Logger, clock: Clock) -> None:
        self._log = log
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held_back: dict[str, int] = {}

    def warn(self, subject: str, interval: float, message: str, *args: object) -> None:
        """Log ``message % args`` unless ``subject`` was warned about less than ``interval``
        seconds ago; a line after held-back ones says how many there were."""
        now = self._clock.monotonic()
        last = self._last.get(subject)
        if last is not None and now - last < interval:
            self._held_back[subject] = self._held_back.get(subject, 0) + 1
            return
        self._last[subject] = now
        held_back = self._held_back.pop(subject, 0)
        if held_back:
            message += f" (and {held_back} more like it since the last such line)"
        self._log.warning(message, *args)
