"""Vendor blocks this replica knows of, per (vendor, partition): its own after a vendor 429
and those other replicas announce; and the marks by which a held request whose reservation
predates a block learns that it must not go out during it."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.clock import Clock
from proxy.limiter.buckets import (
    block_channel_pattern,
    block_seconds,
    partition_of_channel,
    vendor_of_channel,
)
from proxy.limiter.store import BucketStore

_BlockKey = tuple[str, str]  # (vendor, partition)


@dataclass(frozen=True, slots=True)
class BlockMark:
    """What a held request remembers: which block generation of its (vendor, partition)
    it reserved under."""

    generation: int


class Blocks:
    """The blocks of the vendors (and partitions), until when each lasts (local clock)."""

    def __init__(self, clock: Clock, *, limit: int) -> None:
        self.clock = clock
        self.limit = limit
        """Blocks kept before the ones that ended are forgotten."""
        self.until: dict[_BlockKey, float] = {}
        self.generations: dict[_BlockKey, int] = {}
        self._generation = 0  # blocks noted so far: a block's generation is never reused

    def note(self, vendor: str, seconds: float, partition: str = "") -> None:
        """Record a block of ``vendor`` (its ``partition``) for ``seconds`` from now (ours or
        another replica's)."""
        key = (vendor, partition)
        now = self.clock.monotonic()
        until = now + seconds
        if key not in self.until and len(self.until) >= self.limit:
            # Many partitions blocked in turn: forget the blocks that ended (their marks
            # then read "no block since", which is what they would say anyway).
            for old in [k for k, t in self.until.items() if t <= now]:
                del self.until[old]
                self.generations.pop(old, None)
        if until > self.until.get(key, 0.0):
            self.until[key] = until
        self._generation += 1
        self.generations[key] = self._generation

    def mark(self, vendor: str, partition: str = "") -> BlockMark:
        return BlockMark(self.generations.get((vendor, partition), 0))

    def since(self, vendor: str, mark: BlockMark, partition: str = "") -> float:
        """Seconds of block left if a block of (vendor, partition) began after ``mark`` was
        taken, else 0."""
        key = (vendor, partition)
        if self.generations.get(key, 0) == mark.generation:
            return 0.0
        return max(self.until.get(key, 0.0) - self.clock.monotonic(), 0.0)

    def left(self, vendor: str, partition: str = "") -> float:
        """Seconds until the last known block of ``vendor`` (its ``partition``) ends (0 if none)."""
        return max(self.until.get((vendor, partition), 0.0) - self.clock.monotonic(), 0.0)

    def partitions_blocked(self, vendor: str) -> int:
        """Partitions of ``vendor`` other than the default one blocked now (for /status)."""
        now = self.clock.monotonic()
        return sum(1 for (name, part), until in self.until.items() if name == vendor and part and until > now)

    async def watch(self, store: BucketStore, key_prefix: str) -> None:
        """Follow other replicas' blocks, as announced in ``store``, until cancelled."""

        def on_block(channel: str, data: str) -> None:
            seconds = block_seconds(data)
            vendor = vendor_of_channel(channel)
            if vendor is not None:
                self.note(vendor, seconds, partition_of_channel(channel))

        await store.watch(block_channel_pattern(key_prefix), on_block)
