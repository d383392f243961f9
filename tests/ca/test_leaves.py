"""proxy/ca/leaves.py: ``LeafMinter``. Handshakes are real TLS over 127.0.0.1."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import ssl
import stat
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proxy.ca.authority import CAError, CertificateAuthority
from proxy.ca.commands import init_ca
from proxy.ca.leaves import LeafMinter
from tests.ca.conftest import HOST, T0, Mints, ext


async def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str) -> str | None:
    """A TLS handshake over 127.0.0.1; returns the negotiated ALPN protocol (raises on failure)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx, server_hostname=server_hostname
        )
        try:
            assert await reader.read() == b"hello"
            return writer.get_extra_info("ssl_object").selected_alpn_protocol()
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


def client_trusting(ca_path: Path | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca_path)) if ca_path else ssl.create_default_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


# ---------------------------------------------------------------- leaves: real handshakes


async def test_a_client_trusting_the_ca_completes_the_handshake_with_alpn_http11(ca_files, minter):
    context = minter.context_for(HOST)
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert await handshake(context, client_trusting(ca_files[0]), HOST) == "http/1.1"


async def test_a_client_that_does_not_trust_the_ca_fails(tmp_path, minter):
    stranger, _ = init_ca(tmp_path / "stranger")
    for client in (client_trusting(None), client_trusting(stranger)):  # system roots; another CA
        with pytest.raises(ssl.SSLCertVerificationError, match="self-signed certificate in certificate chain"):
            await handshake(minter.context_for(HOST), client, HOST)


async def test_a_leaf_for_another_host_fails_hostname_verification(ca_files, minter):
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        await handshake(minter.context_for(HOST), client_trusting(ca_files[0]), "api.crm.example")


async def test_ip_literal_leaf(ca_files, minter):
    assert await handshake(minter.context_for("127.0.0.1"), client_trusting(ca_files[0]), "127.0.0.1") == "http/1.1"
    leaf = minter.cached_certificate("127.0.0.1")
    assert leaf is not None
    san = ext(leaf, x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert san.value.get_values_for_type(x509.DNSName) == []
    assert san.critical and len(leaf.subject) == 0  # no CN: see LeafMinter._mint


async def test_name_constrained_ca_leaves_pass_in_real_clients(tmp_path):
    cert_path, key_path = init_ca(tmp_path, permitted_hosts=[HOST, "127.0.0.1"])
    with LeafMinter(CertificateAuthority.load(cert_path, key_path), 3600) as minter:
        assert await handshake(minter.context_for(f"eu.{HOST}"), client_trusting(cert_path), f"eu.{HOST}")
        assert await handshake(minter.context_for("127.0.0.1"), client_trusting(cert_path), "127.0.0.1")


async def test_clients_enforce_the_name_constraints_themselves(tmp_path, monkeypatch):
    """What a stolen CA key could mint for another host, OpenSSL refuses."""
    cert_path, key_path = init_ca(tmp_path, permitted_hosts=[HOST])
    ca = CertificateAuthority.load(cert_path, key_path)
    with LeafMinter(ca, 3600) as minter:
        outside = r'^"api\.crm\.example" is outside the CA\'s name constraints \(permitted: api\.payments\.example\)'
        with pytest.raises(CAError, match=outside):
            minter.context_for("api.crm.example")  # the minter refuses first...
        monkeypatch.setattr(CertificateAuthority, "outside", lambda self, host: None)
        for host, violation in (("api.crm.example", "permitted"), ("127.0.0.1", "excluded")):
            with pytest.raises(ssl.SSLCertVerificationError, match=f"{violation} subtree violation"):
                await handshake(minter.context_for(host), client_trusting(cert_path), host)  # ...and so do clients


async def test_a_suffix_constraint_means_to_openssl_what_it_means_to_the_minter(tmp_path, monkeypatch):
    """``.payments.example`` covers every host under payments.example, not the domain itself:
    a real OpenSSL client agrees with ``permits`` on both."""
    cert_path, key_path = init_ca(tmp_path, permitted_hosts=[".payments.example"])
    ca = CertificateAuthority.load(cert_path, key_path)
    with LeafMinter(ca, 3600) as minter:
        for host in (HOST, f"eu.{HOST}"):
            assert await handshake(minter.context_for(host), client_trusting(cert_path), host)
        with pytest.raises(CAError, match=r'^"payments\.example" is outside'):
            minter.context_for("payments.example")
        monkeypatch.setattr(CertificateAuthority, "outside", lambda self, host: None)
        for host in ("payments.example", "api.xpayments.example"):
            with pytest.raises(ssl.SSLCertVerificationError, match="permitted subtree violation"):
                await handshake(minter.context_for(host), client_trusting(cert_path), host)


async def test_a_ca_for_addresses_only_vouches_for_no_dns_name(tmp_path, monkeypatch):
    cert_path, key_path = init_ca(tmp_path, permitted_hosts=["127.0.0.0/8"])
    ca = CertificateAuthority.load(cert_path, key_path)
    with LeafMinter(ca, 3600) as minter:
        assert await handshake(minter.context_for("127.0.0.1"), client_trusting(cert_path), "127.0.0.1")
        with pytest.raises(CAError, match=r'^"api\.crm\.example" is outside .*\(permitted: 127\.0\.0\.0/8; excluded: '):
            minter.context_for("api.crm.example")
        monkeypatch.setattr(CertificateAuthority, "outside", lambda self, host: None)
        with pytest.raises(ssl.SSLCertVerificationError, match="excluded subtree violation"):
            await handshake(minter.context_for("api.crm.example"), client_trusting(cert_path), "api.crm.example")


# ---------------------------------------------------------------- leaves: contents


def test_leaf_certificate_contents(ca):
    with LeafMinter(ca, 7200, clock=lambda: T0) as minter:
        minter.context_for(HOST)
        leaf = minter.cached_certificate(HOST)
        minter.context_for("api.crm.example")
        other = minter.cached_certificate("api.crm.example")
    assert leaf is not None and other is not None
    leaf.verify_directly_issued_by(ca.certificate)
    assert leaf.issuer == ca.certificate.subject
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == HOST
    assert ext(leaf, x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == [HOST]
    basic = ext(leaf, x509.BasicConstraints)
    assert basic.critical and not basic.value.ca
    assert list(ext(leaf, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert ext(leaf, x509.KeyUsage).value.digital_signature
    ca_ski = ext(ca.certificate, x509.SubjectKeyIdentifier).value
    assert ext(leaf, x509.AuthorityKeyIdentifier).value.key_identifier == ca_ski.digest
    assert leaf.not_valid_before_utc.timestamp() == T0 - 3600  # an hour of clock skew
    assert leaf.not_valid_after_utc.timestamp() == T0 + 7200
    assert leaf.serial_number != other.serial_number
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    assert leaf.public_key() == other.public_key()  # one key per minter


def test_long_host_names_are_truncated_in_the_cn_only(minter):
    host = "a" * 60 + ".payments.example"
    minter.context_for(host)
    leaf = minter.cached_certificate(host)
    assert leaf is not None
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == host[:64]
    assert ext(leaf, x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == [host]


@pytest.mark.parametrize(
    "host",
    ["", "*.payments.example", "*", "api.payments.example:443", "a b.example", "-api.example", "1.2.3",
     "fe80::1%eth0", "[api.payments.example]", "api..example", "exämple.com", "x" * 254],
)  # fmt: skip
def test_hosts_that_are_not_a_name_or_address_are_refused(minter, host):
    mints = Mints()
    with LeafMinter(minter.ca, 60, on_mint=mints) as m, pytest.raises(ValueError):
        m.context_for(host)
    assert mints.calls == []


# ---------------------------------------------------------------- the cache


def test_a_cache_hit_returns_the_same_context_without_minting(ca):
    mints = Mints()
    with LeafMinter(ca, 86400, on_mint=mints) as minter:
        first = minter.context_for(HOST)
        started = time.thread_time()  # CPU time: another process taking the core does not count
        for _ in range(10_000):
            assert minter.context_for(HOST) is first
        per_hit = (time.thread_time() - started) / 10_000
        assert minter.context_for("API.Payments.Example.") is first  # one entry per normalised name
    assert mints.hosts == [HOST]
    assert mints.calls[0][1] > 0
    assert per_hit < 50e-6, f"a cache hit took {per_hit * 1e6:.1f} µs of CPU"


def test_the_cache_is_a_bounded_lru(ca):
    mints = Mints()
    with LeafMinter(ca, 86400, cache_size=2, on_mint=mints) as minter:
        minter.context_for("a.example")
        minter.context_for("b.example")
        minter.context_for("a.example")  # a is now the most recent
        minter.context_for("c.example")  # evicts b
        assert minter.cached_certificate("b.example") is None
        minter.context_for("a.example")
        minter.context_for("b.example")
    assert mints.hosts == ["a.example", "b.example", "c.example", "b.example"]


def test_a_leaf_is_reminted_when_under_10_percent_of_its_validity_is_left(ca):
    now = [T0]
    mints = Mints()
    with LeafMinter(ca, 1000, clock=lambda: now[0], on_mint=mints) as minter:
        first = minter.context_for(HOST)
        now[0] = T0 + 899  # 101 s of 1000 left
        assert minter.context_for(HOST) is first
        now[0] = T0 + 901  # 99 s left
        second = minter.context_for(HOST)
        assert second is not first
        leaf = minter.cached_certificate(HOST)
        assert leaf is not None and leaf.not_valid_after_utc.timestamp() == T0 + 901 + 1000
        assert minter.context_for(HOST) is second
    assert mints.hosts == [HOST, HOST]


def test_leaf_validity_never_exceeds_the_cas(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, days=2))
    now = [ca.not_after.timestamp() - 86400]
    with LeafMinter(ca, 30 * 86400, clock=lambda: now[0]) as minter:
        minter.context_for(HOST)
        leaf = minter.cached_certificate(HOST)
        assert leaf is not None and leaf.not_valid_after_utc == ca.not_after
        now[0] = ca.not_after.timestamp() + 1
        with pytest.raises(CAError, match=rf"expired on .*; cannot mint a leaf for {re.escape(HOST)}"):
            minter.context_for(HOST)


# ---------------------------------------------------------------- the temporary directory


def test_chains_pass_through_a_private_directory_and_never_stay(ca, monkeypatch):
    seen: list[tuple[Path, int]] = []
    real_load = ssl.SSLContext.load_cert_chain

    def spy(self, certfile, keyfile=None, password=None):
        path = Path(certfile)
        seen.append((path.parent, stat.S_IMODE(path.stat().st_mode)))
        return real_load(self, certfile, keyfile, password)

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    minter = LeafMinter(ca, 3600)
    directory = minter.directory
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for host in (HOST, "api.crm.example", "10.1.2.3"):
        minter.context_for(host)
    assert seen == [(directory, 0o600)] * 3
    assert list(directory.iterdir()) == []  # each chain (and the leaf key in it) unlinked at once
    cached = minter.context_for(HOST)
    minter.close()
    assert minter.closed and not directory.exists()
    assert minter.context_for(HOST) is cached  # contexts already made keep working
    with pytest.raises(RuntimeError, match="closed"):
        minter.context_for("new.example")
    minter.close()  # idempotent


def test_minter_arguments_are_checked(ca):
    with pytest.raises(ValueError, match="validity must be a positive number"):
        LeafMinter(ca, 0)
    with pytest.raises(ValueError, match="cache_size must be at least 1"):
        LeafMinter(ca, 60, cache_size=0)
