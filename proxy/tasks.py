"""Background tasks that are named and kept referenced until they finish.

asyncio only keeps weak references to tasks; an unreferenced task can be
garbage-collected mid-flight, so every fire-and-forget task goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_running: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
    task = asyncio.create_task(coro, name=name)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


async def cancel_and_wait(task: asyncio.Task[Any], *, retry_every: float = 0.1) -> None:
    """Cancel ``task`` and return once it has ended, before closing what it uses.

    A cancellation can be lost: on Python 3.11, ``asyncio.wait_for`` returns the inner
    result when the cancellation lands as the inner call completes (redis-py wraps every
    command's write in it), and the task runs on. So it is cancelled again until it ends.
    Whatever it raised is retrieved here (never "Task exception was never retrieved").
    """
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=retry_every)
    if not task.cancelled():
        task.exception()
