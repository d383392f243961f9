"""The CA the proxy signs leaves with: loading it, and checking it can sign usable leaves.

``CertificateAuthority.load`` reads a PEM certificate and key and refuses anything that
could not sign usable leaves (not a CA, expired, key and certificate from different
pairs), raising ``CAError`` naming the file and the problem. ``permits`` answers whether
the CA's name constraints cover a host, as OpenSSL would, and ``outside`` says which
constraint a host falls outside and how to re-create the CA. ``normalize_host`` is a host
as a certificate names it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from typing import Final, Literal, TypeAlias

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from proxy.names import ip_or_none, parse_host, split_host_port

__all__ = [
    "CLOCK_SKEW",
    "CN_MAX",
    "CAError",
    "CAPrivateKey",
    "CertificateAuthority",
    "constraint_text",
    "dns_within",
    "format_utc",
    "key_usage",
    "load_ca_certificate",
    "load_ca_key",
    "normalize_host",
    "permit_entries",
]

CAPrivateKey: TypeAlias = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
"""The CA key types the proxy signs with."""

CLOCK_SKEW: Final = 3600.0
"""Seconds the CA and its leaves are backdated, so a worker whose clock runs slow still accepts them."""
CN_MAX: Final = 64
"""ub-common-name, RFC 5280."""
_PEM_CERT: Final = b"-----BEGIN CERTIFICATE-----"

Role = Literal["certificate", "key"]


class CAError(Exception):
    """A CA that cannot be used, or cannot be written; ``str()`` names the file and the problem.

    ``path`` is the file concerned (None when no file is), ``role`` says whether it is the
    CA's certificate or its key (None for other files), ``problem`` is the message alone.
    """

    def __init__(self, problem: str, *, path: str | os.PathLike[str] | None = None, role: Role | None = None) -> None:
        self.problem = problem
        self.path = None if path is None else os.fspath(path)
        self.role: Role | None = role
        super().__init__(problem)

    def __str__(self) -> str:
        if self.path is None:
            return self.problem
        what = {"certificate": "CA certificate ", "key": "CA key ", None: ""}[self.role]
        return f"{what}{self.path}: {self.problem}"


def normalize_host(host: str) -> str:
    """A host as a certificate names it: ``proxy.names.parse_host``'s normal form, brackets
    accepted around IPv6. ValueError for anything else: wildcards, ports, scoped IPv6,
    empty or over-long names, labels with characters DNS does not allow."""
    if not isinstance(host, str):
        raise ValueError(f"host must be a string, got {type(host).__name__}")
    name, port = split_host_port(host)
    if port is not None:
        raise ValueError(f"{host!r}: a certificate names a host without a port")
    normal = parse_host(name)
    ip = ip_or_none(normal)
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        raise ValueError(f"{host!r}: a scoped IPv6 address cannot be named in a certificate")
    return normal


def format_utc(moment: dt.datetime) -> str:
    """``2030-01-31 12:00:00 UTC``, how CA and leaf dates are shown."""
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _read(path: str, role: Role) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise CAError(f"cannot read: {exc.strerror or exc}", path=path, role=role) from None


def load_ca_certificate(path: str | os.PathLike[str], *, now: dt.datetime | None = None) -> x509.Certificate:
    """The one PEM certificate in ``path``, checked to be a CA that is valid ``now``
    (default: the current time). CAError otherwise."""
    where = os.fspath(path)
    data = _read(where, "certificate")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        unreadable = (
            "no PEM certificate in the file" if _PEM_CERT not in data else "the PEM certificate cannot be parsed"
        )
        raise CAError(unreadable, path=where, role="certificate") from None
    if len(certs) != 1:
        raise CAError(f"holds {len(certs)} certificates; give the CA certificate alone", path=where, role="certificate")
    cert = certs[0]
    problem = _not_a_ca(cert) or _outside_validity(cert, now or dt.datetime.now(dt.UTC))
    if problem is not None:
        raise CAError(problem, path=where, role="certificate")
    return cert


def _not_a_ca(cert: x509.Certificate) -> str | None:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return "not a CA certificate (it has no basicConstraints extension)"
    if not constraints.ca:
        return "not a CA certificate (basicConstraints CA:FALSE)"
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.key_cert_sign:
        return "not a CA certificate (keyUsage lacks keyCertSign)"
    try:
        public = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        return f"unsupported public key ({exc})"
    if not isinstance(public, rsa.RSAPublicKey | ec.EllipticCurvePublicKey):
        return f"unsupported key type {type(public).__name__} (RSA or EC only)"
    return None


def _outside_validity(cert: x509.Certificate, now: dt.datetime) -> str | None:
    if now >= cert.not_valid_after_utc:
        return f"expired on {format_utc(cert.not_valid_after_utc)}"
    if now < cert.not_valid_before_utc:
        return f"not valid before {format_utc(cert.not_valid_before_utc)}"
    return None


def load_ca_key(path: str | os.PathLike[str]) -> CAPrivateKey:
    """The unencrypted PEM private key (RSA or EC) in ``path``; CAError otherwise."""
    where = os.fspath(path)
    data = _read(where, "key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:  # "Password was not given but private key is encrypted"
        raise CAError("the key is encrypted; give it unencrypted (and mode 0600)", path=where, role="key") from None
    except UnsupportedAlgorithm as exc:
        raise CAError(f"unsupported key ({exc})", path=where, role="key") from None
    except ValueError:
        raise CAError("not a PEM private key", path=where, role="key") from None
    if not isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        raise CAError(f"unsupported key type {type(key).__name__} (RSA or EC only)", path=where, role="key")
    return key


def _spki(key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey | x509.Certificate) -> bytes:
    public = key.public_key() if isinstance(key, x509.Certificate) else key
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class CertificateAuthority:
    """A CA certificate and its private key, checked to belong together. Immutable.

    Build one with ``load`` (files) or ``CertificateAuthority(certificate, private_key)``
    (objects; the CA and key checks apply, the validity period is not checked).
    """

    __slots__ = ("_aki", "_cert", "_cert_pem", "_constraints", "_fingerprint", "_key")

    def __init__(self, certificate: x509.Certificate, private_key: CAPrivateKey) -> None:
        problem = _not_a_ca(certificate)
        if problem:
            raise CAError(problem)
        if not isinstance(private_key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
            raise CAError(f"unsupported key type {type(private_key).__name__} (RSA or EC only)")
        if _spki(private_key.public_key()) != _spki(certificate):
            raise CAError("the private key does not match the certificate")
        self._cert = certificate
        self._key = private_key
        self._cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
        self._fingerprint = certificate.fingerprint(hashes.SHA256()).hex(":").upper()
        try:
            ski = certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
            self._aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
        except x509.ExtensionNotFound:
            self._aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(private_key.public_key())
        try:
            self._constraints: x509.NameConstraints | None = certificate.extensions.get_extension_for_class(
                x509.NameConstraints
            ).value
        except x509.ExtensionNotFound:
            self._constraints = None

    @classmethod
    def load(
        cls, cert_path: str | os.PathLike[str], key_path: str | os.PathLike[str], *, now: dt.datetime | None = None
    ) -> CertificateAuthority:
        """Read PEM files: the certificate must be a CA valid ``now`` (default: the current
        time), the key RSA or EC, unencrypted, and the certificate's. CAError names the file
        (``role`` says which one) and the problem."""
        cert = load_ca_certificate(cert_path, now=now)
        key = load_ca_key(key_path)
        if _spki(key.public_key()) != _spki(cert):
            raise CAError(f"does not match the certificate in {os.fspath(cert_path)}", path=key_path, role="key")
        return cls(cert, key)

    @property
    def certificate(self) -> x509.Certificate:
        return self._cert

    @property
    def private_key(self) -> CAPrivateKey:
        return self._key

    @property
    def cert_pem(self) -> bytes:
        return self._cert_pem

    @property
    def fingerprint_sha256(self) -> str:
        """``AB:CD:...``, as ``openssl x509 -fingerprint -sha256`` prints it."""
        return self._fingerprint

    @property
    def not_before(self) -> dt.datetime:
        return self._cert.not_valid_before_utc

    @property
    def not_after(self) -> dt.datetime:
        return self._cert.not_valid_after_utc

    @property
    def subject(self) -> str:
        return self._cert.subject.rfc4514_string()

    @property
    def key_type(self) -> str:
        """``EC P-256`` (or the curve's name), ``RSA 2048``."""
        key = self._key
        if isinstance(key, rsa.RSAPrivateKey):
            return f"RSA {key.key_size}"
        return f"EC {_CURVES.get(key.curve.name, key.curve.name)}"

    @property
    def name_constraints(self) -> x509.NameConstraints | None:
        return self._constraints

    @property
    def authority_key_identifier(self) -> x509.AuthorityKeyIdentifier:
        """For the leaves this CA signs."""
        return self._aki

    def permits(self, host: str) -> bool:
        """Whether the CA's name constraints allow a leaf for ``host`` (a normalised DNS name
        or IP literal), matched the way OpenSSL matches them (a DNS constraint covers the
        name and its subdomains, ``.example.com`` only the subdomains)."""
        return self._breach(host) is None

    def outside(self, host: str) -> str | None:
        """None when the CA may vouch for ``host`` (as ``permits``); else one sentence naming
        the host, the constraint it falls outside and the ``ca init --permit`` that would
        cover it, e.g. ``"api.openai.com" is outside the CA's name constraints (permitted:
        .stripe.com, api.payments.example): re-create the CA with ca init --permit
        .stripe.com,api.payments.example,api.openai.com (…)``."""
        breach = self._breach(host)
        if breach is None:
            return None
        assert self._constraints is not None  # no constraints, no breach
        permitted = [constraint_text(g) for g in self._constraints.permitted_subtrees or ()]
        shown = [f"permitted: {', '.join(permitted)}"] if permitted else []
        if breach:  # the excluded subtrees the host falls in
            shown.append(f"excluded: {', '.join(constraint_text(g) for g in breach)}")
        entries = [*permit_entries(self._constraints), host]
        advice = f"re-create the CA with ca init --permit {','.join(entries)}"
        parent = host.partition(".")[2]
        if ip_or_none(host) is None and parent.count(".") >= 1:
            advice += f" (a suffix such as .{parent} covers every host under {parent})"
        return f'"{host}" is outside the CA\'s name constraints ({"; ".join(shown)}): {advice}'

    def _breach(self, host: str) -> list[x509.GeneralName] | None:
        """None when the constraints permit ``host``; else the excluded subtrees it falls in
        (empty when it is simply in no permitted subtree of its kind)."""
        nc = self._constraints
        if nc is None:
            return None
        ip = ip_or_none(host)
        kind: type[x509.GeneralName] = x509.DNSName if ip is None else x509.IPAddress

        def matches(general: x509.GeneralName) -> bool:
            if not isinstance(general, kind):
                return False
            if ip is None:
                return dns_within(host, str(general.value))
            network = general.value
            return isinstance(network, ipaddress.IPv4Network | ipaddress.IPv6Network) and ip in network

        excluded = [g for g in nc.excluded_subtrees or () if matches(g)]
        if excluded:
            return excluded
        permitted = [g for g in nc.permitted_subtrees or () if isinstance(g, kind)]
        return None if not permitted or any(matches(g) for g in permitted) else []


def constraint_text(general: x509.GeneralName) -> str:
    """One name constraint as ``ca init --permit`` writes it: ``.stripe.com``,
    ``api.payments.example``, ``10.0.0.7`` (a single address), ``10.0.0.0/8``;
    ``every DNS name`` for the empty DNS constraint."""
    value = general.value
    if isinstance(general, x509.DNSName):
        return str(value) or "every DNS name"
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return str(value.network_address) if value.prefixlen == value.max_prefixlen else str(value)
    return str(value)


def permit_entries(constraints: x509.NameConstraints) -> list[str]:
    """The permitted DNS and IP subtrees as ``ca init --permit`` entries, in certificate order."""
    return [
        constraint_text(g)
        for g in constraints.permitted_subtrees or ()
        if isinstance(g, x509.DNSName | x509.IPAddress) and g.value != ""
    ]


_CURVES: Final = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}


def dns_within(name: str, base: str) -> bool:
    """RFC 5280 §4.2.1.10 as OpenSSL applies it: ``example.com`` covers itself and every
    subdomain, ``.example.com`` only subdomains, the empty name everything."""
    base = base.lower()
    if not base:
        return True
    if base.startswith("."):
        return name.endswith(base)
    return name == base or name.endswith("." + base)


def key_usage(*, digital_signature: bool = False, key_cert_sign: bool = False, crl_sign: bool = False) -> x509.KeyUsage:
    """A keyUsage extension with only the given bits set; the proxy never needs the others."""
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )
