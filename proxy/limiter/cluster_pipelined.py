"""redis+cluster://: the hot path's scripts on one auto-pipelined connection per primary.

Every key of one vendor carries the hash tag ``{vendor}`` (buckets.py), so one script
call touches one slot and goes to the primary that owns it, as one EVALSHA on that
node's PipelinedConnection: the same single round trip as redis://, where redis-py's
cluster client checks a connection out and back in for every call.

The slot map comes from CLUSTER SLOTS, and is learned again in the background after a
redirection, a lost connection or a missing reply (a failover or a resharding may be
under way); no call waits for that unless its slot has no known owner. A reply that
says the script did not run on this node (MOVED, ASK, TRYAGAIN, READONLY, NOSCRIPT) is
followed by sending it again where it belongs; a lost connection or a missing reply is
never sent again (the script may have taken its tokens), and surfaces to the caller as
the store being unavailable.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from typing import Any
from urllib.parse import quote

import hiredis
from redis.asyncio.connection import parse_url
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from proxy.limiter.pipelined import PipelinedConnection, PipelineError, Replied, ReplyError

Address = tuple[str, int]

# Redirections followed for one call: a slot moves once per resharding step, so more
# than a few in a row means the cluster is still converging: the store is unavailable.
_MAX_REDIRECTS = 5
_TRYAGAIN_PAUSE = 0.005  # between tries of a call whose keys are being migrated, until its deadline
# Background refreshes at most this often: errors under load are no reason to ask the
# cluster for its map a thousand times a second.
_RELEARN_EVERY = 0.5
_KEY_SLOTS_MAX = 10_000  # keys whose slot is remembered (a slot never changes for a key)


class ClusterPipelines:
    """One PipelinedConnection per primary of the cluster ``url`` names, routed by slot."""

    def __init__(self, url: str, connect_timeout: float) -> None:
        opts = parse_url("redis://" + url.removeprefix("redis+cluster://"))
        self._connect_timeout = connect_timeout
        user, password = opts.get("username"), opts.get("password")
        self._credentials = ""
        if password is not None:
            self._credentials = f"{quote(user or '', safe='')}:{quote(password, safe='')}@"
        self._seeds: list[Address] = [(opts.get("host", "localhost"), int(opts.get("port", 6379)))]
        self._slots: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        self._conns: dict[Address, PipelinedConnection] = {}
        self._sources: list[str] = []
        self._refreshing: asyncio.Future[None] | None = None
        self._relearn_after = 0.0
        self._key_slots: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the calls run on, remembered: asyncio.get_running_loop() makes a getpid()
        system call on Python 3.11, and this is asked on every request."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def preload(self, source: str) -> None:
        """Load a script on every node's connection before its first EVALSHA."""
        self._sources.append(source)
        for conn in self._conns.values():
            conn.preload(source)

    def _conn(self, addr: Address) -> PipelinedConnection:
        conn = self._conns.get(addr)
        if conn is None:
            host, port = addr
            conn = PipelinedConnection(f"redis://{self._credentials}{host}:{port}", self._connect_timeout)
            for source in self._sources:
                conn.preload(source)
            self._conns[addr] = conn
        return conn

    def _start_refresh(self, within: float) -> asyncio.Future[None]:
        """Reload the slot map; one query at a time, shared by every caller that needs it."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._load_slots(within))
            self._refreshing.add_done_callback(self._settled)
        return self._refreshing

    def _settled(self, fut: asyncio.Future[None]) -> None:
        if self._refreshing is fut:
            self._refreshing = None
        if not fut.cancelled():
            fut.exception()  # a failed refresh leaves the map as it was: a later error tries again

    def _relearn(self) -> None:
        """Learn the map again in the background; callers go on with the one they have."""
        now = self._running_loop().time()
        if now >= self._relearn_after:
            self._relearn_after = now + _RELEARN_EVERY
            self._start_refresh(self._connect_timeout)

    async def _learn(self, within: float) -> None:
        """Wait (at most ``within`` seconds) for the map to be learned again."""
        await asyncio.wait_for(asyncio.shield(self._start_refresh(within)), within)

    async def _load_slots(self, within: float) -> None:
        # Ask every node known at once and take the first answer: a dead or frozen node
        # then costs nothing as long as one other answers.
        known = list(dict.fromkeys([*(a for a in self._slots if a is not None), *self._seeds]))
        asks = [asyncio.ensure_future(self._slots_from(addr, within)) for addr in known]
        error: BaseException | None = None
        try:
            for done in asyncio.as_completed(asks):
                try:
                    slots = await done
                except (PipelineError, OSError, TimeoutError) as exc:
                    error = exc
                    continue
                # A node that no longer serves a slot keeps its connection: calls still
                # on it get MOVED and follow, where closing it would fail them.
                self._slots = slots
                return
        finally:
            for ask in asks:
                ask.cancel()
        assert error is not None
        raise error

    async def _slots_from(self, addr: Address, within: float) -> list[Address | None]:
        reply = await self._conn(addr).execute("CLUSTER", "SLOTS", reply_within=within)
        slots: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for start, end, primary, *_replicas in reply:
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            if host == "?":  # the node does not know its endpoint yet
                continue
            owner = (host or addr[0], int(primary[1]))  # "" means: where you asked
            slots[int(start) : int(end) + 1] = [owner] * (int(end) - int(start) + 1)
        return slots

    async def execute(self, keys: list[str], *command: Any, reply_within: float, source: str = "") -> Any:
        """``command`` on the primary that owns ``keys`` (one slot); ``source`` is the
        script to load on NOSCRIPT. TimeoutError when no reply comes ``reply_within``
        seconds after the call."""
        return await self.execute_packed(keys, hiredis.pack_command(command), reply_within=reply_within, source=source)

    async def execute_packed(self, keys: list[str], packed: bytes, *, reply_within: float, source: str = "") -> Any:
        """``execute`` of a command already packed (RESP)."""
        loop = self._running_loop()
        deadline = loop.time() + reply_within
        slot = self._slot_of(keys[0]) if keys else 0
        target: Address | None = None  # where a redirection said to go, whatever the map says
        asking = False
        redirects = 0
        refused: ReplyError | None = None  # the last answer, when it was "try again"
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise refused or TimeoutError("no reply from the Redis Cluster within the store timeout")
            addr = target or self._slots[slot]
            if addr is None:  # the first call, or a slot nobody served last time we asked
                await self._learn(left)
                left = deadline - loop.time()
                addr = self._slots[slot]
                if addr is None:
                    raise PipelineError(f"no node of the cluster serves slot {slot}")
            conn = self._conn(addr)
            try:
                return await conn.execute_packed(packed, reply_within=left, asking=asking)
            except ReplyError as exc:
                kind, _, rest = str(exc).partition(" ")
                if kind == "NOSCRIPT" and source:
                    await conn.execute("SCRIPT", "LOAD", source, reply_within=left)
                    continue
                if kind == "TRYAGAIN":  # some of the keys have gone, some not yet: soon all will
                    refused = exc
                    await asyncio.sleep(min(_TRYAGAIN_PAUSE, left))
                    continue
                redirects += 1
                if redirects > _MAX_REDIRECTS:
                    raise
                target, asking = None, False
                if kind == "MOVED":  # the slot has a new owner: go there, and relearn the map
                    self._slots[slot] = target = _address(rest)
                    self._relearn()
                elif kind == "ASK":  # the slot is migrating and these keys have gone already
                    target, asking = _address(rest), True
                elif kind == "READONLY":  # a primary turned replica (failover): no write ran
                    await self._learn(left)
                else:
                    raise
            except (PipelineError, OSError, TimeoutError):
                # The script may have run: never sent again. If a node failed over or
                # moved, the map knows before long.
                self._relearn()
                raise

    def moved(self, keys: list[str], where: str) -> None:
        """A MOVED answer to a call of ``keys`` (``<slot> <host>:<port>``): their slot's owner
        is that node now; the map is learnt again in the background."""
        self._slots[self._slot_of(keys[0]) if keys else 0] = _address(where)
        self._relearn()

    def open_protocol_for(self, keys: list[str]) -> Any:
        """The open connection to the primary that owns ``keys`` (one slot) as the map says,
        else None (the map not learnt yet, the connection not open: ``execute_packed`` sees to it)."""
        addr = self._slots[self._slot_of(keys[0]) if keys else 0]
        conn = None if addr is None else self._conns.get(addr)
        return None if conn is None else conn.open_protocol()

    def _slot_of(self, key: str) -> int:
        """The key's slot; remembered, as the hot path's keys come again and again."""
        slot = self._key_slots.get(key)
        if slot is None:
            if len(self._key_slots) >= _KEY_SLOTS_MAX:
                self._key_slots.clear()
            slot = self._key_slots[key] = key_slot(key.encode())
        return slot

    def drop_if_stuck(self, after: float) -> None:
        """See PipelinedConnection.drop_if_stuck; a dropped node is looked up again."""
        for conn in self._conns.values():
            conn.drop_if_stuck(after)

    def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


_NOT_RUN = frozenset({"MOVED", "ASK", "TRYAGAIN", "READONLY", "NOSCRIPT"})
"""Error replies that say a command did not run on the node that answered."""


def _address(text: str) -> Address:
    """``<slot> <host>:<port>`` of a MOVED or ASK reply."""
    where = text.split()[-1]
    host, _, port = where.rpartition(":")
    return host, int(port)


class ClusterScript:
    """EVALSHA routed to the node that owns the keys' slot; loads the script on NOSCRIPT."""

    def __init__(self, cluster: ClusterPipelines, source: str) -> None:
        self._cluster = cluster
        self._source = source
        cluster.preload(source)
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, keys: list[str], args: list[Any], reply_within: float | None = None) -> Awaitable[Any]:
        packed = hiredis.pack_command(("EVALSHA", self.sha, len(keys), *keys, *args))
        return self.call_packed(keys, packed, reply_within)

    def send_to(self, keys: list[str], packed: bytes, waiter: Replied, reply_within: float) -> bool:
        """The EVALSHA ``packed`` written on the connection of the primary the map says owns
        ``keys``, its reply to ``waiter`` (the straight path's, lane.py); False when that
        connection is not open (nothing sent). A reply that says it did not run there is
        ``reply_error``'s."""
        proto = self._cluster.open_protocol_for(keys)
        if proto is None:
            return False
        proto.send_to(packed, waiter, reply_within)
        return True

    async def reply_error(self, error: str, keys: list[str], packed: bytes, reply_within: float) -> Any:
        """What an error reply to ``send_to`` leads to: one that says the script did not run
        on that node (a redirection, NOSCRIPT, TRYAGAIN, READONLY) sends it again where it
        belongs (``call_packed``, which follows redirections); any other is raised (ReplyError)."""
        kind, _, rest = error.partition(" ")
        if kind not in _NOT_RUN:
            raise ReplyError(error)
        if kind == "MOVED":  # the slot has a new owner: the map says so before the call goes there
            self._cluster.moved(keys, rest)
        return await self.call_packed(keys, packed, reply_within)

    def call_packed(self, keys: list[str], packed: bytes, reply_within: float | None = None) -> Awaitable[Any]:
        """The EVALSHA ``packed`` (RESP, with this script's sha and ``keys``)."""
        # The caller awaits execute's coroutine itself: one coroutine fewer per acquire.
        return self._cluster.execute_packed(
            keys,
            packed,
            reply_within=reply_within if reply_within is not None else 60.0,
            source=self._source,
        )
