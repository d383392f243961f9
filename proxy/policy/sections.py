"""The policy document's top-level sections: version, listeners, store, tenant, tls,
connections and the admin listener's access (the ``vendors:`` list is built in ``vendors``).

Each builder ``(walk, node, path) -> model object`` falls back to the model's defaults
where a value is missing or wrong; a wrong value has already been recorded on the walk,
so the fallback never reaches a running proxy.
"""

from __future__ import annotations

import re
from typing import Final

import yaml

import proxy.policy.values as values
from proxy.policy.answer_presets import build_answer_presets
from proxy.policy.durations import show
from proxy.policy.model import (
    FAILURE_MODES,
    TENANT_FROM,
    Address,
    Breaker,
    Connections,
    FailureMode,
    Policy,
    StoreSettings,
    TenantFrom,
    TenantSettings,
    TlsSettings,
    Vendor,
    Workers,
)
from proxy.policy.presets import AnswerPreset
from proxy.policy.vendors import build_vendors
from proxy.policy.walker import CheckedMapping, Walk

# Defaults live in the model; these instances are how the builders read them
# (slots dataclasses keep no class-level defaults).
_POLICY: Final = Policy()
_STORE: Final = StoreSettings()
_BREAKER: Final = Breaker()
_TENANT: Final = TenantSettings()
_TLS: Final = TlsSettings()
_CONNECTIONS: Final = Connections()

_ROOT_KEYS: Final = (
    "version", "listen", "admin_listen", "store", "tenant", "vendors", "tls", "drain_timeout", "access_log",
    "connections", "admin_token", "admin_hosts", "workers", "answer_presets",
)  # fmt: skip
_STORE_KEYS: Final = ("url", "timeout", "on_failure", "key_prefix", "breaker")
_BREAKER_KEYS: Final = ("failures", "cooloff")
_TENANT_KEYS: Final = ("header", "default", "from", "credentials", "known_only", "max_active")
_CREDENTIAL_KEYS: Final = ("sha256",)
_SHA256_RE: Final = re.compile(r"[0-9a-fA-F]{64}")
_TLS_KEYS: Final = ("upstream_verify", "upstream_ca_file", "ca_cert", "ca_key", "leaf_validity")
_CONNECTIONS_KEYS: Final = ("max", "head_timeout", "idle_timeout")


def build_policy(walk: Walk, root: yaml.Node) -> Policy:
    """The whole document; ``walk`` collects what is wrong with it."""
    m = walk.mapping(root, "", _ROOT_KEYS)
    if m is None:
        return Policy(source=walk.source)
    version = m.require("version", values.version, 1)
    listeners = walk.mark()
    listen = m.get("listen", values.address, _POLICY.listen)
    admin_listen = m.get("admin_listen", values.address, _POLICY.admin_listen)
    if walk.clean_since(listeners):
        _check_listeners(m, listen, admin_listen)
    tls = m.section("tls", _tls, _TLS)
    tenant = m.section("tenant", _tenant, _TENANT)
    presets: dict[str, AnswerPreset] = m.section("answer_presets", build_answer_presets, {})
    vendors: tuple[Vendor, ...] = m.require_section(
        "vendors", lambda w, n, p: build_vendors(w, n, p, tls, tenant, presets), ()
    )
    _check_known_tenants(m, tenant, vendors)
    store = m.section("store", _store, _STORE)
    workers = m.get("workers", workers_value, _POLICY.workers)
    if isinstance(workers, int) and workers > 1 and store.url == "memory://":
        m.walk.error(m.node_of("workers") or m.node, m.child("workers"), memory_with_workers(workers))
    return Policy(
        version=version,
        listen=listen,
        admin_listen=admin_listen,
        store=store,
        tenant=tenant,
        vendors=vendors,
        tls=tls,
        drain_timeout=m.get("drain_timeout", values.duration, _POLICY.drain_timeout),
        access_log=m.get("access_log", values.boolean, _POLICY.access_log),
        connections=m.section("connections", _connections, _CONNECTIONS),
        admin_token=m.get("admin_token", values.nullable(values.admin_token), _POLICY.admin_token),
        admin_hosts=m.section("admin_hosts", _admin_hosts, _POLICY.admin_hosts),
        workers=workers,
        source=walk.source,
        warnings=tuple(walk.warnings),  # last: keyword arguments are evaluated in order, vendors' included
    )


def workers_value(key: str, value: object) -> Workers:
    """``workers``: a whole number of processes, at least 1, or ``auto`` (one per usable CPU)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"workers must be a whole number of at least 1 or auto, got {show(value)}")
    return value


def memory_with_workers(workers: int) -> str:
    """Why ``workers`` > 1 cannot run on ``memory://`` (the file's and the command line's message)."""
    return (
        f"{workers} workers need a shared store: memory:// buckets live in one process and would not be "
        "shared (use redis://, or one worker)"
    )


def _check_listeners(m: CheckedMapping, listen: Address, admin: Address) -> None:
    """Both servers cannot bind one port (0 = the OS picks, so never a clash)."""
    if listen.port == 0 or listen.port != admin.port:
        return
    wildcard = {"0.0.0.0", "::"}
    if listen.host == admin.host or listen.host in wildcard or admin.host in wildcard:
        key = "admin_listen" if m.has("admin_listen") else "listen"
        node = m.node_of(key) or m.node
        m.walk.error(node, m.child(key), f"listen {listen} and admin_listen {admin} use the same port")


def _store(walk: Walk, node: yaml.Node, path: str) -> StoreSettings:
    m = walk.mapping(node, path, _STORE_KEYS)
    if m is None:
        return _STORE
    on_failure: FailureMode = m.get("on_failure", values.choice(FAILURE_MODES), _STORE.on_failure)
    return StoreSettings(
        url=m.get("url", values.store_url, _STORE.url),
        timeout=m.get("timeout", values.positive_duration, _STORE.timeout),
        on_failure=on_failure,
        key_prefix=m.get("key_prefix", values.key_prefix, _STORE.key_prefix),
        breaker=m.section("breaker", _breaker, _BREAKER),
    )


def _breaker(walk: Walk, node: yaml.Node, path: str) -> Breaker:
    m = walk.mapping(node, path, _BREAKER_KEYS)
    if m is None:
        return _BREAKER
    return Breaker(
        failures=m.get("failures", values.integer_at_least(1), _BREAKER.failures),
        cooloff=m.get("cooloff", values.positive_duration, _BREAKER.cooloff),
    )


def _tenant(walk: Walk, node: yaml.Node, path: str) -> TenantSettings:
    """Where the tenant comes from (the header, or proxy credentials), which tenants are
    accepted (``known_only``) and how many others a vendor tracks at once (``max_active``)."""
    m = walk.mapping(node, path, _TENANT_KEYS)
    if m is None:
        return _TENANT
    source: TenantFrom = m.get("from", values.choice(TENANT_FROM), _TENANT.from_)
    credentials = m.section("credentials", _credentials, _TENANT.credentials)
    known_only = m.get("known_only", values.boolean, _TENANT.known_only)
    if source == "proxy_auth":
        if not credentials and not m.has("credentials"):
            walk.error(m.node_of("from") or m.node, m.child("from"), "from: proxy_auth needs tenant.credentials")
        if known_only:
            message = "known_only is for from: header (with proxy_auth only tenants with credentials get in)"
            walk.error(m.node_of("known_only") or m.node, m.child("known_only"), message)
        if m.has("default"):
            message = "default is not used with from: proxy_auth: a request without credentials gets 407"
            walk.warn(m.node_of("default") or m.node, m.child("default"), message)
    elif m.has("credentials"):
        message = "credentials are used only with from: proxy_auth (set tenant.from, or the tenant header decides)"
        walk.error(m.node_of("credentials") or m.node, m.child("credentials"), message)
    return TenantSettings(
        header=m.get("header", values.header_name, _TENANT.header),
        default=m.get("default", values.nullable(values.tenant_name), _TENANT.default),
        from_=source,
        credentials=credentials,
        known_only=known_only,
        max_active=m.get("max_active", values.nullable(values.integer_at_least(1)), _TENANT.max_active),
    )


def _connections(walk: Walk, node: yaml.Node, path: str) -> Connections:
    m = walk.mapping(node, path, _CONNECTIONS_KEYS)
    if m is None:
        return _CONNECTIONS
    return Connections(
        max=m.get("max", values.integer_at_least(1), _CONNECTIONS.max),
        head_timeout=m.get("head_timeout", values.positive_duration, _CONNECTIONS.head_timeout),
        idle_timeout=m.get("idle_timeout", values.positive_duration, _CONNECTIONS.idle_timeout),
    )


def _admin_hosts(walk: Walk, node: yaml.Node, path: str) -> tuple[str, ...]:
    hosts = (
        walk.leaf(item, f"{path}[{i}]", "host", values.host, "")
        for i, item in enumerate(walk.sequence(node, path) or ())
    )
    return tuple(dict.fromkeys(h for h in hosts if h))


def _credentials(walk: Walk, node: yaml.Node, path: str) -> tuple[tuple[str, bytes], ...]:
    """``{acme: {sha256: <64 hex digits>}}``: each tenant and the SHA-256 of its secret
    (the secret itself never goes in the policy)."""
    m = walk.mapping(node, path, None)
    if m is None:
        return ()
    if not m.entries:
        walk.error(node, path, "at least one tenant's credentials are required")
    found: list[tuple[str, bytes]] = []
    for tenant, entry in m.entries.items():
        sub = m.child(tenant)
        try:
            values.tenant_name("tenant", tenant)
            if ":" in tenant:
                raise ValueError(f'"{tenant}" cannot be a proxy user: Basic credentials end the user at the first ":"')
        except ValueError as exc:
            walk.error(entry.key_node, sub, str(exc))
            continue
        digest = _credential(walk, entry.value_node, sub)
        if digest is not None:
            found.append((tenant, digest))
    return tuple(found)


def _credential(walk: Walk, node: yaml.Node, path: str) -> bytes | None:
    m = walk.mapping(node, path, None)
    if m is None:
        return None
    for key, entry in m.entries.items():
        if key not in _CREDENTIAL_KEYS:
            hint = (
                ': give the secret\'s SHA-256 as sha256 (printf %s "$SECRET" | sha256sum), never the secret'
                if key in ("password", "secret")
                else ""
            )
            walk.error(entry.key_node, m.child(key), f'unknown key "{key}"{hint}')
    digest = m.require("sha256", _sha256, None)
    return None if digest is None else bytes.fromhex(digest)


_sha256: Final = values.matching(_SHA256_RE, "sha256 must be 64 hex digits (the SHA-256 of the secret), got {value}")


def _check_known_tenants(m: CheckedMapping, tenant: TenantSettings, vendors: tuple[Vendor, ...]) -> None:
    """``known_only`` with no tenant named anywhere would refuse every request."""
    if not tenant.known_only or tenant.named(vendors):
        return
    section = m.node_of("tenant")
    node = (
        next(
            (value for key, value in section.value if getattr(key, "value", None) == "known_only"),
            section,
        )
        if isinstance(section, yaml.MappingNode)
        else m.node
    )
    message = "the policy names no tenant (no default, no tenant_limits.overrides): every request would get 400"
    m.walk.error(node, "tenant.known_only", message)


def _tls(walk: Walk, node: yaml.Node, path: str) -> TlsSettings:
    m = walk.mapping(node, path, _TLS_KEYS)
    if m is None:
        return _TLS
    ca_file = values.file_path(walk.base_dir, must_exist=False)  # the CA check or `ca init -c` sees to them
    ca_cert = m.get("ca_cert", ca_file, _TLS.ca_cert)
    ca_key = m.get("ca_key", ca_file, _TLS.ca_key)
    if (ca_cert is None) != (ca_key is None):
        key = "ca_cert" if ca_cert is not None else "ca_key"
        walk.error(m.node_of(key) or m.node, m.child(key), "ca_cert and ca_key must be set together")
    elif ca_cert is not None and ca_key is not None and walk.check_ca:
        _check_ca_files(m, ca_cert, ca_key)
    return TlsSettings(
        upstream_verify=m.get("upstream_verify", values.boolean, _TLS.upstream_verify),
        upstream_ca_file=m.get(
            "upstream_ca_file", values.file_path(walk.base_dir, must_exist=True), _TLS.upstream_ca_file
        ),
        ca_cert=ca_cert,
        ca_key=ca_key,
        leaf_validity=m.get("leaf_validity", values.positive_duration, _TLS.leaf_validity),
    )


def _check_ca_files(m: CheckedMapping, ca_cert: str, ca_key: str) -> None:
    """The CA must load as the proxy will load it; each problem goes on the line of the file
    it is about, and a bad certificate does not hide a bad key."""
    from proxy.ca.authority import CAError, CertificateAuthority, load_ca_key  # cryptography only when a CA is set

    def report(exc: CAError) -> None:
        key = "ca_key" if exc.role == "key" else "ca_cert"
        m.walk.error(m.node_of(key) or m.node, m.child(key), f"{exc.path}: {exc.problem}")

    try:
        m.walk.ca = CertificateAuthority.load(ca_cert, ca_key)
    except CAError as exc:
        report(exc)
        if exc.role == "certificate":
            try:
                load_ca_key(ca_key)
            except CAError as key_exc:
                report(key_exc)
