"""Stores for tests: a memory:// store that fails, hangs or forgets on demand, for limiter
tests on a ManualClock; a real three-node Redis Cluster, for redis+cluster://."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis as sync_redis

from proxy.clock import ManualClock
from proxy.limiter import StoreUnavailable
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.store import AcquireResult, BlockResult, BucketSpec, Leases, LeaseSet, Reserve, ShareAsk, StateGuard
from tests.conftest import RedisServer, free_port


class FlakyStore(MemoryStore):
    """A memory store that counts its calls and can be told to fail, to hang, or to lose
    every key (a Redis restarted without persistence). Several limiters may share one: a
    fleet's store."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls = 0
        self.acquires = 0
        """Acquires that reached the store (and did not fail)."""
        self.fail = False
        self.gate: asyncio.Event | None = None  # set: every call waits for it

    async def _enter(self) -> None:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise StoreUnavailable("ConnectionError: injected")

    def forget(self) -> None:
        """Lose every key, as a Redis restarted without persistence."""
        fresh = MemoryStore(self._clock)
        self._state, self._queues, self._seq = fresh._state, fresh._queues, fresh._seq
        self._leases, self._replicas = fresh._leases, fresh._replicas
        self._learned = fresh._learned  # learned limits live in the state hash: lost with it
        self._kept, self._blocked_at = fresh._kept, fresh._blocked_at

    async def acquire(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None = None,
        guard: StateGuard | None = None,
        leases: Leases | None = None,
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
        costs: tuple[float, ...] | None = None,
    ) -> AcquireResult:
        await self._enter()
        self.acquires += 1
        return await super().acquire(buckets, cost, max_wait, queue, guard, leases, reserve, share, costs)

    def straight(
        self,
        buckets: tuple[BucketSpec, ...],
        cost: float,
        max_wait: float,
        queue: str | None,
        guard: StateGuard,
        sets: tuple[LeaseSet, ...] = (),
        reserve: Reserve | None = None,
        share: ShareAsk | None = None,
    ) -> None:
        return None  # every acquire through ``acquire``, where failures are injected

    async def block(self, buckets: tuple[BucketSpec, ...], seconds: float, channel: str) -> BlockResult:
        await self._enter()
        return await super().block(buckets, seconds, channel)

    async def drain(self, buckets: tuple[BucketSpec, ...]) -> BlockResult:
        await self._enter()
        return await super().drain(buckets)

    async def refund(self, buckets: tuple[BucketSpec, ...], cost: float) -> tuple[float, ...]:
        await self._enter()
        return await super().refund(buckets, cost)

    async def settle(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float = 0.0
    ) -> tuple[float, ...]:
        await self._enter()
        return await super().settle(buckets, amounts, since)

    def settle_then(self, *args: Any) -> bool:
        return False  # every settlement through ``settle``, where failures are injected

    async def announce(self, key: str, member: str, stale: float, leave: bool = False) -> int:
        await self._enter()
        return await super().announce(key, member, stale, leave)


class LocalCluster:
    """A three-node Redis Cluster of the tests' own (no replicas) on free ports, whose
    nodes can be killed, restarted and frozen, and whose slots can be migrated."""

    def __init__(self, binary: str, cli: str, workdirs: list[Path]) -> None:
        self.cli = cli
        self.nodes: list[RedisServer] = []
        self._extra: dict[int, list[str]] = {}
        for workdir in workdirs:
            port = free_port()
            while port > 55535:  # Redis refuses larger ports in cluster mode (the bus is port + 10000)
                port = free_port()
            self.nodes.append(RedisServer(binary, workdir, port=port))

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        for node in self.nodes:
            self._extra[node.port] = [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-port",
                str(free_port()),
            ]
            node.start(extra=self._extra[node.port])
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.wait_ok()

    def wait_ok(self, within: float = 20.0) -> None:
        """Until every node agrees the cluster is up (before a client may route to it)."""
        deadline = time.monotonic() + within
        while not all(_cluster_ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise AssertionError(f"the test cluster did not converge within {within}s")
            time.sleep(0.05)

    def kill(self, node: RedisServer) -> None:
        node.kill()

    def restart(self, node: RedisServer) -> None:
        """Start a killed node again: it rejoins with its slots (nodes.conf), without its keys."""
        node.start(extra=self._extra[node.port])
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                os.kill(node.proc.pid, signal.SIGCONT)
            node.kill()

    def flush(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                with node.client() as c:
                    c.flushall()

    def node_id(self, node: RedisServer) -> str:
        with node.client() as c:
            return _text(c.execute_command("CLUSTER", "MYID"))

    def owner(self, slot: int) -> RedisServer:
        with self.nodes[0].client() as c:
            ranges = c.execute_command("CLUSTER", "SLOTS")
        for start, end, primary, *_ in ranges:
            if int(start) <= slot <= int(end):
                return next(n for n in self.nodes if n.port == int(primary[1]))
        raise AssertionError(f"no node serves slot {slot}")

    def begin_migration(self, slot: int, to: RedisServer, keys: list[str] | None = None) -> None:
        """Mark ``slot`` migrating to ``to`` and move its keys there (or only ``keys``): the
        old owner now answers ASK for keys it no longer has, TRYAGAIN for a call that names
        keys on both sides (resharding, midway)."""
        source = self.owner(slot)
        with to.client() as dst, source.client() as src:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to))
            self.migrate(slot, to, keys)

    def migrate(self, slot: int, to: RedisServer, keys: list[str] | None = None) -> None:
        """Move ``keys`` (default: every key still on the old owner) of a migrating slot."""
        with self.owner(slot).client() as src:  # the old owner, until finish_migration
            moving = keys if keys is not None else src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if moving:
                src.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *moving)

    def finish_migration(self, slot: int, to: RedisServer) -> None:
        """Give ``slot`` to ``to`` on every node: the old owner now answers MOVED."""
        target = self.node_id(to)
        for node in [to, *(n for n in self.nodes if n is not to)]:
            with node.client() as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target)

    def calls(self) -> dict[str, int]:
        """Commands each node has run so far, by name (``INFO commandstats``), those that
        scripts call among them; this probe's own (HELLO, INFO) left out."""
        total: dict[str, int] = {}
        for node in self.nodes:
            with node.client() as c:
                stats = c.info("commandstats")
            for name, fields in stats.items():
                command = name.removeprefix("cmdstat_")
                if command not in ("hello", "info"):
                    total[command] = total.get(command, 0) + int(fields["calls"])
        return total

    def stat(self, node: RedisServer, command: str, field: str = "calls") -> int:
        """``INFO commandstats`` of ``node``: e.g. how often it ran ``command`` (calls), or
        refused it before running it (rejected_calls: MOVED, ASK...)."""
        with node.client() as c:
            stats = c.info("commandstats")
        return int(stats.get(f"cmdstat_{command}", {}).get(field, 0))


def _cluster_ok(node: RedisServer) -> bool:
    if node.proc is None:
        return False
    try:
        with node.client() as c:
            info = _text(c.execute_command("CLUSTER", "INFO"))
    except sync_redis.RedisError:
        return False
    return "cluster_state:ok" in info


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
