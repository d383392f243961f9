"""``quota-proxy demo``: its arguments and their defaults, checked, then the demo run.

Light on purpose: ``proxy.cli`` imports it to build the command line, and the demo itself
(aiohttp, the proxy, rich, matplotlib) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_DURATION", "DEFAULT_PLOT", "MAX_WORKERS", "register", "run"]

from proxy.devtools.demo_defaults import DEFAULT_DURATION, DEFAULT_PLOT

MAX_WORKERS: Final = 100
"""Cap on --workers-from/--workers-to: 100 workers x 10/s x 2 fleets is already ~2000 requests/s
through one Python process."""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_WORKERS}, got {value}")
    return value


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` and its arguments to ``commands``; its ``handler`` is ``run``."""
    parser = commands.add_parser(
        "demo",
        help="see per-process limits break a quota and the shared bucket hold it",
        description="Two worker fleets grow under the same vendor quota: one keeps per-process 10/s limits, "
        "the other also goes through quota-proxy. Shows both live and plots them.",
    )
    parser.add_argument(
        "--duration",
        type=_positive_float,
        default=DEFAULT_DURATION,
        metavar="SECONDS",
        help=f"how long to run (default {DEFAULT_DURATION:g}); the fleets grow over the first 3/4",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=Path(DEFAULT_PLOT),
        metavar="PATH.png",
        help=f"where to write the PNG (default ./{DEFAULT_PLOT})",
    )
    parser.add_argument("--workers-from", type=_workers, default=4, metavar="N", help="workers per fleet at the start")
    parser.add_argument("--workers-to", type=_workers, default=40, metavar="N", help="workers per fleet at the end")
    parser.add_argument(
        "--quota",
        type=_positive_float,
        default=100.0,
        metavar="RATE",
        help="each vendor's quota, requests per second (default 100)",
    )
    parser.set_defaults(handler=functools.partial(run, parser=parser))


def run(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    """The demo with ``args``; a ``--duration`` under 3 s is ``parser``'s usage error."""
    if args.duration < 3:
        parser.error("--duration must be at least 3 seconds")
    from proxy.devtools import demo

    config = demo.DemoConfig(
        duration=args.duration,
        plot=args.plot,
        workers_from=args.workers_from,
        workers_to=args.workers_to,
        quota=args.quota,
    )
    return demo.run(config)
