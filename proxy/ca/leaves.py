"""Leaf certificates for intercepted hosts, minted on the TLS handshake path.

``LeafMinter`` turns a host name into a server-side ``ssl.SSLContext`` whose certificate
is a short-lived leaf for that host, signed by the CA. It is called synchronously on the
handshake path, so hits come from an in-memory LRU cache and one EC P-256 key serves
every leaf of a minter (key generation dominates mint time).
"""

from __future__ import annotations

import datetime as dt
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
from collections.abc import Callable
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proxy.ca.authority import CLOCK_SKEW, CN_MAX, CAError, CertificateAuthority, format_utc, key_usage, normalize_host
from proxy.names import ip_or_none

__all__ = ["REMINT_FRACTION", "LeafMinter"]

REMINT_FRACTION: Final = 0.1
"""A cached leaf is re-minted once less than this fraction of its lifetime is left."""


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
            raise CAError(f"expired on {format_utc(ca.not_after)}; cannot mint a leaf for {name}")
        outside = ca.outside(name)
        if outside is not None:
            raise CAError(outside)
        start = math.floor(now)
        end = min(math.ceil(now + self._validity), math.floor(ca_end))
        ip = ip_or_none(name)
        if ip is None:
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:CN_MAX])])
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


# ECDHE with an EC key: signing is all the leaf key does.
_LEAF_KEY_USAGE: Final = key_usage(digital_signature=True)
