"""The vendor SDK tests' ground: the mock vendor speaking Stripe's, OpenAI's and
Anthropic's wire formats over HTTPS, the proxy's CA permitting their host names, and a
worker's environment (HTTPS_PROXY, a CA bundle with the system CAs plus the proxy's,
``stripe.ca_bundle_path``) pointing at a running proxy.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import certifi
import pytest
import stripe
import trustme

from proxy.ca.commands import init_ca
from proxy.server import ProxyServer
from tests.conftest import ProxyFactory
from tests.helpers.cli import PROXY_VARS, TRUST_VARS
from tests.helpers.sdk_vendor import SdkVendor
from tests.helpers.sdks import HOSTS, sdk_policy

WORKER_VARS = (
    *PROXY_VARS,
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
)


@dataclass
class ServedVendor:
    mock: SdkVendor
    port: int
    ca_file: Path
    """the vendor CA (trustme), which the proxy trusts through tls.upstream_ca_file"""

    @property
    def upstream(self) -> str:
        return f"https://localhost:{self.port}"


@pytest.fixture
async def sdk_vendor(vendor_ca: tuple[trustme.CA, Path], aiohttp_server: Any) -> AsyncIterator[ServedVendor]:
    ca, path = vendor_ca
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(ctx)
    mock = SdkVendor()
    server = await aiohttp_server(mock.app(), ssl=ctx)
    yield ServedVendor(mock, server.port, path)
    mock.release()


@dataclass(frozen=True)
class WorkerTrust:
    """The proxy's CA, and the bundle a worker trusts: the usual public CAs plus it."""

    ca_cert: Path
    ca_key: Path
    bundle: Path


@pytest.fixture
def worker_trust(tmp_path: Path) -> WorkerTrust:
    cert, key = init_ca(tmp_path / "proxy-ca", permitted_hosts=sorted(HOSTS.values()))
    bundle = tmp_path / "bundle.pem"  # docs/clients.md: cat "$(python -m certifi)" ca.pem > bundle.pem
    bundle.write_bytes(Path(certifi.where()).read_bytes() + b"\n" + cert.read_bytes())
    return WorkerTrust(cert, key, bundle)


@dataclass
class SdkProxies:
    """Starts proxies for the SDK vendors and points the worker's environment at them."""

    start_proxy: ProxyFactory
    vendor: ServedVendor
    trust: WorkerTrust
    monkeypatch: pytest.MonkeyPatch

    async def start(self, **policy: Any) -> ProxyServer:
        proxy = await self.start_proxy(
            sdk_policy(
                ca_cert=self.trust.ca_cert,
                ca_key=self.trust.ca_key,
                vendor_ca=self.vendor.ca_file,
                upstream=self.vendor.upstream,
                **policy,
            )
        )
        self.point_worker_at(proxy)
        return proxy

    def point_worker_at(self, proxy: ProxyServer) -> None:
        """What a worker's deployment sets; nothing else of the worker changes."""
        mp = self.monkeypatch
        for var in (*PROXY_VARS, *TRUST_VARS):
            mp.delenv(var, raising=False)
        mp.setenv("HTTPS_PROXY", proxy.url)
        mp.setenv("https_proxy", proxy.url)
        mp.setenv("SSL_CERT_FILE", str(self.trust.bundle))  # httpx (OpenAI, Anthropic), aiohttp, urllib
        mp.setenv("REQUESTS_CA_BUNDLE", str(self.trust.bundle))  # requests (Stripe ignores it)
        mp.setenv("NODE_EXTRA_CA_CERTS", str(self.trust.ca_cert))
        mp.setattr(stripe, "ca_bundle_path", str(self.trust.bundle))  # Stripe passes its own bundle


@pytest.fixture
def sdk_proxies(
    start_proxy: ProxyFactory, sdk_vendor: ServedVendor, worker_trust: WorkerTrust, monkeypatch: pytest.MonkeyPatch
) -> SdkProxies:
    return SdkProxies(start_proxy, sdk_vendor, worker_trust, monkeypatch)
