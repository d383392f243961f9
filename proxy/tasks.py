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
