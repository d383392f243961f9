#!/usr/bin/env python3
"""HTTPS through HTTPS_PROXY: what TLS interception costs.

A mock vendor served over TLS (its certificate from a vendor CA made here), the
proxy's own CA from ``proxy.ca.commands.init_ca`` (name-constrained to the vendor host),
and one proxy replica intercepting ``CONNECT api.bench.example:443``. Three parts:

1. Added latency. The same open-loop paced load (request i launched at t0 + i/rate,
   keep-alive pools on both sides, a warm-up that is not measured) sent
   (a) directly to the vendor over HTTPS, (b) through the proxy with interception
   (the client speaks TLS to the proxy inside a CONNECT tunnel; the proxy speaks TLS
   to the vendor), and (c) as plain HTTP to the proxy, which originates TLS to the
   vendor (``upstream: https://``) — the hop without interception, for reference.
   p50/p90/p99/max and the differences from direct. Also the set-up time of a new
   connection: a TLS handshake straight to the vendor versus CONNECT + handshake with
   the proxy (its leaf already cached).
2. Leaf minting. The proxy's own ``ratelimit_leaf_mint_seconds`` (its first mint),
   and ``LeafMinter`` timed directly over many distinct hosts (cold mints and cache
   hits) for an EC P-256 CA and an RSA-2048 CA.
3. Saturation. A closed-loop generator (raw asyncio, TLS inside CONNECT tunnels,
   one request in flight per keep-alive connection) against one replica pinned to
   CPU 1 (generator, vendor and Redis on CPU 0): requests/s and the proxy's CPU per
   request, intercepted and as plain HTTP with TLS origination.

    python bench/https.py
    python bench/https.py --rate 200 --duration 5 --stores memory --sat-duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import json
import re
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    LOOPBACK,
    ROOT,
    VENDOR_HOST,
    BenchError,
    Fleet,
    Limit,
    Proc,
    cpu_busy,
    cpu_seconds,
    dump_json,
    fetch_metrics,
    loadavg,
    metric_sum,
    outcomes,
    paced,
    percentile,
    policy,
    require_pinning,
    run_main,
    table,
    wait_cpu,
    watchdog,
)

if str(ROOT) not in sys.path:  # the checkout's proxy package, for its CA tooling
    sys.path.insert(0, str(ROOT))

BENCH = Path(__file__).resolve().parent
PCTS = (50, 90, 99)
HUGE = 1_000_000_000
PATH = "/v1/ping"
_VENDOR_READY = re.compile(r"mock-vendor listening on https://(\S+)")


# -- certificates ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    proxy_ca: Path
    proxy_key: Path
    vendor_ca: Path
    vendor_cert: Path
    vendor_key: Path


def make_certs(workdir: Path) -> Certs:
    """The proxy's CA (as ``quota-proxy ca init`` makes it) and a vendor CA with a server
    certificate for localhost / 127.0.0.1, all with ``cryptography``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    from proxy.ca.authority import CertificateAuthority
    from proxy.ca.commands import init_ca

    proxy_ca, proxy_key = init_ca(workdir / "proxy-ca", permitted_hosts=[VENDOR_HOST])
    vendor_ca_cert, vendor_ca_key = init_ca(workdir / "vendor-ca", common_name="bench vendor CA")
    ca = CertificateAuthority.load(vendor_ca_cert, vendor_ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(LOOPBACK))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(ca.authority_key_identifier, critical=False)
        .sign(ca.private_key, hashes.SHA256())
    )
    vendor_cert, vendor_key = workdir / "vendor.pem", workdir / "vendor-key.pem"
    vendor_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    vendor_key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    vendor_key.chmod(0o600)
    return Certs(proxy_ca, proxy_key, vendor_ca_cert, vendor_cert, vendor_key)


def client_context(cafile: Path) -> ssl.SSLContext:
    """A worker's context: verification on, trusting ``cafile`` only."""
    return ssl.create_default_context(cafile=str(cafile))


# -- child roles: the TLS mock vendor and the TLS load generator -------------------------------


def serve_vendor(argv: list[str]) -> int:
    """``https.py _vendor --listen H:P --cert C --key K``: an unlimited MockVendor over TLS."""
    from aiohttp import web

    from proxy.devtools.mockvendor import MockVendor

    p = argparse.ArgumentParser(prog="bench/https.py _vendor")
    p.add_argument("--listen", default=f"{LOOPBACK}:0")
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    args = p.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.cert, args.key)
    ctx.set_alpn_protocols(["http/1.1"])

    async def serve() -> int:
        import signal

        vendor = MockVendor(rate=None)
        runner = web.ServerRunner(web.Server(vendor.handle, access_log=None), shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, host, int(port), ssl_context=ctx, backlog=1024)
        await site.start()
        print(f"mock-vendor listening on https://{LOOPBACK}:{runner.addresses[0][1]}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        return 0

    return _run(serve())


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


class _ConnectReply(asyncio.Protocol):
    """Reads the proxy's answer to a CONNECT (nothing else arrives before the TLS handshake)."""

    def __init__(self, established: asyncio.Future[None]) -> None:
        self.established = established
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" in self.buf and not self.established.done():
            if self.buf.startswith(b"HTTP/1.1 200"):
                self.established.set_result(None)
            else:
                self.established.set_exception(BenchError(f"CONNECT refused: {bytes(self.buf[:200])!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.established.done():
            self.established.set_exception(BenchError("the proxy closed the connection before answering CONNECT"))


async def open_tunnel(
    loop: asyncio.AbstractEventLoop, host: str, port: int, ctx: ssl.SSLContext, protocol: asyncio.Protocol
) -> asyncio.Transport:
    """CONNECT api.bench.example:443 through the proxy at host:port, then TLS with ``protocol`` on top."""
    established: asyncio.Future[None] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _ConnectReply(established), host, port)
    transport.write(f"CONNECT {VENDOR_HOST}:443 HTTP/1.1\r\nHost: {VENDOR_HOST}:443\r\n\r\n".encode())
    await established
    tls = await loop.start_tls(transport, protocol, ctx, server_hostname=VENDOR_HOST)
    if tls is None:
        raise BenchError("the proxy closed the connection during the TLS handshake")
    return tls


def loadgen(argv: list[str]) -> int:
    """``https.py _loadgen --connect H:P --mode intercept|plain --ca CA ...``: bench/_loadgen.py's
    closed loop, with each keep-alive connection a CONNECT tunnel carrying TLS (intercept) or
    plain absolute-form HTTP (plain). Prints one JSON line."""
    from _loadgen import _Conn  # the same per-connection request loop as throughput.py's generator

    p = argparse.ArgumentParser(prog="bench/https.py _loadgen")
    p.add_argument("--connect", required=True)
    p.add_argument("--mode", choices=["intercept", "plain"], required=True)
    p.add_argument("--ca", required=True, help="the proxy's CA certificate (intercept)")
    p.add_argument("--connections", type=int, default=50)
    p.add_argument("--duration", type=float, default=10.0)
    args = p.parse_args(argv)
    host, _, port_text = args.connect.rpartition(":")
    if not host.startswith("127."):
        p.error("loopback targets only")
    port = int(port_text)
    target = PATH if args.mode == "intercept" else f"http://{VENDOR_HOST}{PATH}"
    request = f"GET {target} HTTP/1.1\r\nHost: {VENDOR_HOST}\r\nUser-Agent: quota-bench\r\n\r\n".encode()
    ctx = client_context(Path(args.ca))

    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        stats = {"requests": 0, "non2xx": 0, "errors": 0}
        start = time.monotonic()
        deadline = start + args.duration
        futures: list[asyncio.Future[None]] = []

        async def one() -> None:
            done: asyncio.Future[None] = loop.create_future()
            conn = _Conn(request, stats, deadline, done)
            try:
                if args.mode == "plain":
                    await loop.create_connection(lambda: conn, host, port)
                else:
                    conn.connection_made(await open_tunnel(loop, host, port, ctx, conn))
            except (OSError, ssl.SSLError, BenchError):
                stats["errors"] += 1
                return
            futures.append(done)

        await asyncio.gather(*(one() for _ in range(args.connections)))
        if futures:
            await asyncio.wait(futures, timeout=args.duration + 10)
        return {**stats, "elapsed": time.monotonic() - start}

    print(json.dumps(_run(run())), flush=True)
    return 0


# -- the pieces the bench owns -------------------------------------------------------------------


def start_vendor(fleet: Fleet, certs: Certs, cpus: str | None) -> Proc:
    proc = fleet.start(
        "vendor-tls",
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "_vendor",
            "--listen",
            f"{LOOPBACK}:0",
            "--cert",
            str(certs.vendor_cert),
            "--key",
            str(certs.vendor_key),
        ],
        cpus=cpus,
    )
    proc.url = "https://" + fleet.wait_line(proc, _VENDOR_READY).group(1)
    return proc


def intercept_policy(vendor_url: str, certs: Certs, store: str) -> str:
    """The bench vendor at ``vendor_url`` (https), intercepted: connect defaults to intercept
    once tls.ca_cert is set. The limit never binds."""
    yaml = policy(vendor_url, [Limit(HUGE, "1s", HUGE)], store=store, action="defer", access_log=True)
    return yaml + tls_section(certs)


def tls_section(certs: Certs) -> str:
    """The policy's ``tls:`` section: the proxy's CA, and the vendor CA to verify upstream with."""
    return (
        f"tls:\n  ca_cert: {certs.proxy_ca}\n  ca_key: {certs.proxy_key}\n"
        f"  upstream_ca_file: {certs.vendor_ca}\n  leaf_validity: 1d\n"
    )


# -- 1. latency ------------------------------------------------------------------------------------


async def setup_times(vendor_url: str, proxy_url: str | None, ctx: ssl.SSLContext, n: int) -> list[float]:
    """Seconds to a usable TLS connection, ``n`` times in a row: a handshake straight to the
    vendor, or (``proxy_url``) CONNECT + handshake with the proxy's leaf."""
    loop = asyncio.get_running_loop()
    out: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        if proxy_url is None:
            host, _, port = vendor_url.removeprefix("https://").rpartition(":")
            transport, _ = await loop.create_connection(
                asyncio.Protocol, host, int(port), ssl=ctx, server_hostname="localhost"
            )
        else:
            host, _, port = proxy_url.removeprefix("http://").rpartition(":")
            transport = await open_tunnel(loop, host, int(port), ctx, asyncio.Protocol())
        out.append(time.perf_counter() - t)
        transport.close()
    return out


def summarize(lat: list[float]) -> dict[str, float]:
    s = sorted(lat)
    out = {f"p{p}": percentile(s, p) * 1000 for p in PCTS}
    out["max"] = s[-1] * 1000
    out["mean"] = sum(s) / len(s) * 1000
    return out


def latency_phase(
    fleet: Fleet, args: argparse.Namespace, certs: Certs, vendor: Proc, redis: Proc | None, results: dict[str, Any]
) -> None:
    vendor_ctx, proxy_ctx = client_context(certs.vendor_ca), client_context(certs.proxy_ca)
    lat, errors, statuses, achieved = _run(
        paced(vendor.url + PATH, None, args.rate, args.duration, args.warmup, ctx=vendor_ctx)
    )
    if not lat or errors or set(statuses) != {200}:
        raise BenchError(f"direct phase: {errors} errors, statuses {statuses}")
    results["direct"] = {**summarize(lat), "n": len(lat), "achieved_rate": achieved}
    results["setup_direct"] = summarize(_run(setup_times(vendor.url, None, vendor_ctx, args.setups)))

    for store in args.stores:
        url = redis.url if store == "redis" and redis is not None else "memory://"
        proxy = fleet.proxy(intercept_policy(vendor.url, certs, url), name=f"proxy-{store}")
        phases = [(f"intercept ({store})", f"https://{VENDOR_HOST}{PATH}", proxy_ctx)]
        if store == args.stores[0]:
            phases.append((f"plain→https ({store})", f"http://{VENDOR_HOST}{PATH}", proxy_ctx))
        try:
            for name, url_, ctx in phases:
                marks: dict[str, float] = {}

                def mark(pid: int = proxy.pid, marks: dict[str, float] = marks) -> None:
                    marks["cpu0"] = cpu_seconds(pid)

                before = outcomes(fetch_metrics(proxy.admin_url))
                lat, errors, statuses, achieved = _run(
                    paced(url_, proxy.url, args.rate, args.duration, args.warmup, mark, ctx=ctx)
                )
                cpu1 = cpu_seconds(proxy.pid)
                after = outcomes(fetch_metrics(proxy.admin_url))
                if not lat or errors or set(statuses) != {200}:
                    store_errors = metric_sum(fetch_metrics(proxy.admin_url), "ratelimit_store_errors_total")
                    raise BenchError(
                        f"{name}: {errors} errors, statuses {statuses}, proxy outcomes {after}, "
                        f"store errors {store_errors:.0f} (store.timeout is 50ms: a busy machine "
                        "can exceed it)"
                    )
                bound = {k: v - before.get(k, 0) for k, v in after.items() if k != "forwarded" and v > before.get(k, 0)}
                if bound:
                    raise BenchError(f"{name}: the limiter bound ({bound}); the load must stay unlimited")
                summary = summarize(lat)
                results[name] = {
                    **summary,
                    "n": len(lat),
                    "achieved_rate": achieved,
                    "added": {k: summary[k] - results["direct"][k] for k in summary},
                    "cpu_us_per_request": (cpu1 - marks["cpu0"]) / len(lat) * 1e6,
                }
            if store == args.stores[0]:
                results["setup_tunnel"] = summarize(_run(setup_times(vendor.url, proxy.url, proxy_ctx, args.setups)))
            samples = fetch_metrics(proxy.admin_url)
            count = metric_sum(samples, "ratelimit_leaf_mint_seconds_count")
            results.setdefault("proxy_mints", []).append(
                {
                    "store": store,
                    "count": count,
                    "mean_ms": metric_sum(samples, "ratelimit_leaf_mint_seconds_sum") / count * 1000 if count else None,
                }
            )
            modes = {labels.get("mode"): v for n, labels, v in samples if n == "ratelimit_requests_by_mode_total"}
            results.setdefault("requests_by_mode", {})[store] = modes
        finally:
            results.setdefault("exit_codes", {})[f"proxy-{store}"] = fleet.stop(proxy)


# -- 2. leaf minting ------------------------------------------------------------------------------


def mint_phase(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from proxy.ca.authority import CertificateAuthority
    from proxy.ca.commands import init_ca
    from proxy.ca.leaves import LeafMinter

    out: dict[str, Any] = {}
    for key_type in ("ec", "rsa"):
        cert, key = init_ca(workdir / f"mint-{key_type}", key_type=key_type, permitted_hosts=[VENDOR_HOST])
        ca = CertificateAuthority.load(cert, key)
        hosts = [f"h{i}.{VENDOR_HOST}" for i in range(args.mint_hosts)]
        with LeafMinter(ca, 86400.0, cache_size=len(hosts) + 1) as minter:
            cold, hits = [], []
            for host in hosts:
                t = time.perf_counter()
                minter.context_for(host)
                cold.append(time.perf_counter() - t)
            for host in hosts:
                t = time.perf_counter()
                minter.context_for(host)
                hits.append(time.perf_counter() - t)
        out[key_type] = {"hosts": len(hosts), "cold": summarize(cold), "hit_us": summarize(hits)["p50"] * 1000}
    return out


# -- 3. saturation --------------------------------------------------------------------------------


def generate(
    fleet: Fleet, mode: str, proxy: Proc, certs: Certs, connections: int, duration: float, cpus: str | None
) -> tuple[dict[str, float], float]:
    proc = fleet.start(
        f"loadgen-{mode}",
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "_loadgen",
            "--connect",
            proxy.url.removeprefix("http://"),
            "--mode",
            mode,
            "--ca",
            str(certs.proxy_ca),
            "--connections",
            str(connections),
            "--duration",
            f"{duration:g}",
        ],
        cpus=cpus,
    )
    cpu = wait_cpu(proc, duration + 30)
    code = proc.popen.returncode
    fleet.stop(proc)
    if code != 0:
        raise BenchError(f"the load generator exited {code}:\n{proc.tail()}")
    try:
        return json.loads(proc.stdout.read_text().strip().splitlines()[-1]), cpu
    except (ValueError, IndexError):
        raise BenchError(f"cannot read the load generator's output:\n{proc.tail()}") from None


def saturation_phase(
    fleet: Fleet, args: argparse.Namespace, certs: Certs, vendor: Proc, redis: Proc | None
) -> list[dict[str, Any]]:
    store = redis.url if args.sat_store == "redis" and redis is not None else "memory://"
    proxy = fleet.proxy(intercept_policy(vendor.url, certs, store), name="proxy-saturation", cpus=args.proxy_cpu)
    rows = []
    try:
        for mode in args.sat_modes:
            generate(fleet, mode, proxy, certs, args.connections, args.sat_warmup, args.load_cpu)
            before = outcomes(fetch_metrics(proxy.admin_url))
            others = [p for p in (vendor, redis) if p is not None]
            others0 = sum(cpu_seconds(p.pid) for p in others)
            busy0 = cpu_busy()
            cpu0, t0 = cpu_seconds(proxy.pid), time.monotonic()
            load, gen_cpu = generate(fleet, mode, proxy, certs, args.connections, args.sat_duration, args.load_cpu)
            cpu1, t1 = cpu_seconds(proxy.pid), time.monotonic()
            busy1 = cpu_busy()
            others1 = sum(cpu_seconds(p.pid) for p in others)
            after = outcomes(fetch_metrics(proxy.admin_url))
            done = int(load["requests"])
            if done <= 0:
                raise BenchError(f"saturation {mode}: no request completed\n{proxy.tail()}")
            window = t1 - t0
            proxy_cpus = [f"cpu{c}" for c in (args.proxy_cpu or "").split(",") if c.isdigit()]
            core_busy = sum(busy1[c] - busy0[c] for c in proxy_cpus) if proxy_cpus else None
            rows.append(
                {
                    "mode": mode,
                    "requests": done,
                    "rps": done / load["elapsed"],
                    "cpu_us_per_request": (cpu1 - cpu0) / done * 1e6,
                    "proxy_core_utilisation": (cpu1 - cpu0) / window,
                    "proxy_core_others": None if core_busy is None else max(core_busy - (cpu1 - cpu0), 0.0) / window,
                    "load_core_utilisation": (gen_cpu + others1 - others0) / window,
                    "non2xx": load["non2xx"],
                    "errors": load["errors"],
                    "outcomes": {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)},
                }
            )
    finally:
        code = fleet.stop(proxy)
    for r in rows:
        r["exit_code"] = code
    return rows


# -- main -----------------------------------------------------------------------------------------


def main(fleet: Fleet, argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/https.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rate", type=float, default=300.0, help="latency: offered load, req/s (default 300)")
    p.add_argument("--duration", type=float, default=10.0, help="latency: measured seconds per path (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="latency: unmeasured seconds first (default 2)")
    p.add_argument("--stores", default="redis", help="latency: proxy stores, comma-separated (default redis)")
    p.add_argument("--setups", type=int, default=200, help="new-connection set-ups timed per path (default 200)")
    p.add_argument("--mint-hosts", type=int, default=500, help="distinct hosts minted per CA key type (default 500)")
    p.add_argument("--sat-modes", default="intercept,plain", help="saturation: intercept and/or plain")
    p.add_argument("--sat-store", choices=["redis", "memory"], default="redis", help="saturation store")
    p.add_argument("--sat-duration", type=float, default=10.0, help="saturation: measured seconds per mode")
    p.add_argument("--sat-warmup", type=float, default=3.0, help="saturation: unmeasured seconds first")
    p.add_argument("--connections", type=int, default=50, help="saturation: keep-alive connections (default 50)")
    p.add_argument("--proxy-cpu", default="1", help="taskset CPU list for the proxy (default 1)")
    p.add_argument("--load-cpu", default="0", help="taskset CPU list for generator, vendor, redis (default 0)")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything (figures then mean less)")
    p.add_argument("--skip", default="", help="parts to skip, comma-separated: latency, mint, saturation")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 2 when interception adds more than 2 ms at p50 or 10 ms at p99 over direct HTTPS",
    )
    args = p.parse_args(argv)
    args.stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    args.sat_modes = [s.strip() for s in args.sat_modes.split(",") if s.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if not args.stores or not set(args.stores) <= {"redis", "memory"}:
        p.error("--stores takes redis and/or memory")
    if not set(args.sat_modes) <= {"intercept", "plain"}:
        p.error("--sat-modes takes intercept and/or plain")
    if not skip <= {"latency", "mint", "saturation"}:
        p.error("--skip takes latency, mint, saturation")
    if args.no_pin:
        args.proxy_cpu = args.load_cpu = None
    elif "saturation" not in skip:
        require_pinning()
    budget = 60 + (0 if "latency" in skip else (len(args.stores) + 2) * (args.duration + args.warmup + 20))
    budget += 0 if "saturation" in skip else len(args.sat_modes) * (args.sat_duration + args.sat_warmup + 60)
    watchdog(fleet, budget)

    print(f"bench/https.py: load average {loadavg()} at start (2 cores shared: figures are provisional)")
    certs = make_certs(fleet.workdir)
    need_redis = ("latency" not in skip and "redis" in args.stores) or (
        "saturation" not in skip and args.sat_store == "redis"
    )
    vendor = start_vendor(fleet, certs, args.load_cpu)
    redis = fleet.redis(cpus=args.load_cpu) if need_redis else None
    results: dict[str, Any] = {"rate": args.rate, "duration": args.duration}
    missed: list[str] = []

    if "latency" not in skip:
        latency_phase(fleet, args, certs, vendor, redis, results)
        paths = ["direct", *[k for k in results if k.startswith(("intercept (", "plain→https ("))]]
        rows = []
        for name in paths:
            r = results[name]
            row = [name, r["n"], f"{r['achieved_rate']:.0f}", *(f"{r[f'p{q}']:.3f}" for q in PCTS), f"{r['max']:.2f}"]
            row += (
                ["", "", "", ""]
                if name == "direct"
                else [*(f"{r['added'][f'p{q}']:+.3f}" for q in PCTS), f"{r['cpu_us_per_request']:.0f}"]
            )
            rows.append(row)
        print(
            f"\n1. latency: {args.rate:g} req/s open loop, {args.duration:g} s measured per path, keep-alive on "
            "both sides; milliseconds (+: added over direct HTTPS)"
        )
        print(
            table(rows, ["path", "n", "req/s", "p50", "p90", "p99", "max", "+p50", "+p90", "+p99", "proxy CPU µs/req"])
        )
        setup_rows = [
            [label, *(f"{results[key][f'p{q}']:.3f}" for q in PCTS), f"{results[key]['max']:.2f}"]
            for label, key in (
                ("TLS handshake, direct to the vendor", "setup_direct"),
                ("CONNECT + TLS handshake with the proxy", "setup_tunnel"),
            )
            if key in results
        ]
        print(f"\nnew connection set-up ({args.setups} in a row; ms):")
        print(table(setup_rows, ["", "p50", "p90", "p99", "max"]))
        for store in args.stores:
            r = results[f"intercept ({store})"]
            if r["added"]["p50"] > 2.0 or r["added"]["p99"] > 10.0:
                missed.append(
                    f"intercept ({store}): added p50 {r['added']['p50']:.3f} ms / p99 {r['added']['p99']:.3f} ms"
                )

    if "mint" not in skip:
        results["mint"] = mint_phase(args, fleet.workdir)
        print(f"\n2. leaf minting (LeafMinter.context_for; ms, {args.mint_hosts} distinct hosts per CA)")
        rows = [
            [
                f"{kt.upper()} CA",
                m["hosts"],
                *(f"{m['cold'][f'p{q}']:.3f}" for q in PCTS),
                f"{m['cold']['max']:.2f}",
                f"{m['hit_us']:.1f}",
            ]
            for kt, m in results["mint"].items()
        ]
        print(table(rows, ["CA key", "hosts", "mint p50", "p90", "p99", "max", "cache hit µs"]))
        for m in results.get("proxy_mints", []):
            mean = "-" if m["mean_ms"] is None else f"{m['mean_ms']:.3f} ms"
            print(f"in the proxy ({m['store']}): ratelimit_leaf_mint_seconds count {m['count']:.0f}, mean {mean}")

    if "saturation" not in skip:
        results["saturation"] = saturation_phase(fleet, args, certs, vendor, redis)
        print(
            f"\n3. saturation: one replica on CPU {args.proxy_cpu or 'any'}, generator/vendor/redis on CPU "
            f"{args.load_cpu or 'any'}, {args.connections} keep-alive connections, store {args.sat_store}"
        )
        rows = [
            [
                r["mode"],
                r["requests"],
                f"{r['rps']:.0f}",
                f"{r['cpu_us_per_request']:.0f}",
                f"{r['proxy_core_utilisation'] * 100:.0f}%",
                "-" if r["proxy_core_others"] is None else f"{r['proxy_core_others'] * 100:.0f}%",
                f"{r['load_core_utilisation'] * 100:.0f}%",
                r["non2xx"],
                r["errors"],
                ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()) or "-",
            ]
            for r in results["saturation"]
        ]
        print(
            table(
                rows,
                [
                    "mode",
                    "requests",
                    "req/s",
                    "CPU µs/req",
                    "proxy core",
                    "others there",
                    "load core",
                    "non-2xx",
                    "errors",
                    "proxy outcomes",
                ],
            )
        )
        for r in results["saturation"]:
            if r["proxy_core_utilisation"] < 0.85:
                print(
                    f"note: {r['mode']}: the proxy's core was only {r['proxy_core_utilisation'] * 100:.0f}% busy "
                    "— not saturated (the load side or another tenant was the bottleneck); req/s understates "
                    "capacity, CPU µs/req is still valid"
                )
            if r["non2xx"] > 0.01 * r["requests"] or r["errors"] > 0.01 * r["requests"]:
                raise BenchError(
                    f"saturation {r['mode']}: {r['non2xx']} non-2xx and {r['errors']} errors out of {r['requests']}"
                )

    dump_json(args.json, results)
    if missed:
        print("targets missed (interception adds <= 2 ms p50, <= 10 ms p99): " + "; ".join(missed))
        return 2 if args.strict else 0
    if "latency" not in skip:
        print("targets met: interception adds <= 2 ms at p50 and <= 10 ms at p99 over direct HTTPS")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_vendor":
        sys.exit(serve_vendor(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_loadgen":
        sys.exit(loadgen(sys.argv[2:]))
    sys.exit(run_main(main))
