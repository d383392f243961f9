"""deploy/: Compose, Kubernetes, Prometheus rules and the Grafana dashboard, checked without a
container engine (none runs here): every file parses, the policies they embed pass the real
loader, and ports, probes, grace periods, labels and metric names agree with each other, with
the policy and with what /metrics exports. promtool checks and unit-tests the rules; it is
required (``scripts/test`` installs it): without it these tests fail rather than skip.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from proxy.cli import parse_args
from proxy.policy import Policy, load_policy, parse_policy
from proxy.telemetry.metrics import OUTCOMES
from tests.conftest import ROOT, vendor_policy
from tests.helpers.dockerfile import IMAGE_POLICY, parse_dockerfile

DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_POLICY = DEPLOY / "compose" / "policy.yaml"
K8S = DEPLOY / "k8s" / "base"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "quota-proxy.json"
RUNBOOKS = ROOT / "docs" / "alerts.md"

# The metrics the proxy exports (README's table), by the names PromQL sees, with their labels
# (besides the scrape's own: instance, job, pod, ...).
METRICS: dict[str, set[str]] = {
    "ratelimit_requests_total": {"limiter", "tenant", "outcome"},
    "ratelimit_deferred_total": {"limiter"},
    "ratelimit_shed_total": {"limiter"},
    "ratelimit_hold_seconds": {"limiter"},
    "ratelimit_held_requests": {"limiter"},
    "ratelimit_tokens_available": {"limiter"},
    "ratelimit_store_errors_total": set(),
    "ratelimit_breaker_open": set(),
    "ratelimit_fail_open_total": {"limiter"},
    "ratelimit_degraded_grants_total": {"limiter"},
    "ratelimit_vendor_blocks_total": {"limiter"},
    "ratelimit_low_watermark_drains_total": {"limiter"},
    "ratelimit_max_hold_seconds": {"limiter"},
    "ratelimit_configured_rate": {"limiter"},
    "ratelimit_requests_by_mode_total": {"limiter", "mode"},
    "ratelimit_tls_errors_total": {"limiter", "reason"},
    "ratelimit_tunnels_open": {"limiter"},
    "http_client_responses_total": {"limiter", "code"},
    "http_client_request_duration_seconds": {"limiter"},
    "ratelimit_recommended_concurrency": {"limiter"},
    "ratelimit_config_reload_total": {"result"},
    "ratelimit_connections_open": set(),
    "ratelimit_connections_max": set(),
    "ratelimit_connections_closed_total": {"reason"},
}
SUPERVISOR_METRICS: dict[str, set[str]] = {
    "ratelimit_workers_running": set(),
    "ratelimit_worker_restarts_total": {"worker"},
}
"""Exported only by the supervisor of ``run --workers N`` (tests/test_workers.py reads them)."""
HISTOGRAMS = {"ratelimit_hold_seconds", "http_client_request_duration_seconds"}
TARGET_LABELS = {"instance", "job", "namespace", "pod", "container", "service", "node"}
LABEL_VALUES = {"outcome": set(OUTCOMES), "result": {"success", "failure"}, "mode": {"plain", "intercept", "tunnel"}}
SEVERITIES = {"critical", "warning", "info"}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def test_every_yaml_file_under_deploy_loads() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))
    assert len(files) >= 12, files
    for path in files:
        assert load_all(path), f"{path.relative_to(ROOT)} is empty"


# -- PromQL, read just enough -------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_SELECTOR = re.compile(r'([A-Za-z_:][\w:]*)\s*\{((?:[^{}"]|"(?:[^"\\]|\\.)*")*)\}')
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: no functions, keywords, labels or durations."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges, subqueries, Grafana's $__rate_interval
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = match.groups()
        if not call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def selectors(expr: str) -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    """(metric, [(label, op, value)]) for every ``metric{...}`` in the expression."""
    for match in _SELECTOR.finditer(expr):
        yield match[1], _MATCHER.findall(match[2])


def base_metric(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


def test_promql_reader_finds_metrics_not_functions_labels_or_durations() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (limiter, le) (rate(ratelimit_hold_seconds_bucket{limiter=~"$limiter"}'
        "[$__rate_interval]))) > 0.8 * on (limiter) group_left max by (limiter) (ratelimit_max_hold_seconds) "
        "or count(x:y:rate5m unless x:y:rate5m offset 5m) / 1e-3 and sum(rate(a_total[5m:1m])) without (job)"
    )
    assert metric_names(expr) == {
        "ratelimit_hold_seconds_bucket",
        "ratelimit_max_hold_seconds",
        "x:y:rate5m",
        "a_total",
    }
    assert list(selectors('rate(m_total{outcome=~"forwarded|held", code="4{2}9"}[5m])')) == [
        ("m_total", [("outcome", "=~", "forwarded|held"), ("code", "=", "4{2}9")])
    ]


def check_expr(expr: str, where: str, recorded: dict[str, str]) -> set[str]:
    """Every name is a known metric or a recording rule; every selector's labels exist.
    Returns the exported metrics the expression reads, through recording rules too."""
    names = metric_names(expr)
    assert names, f"{where}: selects no metric: {expr}"
    used: set[str] = set()
    for name in names:
        if name in recorded:
            used |= check_expr(recorded[name], f"{where} → {name}", recorded)
            continue
        assert base_metric(name) in METRICS | SUPERVISOR_METRICS, f"{where}: {name} is not a metric the proxy exports"
        used.add(base_metric(name))
    for name, matchers in selectors(expr):
        if name in recorded:
            continue
        labels = (METRICS | SUPERVISOR_METRICS)[base_metric(name)]
        allowed = labels | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
        for label, op, value in matchers:
            assert label in allowed, f"{where}: {name} has no label {label!r}"
            if label in LABEL_VALUES and op in ("=", "=~"):
                assert set(value.split("|")) <= LABEL_VALUES[label], f"{where}: {label}={value!r}"
    return used


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: install Debian's `prometheus` package (bash scripts/test does)")
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )


# -- Prometheus rules ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def recorded(rules: list[dict[str, Any]]) -> dict[str, str]:
    return {rule["record"]: rule["expr"] for rule in rules if "record" in rule}


def alerts_of(rules: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    alerts = {rule["alert"]: rule for rule in rules if "alert" in rule}
    assert len(alerts) == len([r for r in rules if "alert" in r]), "alert names are unique"
    return alerts


def test_promtool_checks_the_rules() -> None:
    result = run_promtool("check", "rules", str(ALERTS.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run_promtool("test", "rules", str(ALERTS_TEST.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_read_only_exported_metrics(rules: list[dict[str, Any]], recorded: dict[str, str]) -> None:
    for rule in rules:
        check_expr(rule["expr"], rule.get("alert") or rule["record"], recorded)
    for name in recorded:
        assert re.fullmatch(r"[a-z_]*:[a-z0-9_]+:[a-z0-9_]+", name), f"{name}: not level:metric:operations"


def test_every_alert_has_severity_summary_description_and_a_runbook(rules: list[dict[str, Any]]) -> None:
    headings = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("#")
    }
    for name, alert in alerts_of(rules).items():
        assert alert["labels"]["severity"] in SEVERITIES, name
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description", "runbook"}, name
        assert len(annotations["description"]) > len(annotations["summary"]) > 20, name
        page, _, anchor = annotations["runbook"].partition("#")
        assert (ROOT / page) == RUNBOOKS and anchor in headings, f"{name}: no runbook section {anchor!r}"


def _expr(alert: dict[str, Any]) -> str:
    return " ".join(alert["expr"].split())


def test_the_seed_signals_and_every_alert_the_issue_asks_for(
    rules: list[dict[str, Any]], recorded: dict[str, str]
) -> None:
    alerts = alerts_of(rules)
    # Vendor 429s are not healthy: the fleet-wide signal, recorded; an alert per vendor.
    seed = 'sum(rate(http_client_responses_total{code="429"}[5m]))'
    assert seed in {" ".join(e.split()) for e in recorded.values()}
    vendor_429 = alerts["QuotaProxyVendor429s"]
    assert 'sum by (limiter) (rate(http_client_responses_total{code="429"}[5m])) > 0' in _expr(vendor_429)
    assert vendor_429["labels"]["severity"] != "info"
    # Deferrals are healthy: recorded, and watched only at severity info.
    assert any("ratelimit_deferred_total" in e for e in recorded.values())
    for name, alert in alerts.items():
        if "ratelimit_deferred_total" in alert["expr"]:
            assert alert["labels"]["severity"] == "info", f"{name}: deferrals must never page"
    # Store down, breaker open, holds near max_hold, fail-open, TLS, reload failures.
    assert "ratelimit_store_errors_total" in alerts["QuotaProxyStoreErrors"]["expr"]
    breaker = alerts["QuotaProxyBreakerOpen"]
    assert _expr(breaker) == "ratelimit_breaker_open == 1" and breaker["for"] == "1m"
    hold = _expr(alerts["QuotaProxyHoldNearMaxHold"])
    assert "histogram_quantile(0.95," in hold and "> 0.8 * max by (limiter) (ratelimit_max_hold_seconds)" in hold
    assert "ratelimit_fail_open_total" in alerts["QuotaProxyFailOpen"]["expr"]
    tls = [a for a in alerts.values() if "ratelimit_tls_errors_total" in a["expr"]]
    assert {a["labels"]["severity"] for a in tls} == {"critical", "warning"}
    assert 'ratelimit_config_reload_total{result="failure"}' in alerts["QuotaProxyConfigReloadFailed"]["expr"]


def test_unit_tests_show_every_alert_firing_and_not_firing(rules: list[dict[str, Any]]) -> None:
    spec = load_yaml(ALERTS_TEST)
    assert [(ALERTS_TEST.parent / f).resolve() for f in spec["rule_files"]] == [ALERTS.resolve()]
    fired: set[str] = set()
    quiet: set[str] = set()
    for group in spec["tests"]:
        for case in group.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    alerts = set(alerts_of(rules))
    assert fired == alerts, f"never shown firing: {alerts - fired}"
    assert quiet == alerts, f"never shown quiet: {alerts - quiet}"


# -- Grafana ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (f"panel {p['id']} {p['title']!r} {t['refId']}", t["expr"])
        for p in _panels(dashboard)
        if p["type"] != "row"
        for t in p["targets"]
    ]


def test_dashboard_variables_datasource_and_layout(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["id"] is None
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    limiter = variables["limiter"]
    assert limiter["type"] == "query" and limiter["includeAll"] and limiter["multi"]
    definition = re.fullmatch(r"label_values\((\w+), limiter\)", limiter["definition"])
    assert definition and "limiter" in METRICS[definition[1]]
    assert limiter["datasource"]["uid"] == "${datasource}"

    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']!r} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), panel["title"]


def test_dashboard_queries_read_only_exported_metrics_and_defined_recording_rules(
    dashboard: dict[str, Any], recorded: dict[str, str]
) -> None:
    used: set[str] = set()
    for where, expr in _targets(dashboard):
        used |= check_expr(expr, where, recorded)
        for name, matchers in selectors(expr):
            if "limiter" in METRICS.get(base_metric(name), set()) or name in recorded:
                assert ("limiter", "=~", "$limiter") in matchers, f"{where}: {name} ignores $limiter"
    # What the issue asks to see: tokens, the stacked outcomes with vendor 429s, per-tenant
    # share, added and upstream latency, holds against max_hold, store and breaker, sizing,
    # TLS and modes.
    assert set(METRICS) - {"ratelimit_shed_total"} <= used, f"not on the dashboard: {set(METRICS) - used}"


def test_dashboard_stacks_forwarded_held_deferred_under_the_vendor_429s(dashboard: dict[str, Any]) -> None:
    def stacked(panel: dict[str, Any]) -> bool:
        return panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"

    for panel in _panels(dashboard):
        if panel["type"] != "timeseries" or not stacked(panel):
            continue
        exprs = [t["expr"] for t in panel["targets"]]
        outcomes = {
            v
            for e in exprs
            for name, ms in selectors(e)
            if name == "ratelimit_requests_total"
            for label, _, v in ms
            if label == "outcome"
        }
        vendor_429 = [t for t in panel["targets"] if 'code="429"' in t["expr"]]
        if outcomes and vendor_429:
            assert {"forwarded", "held", "deferred"} <= set("|".join(outcomes).split("|"))
            (legend,) = {t["legendFormat"] for t in vendor_429}
            unstacked = {
                o["matcher"]["options"]
                for o in panel["fieldConfig"]["overrides"]
                if {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}} in o["properties"]
            }
            assert legend in unstacked, "the vendor's 429s are drawn over the stack, not on it"
            return
    raise AssertionError("no stacked forwarded/held/deferred panel with vendor 429s")


def test_promtool_parses_every_dashboard_query(dashboard: dict[str, Any], tmp_path: Path) -> None:
    grafana = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$limiter": ".*"}
    rules = []
    for i, (where, expr) in enumerate(_targets(dashboard)):
        for variable, value in grafana.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"{where}: unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}:check", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# -- what /metrics really exports -----------------------------------------------------------------


async def test_metrics_list_is_what_the_proxy_exports(start_proxy: Any) -> None:
    server = await start_proxy(vendor_policy("http://127.0.0.1:9"))
    async with aiohttp.ClientSession() as session, session.get(f"{server.admin_url}/metrics") as response:
        text = await response.text()
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    # A counter's family is named without _total (prometheus_client writes it either way).
    exported = {
        name.removesuffix("_total") + "_total" if kind == "counter" else name for name, kind in families.items()
    }
    assert set(METRICS) <= exported, f"listed but not exported: {set(METRICS) - exported}"
    assert {name for name in METRICS if families.get(name) == "histogram"} == HISTOGRAMS


# -- the policies ---------------------------------------------------------------------------------


def _duration(text: str | int) -> float:
    """Compose durations: 20s, 1m30s, 500ms."""
    if isinstance(text, int):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", text)
    assert parts and "".join(a + b for a, b in parts) == text, text
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    return sum(float(a) * scale[b] for a, b in parts)


@pytest.fixture(scope="module")
def image() -> dict[str, Any]:
    instructions = parse_dockerfile((ROOT / "Dockerfile").read_text())
    (cmd,) = [json.loads(i.args) for i in instructions if i.keyword == "CMD"]
    (user,) = [i.args for i in instructions if i.keyword == "USER"]
    (uid,) = {
        int(m)
        for i in instructions
        if i.keyword == "RUN"
        for m in re.findall(rf"useradd\b.*--uid (\d+)\b.*\b{re.escape(user)}\s*$", i.args)
    }
    return {"cmd": cmd, "uid": uid}


# -- Compose --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


def _proxy_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if any(v.split(":")[0] == "./compose/policy.yaml" for v in svc.get("volumes", []))
    }


def _container_port(mapping: str) -> int:
    return int(str(mapping).rsplit(":", 1)[-1].split("/")[0])


def test_compose_runs_two_replicas_of_the_repo_image_on_the_compose_policy(
    compose: dict[str, Any], image: dict[str, Any]
) -> None:
    policy = load_policy(COMPOSE_POLICY)
    services = compose["services"]
    proxies = _proxy_services(compose)
    assert len(proxies) == 2, list(proxies)
    for name, svc in proxies.items():
        assert (COMPOSE.parent / svc["build"]["context"]).resolve() == ROOT, name
        assert (ROOT / svc["build"]["dockerfile"]).is_file()
        assert svc.get("command") is None, f"{name}: the image's CMD runs the mounted policy"
        (mount,) = [v for v in svc["volumes"] if v.startswith("./compose/policy.yaml:")]
        assert mount == f"./compose/policy.yaml:{image['cmd'][-1]}:ro" and image["cmd"][-1] == IMAGE_POLICY
        assert parse_args(image["cmd"][1:]).workers == "auto", "the image serves from every CPU"
        assert not policy.store.url.startswith("memory://"), "the replicas' workers share Redis"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert _duration(svc["stop_grace_period"]) > policy.drain_timeout, f"{name}: stop_grace_period"
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"

        # Both listeners published (on loopback), healthcheck on the admin listener's /healthz.
        assert {_container_port(p) for p in svc["ports"]} == {policy.listen.port, policy.admin_listen.port}
        assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), name
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and f"http://127.0.0.1:{policy.admin_listen.port}/healthz" in " ".join(test)
        assert _duration(svc["healthcheck"]["interval"]) <= 30

    # Host ports do not collide.
    published = [str(p).rsplit(":", 1)[0] for svc in services.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published)), published

    # The policy: every interface, the compose Redis, the compose mock vendor.
    assert policy.listen.host == policy.admin_listen.host == "0.0.0.0"
    store = urlsplit(policy.store.url)
    assert (store.scheme, store.hostname, store.port, store.path) == ("redis", "redis", 6379, "/0")
    assert "redis" in services and "6379" not in " ".join(services["redis"].get("ports", []))
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    (vendor,) = policy.vendors
    upstream = urlsplit(vendor.upstream or "")
    mock = services[upstream.hostname or ""]
    args = parse_args(mock["command"][1:])
    assert mock["command"][:2] == ["quota-proxy", "mock-vendor"]
    assert (args.listen, args.rate) == (("0.0.0.0", upstream.port), 100)
    health_url = urlsplit(mock["environment"]["QUOTA_PROXY_HEALTHCHECK_URL"])
    assert health_url.port == upstream.port and health_url.path == "/__mock/stats"
    for name in proxies:
        assert proxies[name]["depends_on"][upstream.hostname or ""]["condition"] == "service_healthy"


def test_compose_prometheus_scrapes_both_replicas_and_loads_the_rules(compose: dict[str, Any], tmp_path: Path) -> None:
    policy = load_policy(COMPOSE_POLICY)
    prometheus = compose["services"]["prometheus"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in prometheus["volumes"])
    config_path = next(target for source, target in mounts.items() if source.endswith("prometheus.yml"))
    config = load_yaml(COMPOSE.parent / next(s for s, t in mounts.items() if t == config_path))
    assert f"--config.file={config_path}" in prometheus["command"]
    assert [mounts["./prometheus/alerts.yml"]] == config["rule_files"]
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    assert set(static["targets"]) == {f"{name}:{policy.admin_listen.port}" for name in _proxy_services(compose)}
    assert job.get("metrics_path", "/metrics") == "/metrics"

    # promtool agrees, with the rule file where the container would see it.
    config["rule_files"] = [str(ALERTS)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr

    grafana = compose["services"]["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        assert (COMPOSE.parent / source).is_file(), source
    assert any(v.startswith("./grafana/quota-proxy.json:") for v in grafana["volumes"])
    datasource = load_yaml(COMPOSE.parent / "compose" / "grafana" / "datasource.yaml")["datasources"][0]
    assert datasource["type"] == "prometheus"
    assert urlsplit(datasource["url"]).hostname == "prometheus"


# -- Kubernetes -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "kustomization.yaml lists every manifest"
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for name in listed:
        for doc in load_all(K8S / name):
            assert doc["apiVersion"] and doc["metadata"]["name"], name
            assert "namespace" not in doc["metadata"], f"{name}: the kustomization sets the namespace"
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, key
            objects[key] = doc
    namespace = objects[("Namespace", kustomization["namespace"])]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    objects[("Kustomization", "")] = kustomization
    return objects


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _k8s_policy(k8s: dict[tuple[str, str], dict[str, Any]]) -> tuple[Policy, argparse.Namespace]:
    """The policy the Deployment runs: the ConfigMap key its -c path names, through its mount."""
    deployment = k8s[("Deployment", "quota-proxy")]
    container = _container(deployment)
    args = parse_args(container["command"][1:])
    assert container["command"][0] == "quota-proxy" and args.command == "run"
    path = Path(args.config)
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] and "subPath" not in mount, "a directory mount, so ConfigMap edits reach the pod"
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = k8s[("ConfigMap", volume["configMap"]["name"])]
    text = config_map["data"][path.name]
    return parse_policy(text, f"deploy/k8s/base/configmap.yaml#{path.name}", base_dir=K8S), args


def test_k8s_deployment_runs_the_configmap_policy_with_matching_ports_and_probes(
    k8s: dict[tuple[str, str], dict[str, Any]], image: dict[str, Any]
) -> None:
    policy, args = _k8s_policy(k8s)
    assert args.watch, "--watch: an edited ConfigMap is reloaded without a restart"
    assert args.workers == "auto", "--workers auto: every CPU of the pod serves the one port"
    assert not policy.store.url.startswith("memory://"), "workers share buckets only through Redis"
    assert policy.listen.host == policy.admin_listen.host == "0.0.0.0"
    deployment = k8s[("Deployment", "quota-proxy")]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    container = _container(deployment)
    assert spec["replicas"] == 2
    # auto counts the CPUs the container may use: a CPU limit bounds the workers, and the memory
    # limit must hold that many (the supervisor and ~60 MiB per worker).
    limits = container["resources"]["limits"]
    cpus = float(limits["cpu"].removesuffix("m")) / (1000 if limits["cpu"].endswith("m") else 1)
    workers = math.ceil(cpus)
    assert 1 <= workers <= 4
    memory = limits["memory"]
    assert memory.endswith("Mi") and int(memory[:-2]) >= 64 + 96 * workers
    # /tmp is writable (the workers' admin sockets live there under a read-only root).
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert not tmp.get("readOnly", False)
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"proxy": policy.listen.port, "admin": policy.admin_listen.port}

    def probe_port(probe: dict[str, Any]) -> int:
        port = probe["httpGet"]["port"]
        return ports[port] if isinstance(port, str) else port

    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz" and probe_port(readiness) == policy.admin_listen.port
    assert liveness["httpGet"]["path"] == "/healthz" and probe_port(liveness) == policy.admin_listen.port

    # Shutdown: the preStop sleep, then SIGTERM drains for drain_timeout, all within the grace period.
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and 0 < int(sleep[1]) <= 15
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + policy.drain_timeout

    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == policy.admin_listen.port
    assert annotations["prometheus.io/path"] == "/metrics"

    images = {i["name"]: i for i in k8s[("Kustomization", "")]["images"]}
    assert container["image"] in images


def test_k8s_pods_are_non_root_read_only_and_bounded(
    k8s: dict[tuple[str, str], dict[str, Any]], image: dict[str, Any]
) -> None:
    deployments = [d for (kind, _), d in k8s.items() if kind == "Deployment"]
    assert len(deployments) == 2
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]
    proxy_pod = k8s[("Deployment", "quota-proxy")]["spec"]["template"]["spec"]
    assert proxy_pod["securityContext"]["runAsUser"] == image["uid"], "the image's own user"


def test_k8s_selectors_services_and_pdb_agree(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    policy, _ = _k8s_policy(k8s)
    deployment = k8s[("Deployment", "quota-proxy")]
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _matches(selector, labels)
    other_pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for (kind, name), d in k8s.items()
        if kind == "Deployment" and name != "quota-proxy"
    ]
    assert other_pods and not any(_matches(selector, other) for other in other_pods), "the selector is the proxy's"

    pdb = k8s[("PodDisruptionBudget", "quota-proxy")]
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"]["minAvailable"] == 1 < deployment["spec"]["replicas"]

    # Two Services over the proxy pods: workers' (the proxy port only) and the admin one.
    container_ports = {p["name"]: p["containerPort"] for p in _container(deployment)["ports"]}
    for name, port_name in (("quota-proxy", "proxy"), ("quota-proxy-admin", "admin")):
        service = k8s[("Service", name)]
        assert service["spec"]["selector"] == selector, name
        assert service["spec"]["type"] == "ClusterIP", name
        (port,) = service["spec"]["ports"]
        assert port["name"] == port["targetPort"] == port_name, name
        assert container_ports[port["targetPort"]] == port["port"], name

    # The store URL names a Service of this kustomization, on that Service's port, which
    # selects a pod listening there.
    store = urlsplit(policy.store.url)
    assert store.scheme == "redis"
    redis_service = k8s[("Service", store.hostname or "")]
    (redis_port,) = redis_service["spec"]["ports"]
    assert redis_port["port"] == store.port
    (redis,) = [
        d
        for (kind, _), d in k8s.items()
        if kind == "Deployment"
        and _matches(redis_service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    ]
    redis_ports = {p["name"]: p["containerPort"] for p in _container(redis)["ports"]}
    assert redis_ports[redis_port["targetPort"]] == 6379


def test_k8s_network_policy_admits_workers_to_the_proxy_port_and_monitoring_to_the_admin_port(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    deployment = k8s[("Deployment", "quota-proxy")]
    proxy_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (proxy_policy,) = [
        d
        for (kind, _), d in k8s.items()
        if kind == "NetworkPolicy" and _matches(d["spec"]["podSelector"]["matchLabels"], proxy_labels)
    ]
    assert proxy_policy["spec"]["policyTypes"] == ["Ingress"]
    admitted: dict[str, list[dict[str, Any]]] = {}
    for rule in proxy_policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule without `from` admits everyone"
        (port,) = rule["ports"]
        admitted[port["port"]] = rule["from"]
    assert set(admitted) == {"proxy", "admin"}, "no other port, and each port its own sources"
    assert admitted["proxy"] == [{"namespaceSelector": {"matchLabels": {"quota-proxy/client": "true"}}}]
    assert admitted["admin"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert {p["name"] for p in _container(deployment)["ports"]} == set(admitted)

    # Redis: the proxy pods only.
    redis_service = k8s[("Service", "quota-proxy-redis")]
    (redis_policy,) = [
        d
        for (kind, _), d in k8s.items()
        if kind == "NetworkPolicy" and d["spec"]["podSelector"]["matchLabels"] == redis_service["spec"]["selector"]
    ]
    (rule,) = redis_policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": proxy_labels}}]
    assert [p["port"] for p in rule["ports"]] == ["redis"]


def test_k8s_admin_token_comes_from_a_secret_and_the_admin_service_names_are_admin_hosts(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    policy, _ = _k8s_policy(k8s)
    assert policy.admin_token is None, "never a token in the ConfigMap"
    env = {e["name"]: e for e in _container(k8s[("Deployment", "quota-proxy")])["env"]}
    ref = env["QUOTA_PROXY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "quota-proxy-admin", "key": "token"}, "required: no Secret, no pod (never unguarded)"
    assert not any(kind == "Secret" for kind, _ in k8s), "the Secret is made by the operator, not shipped"
    kustomization = (K8S / "kustomization.yaml").read_text()
    assert "create secret generic quota-proxy-admin --from-literal=token=" in kustomization
    namespace = k8s[("Kustomization", "")]["namespace"]
    service = "quota-proxy-admin"
    for name in (
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ):
        assert name in policy.admin_names, name


def test_compose_takes_the_admin_token_from_the_environment_and_keeps_redis_to_the_proxies(
    compose: dict[str, Any],
) -> None:
    policy = load_policy(COMPOSE_POLICY)
    assert policy.admin_token is None, "never a token in the compose policy"
    services = compose["services"]
    proxies = _proxy_services(compose)
    for name, svc in proxies.items():
        token = svc["environment"]["QUOTA_PROXY_ADMIN_TOKEN"]
        assert token.startswith("${QUOTA_PROXY_ADMIN_TOKEN:?"), f"{name}: compose must refuse to start without it"
        assert set(svc["networks"]) == {"default", "store"}, name
        # Prometheus scrapes the replicas by service name: the admin listener answers to it.
        assert name in policy.admin_names, name
    assert compose["networks"]["store"]["internal"] is True
    on_store = {name for name, svc in services.items() if "store" in svc.get("networks", [])}
    assert on_store == {"redis", *proxies}
    assert services["redis"]["networks"] == ["store"]
