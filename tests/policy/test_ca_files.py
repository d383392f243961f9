"""``tls.ca_cert`` / ``tls.ca_key``: the loader loads the CA as the proxy will, and a CA
that could not sign leaves is a config error on the line of the file at fault, collected
with every other problem. The CA files are made in tmp_path; the YAML names them by
absolute path, so each message is exact."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pytest

from proxy.ca.commands import init_ca
from proxy.policy import ConfigErrors, TlsSettings, load_policy
from tests.helpers.certs import write_self_signed

BAD = Path(__file__).parent / "bad"

POLICY = """\
version: 1
vendors:
  - name: payments-api
    hosts: [api.payments.example]
    limits: [{{rate: 10, per: {per}}}]
tls:
  ca_cert: {cert}
  ca_key: {key}
"""
CERT_LINE, KEY_LINE = 7, 8


@pytest.fixture
def ca(tmp_path: Path) -> tuple[Path, Path]:
    return init_ca(tmp_path / "ca")


def write(tmp_path: Path, cert: Path | str, key: Path | str, *, per: str = "1s") -> Path:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(cert=cert, key=key, per=per))
    return policy


def problems(policy: Path) -> list[str]:
    with pytest.raises(ConfigErrors) as raised:
        load_policy(policy)
    return str(raised.value).splitlines()


def test_a_good_ca_loads_and_makes_vendors_intercept(tmp_path, ca):
    cert, key = ca
    policy = load_policy(write(tmp_path, cert, key))
    assert policy.tls == TlsSettings(ca_cert=str(cert), ca_key=str(key))
    assert policy.vendors[0].connect == "intercept"


def test_missing_files_are_each_reported_on_their_line(tmp_path):
    cert, key = tmp_path / "nope.pem", tmp_path / "nope-key.pem"
    policy = write(tmp_path, cert, key)
    assert problems(policy) == [
        f"{policy}:{CERT_LINE}: tls.ca_cert: {cert}: cannot read: No such file or directory",
        f"{policy}:{KEY_LINE}: tls.ca_key: {key}: cannot read: No such file or directory",
    ]


def test_unreadable_key(tmp_path, ca):
    cert, _ = ca
    policy = write(tmp_path, cert, tmp_path)  # a directory: unreadable whoever runs the tests
    assert problems(policy) == [f"{policy}:{KEY_LINE}: tls.ca_key: {tmp_path}: cannot read: Is a directory"]


def test_a_certificate_that_is_not_a_ca(tmp_path):
    write_self_signed(tmp_path / "leaf.pem", ca=False)
    write_self_signed(tmp_path / "bare.pem", basic_constraints=False)
    for name, why in (("leaf", "basicConstraints CA:FALSE"), ("bare", "it has no basicConstraints extension")):
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
        policy = write(tmp_path, cert, key)
        assert problems(policy) == [f"{policy}:{CERT_LINE}: tls.ca_cert: {cert}: not a CA certificate ({why})"]


def test_an_expired_or_not_yet_valid_ca(tmp_path):
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    ended = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    write_self_signed(tmp_path / "old.pem", not_before=ended - dt.timedelta(days=365), not_after=ended)
    starts = now + dt.timedelta(days=2)
    write_self_signed(tmp_path / "future.pem", not_before=starts, not_after=starts + dt.timedelta(days=365))
    for name, why in (
        ("old", "expired on 2024-01-02 03:04:05 UTC"),
        ("future", f"not valid before {starts:%Y-%m-%d %H:%M:%S} UTC"),
    ):
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}-key.pem"
        policy = write(tmp_path, cert, key)
        assert problems(policy) == [f"{policy}:{CERT_LINE}: tls.ca_cert: {cert}: {why}"]


def test_a_key_from_another_ca_goes_on_the_key_line(tmp_path, ca):
    cert, _ = ca
    _, other_key = init_ca(tmp_path / "other")
    policy = write(tmp_path, cert, other_key)
    assert problems(policy) == [
        f"{policy}:{KEY_LINE}: tls.ca_key: {other_key}: does not match the certificate in {cert}"
    ]


def test_files_swapped_or_not_pem(tmp_path, ca):
    cert, key = ca
    policy = write(tmp_path, key, cert)
    assert problems(policy) == [
        f"{policy}:{CERT_LINE}: tls.ca_cert: {key}: no PEM certificate in the file",
        f"{policy}:{KEY_LINE}: tls.ca_key: {cert}: not a PEM private key",
    ]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    policy = write(tmp_path, garbage, key)
    assert problems(policy) == [f"{policy}:{CERT_LINE}: tls.ca_cert: {garbage}: the PEM certificate cannot be parsed"]


def test_ca_problems_are_collected_with_the_others_in_line_order(tmp_path, ca):
    _, key = ca
    missing = tmp_path / "missing.pem"
    policy = write(tmp_path, missing, key, per="1x")
    assert problems(policy) == [
        f'{policy}:5: vendors[0].limits[0].per: "1x" is not a duration',
        f"{policy}:{CERT_LINE}: tls.ca_cert: {missing}: cannot read: No such file or directory",
    ]


def test_relative_paths_are_reported_resolved(tmp_path):
    policy = write(tmp_path, "ca/ca.pem", "ca/ca-key.pem")
    assert problems(policy) == [
        f"{policy}:{CERT_LINE}: tls.ca_cert: {tmp_path / 'ca' / 'ca.pem'}: cannot read: No such file or directory",
        f"{policy}:{KEY_LINE}: tls.ca_key: {tmp_path / 'ca' / 'ca-key.pem'}: cannot read: No such file or directory",
    ]
    init_ca(tmp_path / "ca")
    assert load_policy(policy).tls.ca_cert == str(tmp_path / "ca" / "ca.pem")


def test_check_ca_false_skips_the_files(tmp_path):
    policy = write(tmp_path, tmp_path / "nope.pem", tmp_path / "nope-key.pem")
    assert load_policy(policy, check_ca=False).tls.ca_cert == str(tmp_path / "nope.pem")


def test_intercepted_hosts_must_be_within_the_cas_name_constraints(tmp_path):
    cert, key = init_ca(tmp_path / "narrow", permitted_hosts=["api.other.example"])
    policy = write(tmp_path, cert, key)
    assert problems(policy) == [
        f'{policy}:4: vendors[0].hosts[0]: "api.payments.example" is outside the CA\'s name constraints '
        "(permitted: api.other.example): re-create the CA with ca init --permit "
        "api.other.example,api.payments.example (a suffix such as .payments.example covers every host under "
        "payments.example)",
    ]


def test_a_host_outside_a_suffix_ca_names_the_constraints_and_the_ca_init_that_covers_it(tmp_path):
    policy = tmp_path / "ca_outside_constraints.yaml"
    shutil.copy(BAD / policy.name, policy)
    init_ca(tmp_path / "ca", permitted_hosts=[".stripe.com", "api.payments.example"])
    assert problems(policy) == [  # api. and files.stripe.com are under .stripe.com: no new CA for them
        f'{policy}:7: vendors[1].hosts[0]: "api.openai.com" is outside the CA\'s name constraints '
        "(permitted: .stripe.com, api.payments.example): re-create the CA with ca init --permit "
        ".stripe.com,api.payments.example,api.openai.com (a suffix such as .openai.com covers every host under "
        "openai.com)"
    ]


def test_tunnelled_hosts_need_no_constraint(tmp_path):
    cert, key = init_ca(tmp_path / "narrow", permitted_hosts=["api.other.example"])
    policy = tmp_path / "tunnel.yaml"
    policy.write_text(
        POLICY.format(cert=cert, key=key, per="1s").replace("    limits:", "    connect: tunnel\n    limits:")
    )
    assert load_policy(policy).vendors[0].connect == "tunnel"
