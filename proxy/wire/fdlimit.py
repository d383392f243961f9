"""The process's file-descriptor limit (RLIMIT_NOFILE): raised to its hard limit at start,
and how many worker connections it can hold.

Every worker connection is a descriptor, and while its request is forwarded the vendor
connection is another. A process that runs out of descriptors cannot accept anything, not
even a probe on the admin listener, so the connection cap (connections.py) is lowered to
what the limit holds once the rest of the process has what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from proxy.wire.connections import TURNED_AWAY_MAX

RESERVED: Final = 128
"""Descriptors for everything but worker connections: the listeners, the admin listener's
connections (probes, scrapes), the store's connections, the event loop, logs, DNS."""
_UNLIMITED_TRY: Final = (1 << 20, 65536, 10240)  # when the hard limit is "unlimited" (macOS): what the kernel may allow


@dataclass(frozen=True, slots=True)
class FdLimit:
    soft: int
    """The limit in force."""
    hard: int | None
    """The ceiling an unprivileged process may raise it to (None: unlimited)."""
    raised_from: int | None = None
    """The limit before ``raise_fd_limit`` raised it (None: unchanged)."""
    report: str = ""
    """What happened, for the log once the proxy listens (a refusal to start stays one line)."""
    problem: bool = False
    """The limit could not be raised (``report`` is then a warning)."""

    @property
    def connection_capacity(self) -> int:
        """Worker connections the limit holds: two descriptors each (the worker's and the
        vendor's), one for each connection being turned away, ``RESERVED`` for the rest."""
        return max(1, (self.soft - RESERVED - TURNED_AWAY_MAX) // 2)


def raise_fd_limit() -> FdLimit | None:
    """Raise the soft limit to the hard one where the OS allows; ``report`` says what it is.
    None where the platform has no RLIMIT_NOFILE."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = hard == resource.RLIM_INFINITY
    targets = [t for t in (_UNLIMITED_TRY if unlimited else (hard,)) if t > soft]
    problem: Exception | None = None
    for target in targets:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            problem = exc
            continue
        shown = "unlimited" if unlimited else str(hard)
        report = f"file-descriptor limit raised from {soft} to {target} (the hard limit: {shown})"
        return FdLimit(target, None if unlimited else hard, raised_from=soft, report=report)
    if targets:
        report = f"cannot raise the file-descriptor limit from {soft}: {problem}"
        return FdLimit(soft, None if unlimited else hard, report=report, problem=True)
    return FdLimit(soft, None if unlimited else hard, report=f"file-descriptor limit {soft} (the hard limit)")
