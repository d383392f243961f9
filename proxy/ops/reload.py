"""Live policy reload: SIGHUP, ``POST /reload`` on the admin port, or ``--watch``.

A valid policy takes effect for new requests at once (Runtime.apply); in-flight and
held requests finish under the policy they started with, and buckets whose limits
did not change keep their state (a bucket's key is its limit). An invalid policy is
refused with the same file:line errors as ``quota-proxy check`` and the running one
keeps serving. ``ratelimit_config_reload_total{result}`` counts both.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.app import Runtime
from proxy.policy import ConfigErrors, Policy

log = logging.getLogger("quota_proxy.reload")


@dataclass(frozen=True, slots=True)
class ReloadResult:
    ok: bool
    errors: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def as_json(self, policy: Policy) -> dict[str, object]:
        return {
            "result": "success" if self.ok else "failure",
            "errors": list(self.errors),
            "notes": list(self.notes),
            "policy": policy.source,
            "vendors": [v.name for v in policy.vendors],
        }


class Reloader:
    """Reloads one Runtime from ``load`` (the file, with the command line's overrides)."""

    def __init__(self, runtime: Runtime, load: Callable[[], Policy]) -> None:
        self._runtime = runtime
        self._load = load
        self._lock = asyncio.Lock()

    async def reload(self, reason: str) -> ReloadResult:
        async with self._lock:  # one at a time: two SIGHUPs must not interleave
            try:
                policy = await asyncio.to_thread(self._load)
            except ConfigErrors as exc:
                return self._failed(reason, tuple(str(e) for e in exc.errors))
            except (OSError, ValueError) as exc:
                return self._failed(reason, (f"{type(exc).__name__}: {exc}",))
            try:
                notes = tuple(self._runtime.apply(policy))
            except Exception as exc:  # e.g. a CA that loaded at check time but not now
                log.exception("reload (%s) failed while applying the new policy", reason)
                return self._failed(reason, (f"{type(exc).__name__}: {exc}",))
        self._runtime.metrics.reloads.labels("success").inc()
        log.info("policy reloaded (%s): %s, %d vendor(s)", reason, policy.source, len(policy.vendors))
        for note in notes:
            log.warning("reload: %s", note)
        return ReloadResult(True, (), notes)

    def watch(self, path: str, interval: float = 1.0) -> Coroutine[Any, Any, None]:
        """--watch (``watch_file``)."""
        return watch_file(path, self.reload, interval)

    def _failed(self, reason: str, errors: tuple[str, ...]) -> ReloadResult:
        self._runtime.metrics.reloads.labels("failure").inc()
        return refused(reason, errors)


def refused(reason: str, errors: tuple[str, ...]) -> ReloadResult:
    """A reload that did not happen: logged with every error; the running policy stays."""
    log.error("policy reload (%s) refused; the running policy keeps serving:", reason)
    for error in errors:
        log.error("  %s", error)
    return ReloadResult(False, errors)


def watch_file(
    path: str, reload: Callable[[str], Awaitable[ReloadResult]], interval: float = 1.0
) -> Coroutine[Any, Any, None]:
    """--watch: ``reload("file changed")`` whenever the file's content changes (polled: works
    on every filesystem, including ConfigMap symlink swaps); the coroutine runs until
    cancelled. The file is read now, so a change made right after start (or while workers
    start) is not missed."""
    return _watch(path, reload, interval, _digest(path))


async def _watch(
    path: str, reload: Callable[[str], Awaitable[ReloadResult]], interval: float, last: bytes | None
) -> None:
    while True:
        await asyncio.sleep(interval)
        current = _digest(path)
        if current is not None and current != last:
            last = current
            await reload("file changed")


def _digest(path: str) -> bytes | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).digest()
    except OSError:
        return None  # mid-replace, or gone: keep the running policy and look again
