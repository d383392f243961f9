"""Shared fixtures: a real redis-server per test session, stores, clocks, registries.

The Redis that may run on 6379 is never used: the suite starts its own server on
a free port, and fails (never skips) when ``redis-server`` is missing.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import random
import shutil
import signal
import socket
import ssl
import string
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis as sync_redis
import trustme
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import Runtime
from proxy.clock import Clock, ManualClock
from proxy.devtools.mockvendor import MockVendor
from proxy.limiter.memory_store import MemoryStore
from proxy.limiter.redis_store import RedisStore
from proxy.limiter.store import BucketStore
from proxy.policy import Policy, parse_policy
from proxy.server import ProxyServer
from proxy.telemetry.accesslog import AccessLog

# Before any test module imports them: the shared helpers' asserts explain themselves too.
pytest.register_assert_rewrite("tests.helpers")

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With pytest-xdist (scripts/test runs the suite as three workers on the two cores,
    --dist loadgroup), the tests that assert rates or time bounds run in two lanes, each one
    test at a time: the busy ones (a fleet that keeps a core busy: marker ``busy``) in one, so
    no two of them share the cores, and the quiet ones (mostly waiting on a rate: a fraction
    of a core) in the other; the third worker runs the rest beside them, and a lane that is
    done takes some of the rest."""
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("timing"):
            lane = "timing-busy" if item.get_closest_marker("busy") else "timing"
            item.add_marker(pytest.mark.xdist_group(lane))


_RENICE = os.environ.get("PYTEST_XDIST_WORKER") is not None and os.geteuid() == 0
"""Under xdist, as root (who may raise a priority back): the other tests yield the cores."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that asserts rates or time bounds runs at the normal priority, the others (and
    the processes they start) at nice 10: on two busy cores the scheduler serves the timed
    lanes first, and the rest takes what they leave (a learned-limits run read 40/s for 68
    beside them)."""
    if _RENICE:
        timed = item.get_closest_marker("slow") or item.get_closest_marker("timing")
        os.setpriority(os.PRIO_PROCESS, 0, 0 if timed else 10)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (the vendors' SDKs among it) out of the garbage
    collector: the tests run the proxy, its vendor and its workers in this one process,
    and a full collection of all that stalls the event loop for a few hundred ms, which
    timing tests would read as the proxy's fault. A proxy process carries none of it."""
    gc.collect()
    gc.freeze()


# Ports for servers a test starts by number (redis-server, a `quota-proxy run` told
# --listen): below the kernel's ephemeral range, so no socket bound to port 0 meanwhile (a
# client's, another test's) can take one between this check and the server's bind. Each
# xdist worker (scripts/test runs three) walks its own slice from a random point: two
# workers, or two suites run at once, do not pick the same one. Three slices end below 32768.
_PORTS_FIRST, _PORTS_SLICE, _PORTS_SLICES = 20000, 4000, 3
_next_port: list[int] = []


def free_port() -> int:
    if not _next_port:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        slot = int(worker) % _PORTS_SLICES if worker.isdigit() else 0
        base = _PORTS_FIRST + slot * _PORTS_SLICE
        _next_port.append(base + random.randrange(_PORTS_SLICE))
    for _ in range(_PORTS_SLICE):
        port = _next_port[0]
        first = _PORTS_FIRST + (port - _PORTS_FIRST) // _PORTS_SLICE * _PORTS_SLICE
        _next_port[0] = first + (port - first + 1) % _PORTS_SLICE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


@dataclass
class RedisServer:
    """A redis-server process the tests own: it can be killed, restarted, paused."""

    binary: str
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, extra: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--loglevel",
                "warning",
                "--logfile",
                str(self.log),
                *(extra or []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        client = sync_redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.log.read_text(errors="replace")
                    raise RuntimeError(f"redis-server exited at start: {err}")
                try:
                    if client.ping():
                        return
                except sync_redis.RedisError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers (a slow Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> sync_redis.Redis:
        return sync_redis.Redis(port=self.port, socket_timeout=2)


def _redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed: the limiter is tested against a real Redis "
            "(apt-get install redis-server); refusing to skip"
        )
    return binary


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(_redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session server, emptied after the test."""
    yield redis_server.url
    if redis_server.proc is not None:
        with redis_server.client() as c:
            c.flushall()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone, for killing, restarting and pausing."""
    server = RedisServer(_redis_binary(), tmp_path)
    server.start()
    yield server
    if server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)
    server.kill()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["memory", "redis", "redis-py"])
async def store(request: pytest.FixtureRequest, clock: ManualClock) -> AsyncIterator[BucketStore]:
    """Each store implementation, for the shared contract suite: "redis" acquires over the
    pipelined connection (redis://, rediss://), "redis-py" through redis-py (pipelined=False).
    tests/limiter/test_store_contract.py adds redis+cluster:// on a three-node cluster."""
    if request.param == "memory":
        s: BucketStore = MemoryStore(clock)
    else:
        s = RedisStore(request.getfixturevalue("redis_url"), timeout=1.0, pipelined=request.param == "redis")
    yield s
    await s.close()


# -- a mock vendor and in-process proxies -------------------------------------------


@dataclass
class Vendor:
    """A MockVendor served on loopback."""

    mock: MockVendor
    url: str
    """``http://127.0.0.1:PORT``"""


@pytest.fixture
async def vendor(aiohttp_server: Any) -> Vendor:
    """An unlimited mock vendor; tests give it a quota with ``vendor.mock.configure``."""
    mock = MockVendor(rate=None)
    server = await aiohttp_server(mock.app())
    return Vendor(mock, str(server.make_url("")).rstrip("/"))


def make_policy(text: str, **values: object) -> Policy:
    """A policy from YAML with ``$name`` placeholders (braces stay free for YAML)."""
    body = string.Template(textwrap.dedent(text)).substitute({k: str(v) for k, v in values.items()})
    return parse_policy(body, "test-policy.yaml", base_dir=ROOT)


def vendor_policy(
    upstream: str,
    *,
    limits: str = "[{rate: 1000, per: 1s}]",
    store: str = "memory://",
    extra_vendor: str = "",
    extra_top: str = "",
    tenant_limits: str = "",
    on_limit: str = "{action: hold, max_hold: 500ms}",
    store_timeout: str = "250ms",
) -> Policy:
    """One vendor ``payments`` on hosts api.payments.example, route /payments, at ``upstream``."""
    text = f"""
        version: 1
        listen: 127.0.0.1:0
        admin_listen: 127.0.0.1:0
        store: {{url: "{store}", timeout: {store_timeout}}}
        {extra_top}
        vendors:
          - name: payments
            hosts: [api.payments.example]
            route: /payments
            upstream: {upstream}
            limits: {limits}
            on_limit: {on_limit}
            {tenant_limits}
            {extra_vendor}
    """
    return parse_policy(textwrap.dedent(text), "test-policy.yaml", base_dir=ROOT)


ProxyFactory = Callable[..., Awaitable[ProxyServer]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[ProxyFactory]:
    """Start in-process proxies (both listeners on free ports); all stopped after the test."""
    started: list[ProxyServer] = []

    async def start(
        policy: Policy,
        *,
        clock: Clock | None = None,
        registry: CollectorRegistry | None = None,
        store: BucketStore | None = None,
        access_log: AccessLog | None = None,
    ) -> ProxyServer:
        runtime = Runtime(policy, clock=clock, registry=registry, store=store, access_log=access_log)
        server = ProxyServer(runtime, policy.listen, policy.admin_listen)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        await server.stop()


# -- a raw TCP vendor: exact bytes, exact failures ------------------------------------

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawVendor:
    """A TCP vendor whose every connection runs ``handler``: exact bytes, exact failures."""

    server: asyncio.Server
    url: str
    connections: int = 0


@pytest.fixture
async def raw_vendor() -> AsyncIterator[Callable[[RawHandler], Awaitable[RawVendor]]]:
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(handler: RawHandler) -> RawVendor:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            raw.connections += 1
            writers.append(writer)
            try:
                await handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        raw = RawVendor(server, f"http://127.0.0.1:{port}")
        return raw

    yield start
    for server in servers:
        server.close()
    for writer in writers:
        writer.close()
    for server in servers:
        await server.wait_closed()


# -- small helpers shared by the end-to-end tests ------------------------------------


async def eventually(probe: Callable[[], bool | Awaitable[bool]], what: str, deadline: float = 10.0) -> float:
    """Poll ``probe`` (sync or async) until it is true: a synchronisation point, not a
    guessed delay. Returns the seconds it took; fails the test after ``deadline``."""
    started = time.monotonic()
    while True:
        ok = probe()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return time.monotonic() - started
        if time.monotonic() - started > deadline:
            raise AssertionError(f"not within {deadline}s: {what}")
        await asyncio.sleep(0.005)


def client_session() -> aiohttp.ClientSession:
    """A worker-side session without the default 100-connection cap."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=30))


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metric_samples(text: str) -> Samples:
    """Prometheus text → {(sample name, labels): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


# -- TLS: a test CA (trustme) and an HTTPS mock vendor ------------------------------------


@dataclass
class HttpsVendor:
    mock: MockVendor
    url: str
    """``https://127.0.0.1:PORT``"""
    port: int
    ca_file: Path
    """PEM of the CA that signed the vendor's certificate."""


@pytest.fixture(scope="session")
def vendor_ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[trustme.CA, Path]:
    """A test CA (never the proxy's own) that signs the HTTPS mock vendors' certificates."""
    ca = trustme.CA(organization_name="quota-proxy tests: vendor CA")
    path = tmp_path_factory.mktemp("vendor-ca") / "vendor-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ca, path


@pytest.fixture
async def https_vendor(vendor_ca: tuple[trustme.CA, Path], aiohttp_server: Any) -> HttpsVendor:
    """An unlimited mock vendor over TLS, its certificate valid for api.payments.example,
    localhost and 127.0.0.1."""
    ca, path = vendor_ca
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("api.payments.example", "localhost", "127.0.0.1").configure_cert(ctx)
    mock = MockVendor(rate=None)
    server = await aiohttp_server(mock.app(), ssl=ctx)
    return HttpsVendor(mock, f"https://127.0.0.1:{server.port}", server.port, path)


async def curl(
    method: str, url: str, headers: dict[str, str], body: bytes | None, tmp: Path, *options: str
) -> tuple[int, dict[str, str], bytes]:
    """A real curl, with the proxy from the (monkeypatched) environment: (status,
    lower-case headers, body) of the final answer.

    curl sends ``Expect: 100-continue`` with a body over 1 MiB. Left alone it gives up
    waiting for ``100 Continue`` after 1 s and sends the body anyway, so a proxy that never
    answers would only be slower; with ``--expect100-timeout`` beyond ``--max-time`` it
    fails the call instead, however loaded the machine."""
    out = tmp / "curl-body"
    argv = [
        "curl",
        "--silent",
        "--show-error",
        "--max-time",
        "20",
        "--expect100-timeout",
        "60",
        *options,
        "--request",
        method,
        "--dump-header",
        "-",
        "--output",
        str(out),
    ]
    for name, value in headers.items():
        argv += ["--header", f"{name}: {value}"]
    if body is not None:
        src = tmp / "curl-upload"
        src.write_bytes(body)
        argv += ["--data-binary", f"@{src}", "--header", "Content-Type: application/octet-stream"]
    argv.append(url)
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode(errors="replace")
    # The last header block is the final answer: a proxy's "200 Connection Established"
    # and any "100 Continue" come first.
    blocks = [b for b in stdout.decode("latin-1").split("\r\n\r\n") if b.strip()]
    status_line, *lines = blocks[-1].split("\r\n")
    parsed = (line.split(":", 1) for line in lines if ":" in line)
    return int(status_line.split()[1]), {k.lower(): v.strip() for k, v in parsed}, out.read_bytes()
