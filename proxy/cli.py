"""The ``quota-proxy`` command: run, check, ca; and the developer tools' mock-vendor and demo,
which register themselves (``proxy.devtools.*_cli``).

Precedence: flag > environment (QUOTA_PROXY_CONFIG, QUOTA_PROXY_STORE, QUOTA_PROXY_ADMIN_TOKEN) > file.
Bad configuration never starts a server: exit 2, one line per problem on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence

from proxy.devtools import demo_cli, mockvendor_cli
from proxy.names import split_host_port
from proxy.policy import (
    ConfigErrors,
    Policy,
    load_policy,
    parse_address,
    parse_admin_token,
    parse_policy,
    parse_store_url,
    read_policy_text,
    summarize,
)
from proxy.policy.model import StoreSettings, Workers
from proxy.policy.sections import memory_with_workers, workers_value
from proxy.versions import version_report

EXIT_CONFIG = 2

log = logging.getLogger("quota_proxy")


class _VersionAction(argparse.Action):
    """argparse's own version action reflows its text into one paragraph: this keeps the lines,
    and reads the installed versions only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(version_report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each command's ``handler`` (``args.handler(args)``) runs it."""
    parser = argparse.ArgumentParser(
        prog="quota-proxy", description="An egress proxy that keeps a worker fleet inside a vendor's API quota."
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        nargs=0,
        help="print this release and the versions of Python and the libraries it runs on (for bug reports)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="serve the proxy and its admin endpoints",
        description="Serve the policy: workers connect to its listen address (HTTP_PROXY, HTTPS_PROXY or a "
        "route URL), the admin endpoints (/metrics /healthz /readyz /status, the live page at /) are on "
        "admin_listen. Flags win over the environment, which wins over the file. Bad configuration exits 2 "
        "without serving; SIGTERM drains and exits 0; SIGHUP and POST /reload reload the policy.",
    )
    _config_arg(run)
    run.add_argument("--listen", metavar="HOST:PORT", help="where workers connect (overrides the file)")
    run.add_argument("--admin-listen", metavar="HOST:PORT", help="/metrics /healthz /readyz /status")
    run.add_argument(
        "--store",
        metavar="URL",
        help="memory:// | redis://host:6379/0 | rediss://... | "
        "redis+cluster://host:port (default: $QUOTA_PROXY_STORE, then the file)",
    )
    run.add_argument(
        "--watch",
        action="store_true",
        help="reload the policy when the file changes (SIGHUP and POST /reload always do)",
    )
    run.add_argument(
        "--workers",
        type=_workers_arg,
        metavar="N|auto",
        help="processes serving the one listen address (auto: one per usable CPU; default: the file's "
        "workers, then 1); more than one needs a shared store",
    )
    # How the supervisor of --workers N starts each worker (proxy/ops/workers.py); not for people.
    run.add_argument("--worker-admin-socket", help=argparse.SUPPRESS)
    run.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    run.add_argument("--worker-policy", help=argparse.SUPPRESS)  # the supervisor's copy of -c's text
    run.add_argument(
        "--log-level",
        default=os.environ.get("QUOTA_PROXY_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="the level of the log on stderr (default: $QUOTA_PROXY_LOG_LEVEL, else info); the access log does "
        "not follow it (the policy's access_log switches it)",
    )
    run.set_defaults(handler=_run)

    check = sub.add_parser(
        "check",
        help="validate a policy and print its summary",
        description="Load the policy as run would, without serving it: exit 0 and print a summary (every "
        "default filled in, each vendor's worst case in any window; warnings on stderr), or exit 2 with one "
        "line per problem (file:line: path: message).",
    )
    _config_arg(check)
    check.add_argument(
        "--answers",
        action="store_true",
        help="also print each kind of the proxy's own answers per vendor, as its workers will see it",
    )
    check.set_defaults(handler=_check)

    mockvendor_cli.register(sub)
    demo_cli.register(sub)

    ca = sub.add_parser(
        "ca",
        help="the proxy's own CA, for HTTPS_PROXY interception",
        description="The CA the proxy signs intercepted vendors' certificates with (connect: intercept).",
    )
    ca_sub = ca.add_subparsers(dest="ca_command", required=True, metavar="CA_COMMAND")
    ca_init = ca_sub.add_parser(
        "init",
        help="create DIR/ca.pem and DIR/ca-key.pem (mode 0600)",
        description="Create the interception CA, DIR/ca.pem and DIR/ca-key.pem (mode 0600), name-constrained to "
        "the policy's vendor hosts and --permit's names, and print how workers trust it.",
    )
    ca_init.add_argument("--out", required=True, metavar="DIR", help="directory to write to (created if missing)")
    # No $QUOTA_PROXY_CONFIG default here: name constraints are baked into the CA for years,
    # so only an explicit -c decides them.
    ca_init.add_argument(
        "-c", "--config", metavar="FILE", help="constrain the CA to this policy's vendor hosts (name constraints)"
    )
    ca_init.add_argument(
        "--permit",
        type=_permit_list,
        action="extend",
        default=[],
        metavar="NAMES",
        help="comma-separated names the CA may vouch for: .domain suffixes (.stripe.com: every host under "
        "stripe.com), hosts (with their subdomains), IP addresses and networks (10.0.0.0/8); with -c, "
        "added to the policy's hosts",
    )
    ca_init.add_argument("--name", default="quota-proxy CA", metavar="CN", help="the CA's common name")
    ca_init.add_argument("--days", type=_positive_int, default=3650, metavar="N", help="validity (default 3650)")
    ca_init.add_argument("--rsa", action="store_true", help="RSA-2048 instead of EC P-256")
    ca_init.add_argument("--force", action="store_true", help="overwrite existing files")
    ca_init.set_defaults(handler=_ca_init)
    ca_show = ca_sub.add_parser(
        "show",
        help="print the configured CA's fingerprint and expiry",
        description="Print the policy's CA (tls.ca_cert): subject, fingerprint, expiry and name constraints.",
    )
    _config_arg(ca_show)
    ca_show.set_defaults(handler=_ca_show)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` (without the program name) parsed as ``quota-proxy`` would; a usage error exits 2."""
    return build_parser().parse_args(list(argv))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _workers_arg(text: str) -> Workers:
    try:
        return workers_value("--workers", text if text == "auto" else int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1 or auto, got {text!r}") from None


def _permit_list(text: str) -> list[str]:
    """``--permit``'s comma-separated entries, each checked as ``ca init`` will read it."""
    from proxy.ca.commands import parse_permit  # cryptography only for this command

    entries = [entry.strip() for entry in text.split(",")]
    for entry in entries:
        try:
            parse_permit(entry)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        default=os.environ.get("QUOTA_PROXY_CONFIG"),
        help="policy file (default: $QUOTA_PROXY_CONFIG)",
    )


def _load(path: str | None) -> Policy | None:
    loaded = _load_text(path)
    return None if loaded is None else loaded[1]


def _load_text(path: str | None, copy: str | None = None) -> tuple[str, Policy] | None:
    """The policy file at ``path`` and its text, read from ``copy`` when given (a worker of
    --workers N: the text its supervisor checked, named and resolved as the file); None
    after printing what is wrong."""
    if not path:
        print("quota-proxy: no policy: give -c FILE or set QUOTA_PROXY_CONFIG", file=sys.stderr)
        return None
    try:
        text = read_policy_text(copy or path)
        return text, parse_policy(text, path)
    except ConfigErrors as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return None


def _overridden(policy: Policy, args: argparse.Namespace) -> Policy:
    """The policy with the command line's and the environment's overrides; ValueError
    lists every bad one."""
    problems: list[str] = []
    changes: dict[str, object] = {}
    for flag, field in (("listen", "listen"), ("admin_listen", "admin_listen")):
        value = getattr(args, flag)
        if value is not None:
            try:
                changes[field] = parse_address(value)
            except ValueError as exc:
                problems.append(f"--{flag.replace('_', '-')}: {exc}")
    store_url = args.store if args.store is not None else os.environ.get("QUOTA_PROXY_STORE")
    if store_url is not None:
        origin = "--store" if args.store is not None else "QUOTA_PROXY_STORE"
        try:
            changes["store"] = dataclasses.replace(policy.store, url=parse_store_url(store_url))
        except ValueError as exc:
            problems.append(f"{origin}: {exc}")
    workers: Workers | None = getattr(args, "workers", None)  # only `run` has --workers
    if workers is not None:
        changes["workers"] = workers
    store = changes.get("store", policy.store)
    count = workers if workers is not None else policy.workers
    if isinstance(count, int) and count > 1 and isinstance(store, StoreSettings) and store.url == "memory://":
        # the file's own workers on memory:// was refused by the loader: here --store or the flag
        origin = f"--workers {count}" if workers is not None else "workers"
        problems.append(f"{origin}: {memory_with_workers(count)}")
    token = os.environ.get("QUOTA_PROXY_ADMIN_TOKEN")
    if token is not None:  # a Secret made from a file may end in a newline
        try:
            changes["admin_token"] = parse_admin_token(token.strip())
        except ValueError as exc:
            problems.append(f"QUOTA_PROXY_ADMIN_TOKEN: {exc}")
    if problems:
        raise ValueError("\n".join(problems))
    return dataclasses.replace(policy, **changes) if changes else policy  # type: ignore[arg-type]


def _apply_overrides(policy: Policy, args: argparse.Namespace) -> Policy | None:
    try:
        return _overridden(policy, args)
    except ValueError as exc:
        for problem in str(exc).splitlines():
            print(f"quota-proxy: {problem}", file=sys.stderr)
        return None


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def _run(args: argparse.Namespace) -> int:
    loaded = _load_text(args.config, args.worker_policy)
    if loaded is None:
        return EXIT_CONFIG
    # The supervisor of --workers N keeps this text for its workers: the policy they run is
    # the one checked here, never the file read again behind its back.
    text, read = loaded
    overridden = _apply_overrides(read, args)
    if overridden is None:
        return EXIT_CONFIG
    policy = overridden
    _setup_logging(args.log_level)
    _log_warnings(policy)
    if not policy.tls.upstream_verify:
        log.warning("tls.upstream_verify is false: vendors' certificates are NOT verified")

    def reload(text: str | None = None) -> Policy:
        """What SIGHUP, POST /reload and --watch load: the file (``text``, when the caller
        read it; a worker's: its supervisor's copy), then the same overrides."""
        if text is None:
            text = read_policy_text(args.worker_policy or args.config)
        return _log_warnings(_overridden(parse_policy(text, args.config), args))

    from proxy.server import WorkerSockets, serve

    if args.worker_admin_socket is not None:  # one of a supervisor's workers (the supervisor watches the file)
        _name_worker(args.worker_index)
        worker = WorkerSockets(args.worker_admin_socket, args.worker_index or 0)
        return _asyncio_run(serve(policy, policy.listen, policy.admin_listen, load=reload, worker=worker))
    count = _worker_count(policy)
    if count == 1:
        return _asyncio_run(
            serve(policy, policy.listen, policy.admin_listen, load=reload, watch=args.config if args.watch else None)
        )
    from proxy.ops.fleet import run_workers
    from proxy.ops.workers import WorkerCommand, worker_argv

    base = ["-c", args.config, "--log-level", args.log_level]
    if args.store is not None:
        base += ["--store", args.store]
    if args.admin_listen is not None:  # the workers' admin is a socket; kept for their policy's checks
        base += ["--admin-listen", args.admin_listen]
    command = WorkerCommand(worker_argv(base))
    return asyncio.run(run_workers(policy, count, command, reload, text, args.watch))


def _worker_count(policy: Policy) -> int:
    """``workers`` resolved: ``auto`` is the usable CPUs, or 1 on memory:// (buckets in one
    process); an explicit count above 1 on memory:// was refused with the policy."""
    if policy.workers != "auto":
        return policy.workers
    from proxy.ops.workers import usable_cpus

    cpus = usable_cpus()
    if cpus > 1 and policy.store.url == "memory://":
        log.info("workers: auto is 1 with store memory:// (its buckets live in one process), not %d", cpus)
        return 1
    log.info("workers: auto is %d (usable CPUs)", cpus)
    return cpus


def _name_worker(index: int | None) -> None:
    """A worker's log lines say which worker wrote them."""
    tag = f"quota_proxy[worker {index if index is not None else '?'} pid {os.getpid()}]"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag} %(name)s %(message)s"))


def _log_warnings(policy: Policy) -> Policy:
    for warning in policy.warnings:
        log.warning("policy: %s", warning)
    return policy


def _asyncio_run(coro: object) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(coro)  # type: ignore[arg-type]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)  # type: ignore[arg-type]


def _check(args: argparse.Namespace) -> int:
    policy = _load(args.config)
    if policy is None:
        return EXIT_CONFIG
    for warning in policy.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(summarize(policy))
    if args.answers:
        from proxy.pipeline.answer_samples import describe

        for vendor in policy.vendors:
            print()
            print(describe(vendor))
    return 0


def _ca_init(args: argparse.Namespace) -> int:
    from proxy.ca.authority import CAError, CertificateAuthority
    from proxy.ca.commands import constraint_lines, init_ca, trust_instructions

    hosts: list[str] = []
    if args.config:
        try:  # the CA files the policy names need not exist yet: this command makes them
            policy = load_policy(args.config, check_ca=False)
        except ConfigErrors as exc:
            for error in exc.errors:
                print(error, file=sys.stderr)
            return EXIT_CONFIG
        hosts = _vendor_hosts(policy)
        if not hosts and not args.permit:
            print(f"quota-proxy: {args.config} lists no vendor hosts: the CA is not name-constrained", file=sys.stderr)
    try:
        cert_path, key_path = init_ca(
            args.out,
            common_name=args.name,
            days=args.days,
            key_type="rsa" if args.rsa else "ec",
            permitted_hosts=[*args.permit, *hosts],  # a policy host under a --permit suffix is left out
            force=args.force,
        )
    except (CAError, ValueError) as exc:
        print(f"quota-proxy: ca init: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {cert_path} (the CA certificate, for workers)")
    print(f"wrote {key_path} (the CA private key, mode 0600: keep it on the proxy)")
    constraints = CertificateAuthority.load(cert_path, key_path).name_constraints
    if constraints is not None:
        print("\n".join(constraint_lines(constraints, recipe=False)))
    print()
    print(trust_instructions(cert_path), end="")
    return 0


def _vendor_hosts(policy: Policy) -> list[str]:
    """Every vendor host without its port (and IPv6 without brackets), once, in file order."""
    hosts: list[str] = []
    for vendor in policy.vendors:
        for entry in vendor.hosts:
            host = split_host_port(entry)[0]
            if host not in hosts:
                hosts.append(host)
    return hosts


def _ca_show(args: argparse.Namespace) -> int:
    policy = _load(args.config)
    if policy is None:
        return EXIT_CONFIG
    if policy.tls.ca_cert is None or policy.tls.ca_key is None:
        print(
            f"quota-proxy: {policy.source}: no CA configured (set tls.ca_cert and tls.ca_key; "
            "`quota-proxy ca init --out DIR` creates one)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    from proxy.ca.authority import CAError, CertificateAuthority
    from proxy.ca.commands import describe

    try:
        ca = CertificateAuthority.load(policy.tls.ca_cert, policy.tls.ca_key)
    except CAError as exc:  # the loader checked it; the files may have changed since
        print(f"quota-proxy: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(describe(ca))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)
