"""The proxy's CA (SPEC §8): ``init_ca``, ``CertificateAuthority``, ``LeafMinter`` and
``quota-proxy ca init | show``. Handshakes are real TLS over 127.0.0.1."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import re
import ssl
import stat
import time
from pathlib import Path
from typing import TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proxy.tlsca import (
    CAError,
    CertificateAuthority,
    LeafMinter,
    describe,
    init_ca,
    normalize_host,
    trust_instructions,
)
from tests.helpers.certs import write_self_signed
from tests.helpers.cli import assert_no_traceback, run_cli

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


# ---------------------------------------------------------------- init_ca


def test_init_ca_writes_a_public_certificate_and_a_private_key(tmp_path):
    old = os.umask(0o077)  # the certificate is 0644 whatever the umask...
    try:
        cert_path, key_path = init_ca(tmp_path / "new" / "dir")  # ...and missing directories are made
    finally:
        os.umask(old)
    assert (cert_path, key_path) == (tmp_path / "new" / "dir" / "ca.pem", tmp_path / "new" / "dir" / "ca-key.pem")
    assert stat.S_IMODE(cert_path.stat().st_mode) == 0o644
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert sorted(p.name for p in cert_path.parent.iterdir()) == ["ca-key.pem", "ca.pem"]  # no temp files left
    assert cert_path.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert b"PRIVATE KEY" in key_path.read_bytes()


def test_the_key_file_is_created_0600_never_widened_later(tmp_path, monkeypatch):
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)  # init_ca creates its files with os.open
    old = os.umask(0)  # a umask of 0 must not make the key world-readable either
    try:
        _, key_path = init_ca(tmp_path)
    finally:
        os.umask(old)
    created = [(path, flags, mode) for path, flags, mode in opened if flags & os.O_CREAT]
    key_files = [(flags, mode) for path, flags, mode in created if "ca-key.pem" in path]
    assert key_files, created
    assert all(mode == 0o600 and flags & os.O_EXCL for flags, mode in key_files)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


def test_init_ca_refuses_to_overwrite_either_file(tmp_path):
    cert_path, key_path = init_ca(tmp_path)
    before = (cert_path.read_bytes(), key_path.read_bytes())
    with pytest.raises(CAError, match=r"ca\.pem: already exists; refusing to overwrite it \(--force replaces it\)"):
        init_ca(tmp_path)
    cert_path.unlink()  # half a CA is still refused: the key alone is precious
    with pytest.raises(CAError, match=r"ca-key\.pem: already exists"):
        init_ca(tmp_path)
    assert key_path.read_bytes() == before[1]
    assert not cert_path.exists()


def test_force_replaces_both_files_and_keeps_the_key_private(tmp_path):
    cert_path, key_path = init_ca(tmp_path)
    old = CertificateAuthority.load(cert_path, key_path)
    key_path.chmod(0o644)  # a loosened old key file is replaced, not reused
    init_ca(tmp_path, force=True)
    new = CertificateAuthority.load(cert_path, key_path)
    assert new.fingerprint_sha256 != old.fingerprint_sha256
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600


def test_an_unwritable_directory_is_a_ca_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CAError, match="cannot create the directory"):
        init_ca(tmp_path / "file" / "ca")


@pytest.mark.parametrize(
    ("key_type", "key_class", "label"),
    [("ec", ec.EllipticCurvePrivateKey, "EC P-256"), ("rsa", rsa.RSAPrivateKey, "RSA 2048")],
)
def test_ec_and_rsa_cas(tmp_path, key_type, key_class, label):
    ca = CertificateAuthority.load(*init_ca(tmp_path, key_type=key_type))
    assert isinstance(ca.private_key, key_class)
    assert ca.key_type == label
    with LeafMinter(ca, 3600) as minter:
        minter.context_for(HOST)
        leaf = minter.cached_certificate(HOST)
    assert leaf is not None
    leaf.verify_directly_issued_by(ca.certificate)


def test_init_ca_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="days must be a positive integer"):
        init_ca(tmp_path, days=0)
    with pytest.raises(ValueError, match="common name must be 1 to 64 characters"):
        init_ca(tmp_path, common_name="x" * 65)
    with pytest.raises(ValueError, match="is not a host name or IP address"):
        init_ca(tmp_path, permitted_hosts=["*.payments.example"])
    with pytest.raises(ValueError, match="not one string"):
        init_ca(tmp_path, permitted_hosts="api.payments.example")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the CA certificate


def test_ca_certificate_properties_and_extensions(tmp_path):
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    cert_path, key_path = init_ca(tmp_path, common_name="Acme egress CA", days=30)
    after = dt.datetime.now(dt.UTC)
    ca = CertificateAuthority.load(cert_path, key_path)
    cert = ca.certificate

    assert ca.subject == "CN=Acme egress CA"
    assert cert.issuer == cert.subject
    assert ca.cert_pem == cert_path.read_bytes()
    assert ca.fingerprint_sha256 == cert.fingerprint(hashes.SHA256()).hex(":").upper()
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", ca.fingerprint_sha256)
    assert ca.not_before.tzinfo is not None and ca.not_after.tzinfo is not None
    assert before - dt.timedelta(hours=1) <= ca.not_before <= after - dt.timedelta(hours=1)
    assert before + dt.timedelta(days=30) <= ca.not_after <= after + dt.timedelta(days=30)

    basic = ext(cert, x509.BasicConstraints)
    assert basic.critical and basic.value == x509.BasicConstraints(ca=True, path_length=0)
    usage = ext(cert, x509.KeyUsage)
    assert usage.critical
    assert usage.value.key_cert_sign and usage.value.crl_sign and not usage.value.digital_signature
    ski = ext(cert, x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(ca.private_key.public_key())
    assert ca.name_constraints is None
    with pytest.raises(x509.ExtensionNotFound):
        ext(cert, x509.NameConstraints)
    cert.verify_directly_issued_by(cert)  # self-signed


def test_name_constraints_permit_only_the_given_hosts(tmp_path):
    hosts = [HOST, "API.CRM.example.", "10.0.0.7", "[2001:db8::1]", HOST]
    ca = CertificateAuthority.load(*init_ca(tmp_path, permitted_hosts=hosts))
    nc = ext(ca.certificate, x509.NameConstraints)
    assert nc.critical
    assert nc.value.permitted_subtrees == [
        x509.DNSName(HOST),
        x509.DNSName("api.crm.example"),
        x509.IPAddress(ipaddress.ip_network("10.0.0.7/32")),
        x509.IPAddress(ipaddress.ip_network("2001:db8::1/128")),
    ]
    assert nc.value.excluded_subtrees is None  # both families have a permitted address
    assert ca.permits(HOST) and ca.permits(f"v2.{HOST}") and ca.permits("10.0.0.7")
    assert not ca.permits("api.other.example") and not ca.permits(f"x{HOST}") and not ca.permits("10.0.0.8")


def test_a_ca_for_names_only_vouches_for_no_ip_address(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, permitted_hosts=[HOST]))
    nc = ca.name_constraints
    assert nc is not None
    assert nc.excluded_subtrees == [
        x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
        x509.IPAddress(ipaddress.ip_network("::/0")),
    ]
    assert not ca.permits("127.0.0.1") and not ca.permits("::1")


def test_load_refuses_what_cannot_sign_leaves(tmp_path):
    cert_path, key_path = init_ca(tmp_path / "a")
    _, other_key = init_ca(tmp_path / "b")

    with pytest.raises(CAError) as raised:
        CertificateAuthority.load(cert_path, other_key)
    assert (raised.value.role, raised.value.path) == ("key", str(other_key))
    assert str(raised.value) == f"CA key {other_key}: does not match the certificate in {cert_path}"

    write_self_signed(tmp_path / "leaf.pem", ca=False)
    with pytest.raises(CAError) as raised:
        CertificateAuthority.load(tmp_path / "leaf.pem", tmp_path / "leaf-key.pem")
    assert raised.value.role == "certificate"
    leaf = tmp_path / "leaf.pem"
    assert str(raised.value) == f"CA certificate {leaf}: not a CA certificate (basicConstraints CA:FALSE)"

    with pytest.raises(CAError, match="cannot read: No such file or directory"):
        CertificateAuthority.load(tmp_path / "missing.pem", key_path)
    with pytest.raises(CAError, match="no PEM certificate in the file"):
        CertificateAuthority.load(key_path, key_path)
    with pytest.raises(CAError, match="not a PEM private key"):
        CertificateAuthority.load(cert_path, cert_path)

    encrypted = tmp_path / "encrypted.pem"
    encrypted.write_bytes(
        CertificateAuthority.load(cert_path, key_path).private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
        )
    )
    with pytest.raises(CAError, match="the key is encrypted"):
        CertificateAuthority.load(cert_path, encrypted)


def test_load_checks_the_validity_period(tmp_path):
    cert_path, key_path = init_ca(tmp_path, days=10)
    ca = CertificateAuthority.load(cert_path, key_path)
    with pytest.raises(CAError, match=r"expired on \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"):
        CertificateAuthority.load(cert_path, key_path, now=ca.not_after)
    with pytest.raises(CAError, match="not valid before"):
        CertificateAuthority.load(cert_path, key_path, now=ca.not_before - dt.timedelta(seconds=1))


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
        with pytest.raises(CAError, match=r"api\.crm\.example is outside the CA's name constraints"):
            minter.context_for("api.crm.example")  # the minter refuses first...
        monkeypatch.setattr(CertificateAuthority, "permits", lambda self, host: True)
        for host, violation in (("api.crm.example", "permitted"), ("127.0.0.1", "excluded")):
            with pytest.raises(ssl.SSLCertVerificationError, match=f"{violation} subtree violation"):
                await handshake(minter.context_for(host), client_trusting(cert_path), host)  # ...and so do clients


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


def test_host_names_are_normalised():
    assert normalize_host("API.Payments.Example.") == HOST
    assert normalize_host("[2001:DB8:0::1]") == "2001:db8::1"
    assert normalize_host("my_service") == "my_service"


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


# ---------------------------------------------------------------- describe, instructions


def test_describe_names_fingerprint_expiry_key_and_constraints(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, days=100, permitted_hosts=[HOST]))
    text = describe(ca, now=ca.not_after - dt.timedelta(days=42, hours=1))
    assert f"subject:          CN=quota-proxy CA\nSHA-256:          {ca.fingerprint_sha256}\n" in text
    assert f"not after:        {ca.not_after:%Y-%m-%d %H:%M:%S} UTC (42 days left)" in text
    assert "key:              EC P-256" in text
    assert f"name constraints: permits {HOST}\n                  excludes 0.0.0.0/0, ::/0" in text
    assert "(EXPIRED 3 days ago)" in describe(ca, now=ca.not_after + dt.timedelta(days=3))


def test_trust_instructions_cover_every_client(tmp_path):
    ca_path = tmp_path / "ca.pem"
    text = trust_instructions(ca_path)
    for needle in (
        f"cat /etc/ssl/certs/ca-certificates.crt {ca_path} > /etc/ssl/quota-proxy-bundle.pem",
        "export SSL_CERT_FILE=/etc/ssl/quota-proxy-bundle.pem",
        "export REQUESTS_CA_BUNDLE=",
        f"export NODE_EXTRA_CA_CERTS={ca_path}",
        "export CURL_CA_BUNDLE=",
        f"--cacert {ca_path}",
        f"cp {ca_path} /usr/local/share/ca-certificates/quota-proxy.crt && update-ca-certificates",
        "*replaces*",
    ):
        assert needle in text, needle


# ---------------------------------------------------------------- the command line


POLICY = """\
version: 1
vendors:
  - name: payments-api
    hosts: [api.payments.example, "api.payments.example:8443", "[::1]:9443", 10.0.0.7]
    limits: [{rate: 10}]
  - name: crm
    hosts: [api.crm.example]
    limits: [{rate: 10}]
    connect: tunnel
tls:
  ca_cert: ca/ca.pem
  ca_key: ca/ca-key.pem
"""


def test_cli_ca_init_with_a_policy_then_show(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "ca"
    done = run_cli("ca", "init", "--out", str(out), "-c", str(policy))
    assert done.returncode == 0, done.stderr
    assert f"wrote {out / 'ca.pem'} " in done.stdout and f"wrote {out / 'ca-key.pem'} " in done.stdout
    assert "export NODE_EXTRA_CA_CERTS=" in done.stdout and "update-ca-certificates" in done.stdout
    assert stat.S_IMODE((out / "ca-key.pem").stat().st_mode) == 0o600
    ca = CertificateAuthority.load(out / "ca.pem", out / "ca-key.pem")
    assert ca.name_constraints is not None
    assert ca.name_constraints.permitted_subtrees == [  # ports dropped, brackets stripped, each host once
        x509.DNSName(HOST),
        x509.IPAddress(ipaddress.ip_network("::1/128")),
        x509.IPAddress(ipaddress.ip_network("10.0.0.7/32")),
        x509.DNSName("api.crm.example"),
    ]

    shown = run_cli("ca", "show", "-c", str(policy))
    assert shown.returncode == 0, shown.stderr
    assert f"SHA-256:          {ca.fingerprint_sha256}" in shown.stdout
    assert re.search(r"not after: +\S+ \S+ UTC \(36(49|50) days left\)", shown.stdout)


def test_cli_ca_init_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "ca"
    assert run_cli("ca", "init", "--out", str(out), "--rsa", "--days", "30", "--name", "Ops CA").returncode == 0
    first = (out / "ca.pem").read_bytes()
    again = run_cli("ca", "init", "--out", str(out))
    assert again.returncode == 1
    assert again.stderr == (
        f"quota-proxy: ca init: {out / 'ca.pem'}: already exists; refusing to overwrite it (--force replaces it)\n"
    )
    assert (out / "ca.pem").read_bytes() == first
    forced = run_cli("ca", "init", "--out", str(out), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "ca.pem").read_bytes() != first


def test_cli_ca_init_into_an_unwritable_place_exits_1(tmp_path):
    (tmp_path / "file").write_text("")
    done = run_cli("ca", "init", "--out", str(tmp_path / "file" / "ca"))
    assert done.returncode == 1
    assert done.stderr.startswith("quota-proxy: ca init: ") and "cannot create the directory" in done.stderr
    assert_no_traceback(done.stderr)


def test_cli_ca_show_without_a_ca_or_with_missing_files_exits_2(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.split("tls:")[0])
    done = run_cli("ca", "show", "-c", str(policy))
    assert done.returncode == 2 and done.stdout == ""
    assert f"{policy}: no CA configured" in done.stderr

    policy.write_text(POLICY)  # names ca/ca.pem, which nobody made
    done = run_cli("ca", "show", "-c", str(policy))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"{policy}:11: tls.ca_cert: {tmp_path / 'ca' / 'ca.pem'}: cannot read: No such file or directory",
        f"{policy}:12: tls.ca_key: {tmp_path / 'ca' / 'ca-key.pem'}: cannot read: No such file or directory",
    ]


def test_cli_ca_show_describes_an_rsa_ca(tmp_path):
    init_ca(tmp_path / "ca", key_type="rsa", common_name="Ops CA")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    done = run_cli("ca", "show", "-c", str(policy))
    assert done.returncode == 0, done.stderr
    assert "subject:          CN=Ops CA" in done.stdout and "key:              RSA 2048" in done.stdout
    assert "name constraints: none" in done.stdout
