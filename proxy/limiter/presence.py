"""Who is alive: each replica announces itself in the store, and remembers how many it saw.

With ``store.on_failure: local`` a replica that loses the store enforces its share of
every limit in-process (degraded.py): the limit divided by the replicas seen alive in
the store just before it failed. The store keeps the replica set (presence.lua); this
module keeps the counts it answered.

The share must never be too large, so the count a replica goes by is the largest
answered over the last ``stale + every`` seconds of answers, not the latest one: a
store that restarted empty re-learns the fleet one announcement at a time, and a
failure in that second must not find a replica believing it is alone. A fleet that
shrank is believed a few seconds later. The window is anchored at the last answer,
not at now: an outage does not age the count it needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from collections import deque

from proxy.clock import Clock
from proxy.limiter.store import BucketStore, StoreUnavailable

log = logging.getLogger("quota_proxy.store")

EVERY = 1.0
"""Seconds between announcements."""
STALE = 5.0
"""Seconds after which a replica that has not announced itself no longer counts."""


def replica_id() -> str:
    """Unique per process, readable in ``ZRANGE``: host, pid and a random tail."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Presence:
    def __init__(self, clock: Clock, *, every: float = EVERY, stale: float = STALE) -> None:
        self.clock = clock
        self.every = every
        self.stale = stale
        self.id = replica_id()
        self._counts: deque[tuple[float, int]] = deque()  # (when, replicas alive), local clock
        self.last_seen: float | None = None
        """When (local clock) the store last answered an announcement; None before any."""

    def record(self, count: int) -> None:
        now = self.clock.monotonic()
        self.last_seen = now
        self._counts.append((now, count))
        while self._counts and self._counts[0][0] < now - self.stale - self.every:
            self._counts.popleft()

    def replicas(self) -> int:
        """Replicas alive as the store last said (the largest count of its recent answers);
        0 before the store ever answered."""
        return max((count for _, count in self._counts), default=0)

    async def run(self, store: BucketStore, key: str) -> None:
        """Announce this replica every ``every`` seconds until cancelled. A store that
        cannot answer leaves the counts as they were: the count from before a failure is
        the one a failure needs."""
        while True:
            try:
                self.record(await store.announce(key, self.id, self.stale))
            except StoreUnavailable as exc:
                log.debug("could not announce this replica (%s)", exc)
            await self.clock.sleep(self.every)

    async def leave(self, store: BucketStore, key: str) -> None:
        """Best effort at shutdown: the others stop counting this replica at once."""
        with contextlib.suppress(StoreUnavailable):
            await store.announce(key, self.id, self.stale, leave=True)
