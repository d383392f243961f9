"""A worker's request body as it arrives (the connection feeds it, the request path reads it)."""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

from proxy.wire.inbox import BODY_HIGH, Inbox

DISCARD_MAX: Final = 16 * 1024 * 1024
"""An unread request body up to this size is read and dropped after the answer, keeping the
connection; a larger one (or one that takes over ``DISCARD_WAIT``) closes it."""
CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodySource(Protocol):
    """The worker's connection, as a body being read needs it (http1.Http1Connection)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def stall_limit(self) -> float: ...

    def pause(self, reason: str) -> None: ...

    def resume(self, reason: str) -> None: ...

    def write_interim(self, data: bytes) -> None: ...


class BodyBroken(ConnectionError):
    """The worker's connection ended (or its framing broke) before the body was complete."""


class BodyStalled(BodyBroken):
    """The worker sent no byte of its body for the connection's ``idle_timeout`` while it
    was being read."""


class Body(Inbox):
    """A request body as it arrives: ``read()`` gives the next piece, ``b""`` at its end."""

    __slots__ = ("_conn", "_continue", "_discarding", "_end_waiter", "_since", "_stall")

    def __init__(self, conn: BodySource, expect_continue: bool) -> None:
        super().__init__()
        self._conn = conn
        self._end_waiter: asyncio.Future[None] | None = None
        self._continue = expect_continue
        self._discarding = False
        self._since = 0.0  # when the read now waiting began to wait
        self._stall: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        """Has the body arrived whole (whatever was read of it)?"""
        return self._done

    @property
    def broken(self) -> BaseException | None:
        """Why the body broke off (its framing, or the worker went away), if it did."""
        return self._exc

    @property
    def continue_pending(self) -> bool:
        """The worker waits for ``100 Continue``, not sent yet."""
        return self._continue

    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._conn.loop

    def _pause(self) -> None:
        self._conn.pause("body")

    def _resume(self) -> None:
        self._conn.resume("body")

    def _reading(self) -> None:
        if self._continue:  # the body is wanted now: invite it
            self._continue = False
            self._conn.write_interim(CONTINUE)

    def _waiting(self) -> None:
        """A read waits for the worker's next bytes: they are owed within ``idle_timeout``
        from now (time the reader spent elsewhere, or paused, is not the worker's). One
        timer, moved on lazily: not one per piece."""
        loop = self._conn.loop
        self._since = loop.time()
        if self._stall is None:
            self._stall = loop.call_at(self._since + self._conn.stall_limit, self._check_stall)

    def _check_stall(self) -> None:
        self._stall = None
        if self._done or self._exc is not None or self._waiter is None or self._waiter.done():
            return  # not waiting now: the next wait sets the timer again
        limit = self._conn.stall_limit
        due = self._since + limit
        if self._conn.loop.time() < due:
            self._stall = self._conn.loop.call_at(due, self._check_stall)
            return
        self._fail(BodyStalled(f"no byte of the request body came for {limit:g}s (connections.idle_timeout)"))

    async def whole(self, limit: int) -> bytes | None:
        """The whole body if it ends within ``limit`` bytes, all of it still to be read (a
        meter's estimate reads it before the request goes, SPEC §14); None when it is longer
        (what came of it is kept, the rest comes as it is read) or broke off. Holds up to
        ``limit`` bytes unread: the socket is paused only beyond it."""
        self._reading()
        while not self._done and self._exc is None and self._size <= limit:
            if self._paused:
                self._paused = False
                self._resume()
            waiter = self._waiter = self._loop().create_future()
            self._waiting()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        if not self._done or self._exc is not None or self._size > limit:
            if self._size > BODY_HIGH and not self._paused:
                self._paused = True
                self._pause()
            return None
        return b"".join(self._chunks)

    def in_hand(self) -> bytes | None:
        """What is held unread, when the body has all come (the whole body, if nothing read
        it yet: a lean request's small one, which the straight path sends as it came); else
        None."""
        if not self._done or self._exc is not None:
            return None
        return b"".join(self._chunks)

    # -- from the connection ---------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._discarding:
            self._size += len(data)  # counted, not kept
            if self._size > DISCARD_MAX:
                self._fail(BodyBroken("unread body too large to discard"))
            return
        super()._feed(data)

    def _discard(self) -> None:
        """The answer is out and nobody will read the rest: drop it as it comes."""
        self._discarding = True
        self._drop_unread()

    async def _finished(self) -> None:
        """The rest of a discarded body is in (a reader of the body may still be waiting:
        an upload the vendor answered before its end, being cancelled)."""
        while not self._done and self._exc is None:
            waiter = self._end_waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._end_waiter = None
        if self._exc is not None:
            raise self._exc

    def _wake(self) -> None:
        super()._wake()
        if self._end_waiter is not None and not self._end_waiter.done():
            self._end_waiter.set_result(None)
        if self._stall is not None and (self._done or self._exc is not None):
            self._stall.cancel()
            self._stall = None
