"""Where quota-proxy's CPU goes under load: py-spy's samples sorted into the parts of the
request path. Used by ``bench/peers.py --profile``; also ``python bench/_profile.py
STACKS [--cpu-us N]`` to re-read a collapsed-stacks file (py-spy ``--format raw``).

Each sample (one stack) is charged to one part: walking from the innermost frame
outwards, the first frame that belongs to a known part decides, so a ``write()`` that
the data plane's responder made through uvloop counts as writing the response, and a
sample is the event loop's (polling, reading sockets, scheduling callbacks) only when
no known part is on its stack at all. Shares are of the samples in
which the process was running (py-spy leaves idle samples out); µs per request = share x
the CPU per request measured from /proc over the same window.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Iterable

# (part, pattern on a py-spy frame "function (file:line)"), innermost match wins; order
# matters only between patterns that can match the same frame.
PARTS: tuple[tuple[str, str], ...] = (
    ("garbage collector", r"^gc_collect|^collect_generations|^_PyObject_GC_"),
    ("access log", r"\(proxy/telemetry/accesslog\.py|\(logging/|\(json/|\(_json\.c"),
    (
        "metrics",
        r"prometheus_client/|\(proxy/telemetry/(metrics|recent)\.py|\(proxy/quota/sizing\.py"
        r"|\(proxy/pipeline/accounting\.py",
    ),
    ("limiter: Redis round trip", r"\(proxy/limiter/pipelined\.py|hiredis|\(pack\.c|\(read\.c"),
    (
        "limiter: buckets, decision",
        r"\(proxy/limiter/|\(proxy/pipeline/decide\.py|\(proxy/pipeline/ratelimit_fields\.py",
    ),
    ("concurrency: leases", r"\(proxy/quota/concurrency\.py"),
    ("HTTP parsing (llhttp)", r"\(llhttp|\(http\.c|\(api\.c|\(parser\.c|httptools/"),
    ("data plane: worker side", r"\(proxy/wire/(http1|parsing|request|body|responder)\.py"),
    ("data plane: vendor side", r"\(proxy/wire/(upstream|pool|vendor_answer)\.py"),
    ("forward: headers, relay", r"\(proxy/pipeline/forward\.py|\(proxy/wire/headers\.py"),
    # aiohttp is off the request path since issue 11; kept so an old profile still reads.
    ("aiohttp client (upstream)", r"aiohttp/client|aiohttp/connector\.py|aiohttp/tracing\.py|aiohttp/cookiejar"),
    ("aiohttp server", r"aiohttp/(web_|http_|streams|base_protocol|helpers)|_http_parser|_http_writer"),
    ("multidict, yarl", r"multidict|yarl/|\(_multidict|\(hashtable\.h|\(htkeys\.h|\(bulk_update\.h"),
    ("the straight path (lane.py, flight.py, routes.py)", r"\(proxy/pipeline/(lane|flight|routes)\.py"),
    ("our request path", r"\(proxy/(?!cli\.py|__main__\.py)"),
)
LOOP = "event loop, sockets"
_LOOP = re.compile(r"uvloop|\(loop\.c|\(asyncio/|_asynciomodule|^uv_|^uv__|epoll|\(runpy|\(proxy/cli\.py")
_COMPILED = [(part, re.compile(pattern)) for part, pattern in PARTS]
OTHER = "other"


# The C library's system-call wrappers for socket I/O and polling, as py-spy --native names
# them: the kernel's work for a request (TCP on loopback, waking the peer) is charged to
# these frames, and any proxy that relays the same bytes makes the same calls.
_SYSCALL = re.compile(
    r"^(read|write|recv|send|sendto|recvfrom|readv|writev|sendmsg|recvmsg|epoll_wait|epoll_pwait|epoll_ctl|poll|"
    r"select|getpid|__libc_\w+) \((libc|libpthread)"
)


def syscall_share(stacks: Counter[tuple[str, ...]]) -> float:
    """Share of the samples spent in system calls for sockets and polling (innermost frame)."""
    total = sum(stacks.values()) or 1
    return sum(n for stack, n in stacks.items() if stack and _SYSCALL.search(stack[-1])) / total


def read_collapsed(lines: Iterable[str]) -> Counter[tuple[str, ...]]:
    """py-spy ``--format raw``: ``frame;frame;...;frame COUNT`` per line, outermost first."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def part_of(stack: tuple[str, ...]) -> str:
    for frame in reversed(stack):
        for part, pattern in _COMPILED:
            if pattern.search(frame):
                return part
    return LOOP if any(_LOOP.search(frame) for frame in stack) else OTHER


def breakdown(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """Share of samples per part (0..1), largest first."""
    total = sum(stacks.values()) or 1
    parts: Counter[str] = Counter()
    for stack, n in stacks.items():
        parts[part_of(stack)] += n
    return {part: n / total for part, n in parts.most_common()}


# Functions whose inclusive share (on the stack at all) says what a step costs whole.
STEPS: tuple[tuple[str, str], ...] = (
    ("the straight path: a Flight's steps (flight.py), each whole", r"^Flight\.\w+ \(proxy/pipeline/flight\.py"),
    ("ProxyHandler: our request path, whole (its awaits' callees included)", r"^ProxyHandler\._handle \("),
    ("  admit: limiter.acquire, decide", r"^ProxyHandler\.admit \("),
    ("  send: headers, write the request, await the answer's head", r"^send \(proxy/pipeline/forward\.py"),
    ("  relay: write the answer", r"^relay \(proxy/pipeline/forward\.py"),
    ("Ledger.close: outcome metric, access-log line", r"^Ledger\.close \("),
    ("data plane: Http1Connection.data_received (parse)", r"^Http1Connection\.data_received \("),
    ("data plane: Responder (head, body, socket writes)", r"^Responder\.(start|write|finish|send) \("),
    ("data plane: UpstreamConnection.data_received (parse)", r"^UpstreamConnection\.data_received \("),
    ("data plane: UpstreamConnection.request (head, socket write)", r"^UpstreamConnection\.request \("),
    ("Redis: pipelined _Protocol.data_received", r"^_Protocol\.data_received \(proxy/limiter"),
)


def inclusive(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    total = sum(stacks.values()) or 1
    out = {}
    for label, pattern in STEPS:
        rx = re.compile(pattern)
        out[label] = sum(n for stack, n in stacks.items() if any(rx.search(f) for f in stack)) / total
    return out


def print_breakdown(stacks: Counter[tuple[str, ...]], cpu_us: float | None) -> dict[str, object]:
    from _common import table

    parts = breakdown(stacks)
    steps = inclusive(stacks)

    def row(label: str, share: float) -> list[str]:
        return [label, f"{share * 100:.1f}%", "-" if cpu_us is None else f"{share * cpu_us:.0f}"]

    print(table([row(k, v) for k, v in parts.items()], ["part (innermost known frame)", "share", "µs/req"]))
    print()
    print(table([row(k, v) for k, v in steps.items()], ["step (inclusive: on the stack)", "share", "µs/req"]))
    return {"samples": sum(stacks.values()), "parts": parts, "inclusive": steps, "cpu_us_per_request": cpu_us}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/_profile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("stacks", help="py-spy --format raw output")
    p.add_argument("--cpu-us", type=float, help="CPU µs per request measured over the same window")
    p.add_argument("--top", type=int, default=0, help="also list the N most sampled innermost frames per part")
    args = p.parse_args(argv)
    with open(args.stacks) as f:
        stacks = read_collapsed(f)
    print_breakdown(stacks, args.cpu_us)
    if args.top:
        total = sum(stacks.values())
        leaves: dict[str, Counter[str]] = {}
        for stack, n in stacks.items():
            leaves.setdefault(part_of(stack), Counter())[stack[-1]] += n
        for part, c in leaves.items():
            print(f"\n{part}:")
            for frame, n in c.most_common(args.top):
                print(f"  {n / total * 100:5.1f}%  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
