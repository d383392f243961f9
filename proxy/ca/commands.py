"""What ``quota-proxy ca init`` and ``quota-proxy ca show`` do (the command line only; the
running proxy never creates a CA).

``init_ca`` writes a fresh CA (``ca.pem``, and ``ca-key.pem`` created with mode 0600),
optionally name-constrained (``parse_permit``: domain suffixes, hosts, addresses and
networks, e.g. the policy's vendor hosts); ``trust_instructions`` and ``describe`` are what
the two commands print.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final, Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from proxy.ca.authority import (
    CLOCK_SKEW,
    CN_MAX,
    CAError,
    CAPrivateKey,
    CertificateAuthority,
    constraint_text,
    dns_within,
    format_utc,
    key_usage,
    normalize_host,
    permit_entries,
)
from proxy.names import ip_or_none

__all__ = [
    "CA_CERT_NAME",
    "CA_KEY_NAME",
    "constraint_lines",
    "describe",
    "init_ca",
    "parse_permit",
    "trust_instructions",
]

CA_CERT_NAME: Final = "ca.pem"
CA_KEY_NAME: Final = "ca-key.pem"
_RSA_BITS: Final = 2048
_ALL_IPV4: Final = ipaddress.ip_network("0.0.0.0/0")
_ALL_IPV6: Final = ipaddress.ip_network("::/0")


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

    ``permitted_hosts`` (the entries ``parse_permit`` reads: ``.domain`` suffixes, DNS
    names, IPv4 or IPv6 addresses and networks, no ports) adds a critical NameConstraints
    extension: the CA can then only vouch for those suffixes' hosts, those names (and their
    subdomains), those addresses and networks. Each is kept once, and not at all when
    another entry covers it (``api.stripe.com`` beside ``.stripe.com``). An address family
    with no permitted address is excluded whole, so the CA vouches for no IP at all when
    only names are given, and for no DNS name when only addresses are. OpenSSL-based
    clients honour it on the trust anchor (Python ssl, requests, httpx, aiohttp, curl,
    Node.js); Java's default trust manager does not.

    Files are written to a temporary name in ``out_dir`` and moved into place, the key
    created with mode 0600 from the start (never readable by others, not even briefly).
    Existing files are refused (CAError) unless ``force``; ``out_dir`` is created if
    missing. ValueError for bad arguments, CAError for file problems.
    """
    if not isinstance(days, int) or isinstance(days, bool) or days < 1:
        raise ValueError(f"days must be a positive integer, got {days!r}")
    if not common_name or len(common_name) > CN_MAX:
        raise ValueError(f"common name must be 1 to {CN_MAX} characters, got {len(common_name)}")
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
        .add_extension(key_usage(key_cert_sign=True, crl_sign=True), critical=True)
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


def parse_permit(entry: str) -> x509.GeneralName:
    """One ``ca init --permit`` entry as the name constraint it stands for: ``.stripe.com``
    (every host under stripe.com, not stripe.com itself), ``api.stripe.com`` (that host and
    every host under it: X.509 has no exact-host constraint), ``10.0.0.7`` or ``[::1]`` (one
    address), ``10.0.0.0/8`` or ``2001:db8::/32`` (a network). ValueError names what is wrong
    with anything else: wildcards, ports, a network with host bits set, a suffix that is a
    whole top-level domain (``.com``)."""
    if not isinstance(entry, str):
        raise ValueError(f"a permitted name must be a string, got {type(entry).__name__}")
    text = entry.strip()
    if not text:
        raise ValueError("an empty permitted name (a constraint must name something)")
    if text.startswith("*."):
        suffix = text[1:]
        raise ValueError(f'"{text}": a name constraint has no wildcard; "{suffix}" permits every host under {text[2:]}')
    if "/" in text:
        return x509.IPAddress(_network(text))
    if text.startswith("."):
        try:
            domain = normalize_host(text[1:])
        except ValueError:
            raise ValueError(f'"{text}" is not a domain suffix (a dot, then a domain name)') from None
        if ip_or_none(domain) is not None:
            raise ValueError(f'"{text}" is not a domain suffix: write an address without the dot, or a network')
        if "." not in domain:
            raise ValueError(
                f'"{text}" would let the CA vouch for every host in a top-level domain: name a domain under it'
            )
        return x509.DNSName(f".{domain}")
    name = normalize_host(text)
    ip = ip_or_none(name)
    if ip is None:
        return x509.DNSName(name)
    return x509.IPAddress(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}"))


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    address, _, prefix = text.partition("/")
    if address.startswith("[") and address.endswith("]"):
        address = address[1:-1]
    try:
        return ipaddress.ip_network(f"{address}/{prefix}")
    except ValueError as exc:
        if "has host bits set" in str(exc):
            loose = ipaddress.ip_network(f"{address}/{prefix}", strict=False)
            raise ValueError(f'"{text}" has host bits set: the network is {loose}') from None
        raise ValueError(f'"{text}" is not an IP network (e.g. 10.0.0.0/8 or 2001:db8::/32)') from None


def _name_constraints(entries: Sequence[str]) -> x509.NameConstraints | None:
    if isinstance(entries, str):
        raise ValueError("permitted_hosts must be a sequence of names, not one string")
    permitted: list[x509.GeneralName] = []
    for entry in entries:
        general = parse_permit(entry)
        if any(_covers(kept, general) for kept in permitted):
            continue  # each name once; none that another already covers
        permitted = [kept for kept in permitted if not _covers(general, kept)]
        permitted.append(general)
    if not permitted:
        return None
    families = {g.value.version for g in permitted if isinstance(g, x509.IPAddress)}
    excluded: list[x509.GeneralName] = [
        x509.IPAddress(network) for network in (_ALL_IPV4, _ALL_IPV6) if network.version not in families
    ]
    if not any(isinstance(g, x509.DNSName) for g in permitted):
        excluded.append(x509.DNSName(""))  # addresses only: no DNS name at all (the empty name matches every one)
    return x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=excluded or None)


def _covers(wide: x509.GeneralName, narrow: x509.GeneralName) -> bool:
    """Whether every name ``narrow`` permits, ``wide`` permits too (DNS as OpenSSL matches it)."""
    if isinstance(wide, x509.IPAddress) and isinstance(narrow, x509.IPAddress):
        a, b = narrow.value, wide.value
        if isinstance(a, ipaddress.IPv4Network) and isinstance(b, ipaddress.IPv4Network):
            return a.subnet_of(b)
        return isinstance(a, ipaddress.IPv6Network) and isinstance(b, ipaddress.IPv6Network) and a.subnet_of(b)
    if isinstance(wide, x509.DNSName) and isinstance(narrow, x509.DNSName):
        name, base = narrow.value, wide.value
        if name.startswith("."):  # only subdomains: a base that covers the domain covers them
            return name[1:] == base.lstrip(".") or dns_within(name[1:], base)
        return dns_within(name, base)
    return False


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
        f"not before:       {format_utc(ca.not_before)}",
        f"not after:        {format_utc(ca.not_after)} ({left})",
        f"key:              {ca.key_type}",
    ]
    nc = ca.name_constraints
    if nc is None:
        lines.append("name constraints: none (the CA can vouch for any host)")
    else:
        lines += constraint_lines(nc)
    return "\n".join(lines)


def constraint_lines(nc: x509.NameConstraints, *, recipe: bool = True) -> list[str]:
    """``name constraints: permits …``: one line per constraint, saying what it covers, then
    (``recipe``) the ``ca init --permit`` that makes a CA with the same permitted names."""
    shown: list[str] = []
    for general in nc.permitted_subtrees or ():
        shown.append(f"permits {constraint_text(general)}{_reach(general)}")
    for general in nc.excluded_subtrees or ():
        shown.append(f"excludes {constraint_text(general)}{_reach(general)}")
    lead = ["name constraints: "] + ["                  "] * len(shown)
    lines = [f"{head}{text}" for head, text in zip(lead, shown, strict=False)]
    entries = permit_entries(nc)
    if entries and recipe:
        lines.append(f"{lead[-1]}(the same names: ca init --permit {','.join(entries)})")
    return lines


def _reach(general: x509.GeneralName) -> str:
    value = general.value
    if isinstance(general, x509.DNSName):
        if not value:
            return ""
        if value.startswith("."):
            return f" (every host under {value[1:]})"
        return " (and every host under it)"
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network) and value.prefixlen == 0:
        return f" (every IPv{value.version} address)"
    return ""
