"""A body as it arrives from a socket, read piece by piece with flow control: both sides of
the data plane use it (a worker's request body in http1.py, a vendor's answer body in
upstream.py).

The connection feeds pieces in (``_feed``, ``_end``, ``_fail``); one reader takes them out
(``read``). Holding more than ``BODY_HIGH`` unread bytes pauses reading from the socket
(``_pause``), falling to ``BODY_LOW`` resumes it (``_resume``): what each side pauses is its
own business.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final

BODY_HIGH: Final = 256 * 1024
BODY_LOW: Final = 64 * 1024


class Inbox:
    __slots__ = ("_chunks", "_done", "_exc", "_paused", "_size", "_waiter")

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False

    # -- what each side does -------------------------------------------------------------

    def _loop(self) -> asyncio.AbstractEventLoop:
        raise NotImplementedError

    def _pause(self) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def _reading(self) -> None:
        """A read begins (before anything is taken)."""

    def _waiting(self) -> None:
        """A read is about to wait for the next piece."""

    # -- the reader ---------------------------------------------------------------------

    async def read(self) -> bytes:
        """The next piece, ``b""`` at the end; the failure if the body broke off."""
        self._reading()
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            waiter = self._waiter = self._loop().create_future()
            self._waiting()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        chunk = self._chunks.popleft()
        self._size -= len(chunk)
        self._resume_below_low()
        return chunk

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def _drop_unread(self) -> None:
        """Forget what is held unread (and stop pausing the socket for it)."""
        self._chunks.clear()
        self._size = 0
        self._resume_below_low()

    def _resume_below_low(self) -> None:
        if self._paused and self._size <= BODY_LOW:
            self._paused = False
            self._resume()

    # -- from the connection ------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if not self._paused and self._size > BODY_HIGH:
            self._paused = True
            self._pause()
        self._wake()

    def _end(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done and self._exc is None:
            self._exc = exc
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
