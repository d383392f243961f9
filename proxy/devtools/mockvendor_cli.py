"""``quota-proxy mock-vendor``: its arguments, checked, then the mock vendor served until a signal.

Light on purpose: ``proxy.cli`` imports it to build the command line, and aiohttp (through
``mockvendor``) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from proxy.devtools.mockvendor_tokens import DEFAULT_TOKEN_WINDOW
from proxy.policy.durations import parse_duration
from proxy.policy.values import parse_address
from proxy.quota.estimates import DEFAULT_COMPLETION_CAP

if TYPE_CHECKING:
    import ssl

__all__ = ["DEFAULT_LISTEN", "register", "run"]

QUOTA_HEADERS: Final = (  # mockvendor_quota.QUOTA_HEADERS
    "x-ratelimit",
    "ietf",
    "openai",
    "anthropic",
    "shopify",
    "none",
)

DEFAULT_LISTEN: Final = "127.0.0.1:8081"


def _parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT by the same grammar as the proxy's own ``--listen``."""
    try:
        address = parse_address(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return address.host, address.port


def _parse_window(value: str) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError("the window must be longer than 0")
    return seconds


def _positive(what: str) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 of ``what``."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise argparse.ArgumentTypeError(f"{value!r}: expected a positive number of {what}")
        return number

    return parse


_parse_tokens = _positive("tokens per minute")
_parse_points = _positive("points")


def _parse_change(value: str) -> tuple[float, float]:
    at, sep, rate = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{value!r}: expected DURATION=RATE, e.g. 20s=70")
    try:
        seconds = parse_duration(at.strip())
        per_second = float(rate)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    if not math.isfinite(per_second) or per_second <= 0 or seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: expected DURATION=RATE, e.g. 20s=70")
    return seconds, per_second


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mock-vendor`` and its arguments to ``commands``; its ``handler`` is ``run``."""
    parser = commands.add_parser(
        "mock-vendor",
        help="a local vendor that enforces its own quota (for demos and tests)",
        description="Serve a mock vendor API that enforces its own token-bucket quota.",
    )
    parser.add_argument(
        "--listen",
        type=_parse_listen,
        default=_parse_listen(DEFAULT_LISTEN),
        metavar="HOST:PORT",
        help=f"where to listen (default {DEFAULT_LISTEN}; port 0 picks a free port)",
    )
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100; 0 = unlimited)")
    parser.add_argument("--burst", type=float, default=None, help="bucket capacity (default: the rate)")
    parser.add_argument(
        "--window",
        type=_parse_window,
        default=None,
        metavar="DURATION",
        help="a strict sliding window instead of the bucket: at most rate x DURATION requests accepted in any "
        "DURATION (e.g. 1s, 500ms, 1m), each counted on arrival; 429 beyond",
    )
    parser.add_argument(
        "--quota-headers",
        choices=QUOTA_HEADERS,
        default="x-ratelimit",
        help="the family of quota headers answers carry (default x-ratelimit): X-RateLimit-*, IETF RateLimit "
        "and RateLimit-Policy, OpenAI's x-ratelimit-*-requests, Anthropic's anthropic-ratelimit-requests-*, "
        "Shopify's call limit, or none (OpenAI's and Anthropic's paths always carry their vendor's)",
    )
    tokens = parser.add_argument_group(
        "token quotas",
        "LLM vendors count tokens besides requests. Each option below adds a strict sliding window of "
        "N x --token-window / 60 tokens: a request is admitted by the vendor's own estimate at arrival (as "
        "the proxy's meters estimate it) and refused with the vendor's 429 for tokens when the window lacks "
        "room; its answer's usage replaces the estimate once produced. /__mock/stats reports each window "
        "(token_windows: limit, used, tokens_window_max, tokens_accepted, rejected). A request to OpenAI's or "
        "Anthropic's paths may ask for a reply of N tokens with the mock-only header X-Mock-Output-Tokens: N "
        "(cut to its completion cap; streamed in pieces, its usage says so): how a bench drives the usage.",
    )
    tokens.add_argument(
        "--tokens-per-minute",
        type=_parse_tokens,
        default=None,
        metavar="N",
        help="OpenAI's paths: tokens per minute (TPM), estimated as ceil(prompt characters / 4) + the "
        f"completion cap (max_completion_tokens, max_tokens or max_output_tokens; {DEFAULT_COMPLETION_CAP:g} if "
        "none) x n, then "
        "usage.total_tokens; answers carry x-ratelimit-*-tokens (default: not counted)",
    )
    tokens.add_argument(
        "--input-tokens-per-minute",
        type=_parse_tokens,
        default=None,
        metavar="N",
        help="Anthropic's /v1/messages: input tokens per minute, estimated as ceil(input characters / 4), "
        "then usage.input_tokens; answers carry anthropic-ratelimit-input-tokens-* (default: not counted)",
    )
    tokens.add_argument(
        "--output-tokens-per-minute",
        type=_parse_tokens,
        default=None,
        metavar="N",
        help="Anthropic's /v1/messages: output tokens per minute, counted as max_tokens at arrival, then "
        "usage.output_tokens; answers carry anthropic-ratelimit-output-tokens-* (default: not counted)",
    )
    tokens.add_argument(
        "--token-window",
        type=_parse_window,
        default=None,
        metavar="DURATION",
        help=f"the token windows' span (default {DEFAULT_TOKEN_WINDOW:g}s, e.g. 10s, 1m): at most "
        "N x DURATION / 60 tokens in any DURATION",
    )
    graphql = parser.add_argument_group("Shopify's GraphQL points (POST /admin/api/VERSION/graphql.json)")
    graphql.add_argument(
        "--graphql-points",
        type=_parse_points,
        default=1000.0,
        metavar="N",
        help="the shop's bucket of query-cost points (default 1000): a query runs when it holds the query's "
        "requested cost (X-Mock-Query-Cost, default 10) and takes its actual one (X-Mock-Actual-Cost); "
        "else 200 with a THROTTLED error, as Shopify answers",
    )
    graphql.add_argument(
        "--graphql-restore",
        type=_parse_points,
        default=50.0,
        metavar="N",
        help="points the bucket regains a second (default 50)",
    )
    parser.add_argument(
        "--limit-at",
        type=_parse_change,
        action="append",
        default=[],
        metavar="DURATION=RATE",
        help="change the limit to RATE requests/s DURATION after start, keeping what the quota counted "
        '(repeatable; e.g. --limit-at 20s=70 --limit-at 40s=100); also POST /__mock/limit {"rate": r}',
    )
    parser.add_argument(
        "--tls",
        metavar="DIR",
        help="serve HTTPS with certificates from the CA in DIR (ca.pem and ca-key.pem, as `quota-proxy ca init "
        "--out DIR` writes them; made there first if DIR has none), for whichever host name a client asks "
        "(api.stripe.com, api.openai.com, localhost, 127.0.0.1...): trust DIR/ca.pem",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve HTTPS with this certificate chain (PEM) instead; --tls-key names its key",
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    parser.set_defaults(handler=functools.partial(run, parser=parser))


def run(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> int:
    """Serve until SIGTERM or SIGINT, then exit 0; a bad ``--rate``, ``--burst`` or ``--window``
    is ``parser``'s usage error."""
    host, port = args.listen
    rate: float = args.rate
    burst: float | None = args.burst
    if not math.isfinite(rate) or rate < 0:
        parser.error("--rate must be 0 (unlimited) or a positive number")
    if burst is not None and (not math.isfinite(burst) or burst < 1):
        parser.error("--burst must be at least 1")
    window: float | None = args.window
    if window is not None:
        if rate == 0:
            parser.error("--window needs a --rate (an unlimited vendor counts nothing)")
        if burst is not None:
            parser.error("--window replaces the bucket: give --rate and --window, not --burst")
        if rate * window < 1:
            parser.error("--rate x --window must be at least 1 request")
    from proxy.devtools.mockvendor import MockVendor
    from proxy.devtools.mockvendor_serve import serve

    if args.limit_at and rate == 0:
        parser.error("--limit-at needs a --rate (an unlimited vendor has no limit to change)")
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls is not None and args.tls_cert is not None:
        parser.error("--tls makes its own certificates: give --tls DIR or --tls-cert/--tls-key, not both")
    import ssl

    tls: ssl.SSLContext | None = None
    if args.tls is not None:
        tls = _ca_context(args.tls, parser)
    elif args.tls_cert is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            tls.load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as exc:
            parser.error(f"--tls-cert/--tls-key: {exc}")
    per_minute = (args.tokens_per_minute, args.input_tokens_per_minute, args.output_tokens_per_minute)
    if args.token_window is not None and all(n is None for n in per_minute):
        parser.error(
            "--token-window needs --tokens-per-minute, --input-tokens-per-minute or --output-tokens-per-minute"
        )
    try:
        vendor = MockVendor(
            None if rate == 0 else rate,
            burst,
            window=window,
            quota_headers=args.quota_headers,
            tokens_per_minute=args.tokens_per_minute,
            input_tokens_per_minute=args.input_tokens_per_minute,
            output_tokens_per_minute=args.output_tokens_per_minute,
            token_window=DEFAULT_TOKEN_WINDOW if args.token_window is None else args.token_window,
            graphql_points=args.graphql_points,
            graphql_restore=args.graphql_restore,
        )
    except ValueError as exc:  # a window of less than one token
        parser.error(str(exc))
    return serve(vendor, host, port, tuple(args.limit_at), tls)


def _ca_context(directory: str, parser: argparse.ArgumentParser) -> ssl.SSLContext:
    """``--tls DIR``'s server context; says on stderr which CA clients must trust."""
    from pathlib import Path

    from proxy.ca.authority import CAError
    from proxy.devtools.mockvendor_tls import vendor_tls

    try:
        tls = vendor_tls(Path(directory))
    except (CAError, ValueError) as exc:
        parser.error(f"--tls {directory}: {exc}")
    made = "made now, " if tls.made else ""
    print(f"mock-vendor: HTTPS certificates signed by {tls.ca_file.absolute()} ({made}trust it)", file=sys.stderr)
    return tls.context
