"""Host names, ports and tenant names: the one grammar the policy loader, the router,
CONNECT and the CA read them with, so a host is judged the same way everywhere.

A host is a DNS name or an IP literal. Normalised (``parse_host``) it is lower case,
without a trailing dot, IPv6 compressed and without brackets; brackets come back only
where a port or a URL follows (``format_authority``, ``format_origin``). A DNS label is
1 to 63 letters, digits, ``-`` and ``_``, never starting or ending with ``-``
(underscores are not strict DNS, but container and service names use them); a name of
digits and dots only is an IPv4 address or nothing.

``host[:port]`` has two spellings:

- the policy's (``split_host_port``, ``parse_host_port``): a bare IPv6 address such as
  ``::1`` is a host without a port, as a YAML list of hosts reads best;
- the wire's (``parse_authority``): a request target, a Host header and a CONNECT line
  follow RFC 3986, so an IPv6 address must be in brackets and user information is refused.

Messages are the ones an operator reads from ``quota-proxy check``; the quoting is
``proxy.policy.durations.show``'s for a string (this module cannot import the policy
package, which imports it).
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Final, TypeAlias

__all__ = [
    "TENANT_NAME",
    "IPAddress",
    "default_port",
    "format_authority",
    "format_origin",
    "host_caution",
    "ip_or_none",
    "is_tenant_name",
    "parse_authority",
    "parse_host",
    "parse_host_port",
    "parse_port",
    "split_host_port",
]

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address

TENANT_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
"""A tenant name (header value or policy key): it becomes part of store keys and metric labels."""
_DNS_LABEL: Final = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_PORT: Final = re.compile(r"[0-9]{1,5}")
_MAX_NAME: Final = 253


def _shown(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def parse_host(text: str) -> str:
    """A DNS name or an IP literal (no brackets), normalised; ValueError otherwise."""
    try:
        return ipaddress.ip_address(text).compressed
    except ValueError:
        pass
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if len(name) > _MAX_NAME or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{_shown(text)} is not a host name or IP address")
    if all(label.isdigit() for label in labels):
        raise ValueError(f"{_shown(text)} is not a valid IP address")
    return name


def ip_or_none(host: str) -> IPAddress | None:
    """The address when a *normalised* host is an IP literal (DNS names never contain ":"
    and are never all digits, so the cheap test comes first)."""
    if ":" not in host and not host.replace(".", "").isdigit():
        return None
    return ipaddress.ip_address(host)


def split_host_port(text: str) -> tuple[str, str | None]:
    """Split without judging the parts: ``[v6]:port``, ``[v6]``, bare ``v6``, ``host:port`` or ``host``."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{_shown(text)} has an unclosed or misplaced ]")
        if ":" not in host:
            raise ValueError(f"{_shown(text)}: only IPv6 addresses go in brackets")
        return host, rest[1:] if rest else None
    if text.count(":") > 1:
        return text, None  # a bare IPv6 address has no room for a port
    host, colon, port = text.partition(":")
    return host, port if colon else None


def parse_port(text: str, whole: str, *, minimum: int = 1) -> int:
    """A decimal port from ``minimum`` to 65535; ``whole`` is what messages quote."""
    if not _PORT.fullmatch(text) or not minimum <= int(text) <= 65535:
        raise ValueError(f"{_shown(whole)}: port must be {minimum}..65535")
    return int(text)


def parse_host_port(text: str, *, minimum_port: int = 1) -> tuple[str, int | None]:
    """The policy's ``host[:port]`` → (normalised host, port or None); ValueError otherwise."""
    host, port = split_host_port(text)
    name = parse_host(host)
    return name, None if port is None else parse_port(port, text, minimum=minimum_port)


def parse_authority(text: str) -> tuple[str, int | None]:
    """The wire's ``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` → (normalised host, port
    or None): ``parse_host_port`` without user information or a bare IPv6 address."""
    if "@" in text:
        raise ValueError("user information is not allowed in the target")
    if text.count(":") > 1 and not text.startswith("["):
        raise ValueError(f"{_shown(text)}: an IPv6 address goes in brackets")
    return parse_host_port(text)


def format_authority(host: str, port: int | None = None) -> str:
    """A normalised host, and port if any, as written before a path: ``[::1]:8443``."""
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"


def default_port(scheme: str) -> int:
    """443 for ``https``, 80 for ``http``."""
    return 443 if scheme == "https" else 80


def format_origin(scheme: str, host: str, port: int | None) -> str:
    """``scheme://host[:port]``, the port left out when it is the scheme's default."""
    return f"{scheme}://{format_authority(host, None if port == default_port(scheme) else port)}"


def host_caution(host: str) -> str | None:
    """What to tell the operator about a vendor host (normalised, without its port) that
    may reach more than the vendor, or None: ``localhost``, an IP literal, a single-label
    name. The sentence follows the quoted host in a loader warning."""
    if host == "localhost" or host.endswith(".localhost"):
        return (
            "is this machine: the proxy would reach whatever listens there on the ports listed "
            "(80 and 443 without a port); name the vendor by its public DNS name"
        )
    if ip_or_none(host) is not None:
        return (
            "is an IP address: anything at that address is reachable on the ports listed "
            "(80 and 443 without a port); name the vendor by its DNS name"
        )
    if "." not in host:
        return (
            "is a single-label name: it resolves through the search domains of the proxy's host, "
            "possibly to an internal service; use a fully qualified name"
        )
    return None


def is_tenant_name(text: str) -> bool:
    return TENANT_NAME.fullmatch(text) is not None
