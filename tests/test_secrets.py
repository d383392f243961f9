"""Store credentials never leave the process in clear (issue 9, defect 4): every form
redis-py reads a credential from (``user:pass@``, ``:pass@``, ``?password=``, other
secret query arguments) is masked in the ready line, /status, ``quota-proxy check``'s
summary, the loader's messages and the log. Usernames stay readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.policy import mask_password
from tests.conftest import free_port
from tests.helpers.cli import EXAMPLE, cli, http_get, run_cli, server_process, write_policy

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # no credential at all: unchanged
        ("memory://", "memory://"),
        ("redis://redis.internal:6379/0", "redis://redis.internal:6379/0"),
        ("redis://redis.internal:6379/0?db=1&socket_timeout=2", "redis://redis.internal:6379/0?db=1&socket_timeout=2"),
        # userinfo
        (f"redis://app:{SECRET}@redis.internal:6379/0", "redis://app:***@redis.internal:6379/0"),
        (f"redis://:{SECRET}@redis.internal:6379/0", "redis://:***@redis.internal:6379/0"),
        (f"rediss://app:{SECRET}@cache:6380", "rediss://app:***@cache:6380"),
        (f"redis+cluster://app:{SECRET}@node1:7000", "redis+cluster://app:***@node1:7000"),
        ("redis://app@redis.internal:6379/0", "redis://app@redis.internal:6379/0"),  # a username alone
        # the query string, which redis-py reads too (and where a password overrides none)
        (f"redis://redis.internal:6379/0?password={SECRET}", "redis://redis.internal:6379/0?password=***"),
        (
            f"rediss://cache:6380/0?username=app&password={SECRET}&ssl_cert_reqs=required",
            "rediss://cache:6380/0?username=app&password=***&ssl_cert_reqs=required",
        ),
        (f"redis+cluster://node1:7000?password={SECRET}", "redis+cluster://node1:7000?password=***"),
        (f"redis://h:6379?pass%77ord={SECRET}", "redis://h:6379?pass%77ord=***"),  # percent-encoded name
        (f"redis://h:6379?PASSWORD={SECRET}", "redis://h:6379?PASSWORD=***"),
        (f"rediss://h:6380?ssl_password={SECRET}", "rediss://h:6380?ssl_password=***"),
        (f"redis://u:{SECRET}@h:6379/0?password={SECRET}", "redis://u:***@h:6379/0?password=***"),
        # passwords with the URL's own delimiters in them, pasted unencoded: never half-shown
        (f"redis://:ab/{SECRET}@h:6379/0", "redis://***@h:6379/0"),
        (f"redis://:ab?{SECRET}@h:6379/0", "redis://***@h:6379/0"),
        (f"redis://:ab#{SECRET}@h:6379/0", "redis://***@h:6379/0"),
        (f"redis://:p@{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
        (f"redis://h:6379/0?password=a@{SECRET}", "redis://h:6379/0?password=***"),
        # not even a URL: whatever looks like a credential goes
        (f"http://user:{SECRET}@redis.internal:6379/0", "http://user:***@redis.internal:6379/0"),
        (f"redis:h?password={SECRET}", "redis:h?password=***"),
    ],
)
def test_every_credential_form_is_masked(url: str, shown: str) -> None:
    assert mask_password(url) == shown
    assert SECRET not in mask_password(url)


def test_check_summary_and_loader_messages_mask_a_query_password(tmp_path: Path) -> None:
    good = write_policy(
        tmp_path / "good.yaml",
        f"""
        version: 1
        store: {{url: "redis://redis.internal:6379/0?password={SECRET}"}}
        vendors:
          - name: a
            hosts: [api.a.example]
            limits: [{{rate: 10}}]
        """,
    )
    result = run_cli("check", "-c", str(good))
    assert result.returncode == 0, result.stderr
    assert "store         redis://redis.internal:6379/0?password=***" in result.stdout.splitlines()
    assert SECRET not in result.stdout + result.stderr

    bad = write_policy(tmp_path / "bad.yaml", good.read_text().replace("6379/0", "6379/db"))
    result = run_cli("check", "-c", str(bad))
    assert result.returncode == 2
    assert "?password=***" in result.stderr and SECRET not in result.stderr


def test_a_query_password_is_masked_in_the_ready_line_status_and_log(tmp_path: Path) -> None:
    url = f"redis://app@127.0.0.1:{free_port()}/0?password={SECRET}"
    argv = cli("run", "-c", str(EXAMPLE), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--store", url)
    with server_process(argv, tmp_path) as proc:
        ready = proc.wait_ready()
        assert ready.store == url.replace(SECRET, "***")
        status, _, body = http_get(f"{ready.admin_url}/status")
        assert status == 200
        assert json.loads(body)["store"]["url"] == url.replace(SECRET, "***")
        assert SECRET not in body.decode()
        assert http_get(f"{ready.admin_url}/readyz")[0] == 503  # nothing listens there
        assert proc.terminate_and_wait() == 0
        assert SECRET not in proc.stderr()


def test_a_bad_store_flag_is_reported_masked(tmp_path: Path) -> None:
    result = run_cli("run", "-c", str(EXAMPLE), "--store", f"redis://h:6379/db?password={SECRET}")
    assert result.returncode == 2
    assert result.stderr.startswith("quota-proxy: --store: ") and "password=***" in result.stderr
    assert SECRET not in result.stderr
