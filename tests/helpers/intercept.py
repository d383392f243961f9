"""TLS interception tests' common ground: the proxy's CA, one intercepted vendor's policy,
where the HTTPS mock vendor is reached, and the proxy's metrics."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509

from proxy.ca.commands import init_ca
from proxy.server import ProxyServer
from tests.conftest import HttpsVendor, client_session, make_policy, metric_samples

HOST = "api.payments.example"
URL = f"https://{HOST}"

INTERCEPT_HEAD = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    store: {url: "$store", timeout: 1s}
    tls:
      ca_cert: $ca_cert
      ca_key: $ca_key
      leaf_validity: $leaf_validity
      $upstream_ca
      $tls_extra
"""
"""Everything but the vendors of an intercepting proxy's policy (make_policy's placeholders)."""

INTERCEPT_POLICY = (
    INTERCEPT_HEAD
    + """
    vendors:
      - name: payments
        hosts: [$host]
        upstream: $upstream
        limits: $limits
        on_limit: $on_limit
        feedback: {retry_after_default: 3s}
        $vendor_extra
"""
)


@dataclass(frozen=True)
class ProxyCA:
    cert: Path
    key: Path

    def trust(self, alpn: list[str] | None = None) -> ssl.SSLContext:
        """A worker's client context that trusts the proxy's CA (and nothing else)."""
        ctx = ssl.create_default_context(cafile=str(self.cert))
        if alpn:
            ctx.set_alpn_protocols(alpn)
        return ctx

    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert.read_bytes())


def new_proxy_ca(directory: Path) -> ProxyCA:
    """The proxy's own interception CA, as ``quota-proxy ca init`` makes it (name-constrained)."""
    cert, key = init_ca(directory / "proxy-ca", permitted_hosts=[HOST])
    return ProxyCA(cert, key)


def intercept_policy(
    ca: ProxyCA,
    *,
    upstream: str,
    vendor_ca: Path | None,
    store: str = "memory://",
    limits: str = "[{rate: 1000, per: 1s}]",
    on_limit: str = "{action: defer}",
    leaf_validity: str = "1d",
    tls_extra: str = "",
    vendor_extra: str = "",
) -> Any:
    """One vendor ``payments`` on api.payments.example, intercepted (the default once
    tls.ca_cert is set), sent to ``upstream`` and verified against ``vendor_ca``."""
    upstream_ca = "" if vendor_ca is None else f"upstream_ca_file: {vendor_ca}"
    return make_policy(
        INTERCEPT_POLICY,
        store=store,
        ca_cert=ca.cert,
        ca_key=ca.key,
        leaf_validity=leaf_validity,
        upstream_ca=upstream_ca,
        tls_extra=tls_extra,
        host=HOST,
        upstream=upstream,
        limits=limits,
        on_limit=on_limit,
        vendor_extra=vendor_extra,
    )


def upstream_of(vendor: HttpsVendor) -> str:
    return f"https://localhost:{vendor.port}"


async def scrape(proxy: ProxyServer) -> dict[Any, float]:
    async with client_session() as s, s.get(f"{proxy.admin_url}/metrics") as r:
        assert r.status == 200
        return metric_samples(await r.text())
