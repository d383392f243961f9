"""acquire.lua's command as the Redis store sends it, and its reply: the keys and arguments
of a bucket set packed once (``AcquireShape``), per call only what changes; the reply
decoded into an ``AcquireResult`` (``acquire_result``: nothing outside this module reads
the Lua reply); and the straight path's call (``StraightAcquire``: store.StraightCall),
its reply decoded in the callback that reads it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import hiredis

from proxy.limiter.cluster_pipelined import ClusterScript
from proxy.limiter.pipelined import PipelinedScript, PipelineError
from proxy.limiter.resp import bulk, bulks, header
from proxy.limiter.share import share_spec
from proxy.limiter.store import (
    AcquireResult,
    Answered,
    BucketSpec,
    Leases,
    LeaseSet,
    Reserve,
    ShareAsk,
    StateGuard,
    StoreUnavailable,
)
from proxy.tasks import spawn

_MS = 1000.0
_tuple_new = tuple.__new__
_AROUND_MAX = 64  # (cost, max_wait, debt) triples packed per bucket set
_EMPTY = bulk("")
_ReplyError = hiredis.ReplyError
_ZERO = bulk(0.0)


class AcquireShape:
    """The parts of acquire.lua's keys and arguments that one bucket set (with its queue,
    state and lease sets) sends in every call; ``head`` and ``tail`` as RESP, the
    arguments between them (cost, max_wait...) packed per call."""

    __slots__ = (
        "_around_lease",
        "_around_seen",
        "args",
        "buckets",
        "count",
        "head",
        "keys",
        "n",
        "queued",
        "reserving",
        "sets",
        "share",
        "sharing",
        "state",
        "tail",
    )

    def __init__(
        self,
        buckets: tuple[BucketSpec, ...],
        queue: str | None,
        state: str | None,
        sets: tuple[LeaseSet, ...],
        sha: str,
        reserve: Reserve | None,
        share: ShareAsk | None = None,
    ) -> None:
        self.buckets, self.state, self.sets, self.share = buckets, state, sets, share
        keys = [b.key for b in buckets] + [ls.key for ls in sets]
        if queue is not None:
            keys.append(queue)
            if reserve is not None:
                keys += (reserve.key, reserve.left, reserve.shifts, reserve.offers)
        if share is not None:
            keys += share.keys
        if state is not None:
            keys.append(state)
        self.keys = keys
        args: list[float | str] = []
        for b in buckets:
            args += (b.rate / _MS, b.burst, b.field)
        args += [ls.cap for ls in sets]
        self.args = args
        self.n = len(buckets)
        # EVALSHA sha numkeys keys... | cost max_wait q seen debt n lease_id life claim reserve share member
        # | args...
        self.head = header(3 + len(keys) + 12 + len(args)) + bulks(("EVALSHA", sha, len(keys), *keys))
        self.queued = bulk("q" if queue is not None else "")
        self.reserving = _EMPTY if queue is None or reserve is None else bulk(reserve_spec(reserve))
        self.sharing = _EMPTY + _EMPTY if share is None else bulks((share_spec(share), share.member))
        """acquire.lua's ARGV[11] and ARGV[12] (RESP)."""
        self.count = bulk(self.n)
        self.tail = bulks(args)
        # Per (cost, max_wait, debt), for a call with a state guard, no leases and no claim
        # (the usual): the whole command but the guard's ``seen``, before and after it.
        self._around_seen: dict[tuple[float, float, float], tuple[bytes, bytes]] = {}
        self._around_lease: dict[tuple[float, float, float, float], tuple[bytes, bytes, bytes]] = {}

    def around_seen(self, cost: float, max_wait: float, debt: float) -> tuple[bytes, bytes]:
        """The command of a call with a state guard, no leases and no claim, packed but for
        the guard's ``seen`` (a counter, new in every call), which goes between the two."""
        key = (cost, max_wait, debt)
        parts = self._around_seen.get(key)
        if parts is None:
            if len(self._around_seen) >= _AROUND_MAX:  # max_wait comes from a request header too
                self._around_seen.clear()
            before = b"".join((self.head, bulk(cost), bulk(max_wait * _MS), self.queued))
            after = b"".join(
                (bulk(debt * _MS), self.count, _EMPTY, _ZERO, _EMPTY, self.reserving, self.sharing, self.tail)
            )
            parts = self._around_seen[key] = (before, after)
        return parts

    def around_lease(self, cost: float, max_wait: float, debt: float, life: float) -> tuple[bytes, bytes, bytes]:
        """The command of a call with a state guard and leases, no claim, packed but for the
        guard's ``seen`` and the lease id (new in every call), which go between the three."""
        key = (cost, max_wait, debt, life)
        parts = self._around_lease.get(key)
        if parts is None:
            if len(self._around_lease) >= _AROUND_MAX:
                self._around_lease.clear()
            before = b"".join((self.head, bulk(cost), bulk(max_wait * _MS), self.queued))
            between = b"".join((bulk(debt * _MS), self.count))
            after = b"".join((bulk(life * _MS), _EMPTY, self.reserving, self.sharing, self.tail))
            parts = self._around_lease[key] = (before, between, after)
        return parts

    def packed(
        self, cost: float | str, max_wait: float, guard: StateGuard | None, leases: Leases | None, claim: str
    ) -> bytes:
        """The whole command of one call (the usual one, guarded, without leases or claim,
        from ``around_seen``; a metered one's ``cost``, a string with its buckets' own, is
        packed whole: its estimate is its own)."""
        if guard is not None and not claim and not isinstance(cost, str):
            if leases is None:
                before, after = self.around_seen(cost, max_wait, guard.debt)
                return before + bulk(guard.seen) + after
            before, between, after = self.around_lease(cost, max_wait, guard.debt, leases.life)
            return b"".join((before, bulk(guard.seen), between, bulk(leases.id), after))
        return b"".join(
            (
                self.head,
                bulk(cost),
                bulk(max_wait * _MS),
                self.queued,
                _EMPTY if guard is None else bulk(guard.seen),
                _ZERO if guard is None else bulk(guard.debt * _MS),
                self.count,
                _EMPTY if leases is None else bulk(leases.id),
                _ZERO if leases is None else bulk(leases.life * _MS),
                bulk(claim),
                self.reserving,
                self.sharing,
                self.tail,
            )
        )


def reserve_spec(reserve: Reserve) -> str:
    """acquire.lua's ARGV[10]: ``<horizon>:<owner>:<life>`` in ms, ``:<tenants>``, ``:<standby>`` in ms."""
    return (
        f"{reserve.horizon * _MS:.3f}:{reserve.owner * _MS:.3f}:{reserve.life * _MS:.3f}:{reserve.tenants}"
        f":{reserve.standby * _MS:.3f}"
    )


def per_bucket(amounts: tuple[float, ...]) -> str:
    """One amount per bucket, as acquire.lua's and refund.lua's ARGV[1] lists them (exact)."""
    return ",".join(repr(float(a)) for a in amounts)


def acquire_result(out: list[Any], n: int) -> AcquireResult:
    """acquire.lua's reply to an acquire of ``n`` buckets (its fields in order, as strings)."""
    wait = out[1]
    waited = float(wait) / _MS
    reserved = out[-2]
    # Every field given, in order: the tuple made directly, without the NamedTuple's
    # Python-level __new__ binding twelve arguments (once per request).
    return _tuple_new(
        AcquireResult,
        (
            out[0] == b"1",
            waited,
            int(out[2]) - 1,
            tuple(map(float, out[8 : 8 + n])),
            waited if out[3] == wait else float(out[3]) / _MS,  # granted: the hint is the wait
            int(out[4]),
            out[5] == b"1",
            int(out[6]) - 1,
            tuple(map(int, out[8 + n : -2])) if len(out) > 10 + n else (),
            int(out[7]) / _MS,
            reserved.decode() if reserved else "",
            out[-1] == b"1",
        ),
    )


class StraightAcquire:
    """One bucket set's acquire as the straight path (lane.py) sends it (store.StraightCall):
    written on the pipelined connection (on Redis Cluster, the one to the primary that owns
    its slot), packed as ``RedisStore.acquire`` packs the same call (its fixed parts once,
    here), its reply decoded as it is read (an error reply that says the script did not run,
    NOSCRIPT or a redirection, gets it sent again first)."""

    __slots__ = (
        "_after",
        "_before",
        "_cost",
        "_debt",
        "_key",
        "_leased",
        "_max_wait",
        "_script",
        "_shape",
        "_timeout",
        "failure",
        "n",
    )

    def __init__(
        self,
        script: PipelinedScript | ClusterScript,
        shape: AcquireShape,
        cost: float,
        max_wait: float,
        guard: StateGuard,
        timeout: float,
        failure: Callable[[BaseException], BaseException],
    ) -> None:
        self._timeout = timeout
        self.failure = failure
        """What an exception awaiting the reply means: the store unavailable, or not the store's."""
        self._script = script
        self._shape = shape
        self._cost = cost
        self._max_wait = max_wait
        self._key = guard.key
        self._debt = guard.debt
        self._before, self._after = shape.around_seen(cost, max_wait, guard.debt)
        self._leased: tuple[float, bytes, bytes, bytes] | None = None
        """(life, and the command's parts around the counter and the lease id) of a call with leases."""
        self.n = shape.n

    def _packed(self, seen: int, leases: Leases | None, costs: tuple[float, ...] | None = None) -> bytes:
        if costs is not None:  # a metered call: its estimate is its own (AcquireShape.packed)
            guard = StateGuard(self._key, seen, self._debt)
            return self._shape.packed(f"{self._cost!r}|{per_bucket(costs)}", self._max_wait, guard, leases, "")
        digits = b"%d" % seen
        if leases is None:
            return b"%s$%d\r\n%s\r\n%s" % (self._before, len(digits), digits, self._after)
        leased = self._leased
        if leased is None or leased[0] != leases.life:
            leased = self._leased = (
                leases.life,
                *self._shape.around_lease(self._cost, self._max_wait, self._debt, leases.life),
            )
        return b"".join((leased[1], bulk(seen), leased[2], bulk(leases.id), leased[3]))

    def send(
        self, seen: int, leases: Leases | None, then: Answered, costs: tuple[float, ...] | None = None
    ) -> _Pending | None:
        packed = self._packed(seen, leases, costs)
        waiter = _Pending(self, then, packed)
        script = self._script
        if isinstance(script, PipelinedScript):
            sent = script.send_to(packed, waiter, self._timeout)
        else:
            sent = script.send_to(self._shape.keys, packed, waiter, self._timeout)
        return waiter if sent else None

    def again(self, then: Answered, error: hiredis.ReplyError, packed: bytes) -> None:
        """After an error reply: sent again, in a task, when it says the acquire did not run."""
        task = spawn(self._again(error, packed), name="straight-acquire")
        task.add_done_callback(functools.partial(settled, then))

    async def _again(self, error: hiredis.ReplyError, packed: bytes) -> AcquireResult:
        """The reply after an error reply: one that says the acquire did not run gets it sent
        again; any other, as any failure, is the store unavailable."""
        script = self._script
        try:
            if isinstance(script, PipelinedScript):
                out = await script.reply_error(str(error), packed, self._timeout)
            else:
                out = await script.reply_error(str(error), self._shape.keys, packed, self._timeout)
        except (PipelineError, OSError, TimeoutError) as exc:
            raise self.failure(exc) from exc
        return acquire_result(out, self.n)


class _Pending:
    """What waits for one straight acquire's reply, in place of a future (the pipelined
    connection calls ``set_result`` or ``set_exception`` from the callback that read it):
    the reply decoded for ``then``. ``cancel``: its caller gave up; the reply is dropped."""

    __slots__ = ("_call", "_packed", "_then")

    def __init__(self, call: StraightAcquire, then: Answered, packed: bytes) -> None:
        self._call = call
        self._then: Answered | None = then
        self._packed = packed  # (sent again after an error reply that says it did not run)

    def done(self) -> bool:
        return self._then is None

    def cancel(self) -> bool:
        self._then = None
        return True

    def set_result(self, out: Any) -> None:
        then, self._then = self._then, None
        if then is None:
            return
        if type(out) is _ReplyError:
            self._call.again(then, out, self._packed)
        else:
            then(acquire_result(out, self._call.n), None)

    def set_exception(self, error: BaseException) -> None:
        then, self._then = self._then, None
        if then is not None:
            then(None, self._call.failure(error))


def settled(then: Callable[[Any, BaseException | None], None], task: asyncio.Task[Any]) -> None:
    """Tell ``then`` what a task that asked again (after an error reply) came to."""
    if task.cancelled():
        then(None, StoreUnavailable("cancelled"))
        return
    exc = task.exception()
    then(None, exc) if exc is not None else then(task.result(), None)
