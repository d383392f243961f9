"""proxy/ca/authority.py: what a CA certificate holds, which hosts its name constraints
permit, and the CAs ``CertificateAuthority.load`` refuses."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from proxy.ca.authority import CAError, CertificateAuthority, normalize_host
from proxy.ca.commands import init_ca, parse_permit
from tests.ca.conftest import HOST, ext
from tests.helpers.certs import write_self_signed

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


def net(text: str) -> x509.IPAddress:
    return x509.IPAddress(ipaddress.ip_network(text))


@pytest.mark.parametrize(
    ("entry", "constraint"),
    [
        (".Stripe.COM.", x509.DNSName(".stripe.com")),
        ("api.stripe.com", x509.DNSName("api.stripe.com")),
        (" localhost ", x509.DNSName("localhost")),
        ("10.0.0.7", net("10.0.0.7/32")),
        ("[2001:DB8::1]", net("2001:db8::1/128")),
        ("10.0.0.0/8", net("10.0.0.0/8")),
        ("2001:db8::/32", net("2001:db8::/32")),
        ("[2001:db8::]/32", net("2001:db8::/32")),
    ],
)
def test_permit_entries_become_name_constraints(entry, constraint):
    assert parse_permit(entry) == constraint


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("", "an empty permitted name (a constraint must name something)"),
        (
            "*.stripe.com",
            '"*.stripe.com": a name constraint has no wildcard; ".stripe.com" permits every host under stripe.com',
        ),
        (".com", '".com" would let the CA vouch for every host in a top-level domain: name a domain under it'),
        (".", '"." is not a domain suffix (a dot, then a domain name)'),
        (".10.0.0.1", '".10.0.0.1" is not a domain suffix: write an address without the dot, or a network'),
        ("10.0.0.1/8", '"10.0.0.1/8" has host bits set: the network is 10.0.0.0/8'),
        ("10.0.0.0/33", '"10.0.0.0/33" is not an IP network (e.g. 10.0.0.0/8 or 2001:db8::/32)'),
        ("api.stripe.com:443", "'api.stripe.com:443': a certificate names a host without a port"),
    ],
)
def test_bad_permit_entries_say_what_is_wrong(entry, problem):
    with pytest.raises(ValueError) as raised:
        parse_permit(entry)
    assert str(raised.value) == problem


def test_a_suffix_permits_every_host_under_the_domain_but_not_the_domain(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, permitted_hosts=[".stripe.com", HOST]))
    assert ca.permits("api.stripe.com") and ca.permits("files.eu.stripe.com") and ca.permits(HOST)
    assert not ca.permits("stripe.com") and not ca.permits("api.xstripe.com") and not ca.permits("stripe.com.evil")


def test_each_name_is_kept_once_and_only_when_no_other_covers_it(tmp_path):
    entries = ["api.stripe.com", ".stripe.com", "files.stripe.com", "payments.example", HOST, "10.0.0.7", "10.0.0.0/8"]
    entries += ["10.1.2.3", "stripe.com", "::1", "::/0"]
    nc = CertificateAuthority.load(*init_ca(tmp_path, permitted_hosts=entries)).name_constraints
    assert nc is not None
    assert nc.permitted_subtrees == [
        x509.DNSName("payments.example"),  # covers api.payments.example
        net("10.0.0.0/8"),  # covers 10.0.0.7, 10.1.2.3
        x509.DNSName("stripe.com"),  # covers .stripe.com, which covered api. and files.stripe.com
        net("::/0"),
    ]
    assert nc.excluded_subtrees is None


def test_a_ca_for_addresses_only_excludes_every_dns_name(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, permitted_hosts=["10.0.0.0/8"]))
    nc = ca.name_constraints
    assert nc is not None
    assert nc.excluded_subtrees == [net("::/0"), x509.DNSName("")]
    assert ca.permits("10.200.0.1") and not ca.permits("11.0.0.1") and not ca.permits("::1")
    assert not ca.permits(HOST) and not ca.permits("localhost")


def test_outside_names_the_constraint_and_the_ca_init_that_would_cover_the_host(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, permitted_hosts=[".stripe.com", HOST]))
    assert ca.outside("api.stripe.com") is None
    assert ca.outside("api.openai.com") == (
        '"api.openai.com" is outside the CA\'s name constraints (permitted: .stripe.com, api.payments.example): '
        "re-create the CA with ca init --permit .stripe.com,api.payments.example,api.openai.com "
        "(a suffix such as .openai.com covers every host under openai.com)"
    )
    assert ca.outside("stripe.com") == (  # two labels: no suffix to suggest
        '"stripe.com" is outside the CA\'s name constraints (permitted: .stripe.com, api.payments.example): '
        "re-create the CA with ca init --permit .stripe.com,api.payments.example,stripe.com"
    )
    assert ca.outside("10.0.0.8") == (
        '"10.0.0.8" is outside the CA\'s name constraints (permitted: .stripe.com, api.payments.example; '
        "excluded: 0.0.0.0/0): re-create the CA with ca init --permit .stripe.com,api.payments.example,10.0.0.8"
    )
    ips = CertificateAuthority.load(*init_ca(tmp_path / "ips", permitted_hosts=["10.0.0.0/8", "::1"]))
    assert ips.outside("10.0.0.8") is None
    assert ips.outside("11.0.0.1") == (
        '"11.0.0.1" is outside the CA\'s name constraints (permitted: 10.0.0.0/8, ::1): '
        "re-create the CA with ca init --permit 10.0.0.0/8,::1,11.0.0.1"
    )
    assert ips.outside("localhost") == (
        '"localhost" is outside the CA\'s name constraints (permitted: 10.0.0.0/8, ::1; excluded: every DNS name): '
        "re-create the CA with ca init --permit 10.0.0.0/8,::1,localhost"
    )
    unconstrained = CertificateAuthority.load(*init_ca(tmp_path / "any"))
    assert unconstrained.outside("api.openai.com") is None and unconstrained.permits("10.0.0.8")


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


def test_host_names_are_normalised():
    assert normalize_host("API.Payments.Example.") == HOST
    assert normalize_host("[2001:DB8:0::1]") == "2001:db8::1"
    assert normalize_host("my_service") == "my_service"
