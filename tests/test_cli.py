"""The ``quota-proxy`` command line, run as real subprocesses (``python -m proxy ...``).

SPEC §3: ``run`` and ``check``; flags override QUOTA_PROXY_CONFIG / QUOTA_PROXY_STORE,
which override the file; bad configuration never starts a server (exit 2, one line
per problem on stderr). Every process is waited for with a deadline, never a sleep.

The subprocess helpers (``cli``, ``ProxyProcess``, ``http_get``...) are in ``tests/helpers/cli.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import socket
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import proxy
from tests.conftest import free_port
from tests.helpers.cli import (
    EXAMPLE,
    ROOT,
    Ready,
    assert_no_traceback,
    clean_env,
    cli,
    http_get,
    port_is_free,
    run_cli,
    server_process,
    write_policy,
)

ERROR_LINE_RE = re.compile(r"(?P<file>.+?):(?P<line>\d+): (?P<path>[A-Za-z0-9_.\[\]]+): (?P<message>.+)")


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
    text = textwrap.dedent(BAD_POLICY).lstrip("\n").replace("$port", str(port)).replace("$admin_port", str(admin_port))
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


LOCAL_HOST_POLICY = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    vendors:
      - name: local
        hosts: [api.local.example, localhost]
        limits: [{rate: 10}]
"""


def test_check_prints_warnings_and_still_exits_0(tmp_path: Path) -> None:
    path = write_policy(tmp_path / "warned.yaml", LOCAL_HOST_POLICY)
    result = run_cli("check", "-c", str(path))
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f'warning: {path}:6: vendors[0].hosts[1]: "localhost" is this machine'), line
    assert result.stdout.startswith(f"OK {path}: 1 vendor(s)")


def test_run_logs_the_policys_warnings(tmp_path: Path) -> None:
    path = write_policy(tmp_path / "warned.yaml", LOCAL_HOST_POLICY)
    with server_process(cli("run", "-c", str(path)), tmp_path) as proc:
        proc.wait_ready()
        assert (
            f'WARNING quota_proxy policy: {path}:6: vendors[0].hosts[1]: "localhost" is this machine' in proc.stderr()
        )
        assert proc.terminate_and_wait() == 0


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
    argv = cli("run", "-c", str(EXAMPLE), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--store", url)
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
def test_bad_flag_or_env_exits_2_with_a_clear_message(flags: tuple[str, ...], env: dict[str, str], origin: str) -> None:
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
    argv = audited(
        "run", "-c", str(EXAMPLE), "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}"
    )
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
        path = write_policy(
            tmp_path / "good.yaml",
            f"""
            version: 1
            listen: 127.0.0.1:{port}
            admin_listen: 127.0.0.1:{admin_port}
            vendors:
              - {{name: payments, hosts: [api.payments.example], limits: [{{rate: 5, per: 1s}}]}}
        """,
        )
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


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("taken", ["listen", "admin_listen"])
def test_a_port_in_use_fails_with_one_clear_line(tmp_path: Path, taken: str, store: str, request) -> None:
    """A second ``run`` on a port in use: exit 1 and one line naming the address, never a
    traceback; with Redis, the background block watch must not outlive the store it reads
    (it once did: "Task exception was never retrieved", or a process that never exited)."""
    flags = ["--store", request.getfixturevalue("redis_url")] if store == "redis" else []
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        other = free_port()
        listen, admin = (port, other) if taken == "listen" else (other, port)
        argv = cli(
            "run", "-c", str(EXAMPLE), "--listen", f"127.0.0.1:{listen}", "--admin-listen", f"127.0.0.1:{admin}", *flags
        )
        with server_process(argv, tmp_path) as proc:
            status = proc.wait(timeout=30)
            assert proc.proc.stdout is not None
            assert proc.proc.stdout.read() == ""
            stderr = proc.stderr()
    assert status == 1, stderr
    assert_no_traceback(stderr)
    assert stderr.splitlines() == [f"quota-proxy: cannot listen on 127.0.0.1:{port} ({taken}): address already in use"]
    assert port_is_free(other)  # what it did bind, it let go


# -- mock-vendor, --version ---------------------------------------------------------------------


def test_mock_vendor_subcommand_serves_the_example_policy_end_to_end(tmp_path: Path) -> None:
    with server_process(
        cli("mock-vendor", "--listen", "127.0.0.1:0", "--rate", "50"), tmp_path, name="mock-vendor"
    ) as vendor:
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
    # For bug reports: the release, the Python, and every runtime library at its installed version.
    lines = version.stdout.splitlines()
    assert lines[0] == f"quota-proxy {proxy.__version__}"
    assert lines[1] == f"{platform.python_implementation()} {platform.python_version()}"
    expected = [
        "aiohttp",
        "httptools",
        "redis",
        "hiredis",
        "prometheus-client",
        "pyyaml",
        "uvloop",
        "cryptography",
        "orjson",
    ]
    assert sorted(lines[2:]) == sorted(f"{name} {metadata.version(name)}" for name in expected), version.stdout

    helped = run_cli("--help")
    assert helped.returncode == 0
    for command in ("run", "check", "mock-vendor"):
        assert command in helped.stdout

    unknown = run_cli("frobnicate")
    assert unknown.returncode == 2
    assert "invalid choice" in unknown.stderr


def test_every_command_says_what_it_does_and_every_option_has_help() -> None:
    from proxy.cli import build_parser

    def commands(parser: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(name, parser)]
        for action in parser._actions:  # argparse keeps no public list of a parser's subparsers
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    found += commands(child, f"{name} {sub}")
        return found

    for name, parser in commands(build_parser(), "quota-proxy"):
        assert parser.description, f"{name} --help: no description"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"{name} --help: {action.option_strings or action.dest} has no help"
    printed = run_cli("run", "--help")
    assert printed.returncode == 0
    assert "Serve the policy" in printed.stdout
    assert re.search(r"--log-level \{debug,info,warning,error\}\s+the level of the log", printed.stdout), printed.stdout
    assert "Load the policy as run would" in run_cli("check", "--help").stdout


def test_the_command_line_lists_the_developer_tools_without_importing_them() -> None:
    # `check` and `ca` stay quick to start: mock-vendor and demo register their arguments from
    # light modules, and aiohttp (the tools, the server) is imported only by a command that serves.
    probe = "import json, sys; from proxy.cli import build_parser; build_parser(); print(json.dumps(list(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert {"proxy.devtools.mockvendor_cli", "proxy.devtools.demo_cli"} <= loaded
    assert not loaded & {
        "aiohttp",
        "proxy.devtools.mockvendor",
        "proxy.devtools.demo",
        "proxy.devtools.demo_fleet",
        "proxy.devtools.demo_report",
        "proxy.server",
    }


def test_check_answers_prints_each_answer_as_the_worker_sees_it(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\n"
        "vendors:\n"
        "  - name: gh\n"
        "    hosts: [api.github.example]\n"
        "    limits: [{rate: 10}]\n"
        "    answers: {preset: github, shed: {status: 422}}\n"
    )
    result = run_cli("check", "-c", str(path), "--answers")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "  answers     github+, no SDK retry beyond 1m; RateLimit fields on 429s only" in out
    assert "              defer 403, long defer 409, shed 422 (check --answers shows each answer)" in out
    assert "vendor gh: answers github+" in out
    blocks = out.split("vendor gh: answers github+", 1)[1]
    for kind, status in [
        ("defer", "403 Forbidden"),
        ("long defer", "409 Conflict"),
        ("shed", "422 Unprocessable Entity"),
        ("deny", "403 Forbidden"),
        ("bad request", "400 Bad Request"),
        ("upstream error", "504 Gateway Timeout"),
    ]:
        assert f"\n  {kind} (" in blocks
        assert f"HTTP/1.1 {status}" in blocks
    said = "API rate limit exceeded (gh is over its quota (global 10/1s burst 10); retry in 0.25 s)"
    assert '{"message":"' + said + '"' in blocks
