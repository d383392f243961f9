"""The proxy's own certificate authority, for TLS interception (SPEC §8).

Three parts:

- ``init_ca`` writes a fresh CA (``ca.pem``, and ``ca-key.pem`` created with mode
  0600), optionally name-constrained to the policy's vendor hosts;
  ``CertificateAuthority.load`` reads one back and refuses anything that could not
  sign usable leaves (not a CA, expired, key and certificate from different pairs),
  raising ``CAError`` naming the file and the problem.
- ``LeafMinter`` turns a host name into a server-side ``ssl.SSLContext`` whose
  certificate is a short-lived leaf for that host, signed by the CA. It is called
  synchronously on the handshake path, so hits come from an in-memory LRU cache and
  one EC P-256 key serves every leaf of a minter (key generation dominates mint time).
- ``trust_instructions`` and ``describe`` are what ``quota-proxy ca init`` and
  ``quota-proxy ca show`` print.

Name constraints: a CA made with ``permitted_hosts`` carries a critical
NameConstraints extension, so even a stolen ``ca-key.pem`` cannot vouch for other
hosts. OpenSSL-based clients enforce it on the trust anchor itself: Python's ``ssl``
(and so requests, httpx, aiohttp, urllib), curl, Node.js (all checked). Java's default
trust manager ignores a trust anchor's constraints (checked on OpenJDK 17); other
stacks vary. The constraints only limit what the CA *could* sign: the proxy itself
only ever mints leaves for permitted hosts (``LeafMinter`` refuses others).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import itertools
import math
import os
import shutil
import ssl
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Literal, TypeAlias

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proxy.names import ip_or_none, parse_host, split_host_port

__all__ = [
    "CAError",
    "CAPrivateKey",
    "CertificateAuthority",
    "LeafMinter",
    "describe",
    "init_ca",
    "load_ca_certificate",
    "load_ca_key",
    "normalize_host",
    "trust_instructions",
]

CAPrivateKey: TypeAlias = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
"""The CA key types the proxy signs with."""

CA_CERT_NAME: Final = "ca.pem"
CA_KEY_NAME: Final = "ca-key.pem"
CLOCK_SKEW: Final = 3600.0
"""Seconds a leaf is backdated, so a worker whose clock runs slow still accepts it."""
REMINT_FRACTION: Final = 0.1
"""A cached leaf is re-minted once less than this fraction of its lifetime is left."""
_CN_MAX: Final = 64  # ub-common-name, RFC 5280
_RSA_BITS: Final = 2048
_PEM_CERT: Final = b"-----BEGIN CERTIFICATE-----"
_ALL_IPV4: Final = ipaddress.ip_network("0.0.0.0/0")
_ALL_IPV6: Final = ipaddress.ip_network("::/0")

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


# ---------------------------------------------------------------- host names


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


# ---------------------------------------------------------------- loading


def _utc(moment: dt.datetime) -> str:
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
        return f"expired on {_utc(cert.not_valid_after_utc)}"
    if now < cert.not_valid_before_utc:
        return f"not valid before {_utc(cert.not_valid_before_utc)}"
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
        name and its subdomains)."""
        nc = self._constraints
        if nc is None:
            return True
        ip = ip_or_none(host)
        if ip is not None:
            kind: type[x509.GeneralName] = x509.IPAddress

            def matches(general: x509.GeneralName) -> bool:
                network = general.value
                return isinstance(network, ipaddress.IPv4Network | ipaddress.IPv6Network) and ip in network
        else:
            kind = x509.DNSName

            def matches(general: x509.GeneralName) -> bool:
                return _dns_within(host, str(general.value))

        if any(isinstance(g, kind) and matches(g) for g in nc.excluded_subtrees or ()):
            return False
        permitted = [g for g in nc.permitted_subtrees or () if isinstance(g, kind)]
        return not permitted or any(matches(g) for g in permitted)


_CURVES: Final = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}


def _dns_within(name: str, base: str) -> bool:
    """RFC 5280 §4.2.1.10 as OpenSSL applies it: ``example.com`` covers itself and every
    subdomain, ``.example.com`` only subdomains, the empty name everything."""
    base = base.lower()
    if not base:
        return True
    if base.startswith("."):
        return name.endswith(base)
    return name == base or name.endswith("." + base)


# ---------------------------------------------------------------- creating


def init_ca(
    out_dir: str | os.PathLike[str],
    *,
    common_name: str = "quota-proxy CA",
    days: int = 3650,
    key_type: Literal["ec", "rsa"] = "ec",
    permitted_hosts: Sequence[str] = (),
    force: bool = False,
) -> tuple[Path, Path]:
    """Create a CA: ``out_dir/ca.pem`` (mode 0644) and ``out_dir/ca-key.pem`` (mode 0600).
    Returns their paths (certificate, key).

    The key is EC P-256 (``key_type="ec"``) or RSA-2048; the certificate is self-signed,
    valid from an hour ago (clock skew) for ``days`` days, with basicConstraints CA:TRUE
    pathlen 0 and keyUsage keyCertSign+cRLSign (both critical) and a subject key identifier.

    ``permitted_hosts`` (DNS names, IPv4 or IPv6 literals, no ports) adds a critical
    NameConstraints extension: the CA can then only vouch for those names (and their
    subdomains) and those exact addresses (/32, /128); an address family with no permitted
    address is excluded whole, so the CA vouches for no IP at all when only names are
    given. OpenSSL-based clients honour it on the trust anchor (Python ssl, requests,
    httpx, aiohttp, curl, Node.js); Java's default trust manager does not.

    Files are written to a temporary name in ``out_dir`` and moved into place, the key
    created with mode 0600 from the start (never readable by others, not even briefly).
    Existing files are refused (CAError) unless ``force``; ``out_dir`` is created if
    missing. ValueError for bad arguments, CAError for file problems.
    """
    if not isinstance(days, int) or isinstance(days, bool) or days < 1:
        raise ValueError(f"days must be a positive integer, got {days!r}")
    if not common_name or len(common_name) > _CN_MAX:
        raise ValueError(f"common name must be 1 to {_CN_MAX} characters, got {len(common_name)}")
    if key_type not in ("ec", "rsa"):
        raise ValueError(f'key_type must be "ec" or "rsa", got {key_type!r}')
    constraints = _name_constraints(permitted_hosts)

    out = Path(out_dir)
    cert_path, key_path = out / CA_CERT_NAME, out / CA_KEY_NAME
    if not force:
        for path in (cert_path, key_path):
            if os.path.lexists(path):
                raise CAError("already exists; refusing to overwrite it (--force replaces it)", path=path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CAError(f"cannot create the directory: {exc.strerror or exc}", path=out) from None

    key: CAPrivateKey = (
        ec.generate_private_key(ec.SECP256R1())
        if key_type == "ec"
        else rsa.generate_private_key(public_exponent=65537, key_size=_RSA_BITS)
    )
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(seconds=CLOCK_SKEW))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
    )
    if constraints is not None:
        builder = builder.add_extension(constraints, critical=True)
    cert = builder.sign(key, hashes.SHA256())

    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    placed: list[Path] = []
    try:
        _place(key_path, key_pem, 0o600, force=force)
        placed.append(key_path)
        _place(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644, force=force)
        placed.append(cert_path)
        _fsync_dir(out)
    except BaseException:
        for path in placed:  # never leave half a CA behind
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    return cert_path, key_path


def _name_constraints(hosts: Sequence[str]) -> x509.NameConstraints | None:
    if isinstance(hosts, str):
        raise ValueError("permitted_hosts must be a sequence of host names, not one string")
    names: list[str] = []
    for host in hosts:
        name = normalize_host(host)
        if name not in names:
            names.append(name)
    if not names:
        return None
    permitted: list[x509.GeneralName] = []
    families: set[int] = set()
    for name in names:
        ip = ip_or_none(name)
        if ip is None:
            permitted.append(x509.DNSName(name))
        else:
            families.add(ip.version)
            permitted.append(x509.IPAddress(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}")))
    excluded: list[x509.GeneralName] = [
        x509.IPAddress(network) for network in (_ALL_IPV4, _ALL_IPV6) if network.version not in families
    ]
    return x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=excluded or None)


def _place(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    """Write ``data`` to a fresh temporary file next to ``path``, created with ``mode``
    (then set exactly, whatever the umask), and move it to ``path``: os.replace when
    ``force``, else os.link, which fails rather than overwrite a file that appeared since."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        raise CAError(f"cannot write: {exc.strerror or exc}", path=path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise CAError("already exists; refusing to overwrite it (--force replaces it)", path=path) from None
    except OSError as exc:
        raise CAError(f"cannot write: {exc.strerror or exc}", path=path) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- telling people


def trust_instructions(ca_path: Path) -> str:
    """How to make workers trust the CA at ``ca_path`` (only the certificate: the key stays
    on the proxy)."""
    ca = str(Path(ca_path).absolute())
    return f"""\
Make workers trust {ca} (the certificate only; ca-key.pem never leaves the proxy):

  Python (ssl, urllib, aiohttp, httpx), Go, OpenSSL tools: SSL_CERT_FILE *replaces* the
  default bundle, so point it at a combined one:
    cat /etc/ssl/certs/ca-certificates.crt {ca} > /etc/ssl/quota-proxy-bundle.pem
    export SSL_CERT_FILE=/etc/ssl/quota-proxy-bundle.pem
  requests (which uses certifi, not SSL_CERT_FILE):
    export REQUESTS_CA_BUNDLE=/etc/ssl/quota-proxy-bundle.pem
  Node.js (adds to its built-in roots):
    export NODE_EXTRA_CA_CERTS={ca}
  curl:
    export CURL_CA_BUNDLE=/etc/ssl/quota-proxy-bundle.pem    # or: curl --cacert {ca} ...
  Debian/Ubuntu system store (OpenSSL's default bundle; then REQUESTS_CA_BUNDLE can be
  /etc/ssl/certs/ca-certificates.crt):
    cp {ca} /usr/local/share/ca-certificates/quota-proxy.crt && update-ca-certificates
"""


def describe(ca: CertificateAuthority, *, now: dt.datetime | None = None) -> str:
    """What ``quota-proxy ca show`` prints: subject, SHA-256 fingerprint, validity, days
    left, key type and name constraints."""
    moment = now or dt.datetime.now(dt.UTC)
    days = math.floor((ca.not_after - moment).total_seconds() / 86400)
    left = f"{days} days left" if days >= 0 else f"EXPIRED {-days} days ago"
    lines = [
        f"subject:          {ca.subject}",
        f"SHA-256:          {ca.fingerprint_sha256}",
        f"not before:       {_utc(ca.not_before)}",
        f"not after:        {_utc(ca.not_after)} ({left})",
        f"key:              {ca.key_type}",
    ]
    nc = ca.name_constraints
    if nc is None:
        lines.append("name constraints: none (the CA can vouch for any host)")
    else:
        lines.append(f"name constraints: permits {_general_names(nc.permitted_subtrees)}")
        if nc.excluded_subtrees:
            lines.append(f"                  excludes {_general_names(nc.excluded_subtrees)}")
    return "\n".join(lines)


def _general_names(names: Sequence[x509.GeneralName] | None) -> str:
    shown = [str(name.value) for name in names or ()]
    return ", ".join(shown) if shown else "nothing"


# ---------------------------------------------------------------- leaves


class _Leaf:
    __slots__ = ("certificate", "context", "refresh_at")

    def __init__(self, context: ssl.SSLContext, certificate: x509.Certificate, refresh_at: float) -> None:
        self.context = context
        self.certificate = certificate
        self.refresh_at = refresh_at


class LeafMinter:
    """Server-side SSL contexts for intercepted hosts, each with a leaf certificate signed by ``ca``.

    ``validity`` is a leaf's lifetime in seconds (``tls.leaf_validity``), capped by the
    CA's own expiry; ``clock`` gives the time in epoch seconds; at most ``cache_size``
    hosts are kept (least recently used dropped first); ``on_mint(host, seconds)`` is
    called after each mint with how long it took.

    Python's ssl loads certificate chains from files only: each chain (leaf, CA and the
    leaf key) is written to a private directory (mode 0700) created for this minter,
    loaded, and unlinked at once; ``close()`` removes the directory (the minter is also a
    context manager, and the directory is removed at garbage collection or exit if
    ``close`` was never called). Thread-safe.
    """

    def __init__(
        self,
        ca: CertificateAuthority,
        validity: float,
        *,
        clock: Callable[[], float] = time.time,
        cache_size: int = 1024,
        on_mint: Callable[[str, float], None] | None = None,
    ) -> None:
        if not (isinstance(validity, int | float) and math.isfinite(validity) and validity > 0):
            raise ValueError(f"validity must be a positive number of seconds, got {validity!r}")
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self._ca = ca
        self._validity = float(validity)
        self._clock = clock
        self._cache_size = cache_size
        self._on_mint = on_mint
        self._key = ec.generate_private_key(ec.SECP256R1())
        # SEC1 ("EC PRIVATE KEY"): OpenSSL 3 decodes it a third faster than PKCS#8, on every mint.
        self._key_pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        self._ski = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())
        self._chain_tail = ca.cert_pem + self._key_pem
        self._cache: OrderedDict[str, _Leaf] = OrderedDict()
        self._lock = threading.Lock()
        self._names = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="quota-proxy-leaves-")
        os.chmod(self._dir, 0o700)  # mkdtemp's mode already; said out loud
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)

    @property
    def ca(self) -> CertificateAuthority:
        return self._ca

    @property
    def directory(self) -> Path:
        """The private directory chains pass through (empty between mints)."""
        return Path(self._dir)

    @property
    def closed(self) -> bool:
        return not self._cleanup.alive

    def context_for(self, host: str) -> ssl.SSLContext:
        """A TLS 1.2+ server context (ALPN ``http/1.1``) presenting a leaf for ``host``.

        ``host`` is a DNS name or IP literal (brackets allowed for IPv6), never a pattern:
        ValueError otherwise. CAError when the CA has expired or its name constraints do
        not cover ``host``; RuntimeError after ``close()``. A cache hit costs a dict lookup;
        a miss (or a leaf with under 10% of its lifetime left) mints a new leaf.
        """
        now = self._clock()
        with self._lock:
            leaf = self._cache.get(host)  # keys are normalised names: a hit needs no validation
            if leaf is None:
                name = normalize_host(host)
                leaf = self._cache.get(name)
            else:
                name = host
            if leaf is not None and now < leaf.refresh_at:
                self._cache.move_to_end(name)
                return leaf.context
            if self.closed:
                raise RuntimeError("LeafMinter is closed")
            started = time.perf_counter()
            leaf = self._mint(name, now)
            took = time.perf_counter() - started
            self._cache[name] = leaf
            self._cache.move_to_end(name)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        if self._on_mint is not None:
            self._on_mint(name, took)
        return leaf.context

    def cached_certificate(self, host: str) -> x509.Certificate | None:
        """The leaf currently cached for ``host``, if any (for inspection; mints nothing)."""
        with self._lock:
            leaf = self._cache.get(normalize_host(host))
        return None if leaf is None else leaf.certificate

    def close(self) -> None:
        """Remove the private directory; contexts already handed out keep working."""
        self._cleanup()

    def __enter__(self) -> LeafMinter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mint(self, name: str, now: float) -> _Leaf:
        ca = self._ca
        ca_end = ca.not_after.timestamp()
        if ca_end <= now:
            raise CAError(f"expired on {_utc(ca.not_after)}; cannot mint a leaf for {name}")
        if not ca.permits(name):
            raise CAError(f"{name} is outside the CA's name constraints (re-create the CA with it: ca init -c)")
        start = math.floor(now)
        end = min(math.ceil(now + self._validity), math.floor(ca_end))
        ip = ip_or_none(name)
        if ip is None:
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:_CN_MAX])])
            san: x509.GeneralName = x509.DNSName(name)
        else:
            # No CN: OpenSSL checks a CN such as "10.0.0.1" against a CA's *DNS* name
            # constraints when the leaf has no DNS SAN, and would refuse it. RFC 5280
            # wants the SAN critical when the subject is empty.
            subject = x509.Name([])
            san = x509.IPAddress(ip)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.certificate.subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(dt.datetime.fromtimestamp(start - CLOCK_SKEW, dt.UTC))
            .not_valid_after(dt.datetime.fromtimestamp(end, dt.UTC))
            .add_extension(x509.SubjectAlternativeName([san]), critical=ip is not None)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_LEAF_KEY_USAGE, critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(self._ski, critical=False)
            .add_extension(ca.authority_key_identifier, critical=False)
            .sign(ca.private_key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
        context.set_alpn_protocols(["http/1.1"])
        self._load_chain(context, cert.public_bytes(serialization.Encoding.PEM) + self._chain_tail)
        return _Leaf(context, cert, end - (end - start) * REMINT_FRACTION)

    def _load_chain(self, context: ssl.SSLContext, pem: bytes) -> None:
        path = os.path.join(self._dir, f"chain-{next(self._names)}.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            context.load_cert_chain(path)
        finally:
            os.unlink(path)


_LEAF_KEY_USAGE: Final = x509.KeyUsage(
    digital_signature=True,  # ECDHE with an EC key: signing is all the leaf key does
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)
