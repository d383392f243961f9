"""Shared by the CA's tests: CA files made in tmp_path and an ``on_mint`` recorder
(certificates of any shape come from tests/helpers/certs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509

from proxy.ca.authority import CertificateAuthority
from proxy.ca.commands import init_ca
from proxy.ca.leaves import LeafMinter

HOST = "api.payments.example"
T0 = 1_800_000_000.0  # an injected "now", 2027-01-15


E = TypeVar("E", bound=x509.ExtensionType)


def ext(cert: x509.Certificate, kind: type[E]) -> x509.Extension[E]:
    return cert.extensions.get_extension_for_class(kind)


@pytest.fixture
def ca_files(tmp_path: Path) -> tuple[Path, Path]:
    return init_ca(tmp_path / "ca")


@pytest.fixture
def ca(ca_files: tuple[Path, Path]) -> CertificateAuthority:
    return CertificateAuthority.load(*ca_files)


@pytest.fixture
def minter(ca: CertificateAuthority):
    with LeafMinter(ca, 86400) as m:
        yield m


class Mints:
    """An ``on_mint`` that remembers every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def __call__(self, host: str, seconds: float) -> None:
        self.calls.append((host, seconds))

    @property
    def hosts(self) -> list[str]:
        return [host for host, _ in self.calls]
