"""``quota-proxy mock-vendor --tls DIR``: HTTPS that a client trusts with DIR/ca.pem alone, for
every name the CA may vouch for, the CA made in DIR when it has none and reused when it has."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509

from proxy.ca.commands import init_ca
from proxy.devtools.mockvendor import MockVendor
from proxy.devtools.mockvendor_tls import TLS_NAMES, vendor_tls
from tests.helpers.cli import clean_env, cli, run_process
from tests.helpers.vendor_process import vendor_process


async def get(url: str, ca_file: Path, server_hostname: str | None = None) -> tuple[int, Any]:
    trust = ssl.create_default_context(cafile=str(ca_file))
    async with (
        aiohttp.ClientSession() as s,
        s.get(url, ssl=trust, server_hostname=server_hostname) as r,
    ):
        return r.status, await r.json()


async def test_a_client_trusting_ca_pem_alone_reaches_it_by_any_vendor_name_and_by_address(
    tmp_path: Path, aiohttp_server: Any
) -> None:
    tls = vendor_tls(tmp_path / "ca")
    assert tls.made and tls.ca_file == tmp_path / "ca" / "ca.pem"
    assert stat.S_IMODE((tmp_path / "ca" / "ca-key.pem").stat().st_mode) == 0o600
    constraints = x509.load_pem_x509_certificate(tls.ca_file.read_bytes()).extensions.get_extension_for_class(
        x509.NameConstraints
    )
    assert constraints.critical  # the CA a reader trusts vouches for the mock's names only
    server = await aiohttp_server(MockVendor(rate=None).app(), ssl=tls.context)
    base = f"https://127.0.0.1:{server.port}"
    assert (await get(f"{base}/v1/customers/cus_1", tls.ca_file))[1]["object"] == "customer"
    for name in ("api.stripe.com", "api.openai.com", "localhost"):
        status, body = await get(f"{base}/v1/ping", tls.ca_file, server_hostname=name)
        assert (status, body["path"]) == (200, "/v1/ping")
    with pytest.raises(aiohttp.ClientConnectorError):  # a name the CA may not vouch for
        await get(f"{base}/v1/ping", tls.ca_file, server_hostname="api.elsewhere.example")
    tls.close()


async def test_a_ca_already_in_the_directory_is_used(tmp_path: Path, aiohttp_server: Any) -> None:
    cert, _ = init_ca(tmp_path / "ca", permitted_hosts=["api.stripe.com", "127.0.0.1"])
    before = cert.read_bytes()
    tls = vendor_tls(tmp_path / "ca")
    assert not tls.made and cert.read_bytes() == before
    server = await aiohttp_server(MockVendor(rate=None).app(), ssl=tls.context)
    base = f"https://127.0.0.1:{server.port}"
    assert (await get(f"{base}/v1/ping", cert, server_hostname="api.stripe.com"))[0] == 200
    with pytest.raises(aiohttp.ClientConnectorError):  # that CA does not permit it
        await get(f"{base}/v1/ping", cert, server_hostname="api.openai.com")
    tls.close()


def test_the_names_cover_the_vendors_the_mock_imitates() -> None:
    assert {"api.stripe.com", "api.openai.com", "127.0.0.1", "localhost"} <= set(TLS_NAMES)


async def test_the_command_serves_https_from_the_directory_it_is_given(tmp_path: Path) -> None:
    with vendor_process(tmp_path, "--rate", "0", ca_dir=Path("ca"), cwd=tmp_path) as vendor:
        assert vendor.url.startswith("https://") and vendor.ca_file == tmp_path / "ca" / "ca.pem"
        status, body = await get(f"{vendor.url}/v1/customers/cus_9", vendor.ca_file, server_hostname="api.stripe.com")
        assert (status, body["id"]) == (200, "cus_9")
        assert (await vendor.stats())["accepted"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls", "ca", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "give --tls DIR or --tls-cert/--tls-key"),
        (["--tls", "broken"], "--tls broken: "),
    ],
)
async def test_bad_tls_arguments_exit_2_saying_why(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "ca.pem").write_text("not a certificate\n")
    status, out, err = await run_process(
        cli("mock-vendor", "--listen", "127.0.0.1:0", *args), env=clean_env(), cwd=tmp_path
    )
    assert status == 2 and out == "", err
    assert message in err, err
