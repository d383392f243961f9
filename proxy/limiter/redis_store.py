"""redis:// rediss:// redis+cluster://: bucket state shared by every replica.

Each operation is one registered Lua script (EVALSHA; redis-py reloads it on
NOSCRIPT), so a request costs one round trip and the clock is Redis ``TIME``. The
per-request scripts (acquire, release) and the replicas' presence skip redis-py: they go
over one auto-pipelined connection (pipelined.py), or on Redis Cluster one per primary
(cluster_pipelined.py).
Every failure (refused connection, timeout, OOM, READONLY...) surfaces as
StoreUnavailable: the caller then fails closed or open, never half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.limiter.cluster_pipelined import ClusterPipelines, ClusterScript
from proxy.limiter.pipelined import PipelinedConnection, PipelinedScript, PipelineError, Reply
from proxy.limiter.redis_acquire import (
    AcquireShape,
    StraightAcquire,
    acquire_result,
    per_bucket,
    reserve_spec,
    settled,
)
from proxy.limiter.scripts import script
from proxy.limiter.share import share_spec
from proxy.limiter.store import (
    AcquireResult,
    BlockResult,
    BucketSpec,
    LearnResult,
    Leases,
    LeaseSet,
    Lesson,
    Reserve,
    Settled,
    ShareAsk,
    StateGuard,
    StoreUnavailable,
    left_key,
    offers_key,
)
from proxy.tasks import spawn

log = logging.getLogger("quota_proxy.store")

T = TypeVar("T")

_MS = 1000.0

# Store calls in flight per replica; more wait their turn (inside the store timeout).
# redis-py's pools refuse the 101st connection outright (MaxConnectionsError), which
# would surface as a store failure with Redis perfectly healthy.
_MAX_IN_FLIGHT = 64
_SHAPES_MAX = 10_000  # bucket sets whose acquire is kept packed (the limiter keeps as many)


def connect(url: str, timeout: float) -> aioredis.Redis | RedisCluster:
    """A client for ``url``; ``redis+cluster://`` selects Redis Cluster."""
    options: dict[str, Any] = {
        "socket_timeout": max(timeout, 0.001),
        "socket_connect_timeout": max(timeout, 0.001),
        "health_check_interval": 0,
    }
    if url.startswith("redis+cluster://"):
        return RedisCluster.from_url("redis://" + url.removeprefix("redis+cluster://"), **options)
    # A pooled connection may be dead (Redis restarted or failed over while it sat idle):
    # retry once, at once, on a fresh connection; _call's timeout still bounds the whole call.
    # Should a connection break after Redis ran the script, the retry takes a token twice:
    # that errs towards sending less, never more.
    return aioredis.from_url(url, retry=Retry(NoBackoff(), 1), **options)


def close_pubsub(pubsub: aioredis.client.PubSub) -> Awaitable[None]:
    """`pubsub.aclose()`, typed whichever redis-py runs: the floor (6.4) leaves it unannotated
    and newer releases (8.x) annotate it, so a `type: ignore` one needs the other flags as unused."""
    aclose: Callable[[], Awaitable[None]] = pubsub.aclose
    return aclose()


class RedisStore:
    def __init__(self, url: str, timeout: float, *, pipelined: bool = True) -> None:
        """``pipelined=False`` sends acquire, release and presence through redis-py, like every
        other call: the store contract suite runs both paths, and bench/cluster.py compares them."""
        self._timeout = timeout
        self._client = connect(url, timeout)
        self._acquire = self._client.register_script(script("acquire"))
        self._feedback = self._client.register_script(script("feedback"))
        self._peek = self._client.register_script(script("peek"))
        self._probe = self._client.register_script(script("probe"))
        self._presence = self._client.register_script(script("presence"))
        self._refund = self._client.register_script(script("refund"))
        self._release = self._client.register_script(script("release"))
        self._renew = self._client.register_script(script("renew"))
        self._inflight = self._client.register_script(script("inflight"))
        self._leave = self._client.register_script(script("leave"))
        self._in_flight = asyncio.Semaphore(_MAX_IN_FLIGHT)
        self._closed = False
        self._calls = 0  # redis-py commands in flight
        self._idle: asyncio.Event | None = None  # set when the last one ends, while closing
        self._shapes: dict[tuple[int, str | None, tuple[float, float] | None, ShareAsk | None], AcquireShape] = {}
        # The per-request script goes over one auto-pipelined connection (no pool, so no
        # in-flight cap either), on Cluster one per primary, routed by the vendor's slot.
        # The once-a-second announcement rides on the same connections as the requests'
        # scripts, pipelined with whatever is in flight: no connection of its own, and
        # never a round trip any request waits for.
        self._pipe: PipelinedConnection | ClusterPipelines | None = None
        self._acquire_fast: PipelinedScript | ClusterScript | None = None
        self._presence_fast: PipelinedScript | ClusterScript | None = None
        self._release_fast: PipelinedScript | ClusterScript | None = None
        self._refund_fast: PipelinedScript | ClusterScript | None = None  # (a metered call's settlement)
        # (on the requests' connection: a slot left is marked before the refusals after it)
        self._leave_fast: PipelinedScript | ClusterScript | None = None
        if pipelined and url.startswith("redis+cluster://"):
            cluster = ClusterPipelines(url, connect_timeout=max(timeout * 10, 1.0))
            self._pipe = cluster
            self._acquire_fast = ClusterScript(cluster, script("acquire"))
            self._release_fast = ClusterScript(cluster, script("release"))
            self._refund_fast = ClusterScript(cluster, script("refund"))
            self._presence_fast = ClusterScript(cluster, script("presence"))
            self._leave_fast = ClusterScript(cluster, script("leave"))
        elif pipelined:
            pipe = PipelinedConnection(url, connect_timeout=max(timeout * 10, 1.0))
            self._pipe = pipe
            self._acquire_fast = PipelinedScript(pipe, script("acquire"))
            self._release_fast = PipelinedScript(pipe, script("release"))
            self._refund_fast = PipelinedScript(pipe, script("refund"))
            self._presence_fast = PipelinedScript(pipe, script("presence"))
            self._leave_fast = PipelinedScript(pipe, script("leave"))

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        return self._client

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        if self._closed:  # (a task that outlived its proxy: redis-py would open a new connection)
            raise StoreUnavailable("the store is closed")
        self._calls += 1
        try:
            async with asyncio.timeout(self._timeout), self._in_flight:
                return await op()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from exc
        except AttributeError as exc:
            # redis-py's cluster client, under concurrent load while a node's connection is
            # being replaced, raises AttributeError ('NoneType' object has no attribute
            # 'writelines') from inside itself: the store is unavailable, not the proxy broken.
            if not isinstance(self._client, RedisCluster):
                raise
            raise StoreUnavailable(f"redis-py cluster client: {exc}") from exc
        finally:
            self._calls -= 1
            if not self._calls and self._idle is not None:
                self._idle.set()

    def _failure(self, exc: BaseException) -> BaseException:
        """What an exception awaiting a pipelined reply means: the store unavailable (its
        connection's failures, a timeout), or not the store's."""
        return self._fast_failed(exc) if isinstance(exc, (PipelineError, OSError, TimeoutError)) else exc

    def _fast_failed(self, exc: BaseException) -> StoreUnavailable:
        """A pipelined call failed: what to raise (and a stuck connection is dropped)."""
        assert self._pipe is not None
        self._pipe.drop_if_stuck(self._timeout)
        return StoreUnavailable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    async def _call_fast(self, fast: PipelinedScript | ClusterScript, keys: list[str], args: list[float | str]) -> Any:
        assert self._pipe is not None
        try:
            return await fast(keys, args, reply_within=self._timeout)
        except (PipelineError, OSError, TimeoutError) as exc:
            raise self._fast_failed(exc) from exc

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
        sets = leases.sets if leases is not None else ()
        charge: float | str = cost  # acquire.lua's ARGV[1]
        if costs is not None:
            charge = f"{cost!r}|{per_bucket(costs)}"
        shape = self._shape(buckets, queue, guard, sets, reserve, share)
        n = shape.n
        claim = "" if reserve is None or queue is None else reserve.claim
        fast = self._acquire_fast
        if fast is not None:
            # The command's fixed parts were packed once (AcquireShape): only what changes
            # per call is packed here, the bytes being those of the whole command packed.
            packed = shape.packed(charge, max_wait, guard, leases, claim)
            try:
                if isinstance(fast, PipelinedScript) and (sent := fast.send_now(packed, self._timeout)) is not None:
                    out = await sent
                    if isinstance(out, hiredis.ReplyError):
                        out = await fast.reply_error(str(out), packed, self._timeout)
                else:
                    out = await fast.call_packed(shape.keys, packed, reply_within=self._timeout)
            except (PipelineError, OSError, TimeoutError) as exc:
                raise self._fast_failed(exc) from exc
        else:
            args: list[float | str] = [
                charge,
                max_wait * _MS,
                "q" if queue is not None else "",
                "" if guard is None else guard.seen,
                0.0 if guard is None else guard.debt * _MS,
                n,
                "" if leases is None else leases.id,
                0.0 if leases is None else leases.life * _MS,
                claim,
                "" if reserve is None or queue is None else reserve_spec(reserve),
                "" if share is None else share_spec(share),
                "" if share is None else share.member,
                *shape.args,
            ]
            keys = shape.keys
            out = await self._call(lambda: self._acquire(keys=keys, args=args))
        return acquire_result(out, n)

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
    ) -> StraightAcquire | None:
        """(store.BucketStore.straight) None when the acquire does not go over pipelined
        connections (redis-py's clients)."""
        fast = self._acquire_fast
        if fast is None:
            return None
        shape = self._shape(buckets, queue, guard, sets, reserve, share)
        return StraightAcquire(fast, shape, cost, max_wait, guard, self._timeout, self._failure)

    def _shape(
        self,
        buckets: tuple[BucketSpec, ...],
        queue: str | None,
        guard: StateGuard | None,
        sets: tuple[LeaseSet, ...],
        reserve: Reserve | None,
        share: ShareAsk | None = None,
    ) -> AcquireShape:
        """What an acquire of these buckets sends whatever the call (keys, rates, bursts,
        fields, caps, how slots are kept), kept per bucket set: the limiter passes the same
        tuple every time."""
        state = None if guard is None else guard.key
        # (A bucket set's slots are kept under the vendor's horizon, or none for a caller
        # that only claims, and a new vendor after a reload has new buckets.)
        key = (id(buckets), queue, None if reserve is None else (reserve.horizon, reserve.owner), share)
        shape = self._shapes.get(key)
        if (
            shape is not None
            and shape.buckets is buckets
            and shape.state == state
            and (shape.sets is sets or shape.sets == sets)
            and shape.share == share
        ):
            return shape
        if len(self._shapes) >= _SHAPES_MAX:
            self._shapes.clear()
        shape = self._shapes[key] = AcquireShape(
            buckets, queue, state, sets, "" if self._acquire_fast is None else self._acquire_fast.sha, reserve, share
        )
        return shape

    async def release(self, sets: tuple[LeaseSet, ...], lease_ids: tuple[str, ...], channel: str) -> tuple[int, ...]:
        keys = [ls.key for ls in sets]
        args: list[float | str] = [channel, *(ls.cap for ls in sets), *lease_ids]
        if self._release_fast is not None:  # once per request with a cap: pipelined like acquire
            out = await self._call_fast(self._release_fast, keys, args)
        else:
            out = await self._call(lambda: self._release(keys=keys, args=args))
        return tuple(int(x) for x in out)

    def release_then(
        self,
        sets: tuple[LeaseSet, ...],
        lease_ids: tuple[str, ...],
        channel: str,
        then: Callable[[tuple[int, ...] | None, BaseException | None], None],
    ) -> bool:
        fast = self._release_fast
        if fast is None:
            return False
        keys = [ls.key for ls in sets]
        args = [channel, *(ls.cap for ls in sets), *lease_ids]
        again = functools.partial(self.release, sets, lease_ids, channel)
        return self._send_then(fast, keys, args, then, _counts, again, "release-leases")

    def _send_then(
        self,
        fast: PipelinedScript | ClusterScript,
        keys: list[str],
        args: list[Any],
        then: Callable[[Any, BaseException | None], None],
        reply: Callable[[Any], Any],
        again: Callable[[], Coroutine[Any, Any, Any]],
        name: str,
    ) -> bool:
        """A script's call without a coroutine (``release_then``, ``settle_then``): ``then``
        hears ``reply`` of its reply, or why none came; an error reply (NOSCRIPT: Redis
        restarted) sends it ``again`` the coroutine's way, which loads the script."""
        packed = hiredis.pack_command(("EVALSHA", fast.sha, len(keys), *keys, *args))
        waiter = Reply(functools.partial(self._replied, then, reply, again, name))
        if isinstance(fast, PipelinedScript):
            return fast.send_to(packed, waiter, self._timeout)
        return fast.send_to(keys, packed, waiter, self._timeout)

    def _replied(
        self,
        then: Callable[[Any, BaseException | None], None],
        reply: Callable[[Any], Any],
        again: Callable[[], Coroutine[Any, Any, Any]],
        name: str,
        out: Any,
        exc: BaseException | None,
    ) -> None:
        if exc is not None:
            then(None, self._failure(exc))
        elif type(out) is hiredis.ReplyError:
            task: asyncio.Task[Any] = spawn(again(), name=name)
            task.add_done_callback(functools.partial(settled, then))
        else:
            then(reply(out), None)

    async def renew(self, leases: tuple[tuple[LeaseSet, str], ...], life: float) -> int:
        keys = [ls.key for ls, _ in leases]
        args: list[float | str] = [life * _MS, *(lease_id for _, lease_id in leases)]
        return int(await self._call(lambda: self._renew(keys=keys, args=args)))

    async def inflight(self, sets: tuple[LeaseSet, ...]) -> tuple[int, ...]:
        keys = [ls.key for ls in sets]
        out = await self._call(lambda: self._inflight(keys=keys, args=[]))
        return tuple(int(x) for x in out)

    async def block(self, buckets: tuple[BucketSpec, ...], seconds: float, channel: str) -> BlockResult:
        return await self._feedback_call(buckets, "block", seconds, channel)

    async def drain(self, buckets: tuple[BucketSpec, ...]) -> BlockResult:
        return await self._feedback_call(buckets, "drain", 0.0, "")

    async def _feedback_call(
        self, buckets: tuple[BucketSpec, ...], mode: str, seconds: float, channel: str
    ) -> BlockResult:
        keys = [b.key for b in buckets]
        args: list[float | str] = [mode, seconds * _MS, channel]
        for b in buckets:
            args += (b.rate / _MS, b.burst, b.field)
        out = await self._call(lambda: self._feedback(keys=keys, args=args))
        return BlockResult(float(out[0]) / _MS, tuple(float(x) for x in out[1:]))

    async def learn(self, buckets: tuple[BucketSpec, ...], lessons: tuple[Lesson, ...]) -> LearnResult:
        keys = [b.key for b in buckets]
        args: list[float | str] = ["learn", 0.0, ""]
        for b in buckets:
            args += (b.rate / _MS, b.burst, b.field)
        for lesson in lessons:
            if lesson.forget:
                rate: float | str = "-"
            elif lesson.rate is not None and lesson.burst is not None:
                rate = repr(lesson.rate / _MS)
            else:
                rate = ""
            burst = repr(lesson.burst) if lesson.burst is not None and rate not in ("", "-") else ""
            remaining = "" if lesson.remaining is None else repr(lesson.remaining)
            args += (rate, burst, remaining, lesson.window * _MS, lesson.ttl * _MS)
        out = await self._call(lambda: self._feedback(keys=keys, args=args))
        n = len(buckets)
        tail = [float(x) for x in out[1 + n :]]
        return LearnResult(
            levels=tuple(float(x) for x in out[1 : 1 + n]),
            rates=tuple(r * _MS for r in tail[0::3]),
            bursts=tuple(tail[1::3]),
            settling=tuple(x / _MS for x in tail[2::3]),
        )

    async def refund(self, buckets: tuple[BucketSpec, ...], cost: float) -> tuple[float, ...]:
        return await self._refund_as(buckets, cost)

    async def settle(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float = 0.0
    ) -> tuple[float, ...]:
        return await self._refund_as(buckets, _settling(amounts, since))

    def settle_then(
        self, buckets: tuple[BucketSpec, ...], amounts: tuple[float, ...], since: float, then: Settled
    ) -> bool:
        fast = self._refund_fast
        if fast is None:
            return False
        keys, args = _refund_args(buckets, _settling(amounts, since))
        again = functools.partial(self.settle, buckets, amounts, since)
        return self._send_then(fast, keys, args, then, _levels, again, "settle")

    async def _refund_as(self, buckets: tuple[BucketSpec, ...], amount: float | str) -> tuple[float, ...]:
        keys, args = _refund_args(buckets, amount)
        out = await self._call(lambda: self._refund(keys=keys, args=args))
        return tuple(float(x) for x in out)

    async def peek(self, buckets: tuple[BucketSpec, ...]) -> tuple[float, ...]:
        keys = [b.key for b in buckets]
        args: list[float | str] = []
        for b in buckets:
            args += (b.rate / _MS, b.burst, b.field)
        out = await self._call(lambda: self._peek(keys=keys, args=args))
        return tuple(float(x) for x in out)

    async def left(self, kept: str, claims: tuple[str, ...]) -> int:
        keys, args = [kept, left_key(kept), offers_key(kept)], list[float | str](claims)
        if self._leave_fast is not None:
            return int(await self._call_fast(self._leave_fast, keys, args))
        return int(await self._call(lambda: self._leave(keys=keys, args=args)))

    async def announce(self, key: str, member: str, stale: float, leave: bool = False) -> int:
        args: list[float | str] = [member, stale * _MS, "leave" if leave else ""]
        if self._presence_fast is not None:
            return int(await self._call_fast(self._presence_fast, [key], args))
        return int(await self._call(lambda: self._presence(keys=[key], args=args)))

    async def ping(self, probes: tuple[str, ...] = ()) -> None:
        await self._call(self._client.ping)
        for key in probes:
            await self._call(functools.partial(self._probe, keys=[key]))

    async def publish(self, channel: str, data: str) -> None:
        await self._call(functools.partial(self._client.publish, channel, data))

    async def watch(self, pattern: str, on_message: Callable[[str, str], None]) -> None:
        """A pattern subscription of its own; reconnects with backoff until cancelled."""
        backoff = 0.1
        while not self._closed:
            pubsub = self._client.pubsub()
            try:
                await pubsub.psubscribe(pattern)
                backoff = 0.1
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is None or msg.get("type") != "pmessage":
                        continue
                    name, data = _text(msg["channel"]), _text(msg["data"])
                    try:
                        on_message(name, data)
                    except ValueError:
                        log.warning("ignoring a malformed announcement on %s: %r", name, data)
            except (RedisError, OSError) as exc:
                log.debug("watch of %s lost its connection (%s); retrying in %.1fs", pattern, exc, backoff)
            finally:
                # Closed whole even if cancelled again meanwhile (a half-closed subscription
                # leaves its connection open); that cancellation is dropped, and
                # cancel_and_wait repeats it.
                closing = asyncio.ensure_future(close_pubsub(pubsub))
                while not closing.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(closing)
                if not closing.cancelled():
                    closing.exception()  # retrieved: a failed close is only a closed connection
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def close(self) -> None:
        self._closed = True
        if self._pipe is not None:
            self._pipe.close()
        await self._client.aclose()
        if self._calls:
            # A command in flight (a task that outlived its proxy) may reconnect after the
            # close (redis-py retries): once each has ended (within the store's timeout), the
            # connections are closed again, so none is left open for the garbage collector.
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout + 1.0):
                    await self._idle.wait()
            await self._client.aclose()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _settling(amounts: tuple[float, ...], since: float) -> str:
    """refund.lua's ARGV[1] for a settlement: one amount per bucket, and ``since``."""
    tail = f"|{since * _MS:.3f}" if since > 0 else ""
    return "|" + per_bucket(amounts) + tail


def _refund_args(buckets: tuple[BucketSpec, ...], amount: float | str) -> tuple[list[str], list[float | str]]:
    """refund.lua's keys and arguments."""
    args: list[float | str] = [amount]
    for b in buckets:
        args += (b.rate / _MS, b.burst, b.field)
    return [b.key for b in buckets], args


def _counts(out: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in out)


def _levels(out: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in out)
