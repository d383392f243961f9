"""README.md's "Install and run", run as printed from a reader's directory: the proxy on
``config/example.yaml``, then, in "another terminal", the mock vendor and the three curls; and
the same set-up as docs/clients.md's "Plain HTTP first" words it, inline.

What differs from a reader's machine, and only that: the ports (127.0.0.1:8080, :8081 and
:9090 become free ones, in the commands and in the reader's copy of ``config/example.yaml``),
and ``.venv/bin/quota-proxy`` is this checkout's, not a new venv's: ``python3 -m venv .venv
&& .venv/bin/pip install .`` is what tests/test_packaging.py (the wheel, outside the
checkout) and ``../shared/tools/newcomer-check`` (a fresh venv from PyPI) run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.helpers.cli import ROOT, clean_env

pytestmark = pytest.mark.long  # two processes started and stopped, seconds; no time bound asserted

README = ROOT / "README.md"
PORTS = (8080, 8081, 9090)


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)\n```", README.read_text(), re.S)


class Reader:
    """A reader's directory: ``config/example.yaml`` (its ports moved), ``.venv/bin/quota-proxy``."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.ports = {port: free_port() for port in PORTS}
        (work / "config").mkdir()
        (work / "config" / "example.yaml").write_text(self.moved((ROOT / "config" / "example.yaml").read_text()))
        bin_dir = work / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        launcher = bin_dir / "quota-proxy"
        launcher.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m proxy "$@"\n')
        launcher.chmod(0o755)
        self.env = clean_env()
        self.procs: list[subprocess.Popen[str]] = []

    def moved(self, text: str) -> str:
        for printed, port in self.ports.items():
            text = text.replace(f"127.0.0.1:{printed}", f"127.0.0.1:{port}")
        return text

    def start(self, line: str) -> subprocess.Popen[str]:
        log = self.work / f"process-{len(self.procs)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["bash", "-c", f"exec {self.moved(line)}"],
                cwd=self.work,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        self.procs.append(proc)
        return proc

    def log(self, proc: subprocess.Popen[str]) -> str:
        return (self.work / f"process-{self.procs.index(proc)}.log").read_text(errors="replace")

    def run(self, line: str) -> str:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", self.moved(line)],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def wait_for(self, printed: int, path: str, proc: subprocess.Popen[str]) -> None:
        url = f"http://127.0.0.1:{self.ports[printed]}{path}"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"exited {proc.returncode}: {self.log(proc)}"
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)  # polling a process started apart: nothing to wait on but its port
        pytest.fail(f"{url} not answering after 20 s")

    def stop(self) -> list[int | None]:
        codes: list[int | None] = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes.append(proc.wait(timeout=20))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        return codes


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[Reader]:
    assert shutil.which("curl"), "curl is required: apt install curl"
    r = Reader(tmp_path)
    try:
        yield r
    finally:
        r.stop()


def test_the_quick_start_runs_as_printed(reader: Reader) -> None:
    install, try_it = sh_blocks()[:2]
    setup, _, run = install.rpartition(" && ")
    assert setup == "python3 -m venv .venv && .venv/bin/pip install .", install  # (the module's doc)
    assert run == ".venv/bin/quota-proxy run -c config/example.yaml", install
    proxy = reader.start(run)
    reader.wait_for(9090, "/readyz", proxy)

    vendor_line, *curls = [line.split("#")[0].strip() for line in try_it.splitlines()]
    assert vendor_line == ".venv/bin/quota-proxy mock-vendor --listen 127.0.0.1:8081 --rate 100", try_it
    vendor = reader.start(vendor_line)
    reader.wait_for(8081, "/__mock/stats", vendor)
    assert len(curls) == 3 and all(c.startswith("curl ") for c in curls), try_it
    forward, route, status = (reader.run(c) for c in curls)
    assert json.loads(forward)["path"] == "/v1/ping", forward  # the mock vendor echoes what it was asked
    assert json.loads(route)["path"] == "/v1/ping", route
    buckets = json.loads(status)
    assert buckets["vendors"], status
    stats = json.loads(reader.run("curl -s http://127.0.0.1:8081/__mock/stats"))
    assert stats["accepted"] == 2, stats  # both calls reached the vendor, through the proxy
    assert reader.stop() == [0, 0]  # SIGTERM: both drain and exit 0


def test_the_clients_pages_plain_http_commands_run_as_printed(reader: Reader) -> None:
    """docs/clients.md's "Plain HTTP first" starts the example as the README does, in words, and
    gives the curl forms inline: each code span that is a command runs as printed (the
    reader's venv on PATH, as after ``pip install .``)."""
    page = (ROOT / "docs" / "clients.md").read_text()
    section = page[page.index("## Plain HTTP first") : page.index("## Troubleshooting")]
    prose = re.sub(r"```.*?```", "", section, flags=re.S)  # (the fenced snippets: tests/sdk)
    spans = [" ".join(code.split()) for code in re.findall(r"`([^`]+)`", prose)]
    commands = [c for c in spans if c.startswith(("quota-proxy ", "curl "))]
    assert commands == [
        "quota-proxy mock-vendor --listen 127.0.0.1:8081 &",
        "quota-proxy run -c config/example.yaml",
        "curl -x http://127.0.0.1:8080 -H 'X-Tenant-Id: acme' http://api.mock-vendor.example/v1/ping",
        "curl http://127.0.0.1:8080/mock-vendor/v1/ping",
    ], commands
    reader.env["PATH"] = f"{reader.work / '.venv' / 'bin'}{os.pathsep}{reader.env['PATH']}"
    vendor = reader.start(commands[0].removesuffix(" &"))  # (in the background, as `&` puts it)
    reader.wait_for(8081, "/__mock/stats", vendor)
    proxy = reader.start(commands[1])
    reader.wait_for(9090, "/readyz", proxy)
    for curl in commands[2:]:
        assert json.loads(reader.run(curl))["path"] == "/v1/ping", curl
    stats = json.loads(reader.run("curl -s http://127.0.0.1:8081/__mock/stats"))
    assert stats["accepted"] == 2, stats
    assert reader.stop() == [0, 0]


def test_the_https_section_runs_as_printed(reader: Reader) -> None:
    """README's "HTTPS vendors": its policy as printed, ``ca init`` and ``run`` as printed; the
    last line calls Stripe itself (the page says so, with a key of the reader's), so the test
    does what its curl does up to the vendor: a CONNECT to the proxy and a TLS handshake for
    api.stripe.com that trusts ``ca/ca.pem`` alone (no request is sent: nothing leaves the
    machine)."""
    text = README.read_text()
    section = text[text.index("### HTTPS vendors") : text.index("### The demo")]
    (policy,) = re.findall(r"```yaml\n(.*?)\n```", section, re.S)
    assert policy.startswith("# policy.yaml\n"), policy
    (reader.work / "policy.yaml").write_text(reader.moved(policy) + "\n")
    (commands,) = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    ca_init, run, curl = [line.split("  #")[0].strip() for line in commands.splitlines()]
    assert ca_init == ".venv/bin/quota-proxy ca init --out ca -c policy.yaml", commands
    reader.run(ca_init)
    assert (reader.work / "ca" / "ca.pem").is_file() and (reader.work / "ca" / "ca-key.pem").is_file()
    assert run == ".venv/bin/quota-proxy run -c policy.yaml", commands
    proxy = reader.start(run)
    reader.wait_for(9090, "/readyz", proxy)
    assert curl == (
        'HTTPS_PROXY=http://127.0.0.1:8080 curl --cacert ca/ca.pem https://api.stripe.com/v1/balance -u "$STRIPE_KEY:"'
    ), commands
    assert "The last line calls Stripe itself" in section
    context = ssl.create_default_context(cafile=str(reader.work / "ca" / "ca.pem"))
    with socket.create_connection(("127.0.0.1", reader.ports[8080]), timeout=10) as raw:
        raw.sendall(b"CONNECT api.stripe.com:443 HTTP/1.1\r\nHost: api.stripe.com:443\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = raw.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        with context.wrap_socket(raw, server_hostname="api.stripe.com") as tls:
            cert = tls.getpeercert()
    assert cert is not None
    alt = cert.get("subjectAltName", ())
    names = [str(entry[1]) for entry in alt if entry[0] == "DNS"]
    assert names == ["api.stripe.com"], names
    assert reader.stop() == [0]
