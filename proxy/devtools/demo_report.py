"""The demo's output: one row per second (a ``rich`` live table on a terminal, a plain line
otherwise), the closing summary, and the PNG of both fleets' rates against the quota."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from proxy.devtools.demo_fleet import PER_WORKER_RATE, FleetCounters

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Display", "ReportConfig", "Row", "Summary", "plain_line", "summary_text", "write_plot"]

TABLE_ROWS: Final = 12


class ReportConfig(Protocol):
    """What the output reads of the run's ``DemoConfig`` (a protocol, so it need not import the run)."""

    @property
    def duration(self) -> float: ...

    @property
    def workers_from(self) -> int: ...

    @property
    def workers_to(self) -> int: ...

    @property
    def quota(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Row:
    """One second of the run; rates are per second over the second that just ended."""

    elapsed: float
    workers: int
    a_sent: float
    a_accepted: float
    a_429: float
    b_sent: float
    b_forwarded: float
    b_held: int
    b_deferred: float
    b_429: float
    b_at_vendor: float
    """Requests of fleet B that reached vendor B (accepted + 429)."""


def plain_line(row: Row, quota: float) -> str:
    """One second as one line, for logs and pipes (stable ``key=value`` fields)."""
    return (
        f"t={row.elapsed:5.1f}s workers={row.workers:3d} | "
        f"A sent={row.a_sent:6.1f}/s accepted={row.a_accepted:6.1f}/s vendor_429={row.a_429:6.1f}/s | "
        f"B sent={row.b_sent:6.1f}/s forwarded={row.b_forwarded:6.1f}/s held={row.b_held:3d} "
        f"deferred={row.b_deferred:6.1f}/s vendor_429={row.b_429:6.1f}/s | quota={quota:g}/s"
    )


def _table(rows: Sequence[Row], config: ReportConfig, elapsed: float, stopping: bool) -> Table:
    from rich.table import Table

    quota = config.quota
    state = "stopping…" if stopping else f"{elapsed:4.0f}/{config.duration:g} s (Ctrl-C stops early)"
    table = Table(
        title=f"quota-proxy demo: vendor quota {quota:g}/s, every worker limited to {PER_WORKER_RATE:g}/s  ·  {state}",
        caption="A: workers call the vendor directly  ·  B: the same workers through quota-proxy's shared bucket",
        header_style="bold",
    )
    for name in ("elapsed", "workers"):
        table.add_column(name, justify="right")
    for name in ("A sent/s", "A accepted/s", "A 429/s"):
        table.add_column(name, justify="right", style="red")
    for name in ("B sent/s", "B forwarded/s", "B held", "B deferred/s", "B 429/s"):
        table.add_column(name, justify="right", style="cyan")
    table.add_column("quota", justify="right")
    for row in rows[-TABLE_ROWS:]:
        over = row.a_accepted + row.a_429 > quota
        table.add_row(
            f"{row.elapsed:.0f} s",
            str(row.workers),
            f"[bold]{row.a_sent:.0f}[/bold]" if over else f"{row.a_sent:.0f}",
            f"{row.a_accepted:.0f}",
            f"[bold red]{row.a_429:.0f}[/bold red]" if row.a_429 else "0",
            f"{row.b_sent:.0f}",
            f"[green]{row.b_forwarded:.0f}[/green]",
            str(row.b_held),
            f"{row.b_deferred:.0f}",
            f"[bold red]{row.b_429:.0f}[/bold red]" if row.b_429 else "[green]0[/green]",
            f"{quota:g}",
        )
    return table


class Display:
    """A rich live table on a terminal, else one plain line per second."""

    def __init__(self, config: ReportConfig, live: bool) -> None:
        self.config = config
        self._live: Any = None
        if live:
            try:
                from rich.live import Live
            except ImportError:
                live = False
            else:
                self._live = Live(_table([], config, 0.0, False), refresh_per_second=4, transient=False)
        self.live = live

    def __enter__(self) -> Display:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def update(self, rows: Sequence[Row], elapsed: float, stopping: bool = False) -> None:
        if self._live is not None:
            self._live.update(_table(rows, self.config, elapsed, stopping), refresh=True)
        elif rows and not stopping:
            print(plain_line(rows[-1], self.config.quota), flush=True)


@dataclass(frozen=True, slots=True)
class Summary:
    elapsed: float
    stopped_early: bool
    a: FleetCounters
    b: FleetCounters
    a_accepted: int
    a_429: int
    b_accepted: int
    b_429: int
    b_deferred: int


def summary_text(s: Summary, config: ReportConfig, plot: Path | None) -> str:
    span = max(s.elapsed, 1e-6)
    early = " (stopped early)" if s.stopped_early else ""
    lines = []
    if plot is not None:
        lines.append(f"plot: {plot}")
    lines += [
        f"summary: {s.elapsed:.1f} s{early}, workers {config.workers_from} -> {config.workers_to}, "
        f"{PER_WORKER_RATE:g}/s per worker, vendor quota {config.quota:g}/s",
        f"  fleet A (per-worker limits, direct):       sent {s.a.sent} (retries {s.a.retries}), "
        f"vendor accepted {s.a_accepted} ({s.a_accepted / span:.1f}/s), vendor 429s {s.a_429}",
        f"  fleet B (per-worker limits + quota-proxy): sent {s.b.sent} (retries {s.b.retries}), "
        f"deferred by the proxy {s.b_deferred}, vendor accepted {s.b_accepted} "
        f"({s.b_accepted / span:.1f}/s), vendor 429s {s.b_429}",
    ]
    if s.a.errors or s.b.errors:
        lines.append(f"  connection errors: fleet A {s.a.errors}, fleet B {s.b.errors}")
    if s.a_429 and not s.b_429:
        lines.append(
            f"  -> per-process limits sent {s.a_429} requests the vendor refused; "
            "the shared bucket kept fleet B inside the quota"
        )
    return "\n".join(lines)


def write_plot(rows: Sequence[Row], config: ReportConfig, path: Path, summary: Summary) -> None:
    """Both fleets' rates at the vendor and attempted, the quota, the workers; Agg PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.elapsed for r in rows]
    a_vendor = [r.a_accepted + r.a_429 for r in rows]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, layout="constrained"
    )
    fig.suptitle(
        "Per-process limits break the quota when the autoscaler adds workers; the shared bucket does not", fontsize=12
    )
    top.axhline(config.quota, color="black", linestyle="--", linewidth=1.5, label=f"vendor quota {config.quota:g}/s")
    top.fill_between(
        t,
        config.quota,
        a_vendor,
        where=[v > config.quota for v in a_vendor],
        interpolate=True,
        color="tab:red",
        alpha=0.12,
        label="fleet A: over the quota (vendor 429s)",
    )
    top.plot(
        t,
        a_vendor,
        color="tab:red",
        linewidth=2.2,
        label=f"fleet A at the vendor: {PER_WORKER_RATE:g}/s per worker, direct",
    )
    top.plot(
        t,
        [r.a_accepted for r in rows],
        color="tab:red",
        linestyle=":",
        linewidth=1.2,
        label="fleet A accepted by the vendor",
    )
    top.plot(
        t,
        [r.b_sent for r in rows],
        color="tab:blue",
        linestyle=":",
        linewidth=1.5,
        label="fleet B attempted (sent to quota-proxy, incl. deferred)",
    )
    top.plot(
        t,
        [r.b_at_vendor for r in rows],
        color="tab:blue",
        linewidth=2.2,
        label="fleet B at the vendor: through quota-proxy's shared bucket",
    )
    top.set_ylabel("requests / s")
    top.set_ylim(bottom=0)
    top.grid(True, alpha=0.3)
    workers_axis = top.twinx()
    workers_axis.step(
        t,
        [r.workers for r in rows],
        where="post",
        color="tab:gray",
        alpha=0.7,
        linewidth=1.2,
        label="workers per fleet",
    )
    workers_axis.set_ylabel("workers per fleet", color="tab:gray")
    workers_axis.set_ylim(0, max([config.workers_from, config.workers_to, *(r.workers for r in rows)]) * 1.1)
    handles, labels = top.get_legend_handles_labels()
    more_handles, more_labels = workers_axis.get_legend_handles_labels()
    top.legend(handles + more_handles, labels + more_labels, loc="upper left", fontsize=8.5, framealpha=0.9)

    bottom.plot(
        t,
        [r.a_429 for r in rows],
        color="tab:red",
        linewidth=1.8,
        label=f"fleet A: vendor 429s/s (total {summary.a_429})",
    )
    bottom.plot(
        t,
        [r.b_429 for r in rows],
        color="tab:blue",
        linewidth=1.8,
        label=f"fleet B: vendor 429s/s (total {summary.b_429})",
    )
    bottom.set_ylabel("vendor 429s / s")
    bottom.set_xlabel("seconds")
    top_429 = max([1.0, *(r.a_429 for r in rows), *(r.b_429 for r in rows)])
    bottom.set_ylim(-0.05 * top_429, top_429 * 1.15)  # a line at 0 stays visible above the axis
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8.5)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
