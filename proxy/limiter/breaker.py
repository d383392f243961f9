"""A circuit breaker around the store, so a dead Redis is not hammered by every request.

closed: calls go through; ``failures`` consecutive failures open it.
open: calls are refused at once for ``cooloff`` seconds.
half-open: one probe call goes through; success closes, failure re-opens.
"""

from __future__ import annotations

import logging
from typing import Literal

from proxy.clock import Clock

log = logging.getLogger("quota_proxy.store")

State = Literal["closed", "open", "half-open"]


class Breaker:
    def __init__(self, clock: Clock, failures: int, cooloff: float) -> None:
        self._clock = clock
        self._threshold = failures
        self.cooloff = cooloff
        self._failures = 0
        self._opened_at = 0.0
        self._state: State = "closed"
        self._probing = False

    @property
    def state(self) -> State:
        if self._state == "open" and self._clock.monotonic() - self._opened_at >= self.cooloff:
            return "half-open"
        return self._state

    def retry_after(self) -> float:
        """Seconds a request deferred for a store failure should wait: the cool-off.

        Never less, even when the open breaker is about to probe: the probe may fail
        and re-open it for a whole cool-off."""
        return self.cooloff

    def allow(self) -> bool:
        """May a call go to the store now? In half-open, only the single probe may."""
        if self._state == "closed":
            return True
        state = self.state
        if state == "closed":
            return True
        if state == "half-open" and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> None:
        if self._state == "closed" and not self._failures and not self._probing:
            return  # nothing to reset: the usual answer costs nothing
        if self._state != "closed":
            log.warning("store recovered: circuit breaker closed")
        self._failures = 0
        self._probing = False
        self._state = "closed"

    def failure(self) -> None:
        self._failures += 1
        self._probing = False
        if self._state != "closed" or self._failures >= self._threshold:
            if self._state == "closed":
                log.error(
                    "store failing: circuit breaker opened after %d consecutive failures; probing every %.1fs",
                    self._failures,
                    self.cooloff,
                )
            self._state = "open"
            self._opened_at = self._clock.monotonic()

    def release(self) -> None:
        """A permitted call ended without a verdict (cancelled): let another probe try."""
        self._probing = False
