"""The ``quota-proxy`` command line, run as real subprocesses (``python -m proxy ...``).

SPEC §3: ``run`` and ``check``; flags override QUOTA_PROXY_CONFIG / QUOTA_PROXY_STORE,
which override the file; bad configuration never starts a server (exit 2, one line
per problem on stderr). Every process is waited for with a deadline, never a sleep.

The helpers here (``cli``, ``ProxyProcess``, ``http_get``...) are shared with
``test_drain.py`` and ``test_packaging.py``.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

import proxy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "example.yaml"

READY_RE = re.compile(
    r"quota-proxy listening on http://(?P<host>\S+?):(?P<port>\d+) "
    r"\(admin http://(?P<admin_host>\S+?):(?P<admin_port>\d+), store (?P<store>\S+), (?P<vendors>\d+) vendor\(s\)\)"
)
ERROR_LINE_RE = re.compile(r"(?P<file>.+?):(?P<line>\d+): (?P<path>[A-Za-z0-9_.\[\]]+): (?P<message>.+)")
TRACEBACK_MARKERS = ("Traceback", 'File "', "Error:", "raise ")

_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
               "no_proxy")


# -- helpers shared with test_drain.py and test_packaging.py --------------------------------


def cli(*args: str) -> list[str]:
    """The command line of ``quota-proxy ARGS`` run from the checkout."""
    return [sys.executable, "-m", "proxy", *args]


def clean_env(extra: Mapping[str, str] | None = None, *, checkout: bool = True) -> dict[str, str]:
    """The test's environment without QUOTA_PROXY_* or proxy variables; the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUOTA_PROXY_") and k not in _PROXY_VARS}
    env.pop("PYTHONPATH", None)
    if checkout:
        env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(*args: str, env: Mapping[str, str] | None = None, cwd: Path = ROOT,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``quota-proxy ARGS`` to completion (commands that must not serve)."""
    return subprocess.run(cli(*args), env=clean_env(env), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def assert_no_traceback(text: str) -> None:
    for marker in TRACEBACK_MARKERS:
        assert marker not in text, f"looks like a traceback ({marker!r}):\n{text}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class Ready:
    """What the ready line says."""

    host: str
    port: int
    admin_host: str
    admin_port: int
    store: str
    vendors: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_host}:{self.admin_port}"


def parse_ready(line: str) -> Ready:
    match = READY_RE.fullmatch(line.rstrip("\n"))
    assert match, f"not a ready line: {line!r}"
    return Ready(match["host"], int(match["port"]), match["admin_host"], int(match["admin_port"]),
                 match["store"], int(match["vendors"]))


class ProxyProcess:
    """A server subprocess (the proxy or the mock vendor): stdout piped for its ready line,
    stderr to a file so a chatty log can never block it on a full pipe."""

    def __init__(self, argv: Sequence[str], log_dir: Path, *, env: Mapping[str, str] | None = None,
                 cwd: Path = ROOT, name: str = "proxy") -> None:
        self.stderr_path = log_dir / f"{name}-{time.monotonic_ns()}.stderr"
        self._stderr: IO[str] = self.stderr_path.open("w")
        self.proc = subprocess.Popen(list(argv), env=clean_env(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def readline(self, timeout: float = 30) -> str:
        """The next stdout line; fails with the process's stderr if it exits or stays silent."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no line on stdout within {timeout}s; stderr:\n{self.stderr()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.2))
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    return line
                self.proc.wait(timeout=10)
                pytest.fail(f"exited with {self.proc.returncode} before printing a line; stderr:\n{self.stderr()}")

    def wait_ready(self, timeout: float = 30) -> Ready:
        return parse_ready(self.readline(timeout))

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit status; fails (with stderr) if the process is still running at the deadline."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout}s later; stderr:\n{self.stderr()}")

    def terminate_and_wait(self, timeout: float = 20) -> int:
        self.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


@contextmanager
def server_process(argv: Sequence[str], log_dir: Path, **kwargs: object) -> Iterator[ProxyProcess]:
    process = ProxyProcess(argv, log_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield process
    finally:
        process.close()


_NO_ENV_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, *, via: str | None = None, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """GET ``url`` (through the HTTP proxy ``via``, if given); HTTP errors are answers, not exceptions."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": via})) if via else _NO_ENV_PROXY
    try:
        with opener.open(url, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read()


def write_policy(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def line_of(text: str, needle: str) -> int:
    """The 1-based line of the only line of ``text`` containing ``needle``."""
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


BAD_POLICY = """
    version: 1
    listen: 127.0.0.1:$port
    admin_listen: 127.0.0.1:$admin_port
    colour: blue
    vendors:
      - name: payments
        hosts: [api.payments.example]
        upstream: http://127.0.0.1:9
        limits:
          - {rate: 5, per: 1x}
        on_limit: {action: hold, max_hold: soon}
"""


def bad_policy(tmp_path: Path, port: int = 0, admin_port: int = 0) -> tuple[Path, set[tuple[int, str]]]:
    """A policy with an unknown key and two bad durations; the (line, path) of each problem."""
    text = textwrap.dedent(BAD_POLICY).lstrip("\n").replace("$port", str(port)).replace("$admin_port",
                                                                                         str(admin_port))
    path = tmp_path / "bad-policy.yaml"
    path.write_text(text)
    expected = {
        (line_of(text, "colour:"), "colour"),
        (line_of(text, "per: 1x"), "vendors[0].limits[0].per"),
        (line_of(text, "max_hold: soon"), "vendors[0].on_limit.max_hold"),
    }
    return path, expected


def assert_config_errors(stderr: str, path: Path, expected: set[tuple[int, str]]) -> None:
    """One ``file:line: path: message`` line per problem, nothing else."""
    assert_no_traceback(stderr)
    lines = stderr.splitlines()
    assert len(lines) == len(expected), stderr
    seen = set()
    for line in lines:
        match = ERROR_LINE_RE.fullmatch(line)
        assert match, f"not file:line: path: message: {line!r}"
        assert match["file"] == str(path), line
        seen.add((int(match["line"]), match["path"]))
    assert seen == expected, stderr


# -- check ----------------------------------------------------------------------------------


def test_check_example_policy_exits_0_with_a_one_screen_summary() -> None:
    result = run_cli("check", "-c", "config/example.yaml")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "OK config/example.yaml: 1 vendor(s)"
    assert 5 <= len(lines) <= 40, "a summary that fits one screen"
    text = result.stdout
    assert "vendor mock-vendor" in text
    assert "memory://" in text
    assert "api.mock-vendor.example" in text
    assert "80/1s burst 20" in text


def test_check_bad_policy_exits_2_with_one_line_per_problem(tmp_path: Path) -> None:
    path, expected = bad_policy(tmp_path)
    result = run_cli("check", "-c", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert_config_errors(result.stderr, path, expected)
    assert '"1x" is not a duration' in result.stderr
    assert 'unknown key "colour"' in result.stderr


def test_check_unreadable_policy_exits_2_naming_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.yaml"
    result = run_cli("check", "-c", str(missing))
    assert result.returncode == 2
    assert result.stdout == ""
    assert_no_traceback(result.stderr)
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{missing}: cannot read policy"), line


def test_quota_proxy_config_stands_in_for_c(tmp_path: Path) -> None:
    by_env = run_cli("check", env={"QUOTA_PROXY_CONFIG": str(EXAMPLE)})
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.stdout.splitlines()[0] == f"OK {EXAMPLE}: 1 vendor(s)"

    bad, expected = bad_policy(tmp_path)
    env_bad = run_cli("check", env={"QUOTA_PROXY_CONFIG": str(bad)})
    assert env_bad.returncode == 2
    assert_config_errors(env_bad.stderr, bad, expected)

    # -c beats the environment.
    flag_wins = run_cli("check", "-c", str(EXAMPLE), env={"QUOTA_PROXY_CONFIG": str(bad)})
    assert flag_wins.returncode == 0, flag_wins.stderr
    assert flag_wins.stdout.splitlines()[0] == f"OK {EXAMPLE}: 1 vendor(s)"


@pytest.mark.parametrize("command", ["run", "check"])
def test_no_config_at_all_exits_2_with_a_message(command: str) -> None:
    result = run_cli(command)
    assert result.returncode == 2
    assert result.stdout == ""
    assert_no_traceback(result.stderr)
    (line,) = result.stderr.splitlines()
    assert "-c FILE" in line
    assert "QUOTA_PROXY_CONFIG" in line


# -- run: overrides -------------------------------------------------------------------------


def _status(ready: Ready) -> dict[str, object]:
    code, _, body = http_get(f"{ready.admin_url}/status")
    assert code == 200
    status = json.loads(body)
    assert isinstance(status, dict)
    return status


def test_listen_flags_override_the_file_and_accept_port_0(tmp_path: Path) -> None:
    port = free_port()
    argv = cli("run", "-c", str(EXAMPLE), "--listen", f"127.0.0.1:{port}", "--admin-listen", "127.0.0.1:0")
    with server_process(argv, tmp_path) as proc:
        ready = proc.wait_ready()
        assert (ready.host, ready.port) == ("127.0.0.1", port)
        assert ready.admin_host == "127.0.0.1"
        assert ready.admin_port not in (0, 9090, port)
        assert ready.store == "memory://"
        assert ready.vendors == 1

        code, _, body = http_get(f"{ready.admin_url}/healthz")
        assert code == 200
        assert json.loads(body)["status"] == "ok"
        # The proxy listener is the proxy: a host in no vendor is denied, never forwarded.
        code, headers, body = http_get("http://not-a-vendor.example/x", via=ready.url)
        assert code == 403
        assert headers.get("X-Quota-Action") == "deny"

        assert proc.terminate_and_wait() == 0


def test_both_listeners_on_port_0_report_their_real_ports(tmp_path: Path) -> None:
    argv = cli("run", "-c", str(EXAMPLE), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")
    with server_process(argv, tmp_path) as proc:
        ready = proc.wait_ready()
        assert ready.port > 0
        assert ready.admin_port > 0
        assert ready.port != ready.admin_port
        assert http_get(f"{ready.admin_url}/healthz")[0] == 200
        assert http_get("http://not-a-vendor.example/x", via=ready.url)[0] == 403
        assert proc.terminate_and_wait() == 0


def test_store_precedence_flag_over_env_over_file(tmp_path: Path, redis_url: str) -> None:
    listen = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    cases = [
        ("file", {}, (), "memory://"),
        ("env over file", {"QUOTA_PROXY_STORE": redis_url}, (), redis_url),
        ("flag over env", {"QUOTA_PROXY_STORE": dead}, ("--store", redis_url), redis_url),
        ("flag over file", {}, ("--store", redis_url), redis_url),
    ]
    for name, env, flags, expected in cases:
        with server_process(cli("run", "-c", str(EXAMPLE), *listen, *flags), tmp_path, env=env) as proc:
            ready = proc.wait_ready()
            assert ready.store == expected, name
            store = _status(ready)["store"]
            assert isinstance(store, dict)
            assert store["url"] == expected, name
            # The store really is the one named: a reachable Redis (or memory) makes /readyz 200.
            assert http_get(f"{ready.admin_url}/readyz")[0] == 200, name
            assert proc.terminate_and_wait() == 0, name


def test_store_password_is_masked_in_the_ready_line_and_status(tmp_path: Path) -> None:
    url = f"redis://app:s3cr3t-pw@127.0.0.1:{free_port()}/0"
    argv = cli("run", "-c", str(EXAMPLE), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
               "--store", url)
    with server_process(argv, tmp_path) as proc:
        ready = proc.wait_ready()
        assert ready.store.startswith("redis://app:")
        assert "s3cr3t-pw" not in ready.store
        store = _status(ready)["store"]
        assert isinstance(store, dict)
        assert "s3cr3t-pw" not in str(store["url"])
        # Nothing listens there: not ready, but alive.
        assert http_get(f"{ready.admin_url}/readyz")[0] == 503
        assert http_get(f"{ready.admin_url}/healthz")[0] == 200
        assert proc.terminate_and_wait() == 0
        assert "s3cr3t-pw" not in proc.stderr()


@pytest.mark.parametrize(
    ("flags", "env", "origin"),
    [
        (("--listen", "nope"), {}, "--listen"),
        (("--listen", "127.0.0.1:99999"), {}, "--listen"),
        (("--admin-listen", "localhost"), {}, "--admin-listen"),
        (("--store", "foo://x"), {}, "--store"),
        (("--store", "redis://"), {}, "--store"),
        ((), {"QUOTA_PROXY_STORE": "ftp://x"}, "QUOTA_PROXY_STORE"),
    ],
)
def test_bad_flag_or_env_exits_2_with_a_clear_message(flags: tuple[str, ...], env: dict[str, str],
                                                       origin: str) -> None:
    result = run_cli("run", "-c", str(EXAMPLE), *flags, env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert_no_traceback(result.stderr)
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"quota-proxy: {origin}: "), line


# -- bad configuration never binds a port --------------------------------------------------------

# ``python -c`` with an audit hook reporting every bind(), then exactly what ``-m proxy`` runs.
AUDITED = textwrap.dedent("""
    import runpy, sys

    def hook(event, args):
        if event == "socket.bind":
            sys.stderr.write(f"AUDIT socket.bind {args[1]!r}\\n")
            sys.stderr.flush()

    sys.addaudithook(hook)
    runpy.run_module("proxy", run_name="__main__", alter_sys=True)
""")


def audited(*args: str) -> list[str]:
    return [sys.executable, "-c", AUDITED, *args]


def test_the_bind_audit_sees_a_good_run(tmp_path: Path) -> None:
    """The control for the next test: the audit hook does see the listeners being bound."""
    port, admin_port = free_port(), free_port()
    argv = audited("run", "-c", str(EXAMPLE), "--listen", f"127.0.0.1:{port}",
                   "--admin-listen", f"127.0.0.1:{admin_port}")
    with server_process(argv, tmp_path) as proc:
        ready = proc.wait_ready()
        assert ready.port == port
        assert proc.terminate_and_wait() == 0
        binds = proc.stderr()
    assert f"AUDIT socket.bind ('127.0.0.1', {port})" in binds
    assert f"AUDIT socket.bind ('127.0.0.1', {admin_port})" in binds


@pytest.mark.parametrize("flaw", ["policy", "flag"])
def test_bad_configuration_never_binds_a_port(tmp_path: Path, flaw: str) -> None:
    port, admin_port = free_port(), free_port()
    if flaw == "policy":
        path, expected = bad_policy(tmp_path, port, admin_port)
        argv = audited("run", "-c", str(path))
    else:
        path = write_policy(tmp_path / "good.yaml", f"""
            version: 1
            listen: 127.0.0.1:{port}
            admin_listen: 127.0.0.1:{admin_port}
            vendors:
              - {{name: payments, hosts: [api.payments.example], limits: [{{rate: 5, per: 1s}}]}}
        """)
        argv = audited("run", "-c", str(path), "--store", "nosuch://store")
    with server_process(argv, tmp_path) as proc:
        assert proc.wait(timeout=60) == 2
        assert proc.proc.stdout is not None
        assert proc.proc.stdout.read() == "", "no ready line"
        stderr = proc.stderr()
    assert "AUDIT socket.bind" not in stderr, stderr
    if flaw == "policy":
        assert_config_errors(stderr, path, expected)
    else:
        assert stderr.startswith("quota-proxy: --store: "), stderr
    assert port_is_free(port)
    assert port_is_free(admin_port)


def test_a_listen_port_in_use_fails_with_a_message(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = cli("run", "-c", str(EXAMPLE), "--listen", f"127.0.0.1:{port}", "--admin-listen", "127.0.0.1:0")
        with server_process(argv, tmp_path) as proc:
            status = proc.wait(timeout=60)
            assert proc.proc.stdout is not None
            assert proc.proc.stdout.read() == ""
            stderr = proc.stderr()
    assert status != 0
    assert "cannot listen" in stderr
    assert_no_traceback(stderr)


# -- mock-vendor, --version ---------------------------------------------------------------------


def test_mock_vendor_subcommand_serves_the_example_policy_end_to_end(tmp_path: Path) -> None:
    with server_process(cli("mock-vendor", "--listen", "127.0.0.1:0", "--rate", "50"), tmp_path,
                        name="mock-vendor") as vendor:
        line = vendor.readline()
        match = re.fullmatch(r"mock-vendor listening on http://127\.0\.0\.1:(\d+) \(rate 50/s, burst 50\)\n", line)
        assert match, line
        vendor_url = f"http://127.0.0.1:{match[1]}"
        code, _, body = http_get(f"{vendor_url}/__mock/stats")
        assert code == 200
        assert json.loads(body)["rate"] == 50

        # The shipped example, pointed at this mock instead of 127.0.0.1:8081.
        text = EXAMPLE.read_text()
        assert "upstream: http://127.0.0.1:8081\n" in text
        policy = tmp_path / "example.yaml"
        policy.write_text(text.replace("upstream: http://127.0.0.1:8081\n", f"upstream: {vendor_url}\n"))
        argv = cli("run", "-c", str(policy), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")
        with server_process(argv, tmp_path) as proxy_proc:
            ready = proxy_proc.wait_ready()
            code, headers, body = http_get(f"{ready.url}/mock-vendor/v1/ping")  # route form
            assert code == 200, body
            assert json.loads(body)["path"] == "/v1/ping"
            assert "X-RateLimit-Remaining" in headers
            code, _, body = http_get("http://api.mock-vendor.example/v1/pong", via=ready.url)  # HTTP_PROXY form
            assert code == 200, body
            assert json.loads(body)["path"] == "/v1/pong"
            assert proxy_proc.terminate_and_wait() == 0

        stats = json.loads(http_get(f"{vendor_url}/__mock/stats")[2])
        assert stats["accepted"] == 2
        assert vendor.terminate_and_wait() == 0


def test_version_and_help() -> None:
    version = run_cli("--version")
    assert version.returncode == 0
    assert version.stdout == f"quota-proxy {proxy.__version__}\n"

    helped = run_cli("--help")
    assert helped.returncode == 0
    for command in ("run", "check", "mock-vendor"):
        assert command in helped.stdout

    unknown = run_cli("frobnicate")
    assert unknown.returncode == 2
    assert "invalid choice" in unknown.stderr


def test_the_command_line_lists_the_developer_tools_without_importing_them() -> None:
    # `check` and `ca` stay quick to start: mock-vendor and demo register their arguments from
    # light modules, and aiohttp (the tools, the server) is imported only by a command that serves.
    probe = "import json, sys; from proxy.cli import build_parser; build_parser(); print(json.dumps(list(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], env=clean_env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL, check=False)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert {"proxy.devtools.mockvendor_cli", "proxy.devtools.demo_cli"} <= loaded
    assert not loaded & {"aiohttp", "proxy.devtools.mockvendor", "proxy.devtools.demo", "proxy.server"}
