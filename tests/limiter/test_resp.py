"""The acquire's command packed in parts (resp.py, redis_store.py) is, byte for byte,
the whole command as hiredis packs it: Redis sees exactly what it saw before."""

from __future__ import annotations

import math
from typing import Any

import hiredis
import pytest

from proxy.limiter import redis_acquire
from proxy.limiter.pipelined import PipelinedScript
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.resp import bulk, bulks
from proxy.limiter.store import AcquireResult, BucketSpec, Leases, LeaseSet, Reserve, StateGuard

VALUES: list[Any] = [
    0.0,
    -0.0,
    1.0,
    1,
    2.5,
    0.1,
    1 / 3,
    1e-9,
    1e20,
    1e16,
    -7.25,
    math.inf,
    -math.inf,
    math.nan,
    0,
    -3,
    12345678901234567890,
    "",
    "q",
    "tenant é ☃",
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_bulk_is_what_hiredis_packs(value: Any) -> None:
    whole = hiredis.pack_command(("X", value))  # type: ignore[arg-type]
    assert b"*2\r\n$1\r\nX\r\n" + bulk(value) == whole
    assert b"*2\r\n$1\r\nX\r\n" + bulk(value) == whole  # remembered: the same again
    assert b"*2\r\n$1\r\nX\r\n" + bulks([value]) == whole


def test_what_hiredis_refuses_is_refused() -> None:
    with pytest.raises(TypeError):
        bulk(True)


def test_zero_and_negative_zero_are_told_apart() -> None:
    assert bulk(0.0) != bulk(-0.0)
    assert bulk(-0.0) == bulks([-0.0]) and bulk(0.0) == bulks([0.0])


def spec(key: str, rate: float, burst: float, field: str = "") -> BucketSpec:
    return BucketSpec(f"resp:{{v}}:{key}", rate, burst, "global", key, field=field)


SETS = (LeaseSet("resp:{v}:c:e:search", 5, "endpoint search concurrency 5"), LeaseSet("resp:{v}:c", 50, "c 50"))
BUCKETS = (
    spec("t:acme", 2.0, 100.0),
    spec("state", 10.0 / 3, 20.5, "e:search:1/1/1"),
    spec("state", 1e9, 1e9, "g:1e9/1/1e9"),
)


def reference(
    sha: str,
    buckets: tuple[BucketSpec, ...],
    cost: Any,
    max_wait: float,
    queue: Any,
    guard: Any,
    leases: Any,
    reserve: Reserve | None = None,
) -> bytes:
    """The command as RedisStore packed it before it kept parts packed."""
    sets = leases.sets if leases is not None else ()
    keys = [b.key for b in buckets] + [ls.key for ls in sets]
    args: list[Any] = [cost, max_wait * 1000.0, "", "", 0.0, len(buckets), "", 0.0, "", "", "", ""]
    if queue is not None:
        keys.append(queue)
        args[2] = "q"
        if reserve is not None:
            keys += (reserve.key, reserve.key + "/left", reserve.key + "/shifts", reserve.key + "/offers")
            args[8] = reserve.claim
            args[9] = (
                f"{reserve.horizon * 1000:.3f}:{reserve.owner * 1000:.3f}:{reserve.life * 1000:.3f}:0"
                f":{reserve.standby * 1000:.3f}"
            )
    if guard is not None:
        keys.append(guard.key)
        args[3], args[4] = guard.seen, guard.debt * 1000.0
    if leases is not None:
        args[6], args[7] = leases.id, leases.life * 1000.0
    for b in buckets:
        args += (b.rate / 1000.0, b.burst, b.field)
    args += [ls.cap for ls in sets]
    return bytes(hiredis.pack_command(("EVALSHA", sha, len(keys), *keys, *args)))


CALLS = [
    (BUCKETS, 1.0, 0.0, None, None, None),
    (BUCKETS, 1.0, 0.5, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 0, 0.5), None),
    (BUCKETS, 2, 0.25, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 1, 1.5), Leases("r1:7", 31.0, SETS)),
    (BUCKETS[:1], 0.5, 0.0, None, StateGuard("resp:{v}:state", 2, 0.0), Leases("r1:8", 5.0, SETS[1:])),
    (BUCKETS, 1.0, 0.0, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 3, 0.5), None),  # the same set, again
    (BUCKETS, 1.0, 0.0, None, StateGuard("resp:{v}:state", 4, 0.5), None),  # ... without its queue
    (BUCKETS, 1.0, 0.0, None, StateGuard("resp:{v}:state", 5, 0.5), None),  # its packed parts again
]
KEPT = Reserve("resp:{v}:r:acme", "", 60.0)
RESERVING = [
    # A deferring caller: its slot kept on a refusal (none of these refuses), then with a claim.
    (BUCKETS, 1.0, 0.0, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 6, 0.5), None, KEPT),
    (BUCKETS, 1.0, 0.0, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 7, 0.5), None, KEPT),  # packed again
    (BUCKETS, 1.0, 0.0, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 8, 0.5), None, KEPT._replace(claim="1:1:a")),
    (BUCKETS, 2, 0.25, "resp:{v}:q:acme", StateGuard("resp:{v}:state", 9, 1.5), Leases("r1:9", 31.0, SETS), KEPT),
]


async def test_every_acquire_sends_the_command_it_sent_before(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RedisStore(redis_url, timeout=1.0)
    fast = store._acquire_fast
    assert isinstance(fast, PipelinedScript)
    sent: list[bytes] = []
    call_packed = fast.call_packed

    async def spy(keys: list[str], packed: bytes, reply_within: float | None = None) -> Any:
        sent.append(packed)
        return await call_packed(keys, packed, reply_within)

    send_now = fast.send_now

    def spy_now(packed: bytes, reply_within: float) -> Any:
        sent.append(packed)
        return send_now(packed, reply_within)

    monkeypatch.setattr(fast, "call_packed", spy)
    monkeypatch.setattr(fast, "send_now", spy_now)  # the way an acquire takes once connected
    try:
        calls: list[tuple[Any, ...]] = [(*call, None) for call in CALLS] + list(RESERVING)
        for buckets, cost, max_wait, queue, guard, leases, kept in calls:
            result = await store.acquire(buckets, cost, max_wait, queue, guard, leases, kept)
            assert result.granted, result
            # made as a plain tuple (no NamedTuple __new__): every field there, each of its type
            assert type(result) is AcquireResult and len(result) == len(AcquireResult._fields)
            types = [bool, float, int, tuple, float, int, bool, int, tuple, float, str, bool]
            assert [type(v) for v in result] == types
            assert sent[-1] == reference(fast.sha, buckets, cost, max_wait, queue, guard, leases, kept)
    finally:
        await store.close()


async def test_the_straight_call_packs_the_bytes_acquire_sends(redis_url: str) -> None:
    """The straight path's call (redis_acquire.StraightAcquire) packs its fixed parts once:
    the bytes are still those of the whole command, with leases and without."""
    store = RedisStore(redis_url, timeout=1.0)
    fast = store._acquire_fast
    assert isinstance(fast, PipelinedScript)
    try:
        checked = 0
        for buckets, cost, max_wait, queue, guard, leases in CALLS:
            if guard is None:
                continue
            sets = () if leases is None else leases.sets
            call = store.straight(buckets, cost, max_wait, queue, guard, sets, None)
            assert call is not None
            for _ in range(2):  # (the second from what the first kept)
                assert call._packed(guard.seen, leases) == reference(
                    fast.sha, buckets, cost, max_wait, queue, guard, leases, None
                )
            checked += 1
        assert checked >= 2
    finally:
        await store.close()


async def test_the_parts_packed_per_cost_and_wait_are_bounded(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_wait comes from a request header (X-Quota-Max-Hold) too: a worker spraying values
    cannot grow what is kept packed; each command is still the one it always was."""
    monkeypatch.setattr(redis_acquire, "_AROUND_MAX", 3)
    store = RedisStore(redis_url, timeout=1.0)
    fast = store._acquire_fast
    assert isinstance(fast, PipelinedScript)
    sent: list[bytes] = []
    send_now = fast.send_now

    def spy_now(packed: bytes, reply_within: float) -> Any:
        sent.append(packed)
        return send_now(packed, reply_within)

    monkeypatch.setattr(fast, "send_now", spy_now)
    try:
        await store.acquire(BUCKETS, 1.0, 0.0, None, StateGuard("resp:{v}:state", 0, 0.5))  # connects
        for i in range(10):
            guard = StateGuard("resp:{v}:state", 0, 0.5)
            await store.acquire(BUCKETS, 1.0, i / 100, None, guard)
            assert sent[-1] == reference(fast.sha, BUCKETS, 1.0, i / 100, None, guard, None)
        shape = next(iter(store._shapes.values()))
        assert 0 < len(shape._around_seen) <= 3
    finally:
        await store.close()
