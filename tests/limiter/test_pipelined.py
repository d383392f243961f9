"""The auto-pipelined connection the acquire script rides on (real redis-server)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from proxy.limiter.pipelined import BATCH_MAX, PipelinedConnection, PipelinedScript, PipelineError
from tests.conftest import RedisServer

ECHO = "return ARGV[1]"


async def test_concurrent_callers_get_their_own_replies_in_order(redis_url: str) -> None:
    conn = PipelinedConnection(redis_url, connect_timeout=1.0)
    echo = PipelinedScript(conn, ECHO)
    try:
        replies = await asyncio.gather(*(echo([], [str(i)]) for i in range(500)))
        assert replies == [str(i).encode() for i in range(500)]
    finally:
        conn.close()


async def test_a_busy_turns_commands_leave_in_batches_and_an_idle_connections_at_once(redis_url: str) -> None:
    # A system call per batch of the acquires a turn of the loop serves, not one per request;
    # and no wait for the turn's end when Redis has nothing else to answer (latency).
    conn = PipelinedConnection(redis_url, connect_timeout=1.0)
    echo = PipelinedScript(conn, ECHO)
    try:
        await echo([], ["warm"])
        proto = await conn._connection()
        assert proto.transport is not None
        writes: list[bytes] = []
        real_write = proto.transport.write

        def counted(data: bytes | bytearray | memoryview) -> None:
            writes.append(bytes(data))
            real_write(data)

        proto.transport.write = counted  # type: ignore[method-assign]
        calls = [asyncio.ensure_future(echo([], [str(i)], reply_within=1.0)) for i in range(50)]
        await asyncio.sleep(0)  # one turn: every call queues its command
        assert [w.count(b"EVALSHA") for w in writes] == [1] + [BATCH_MAX] * (49 // BATCH_MAX)
        assert [str(i).encode() for i in range(50)] == await asyncio.gather(*calls)
        assert sum(w.count(b"EVALSHA") for w in writes) == 50
        assert len(writes) == 1 + math.ceil(49 / BATCH_MAX)  # the rest left when the turn ended

        writes.clear()
        alone = asyncio.ensure_future(echo([], ["alone"], reply_within=1.0))
        await asyncio.sleep(0)  # the call ran: its command is out without another turn
        assert len(writes) == 1
        assert await alone == b"alone"
    finally:
        conn.close()


async def test_a_caller_that_gives_up_does_not_shift_later_replies(redis_url: str) -> None:
    conn = PipelinedConnection(redis_url, connect_timeout=1.0)
    slow = PipelinedScript(
        conn,
        "local t = redis.call('TIME'); while true do "
        "local u = redis.call('TIME'); if (u[1]-t[1])*1e6 + (u[2]-t[2]) > 50000 "
        "then break end end; return 'slow'",
    )
    echo = PipelinedScript(conn, ECHO)
    try:
        await echo([], ["warm"])
        waiting = asyncio.ensure_future(slow([], []))
        for _ in range(3):  # let it write its command on the warm connection
            await asyncio.sleep(0)
        waiting.cancel()
        assert await echo([], ["after"]) == b"after"  # not 'slow'
    finally:
        conn.close()


async def test_errors_and_noscript(redis_url: str, redis_server: RedisServer) -> None:
    conn = PipelinedConnection(redis_url, connect_timeout=1.0)
    echo = PipelinedScript(conn, ECHO)
    try:
        assert await echo([], ["1"]) == b"1"
        with redis_server.client() as c:
            c.script_flush()
        assert await echo([], ["2"]) == b"2"  # reloaded on NOSCRIPT
        with pytest.raises(PipelineError, match="ERR"):
            await conn.execute("NOSUCHCOMMAND")
        assert await echo([], ["3"]) == b"3"
    finally:
        conn.close()


async def test_reconnects_after_redis_restarts(own_redis: RedisServer) -> None:
    conn = PipelinedConnection(own_redis.url, connect_timeout=1.0)
    echo = PipelinedScript(conn, ECHO)
    try:
        assert await echo([], ["a"]) == b"a"
        own_redis.kill()
        with pytest.raises((PipelineError, OSError)):
            await echo([], ["b"])
        own_redis.start()
        assert await echo([], ["c"]) == b"c"
    finally:
        conn.close()


async def test_a_peer_that_never_answers_cannot_hold_callers_forever() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = PipelinedConnection(f"redis://127.0.0.1:{port}/0", connect_timeout=0.2)
    PipelinedScript(conn, ECHO)  # a script to load at connect: the set-up never gets an answer
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await conn.execute("PING")
        assert time.monotonic() - started < 1.0
        assert accepted  # it did connect; the silence is what timed out
    finally:
        conn.close()
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


async def _busy_loop_case(url: str) -> bytes:
    conn = PipelinedConnection(url, connect_timeout=1.0)
    echo = PipelinedScript(conn, ECHO)
    try:
        await echo([], ["warm"])
        # Another connection's data_received keeps the loop busy past the deadline, in
        # the phase where sockets are read (as a burst of requests does): Redis's reply
        # arrives meanwhile and waits unread while the deadline timer comes due.
        loop = asyncio.get_running_loop()
        peers: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: peers.append(w), "127.0.0.1", 0)

        class Hog(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                time.sleep(0.2)

        hog, _ = await loop.create_connection(Hog, "127.0.0.1", server.sockets[0].getsockname()[1])
        while not peers:
            await asyncio.sleep(0)
        peers[0].write(b"x")  # readable at the next poll, before Redis can have answered
        call = asyncio.ensure_future(echo([], ["on time"], reply_within=0.05))
        try:
            reply: bytes = await call
        finally:
            hog.close()
            peers[0].close()
            server.close()
        return reply
    finally:
        conn.close()


async def test_a_busy_loop_is_not_mistaken_for_a_dead_store(redis_url: str) -> None:
    assert await _busy_loop_case(redis_url) == b"on time"


def test_a_busy_uvloop_is_not_mistaken_for_a_dead_store(redis_server: RedisServer) -> None:
    # (With asyncio.timeout around the call, both this and the asyncio case time out.)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(_busy_loop_case(redis_server.url)) == b"on time"


async def test_a_silent_store_still_times_out_at_the_deadline(own_redis: RedisServer) -> None:
    conn = PipelinedConnection(own_redis.url, connect_timeout=1.0)
    echo = PipelinedScript(conn, ECHO)
    try:
        await echo([], ["warm"])
        own_redis.pause()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await echo([], ["late"], reply_within=0.1)
        assert 0.1 <= time.monotonic() - started < 0.5
    finally:
        own_redis.resume()
        conn.close()


SLOW = (
    "local t = redis.call('TIME'); while true do "
    "local u = redis.call('TIME'); if (u[1]-t[1])*1e6 + (u[2]-t[2]) > 300000 "
    "then break end end; return 'slow'"
)


async def test_every_waiter_times_out_at_its_own_deadline(redis_url: str) -> None:
    # One timer watches the connection's deadlines: a later one sent after an earlier one
    # still times out when its time comes, and one earlier than those sent before it does too.
    conn = PipelinedConnection(redis_url, connect_timeout=1.0)
    slow = PipelinedScript(conn, SLOW)
    echo = PipelinedScript(conn, ECHO)
    try:
        await echo([], ["warm"])
        await slow([], [])  # loaded: no NOSCRIPT round trip below
        loop = asyncio.get_running_loop()
        started = loop.time()
        busy = asyncio.ensure_future(slow([], [], reply_within=5.0))
        later = asyncio.ensure_future(echo([], ["later"], reply_within=0.15))
        earlier = asyncio.ensure_future(echo([], ["earlier"], reply_within=0.05))  # earlier than `later`'s
        with pytest.raises(TimeoutError):
            await earlier
        assert loop.time() - started < 0.15  # not at `later`'s deadline, nor at Redis's answer
        with pytest.raises(TimeoutError):
            await later
        assert loop.time() - started < 0.28  # Redis is still busy: before its answer
        assert await busy == b"slow"
        assert await echo([], ["after"], reply_within=1.0) == b"after"  # the dropped replies kept order
    finally:
        conn.close()
