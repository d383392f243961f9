"""Who may use the admin listener (SPEC §12): ``admin_token`` (or QUOTA_PROXY_ADMIN_TOKEN,
which wins) guards GET /status and POST /reload with a bearer token; /metrics, /healthz
and /readyz stay open. The listener answers only to its own names (DNS rebinding cannot
read /status from a browser), and a POST from another origin is refused."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.server import ProxyServer
from tests.conftest import Vendor, vendor_policy
from tests.helpers.cli import cli, run_cli, server_process
from tests.helpers.policies import payments_policy

TOKEN = "admin-token-0123456789abcdef"


async def admin(
    proxy: ProxyServer, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"{proxy.admin_url}{path}", headers=headers or {}) as r,
    ):
        body = await r.read()
        return r.status, dict(r.headers), json.loads(body) if r.content_type == "application/json" else body


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def with_token(vendor: Vendor, start_proxy: Any, extra: str = "") -> ProxyServer:
    return await start_proxy(vendor_policy(vendor.url, extra_top=f'admin_token: "{TOKEN}"{extra}'))


# -- the bearer token --------------------------------------------------------------------------------


async def test_without_a_token_status_is_open(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    assert (await admin(proxy, "GET", "/status"))[0] == 200


async def test_status_and_reload_need_the_bearer_token(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await with_token(vendor, start_proxy)
    for method, path in (("GET", "/status"), ("POST", "/reload")):
        status, headers, body = await admin(proxy, method, path)
        assert status == 401, (method, path)
        assert headers["WWW-Authenticate"] == 'Bearer realm="quota-proxy admin"'
        assert body["error"]["code"] == "unauthorized" and "admin_token" in body["message"]
        for wrong in (bearer("x" * len(TOKEN)), bearer(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"}):
            status, headers, _ = await admin(proxy, method, path, wrong)
            assert status == 401, (method, path, wrong)
        status, headers, _ = await admin(proxy, method, path, bearer("x" * len(TOKEN)))
        assert headers["WWW-Authenticate"] == 'Bearer realm="quota-proxy admin", error="invalid_token"'
    status, _, body = await admin(proxy, "GET", "/status", bearer())
    assert status == 200 and body["vendors"][0]["name"] == "payments"
    assert TOKEN not in json.dumps(body)
    status, _, _ = await admin(proxy, "GET", "/status", {"Authorization": f"bearer  {TOKEN} "})
    assert status == 200  # the scheme is case-insensitive (RFC 9110 §11.1)
    # No reload function in this in-process proxy: past the token check, 501.
    assert (await admin(proxy, "POST", "/reload", bearer()))[0] == 501


async def test_metrics_healthz_and_readyz_stay_open(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await with_token(vendor, start_proxy)
    for path in ("/metrics", "/healthz", "/readyz"):
        assert (await admin(proxy, "GET", path))[0] == 200, path


# -- Host: DNS rebinding ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.0.0.1:9090", "[::1]:9090", "10.1.2.3:9090", "localhost", "LocalHost.:9090", "admin.internal"],
)
async def test_its_own_names_and_any_ip_address_are_served(host: str, vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, extra_top="admin_hosts: [admin.internal]"))
    for path in ("/status", "/metrics"):
        assert (await admin(proxy, "GET", path, {"Host": host}))[0] == 200, (host, path)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:9090", "localhost.evil.example", "admin.internal"])
async def test_another_name_is_refused_421(host: str, vendor: Vendor, start_proxy: Any) -> None:
    """A page served from evil.example, its name rebound to the proxy's address, asks with Host: evil.example."""
    proxy = await start_proxy(vendor_policy(vendor.url))
    for method, path in (("GET", "/status"), ("GET", "/metrics"), ("POST", "/reload")):
        status, _, body = await admin(proxy, method, path, {"Host": host})
        assert status == 421, (host, path)
        assert body["error"]["code"] == "misdirected" and "admin_hosts" in body["message"]
    for path in ("/healthz", "/readyz"):  # probes: nothing to read there, never refused
        assert (await admin(proxy, "GET", path, {"Host": host}))[0] == 200, path


async def test_a_malformed_host_is_refused(vendor: Vendor, start_proxy: Any) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    assert (await admin(proxy, "GET", "/status", {"Host": "user@127.0.0.1"}))[0] == 421


async def test_a_post_from_another_origin_is_refused(vendor: Vendor, start_proxy: Any) -> None:
    """A web page may send a simple POST to http://127.0.0.1:9090/reload (its Host is an IP
    address); the browser says where the page came from."""
    proxy = await start_proxy(vendor_policy(vendor.url))
    status, _, body = await admin(proxy, "POST", "/reload", {"Origin": "http://evil.example"})
    assert status == 403 and body["error"]["code"] == "cross_origin"
    assert (await admin(proxy, "POST", "/reload", {"Origin": "null"}))[0] == 403
    own = f"http://127.0.0.1:{proxy.admin_address.port}"
    assert (await admin(proxy, "POST", "/reload", {"Origin": own}))[0] == 501  # past the check


# -- the token from the environment, in a real process -----------------------------------------------


def token_policy(tmp_path: Path, upstream: str, token: str | None) -> Path:
    return payments_policy(tmp_path / "admin.yaml", upstream, top=f'admin_token: "{token}"' if token else "", rate=100)


def fetch(url: str, method: str = "GET", token: str | None = None) -> int:
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {token}"} if token else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        with err:
            return err.code


async def test_the_environments_token_wins_over_the_files_and_guards_reload(tmp_path: Path, vendor: Vendor) -> None:
    env_token = "from-the-secret-0123456789"
    policy = token_policy(tmp_path, vendor.url, TOKEN)
    env = {"QUOTA_PROXY_ADMIN_TOKEN": env_token + "\n"}  # a Secret made from a file keeps its newline
    with server_process(cli("run", "-c", str(policy)), tmp_path, env=env) as proc:
        ready = await asyncio.to_thread(proc.wait_ready)
        status_url, reload_url = f"{ready.admin_url}/status", f"{ready.admin_url}/reload"
        assert await asyncio.to_thread(fetch, status_url, "GET", TOKEN) == 401
        assert await asyncio.to_thread(fetch, status_url, "GET", env_token) == 200
        assert await asyncio.to_thread(fetch, reload_url, "POST") == 401
        assert await asyncio.to_thread(fetch, reload_url, "POST", env_token) == 200
        assert proc.terminate_and_wait() == 0
        assert env_token not in proc.stderr() and TOKEN not in proc.stderr()


def test_a_bad_token_in_the_environment_is_a_configuration_error(tmp_path: Path) -> None:
    policy = token_policy(tmp_path, "http://127.0.0.1:9", None)
    result = run_cli("run", "-c", str(policy), env={"QUOTA_PROXY_ADMIN_TOKEN": "short-secret"})
    assert result.returncode == 2
    assert result.stderr == (
        "quota-proxy: QUOTA_PROXY_ADMIN_TOKEN: the admin token must be at least 16 characters long, it has 12\n"
    )
