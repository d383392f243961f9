"""Certificates of a chosen shape for the CA tests (``tests/ca``, ``tests/policy``)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def write_self_signed(
    path: Path,
    *,
    ca: bool = True,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
    key: ec.EllipticCurvePrivateKey | None = None,
    basic_constraints: bool = True,
) -> ec.EllipticCurvePrivateKey:
    """A self-signed certificate at ``path`` with the given shape; returns its key
    (written next to it as ``<stem>-key.pem``)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - dt.timedelta(days=1))
        .not_valid_after(not_after or now + dt.timedelta(days=30))
    )
    if basic_constraints:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    path.write_bytes(builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.with_name(f"{path.stem}-key.pem").write_bytes(key_pem)
    return key
