"""The policy document's top-level sections: version, listeners, store, tenant, tls
(the ``vendors:`` list is built in ``vendors``).

Each builder ``(walk, node, path) -> model object`` falls back to the model's defaults
where a value is missing or wrong; a wrong value has already been recorded on the walk,
so the fallback never reaches a running proxy.
"""

from __future__ import annotations

from typing import Final

import yaml

from proxy.policy import values
from proxy.policy.model import (
    FAILURE_MODES,
    Address,
    Breaker,
    FailureMode,
    Policy,
    StoreSettings,
    TenantSettings,
    TlsSettings,
)
from proxy.policy.vendors import build_vendors
from proxy.policy.walker import CheckedMapping, Walk

# Defaults live in the model; these instances are how the builders read them
# (slots dataclasses keep no class-level defaults).
_POLICY: Final = Policy()
_STORE: Final = StoreSettings()
_BREAKER: Final = Breaker()
_TENANT: Final = TenantSettings()
_TLS: Final = TlsSettings()

_ROOT_KEYS: Final = (
    "version", "listen", "admin_listen", "store", "tenant", "vendors", "tls", "drain_timeout", "access_log",
)  # fmt: skip
_STORE_KEYS: Final = ("url", "timeout", "on_failure", "key_prefix", "breaker")
_BREAKER_KEYS: Final = ("failures", "cooloff")
_TENANT_KEYS: Final = ("header", "default")
_TLS_KEYS: Final = ("upstream_verify", "upstream_ca_file", "ca_cert", "ca_key", "leaf_validity")


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
    return Policy(
        version=version,
        listen=listen,
        admin_listen=admin_listen,
        store=m.section("store", _store, _STORE),
        tenant=m.section("tenant", _tenant, _TENANT),
        vendors=m.require_section("vendors", lambda w, n, p: build_vendors(w, n, p, tls), ()),
        tls=tls,
        drain_timeout=m.get("drain_timeout", values.duration, _POLICY.drain_timeout),
        access_log=m.get("access_log", values.boolean, _POLICY.access_log),
        source=walk.source,
        warnings=tuple(walk.warnings),  # last: keyword arguments are evaluated in order, vendors' included
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
    m = walk.mapping(node, path, _TENANT_KEYS)
    if m is None:
        return _TENANT
    return TenantSettings(
        header=m.get("header", values.header_name, _TENANT.header),
        default=m.get("default", values.nullable(values.tenant_name), _TENANT.default),
    )


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
