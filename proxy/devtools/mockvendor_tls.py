"""``quota-proxy mock-vendor --tls DIR``: HTTPS with certificates from the CA in ``DIR``.

``DIR`` holds a CA as ``quota-proxy ca init --out DIR`` writes it (``ca.pem``,
``ca-key.pem``); without one, one is made there first, name-constrained to ``TLS_NAMES``.
The vendor presents, for each name a client asks for (SNI), a leaf minted by the proxy's own
``LeafMinter``, and for a client that names no host (one that connects to an address) a
leaf for 127.0.0.1. So one CA covers the whole local set-up: the proxy intercepts with it
(``tls.ca_cert``) and trusts the vendor with it (``tls.upstream_ca_file``), and a worker
trusts both with the one ``ca.pem``.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Final

from proxy.ca.authority import CAError, CertificateAuthority
from proxy.ca.commands import CA_CERT_NAME, CA_KEY_NAME, init_ca
from proxy.ca.leaves import LeafMinter

__all__ = ["TLS_NAMES", "VendorTls", "vendor_tls"]

TLS_NAMES: Final = (
    "api.stripe.com",
    "api.openai.com",
    "api.anthropic.com",
    "api.github.com",
    "slack.com",
    "api.mock-vendor.example",
    "localhost",
    "127.0.0.1",
    "::1",
)
"""What a CA made by ``--tls`` may vouch for: the vendors the mock imitates, and loopback."""

_LEAF_VALIDITY: Final = 30 * 86400.0  # a leaf outlives any run of the mock (re-minted if not)
_NO_SNI: Final = "127.0.0.1"


class VendorTls:
    """The server context, and where its CA is."""

    def __init__(self, context: ssl.SSLContext, ca_file: Path, made: bool, minter: LeafMinter) -> None:
        self.context = context
        self.ca_file = ca_file
        self.made = made
        """whether the CA was made now"""
        self._minter = minter  # kept alive: its contexts hold the leaves the handshakes pick

    def close(self) -> None:
        self._minter.close()


def vendor_tls(directory: Path) -> VendorTls:
    """The HTTPS context of a vendor whose certificates come from the CA in ``directory``
    (made there if it has none). CAError names the file and the problem."""
    cert, key = directory / CA_CERT_NAME, directory / CA_KEY_NAME
    made = not cert.exists() and not key.exists()
    if made:
        init_ca(directory, common_name="quota-proxy mock-vendor CA", permitted_hosts=TLS_NAMES)
    minter = LeafMinter(CertificateAuthority.load(cert, key), _LEAF_VALIDITY)
    context = minter.context_for(_NO_SNI)

    def by_name(connection: ssl.SSLObject, name: str | None, _: ssl.SSLContext) -> int | None:
        if name is None:
            return None
        try:
            connection.context = minter.context_for(name)
        except (CAError, ValueError):  # a name the CA may not vouch for
            return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
        return None

    context.sni_callback = by_name
    return VendorTls(context, cert, made, minter)
