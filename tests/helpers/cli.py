"""``quota-proxy`` as a real subprocess: its command line, a clean environment, the ready
line, a server process whose every wait has a deadline, and a GET that never goes through
the environment's proxy variables.
"""

from __future__ import annotations

import asyncio
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

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "example.yaml"

READY_RE = re.compile(
    r"quota-proxy listening on http://(?P<host>\S+?):(?P<port>\d+) "
    r"\(admin http://(?P<admin_host>\S+?):(?P<admin_port>\d+), store (?P<store>\S+), (?P<vendors>\d+) vendor\(s\)\)"
)
TRACEBACK_MARKERS = ("Traceback", 'File "', "Error:", "raise ")

# Every environment variable a client reads its proxy from (a test sets the ones it means).
PROXY_VARS = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)

# Every environment variable a client reads the CAs it trusts from (docs/clients.md).
TRUST_VARS = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")


def cli(*args: str) -> list[str]:
    """The command line of ``quota-proxy ARGS`` run from the checkout."""
    return [sys.executable, "-m", "proxy", *args]


def clean_env(extra: Mapping[str, str] | None = None, *, checkout: bool = True) -> dict[str, str]:
    """The test's environment without QUOTA_PROXY_* or proxy variables; the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUOTA_PROXY_") and k not in PROXY_VARS}
    env.pop("PYTHONPATH", None)
    if checkout:
        env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, cwd: Path = ROOT, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``quota-proxy ARGS`` to completion (commands that must not serve)."""
    return subprocess.run(
        cli(*args),
        env=clean_env(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def assert_no_traceback(text: str) -> None:
    for marker in TRACEBACK_MARKERS:
        assert marker not in text, f"looks like a traceback ({marker!r}):\n{text}"


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
    return Ready(
        match["host"],
        int(match["port"]),
        match["admin_host"],
        int(match["admin_port"]),
        match["store"],
        int(match["vendors"]),
    )


class ProxyProcess:
    """A server subprocess (the proxy or the mock vendor): stdout piped for its ready line,
    stderr to a file so a chatty log can never block it on a full pipe."""

    def __init__(
        self,
        argv: Sequence[str],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        name: str = "proxy",
    ) -> None:
        self.stderr_path = log_dir / f"{name}-{time.monotonic_ns()}.stderr"
        self._stderr: IO[str] = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            list(argv),
            env=clean_env(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

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


async def run_process(
    argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float = 90
) -> tuple[int, str, str]:
    """``argv`` to completion with exactly ``env``, from the event loop: (exit status,
    stdout, stderr). Killed, and the test failed, if it outlives ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"{argv[0]} still running after {timeout}s: {' '.join(argv)}")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(errors="replace")
