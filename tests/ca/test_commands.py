"""proxy/ca/commands.py and ``quota-proxy ca init | show``: the files ``init_ca``
writes, what ``describe`` and ``trust_instructions`` print, and the commands' exits."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from proxy.ca.authority import CAError, CertificateAuthority
from proxy.ca.commands import describe, init_ca, trust_instructions
from proxy.ca.leaves import LeafMinter
from tests.ca.conftest import HOST
from tests.helpers.cli import assert_no_traceback, run_cli

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
        init_ca(tmp_path, permitted_hosts=["api payments.example"])
    with pytest.raises(ValueError, match=r'^"\*\.payments\.example": a name constraint has no wildcard; '):
        init_ca(tmp_path, permitted_hosts=["*.payments.example"])
    with pytest.raises(ValueError, match="not one string"):
        init_ca(tmp_path, permitted_hosts="api.payments.example")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- describe, instructions


def test_describe_names_fingerprint_expiry_key_and_constraints(tmp_path):
    ca = CertificateAuthority.load(*init_ca(tmp_path, days=100, permitted_hosts=[HOST]))
    text = describe(ca, now=ca.not_after - dt.timedelta(days=42, hours=1))
    assert f"subject:          CN=quota-proxy CA\nSHA-256:          {ca.fingerprint_sha256}\n" in text
    assert f"not after:        {ca.not_after:%Y-%m-%d %H:%M:%S} UTC (42 days left)" in text
    assert "key:              EC P-256" in text
    assert text.endswith(
        f"key:              EC P-256\n"
        f"name constraints: permits {HOST} (and every host under it)\n"
        "                  excludes 0.0.0.0/0 (every IPv4 address)\n"
        "                  excludes ::/0 (every IPv6 address)\n"
        f"                  (the same names: ca init --permit {HOST})"
    )
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


def test_cli_ca_init_permit_with_a_policy_keeps_both_and_drops_what_a_suffix_covers(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.replace("hosts: [api.crm.example]", "hosts: [api.crm.example, files.crm.example]"))
    out = tmp_path / "ca"
    done = run_cli(
        "ca", "init", "--out", str(out), "-c", str(policy), "--permit", ".crm.example, 10.0.0.0/8", "--permit", "::1"
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    ca = CertificateAuthority.load(out / "ca.pem", out / "ca-key.pem")
    assert ca.name_constraints is not None
    assert ca.name_constraints.permitted_subtrees == [  # --permit first; policy hosts a --permit covers left out
        x509.DNSName(".crm.example"),
        x509.IPAddress(ipaddress.ip_network("10.0.0.0/8")),
        x509.IPAddress(ipaddress.ip_network("::1/128")),
        x509.DNSName(HOST),
    ]
    assert ca.name_constraints.excluded_subtrees is None
    assert (
        "name constraints: permits .crm.example (every host under crm.example)\n"
        "                  permits 10.0.0.0/8\n"
        "                  permits ::1\n"
        f"                  permits {HOST} (and every host under it)\n\n"
    ) in done.stdout

    policy.write_text(POLICY.replace("api.crm.example", "billing.crm.example"))  # a new host under .crm.example...
    shown = run_cli("ca", "show", "-c", str(policy))  # ...loads with the same CA
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.endswith(
        "name constraints: permits .crm.example (every host under crm.example)\n"
        "                  permits 10.0.0.0/8\n"
        "                  permits ::1\n"
        f"                  permits {HOST} (and every host under it)\n"
        f"                  (the same names: ca init --permit .crm.example,10.0.0.0/8,::1,{HOST})\n"
    )

    policy.write_text(POLICY.replace("10.0.0.7]", "10.0.0.7, api.mail.example]"))  # one outside: exit 2, explained
    refused = run_cli("ca", "show", "-c", str(policy))
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == (
        f'{policy}:4: vendors[0].hosts[4]: "api.mail.example" is outside the CA\'s name constraints (permitted: '
        f".crm.example, 10.0.0.0/8, ::1, {HOST}): re-create the CA with ca init --permit "
        f".crm.example,10.0.0.0/8,::1,{HOST},api.mail.example (a suffix such as .mail.example covers every host "
        "under mail.example)\n"
    )


def test_cli_ca_init_permit_alone_constrains_without_a_policy(tmp_path):
    out = tmp_path / "ca"
    done = run_cli("ca", "init", "--out", str(out), "--permit", ".stripe.com,.openai.com")
    assert done.returncode == 0, done.stderr
    nc = CertificateAuthority.load(out / "ca.pem", out / "ca-key.pem").name_constraints
    assert nc is not None
    assert nc.permitted_subtrees == [x509.DNSName(".stripe.com"), x509.DNSName(".openai.com")]
    assert len(nc.excluded_subtrees or ()) == 2  # no IP address at all

    empty = tmp_path / "routes.yaml"  # a policy whose vendors have routes, not hosts
    empty.write_text(
        "version: 1\nvendors:\n  - {name: a, route: /a, upstream: 'http://127.0.0.1:1', limits: [{rate: 1}]}\n"
    )
    warned = run_cli("ca", "init", "--out", str(tmp_path / "warned"), "-c", str(empty))
    assert warned.returncode == 0 and "lists no vendor hosts: the CA is not name-constrained" in warned.stderr
    quiet = run_cli("ca", "init", "--out", str(tmp_path / "quiet"), "-c", str(empty), "--permit", ".stripe.com")
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.parametrize(
    ("permit", "problem"),
    [
        ("*.stripe.com", '"*.stripe.com": a name constraint has no wildcard; ".stripe.com" permits every host under'),
        (".stripe.com,,.openai.com", "an empty permitted name (a constraint must name something)"),
        ("10.0.0.1/8", '"10.0.0.1/8" has host bits set: the network is 10.0.0.0/8'),
    ],
)
def test_cli_ca_init_refuses_a_bad_permit_as_a_usage_error(tmp_path, permit, problem):
    done = run_cli("ca", "init", "--out", str(tmp_path / "ca"), "--permit", permit)
    assert done.returncode == 2
    assert f"quota-proxy ca init: error: argument --permit: {problem}" in done.stderr
    assert_no_traceback(done.stderr)
    assert not (tmp_path / "ca").exists()
