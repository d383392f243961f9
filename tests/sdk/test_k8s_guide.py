"""docs/guides/stripe-on-kubernetes.md, checked: its manifests against Kubernetes' own
schemas (kubernetes-validate, offline), the overlay as kustomize would build it, its policy
with ``quota-proxy check``, its commands' names and paths against the manifests, and the
worker's code run through a proxy on the guide's policy against the Stripe stand-in."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from proxy.cli import main as cli_main
from proxy.policy import load_policy, parse_policy
from tests.helpers.cli import ROOT
from tests.helpers.guide import blocks, celery_driver
from tests.helpers.sdks import HOSTS, outcomes
from tests.sdk.test_clients_guide import guide  # noqa: F401  (the fixture: a worker set up as the guides say)

PAGE = ROOT / "docs" / "guides" / "stripe-on-kubernetes.md"
BASE = ROOT / "deploy" / "k8s"
OVERLAY = BASE / "stripe"
K8S_VERSION = "1.31"


def snippet(name: str) -> str:
    found = {b.name: b.code for b in blocks(PAGE.read_text()) if b.kind == "snippet"}
    return found[name]


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def built() -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay as ``kubectl apply -k deploy/k8s/stripe`` builds it: the base's resources,
    the policy ConfigMap replaced by policy.yaml, proxy-ca.yaml merged into the Deployment
    (containers and volumes by name, as a strategic merge patch does)."""
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../"]
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    resources: dict[tuple[str, str], dict[str, Any]] = {}
    for name in base["resources"]:
        for doc in documents(BASE / name):
            resources[(doc["kind"], doc["metadata"]["name"])] = doc
    (generator,) = kustomization["configMapGenerator"]
    assert generator["behavior"] == "replace" and generator["options"]["disableNameSuffixHash"] is True
    config_map = resources[("ConfigMap", generator["name"])]
    config_map["data"] = {Path(f).name: (OVERLAY / f).read_text() for f in generator["files"]}
    for patch in kustomization["patches"]:
        for doc in documents(OVERLAY / patch["path"]):
            _merge(resources[(doc["kind"], doc["metadata"]["name"])], doc)
    return resources


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict):
            _merge(target.setdefault(key, {}), value)
        elif isinstance(value, list) and value and isinstance(value[0], dict) and "name" in value[0]:
            by_name = {item["name"]: item for item in target.setdefault(key, [])}
            for item in value:
                if item["name"] in by_name:
                    _merge(by_name[item["name"]], item)
                else:
                    target[key].append(copy.deepcopy(item))
        else:
            target[key] = value


def test_every_manifest_is_valid_kubernetes() -> None:
    manifests = [*built().values(), *documents(OVERLAY / "worker.yaml")]
    assert len(manifests) > 8
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_the_proxy_mounts_the_ca_secret_where_the_policy_reads_it() -> None:
    resources = built()
    deployment = resources[("Deployment", "quota-proxy")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["ca"]["secret"]["secretName"] == "quota-proxy-ca"
    policy_dir = mounts[next(n for n, v in volumes.items() if "configMap" in v)]
    assert f"{policy_dir}/policy.yaml" in container["command"]
    # A kubernetes.io/tls Secret (kubectl create secret tls) holds tls.crt and tls.key.
    policy = yaml.safe_load(resources[("ConfigMap", "quota-proxy-policy")]["data"]["policy.yaml"])
    assert policy["tls"]["ca_cert"] == f"{mounts['ca']}/tls.crt"
    assert policy["tls"]["ca_key"] == f"{mounts['ca']}/tls.key"
    assert "kubectl -n quota-proxy create secret tls quota-proxy-ca --cert=ca/ca.pem --key=ca/ca-key.pem" in (
        snippet("deploy")
    )
    assert "kubectl apply -k deploy/k8s/stripe" in snippet("deploy")


def test_the_worker_goes_through_the_proxy_service_and_trusts_the_bundle_its_init_container_writes() -> None:
    (worker,) = documents(OVERLAY / "worker.yaml")
    pod = worker["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    services = {d["metadata"]["name"]: d for d in documents(BASE / "service.yaml")}
    port = next(p["port"] for p in services["quota-proxy"]["spec"]["ports"] if p["name"] == "proxy")
    address = f"http://quota-proxy.quota-proxy.svc:{port}"
    assert env["HTTPS_PROXY"] == env["https_proxy"] == address
    written = re.search(r"> (\S+)'?$", init["command"][-1])
    assert written is not None
    bundle = written.group(1).rstrip("'")
    assert env["REQUESTS_CA_BUNDLE"] == env["SSL_CERT_FILE"] == env["STRIPE_CA_BUNDLE"] == bundle
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    worker_mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert Path(bundle).parent == Path(init_mounts["bundle"]) == Path(worker_mounts["bundle"])
    assert f"{init_mounts['proxy-ca']}/ca.pem" in init["command"][-1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["proxy-ca"]["configMap"]["name"] == "quota-proxy-ca"
    commands = snippet("workers-namespace")
    assert "kubectl -n jobs create configmap quota-proxy-ca --from-file=ca.pem=ca/ca.pem" in commands
    assert worker["metadata"]["namespace"] == "jobs" and "quota-proxy/client=true" in commands
    network = documents(BASE / "networkpolicy.yaml")
    assert any("quota-proxy/client" in yaml.safe_dump(n) for n in network)  # the label it admits
    page = PAGE.read_text()
    for name, value in env.items():  # the page shows the environment the manifest sets
        if value is not None:
            assert f"{name}, value: {value}" in page or f'{name}, value: "{value}"' in page, name


def test_the_guide_policy_checks_clean_with_a_ca_from_ca_init(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = [shlex.split(line) for line in snippet("check").splitlines()]
    assert [c[:3] for c in commands] == [["quota-proxy", "ca", "init"], ["quota-proxy", "check", "-c"]]
    out = tmp_path / "ca"
    init = commands[0][1:]
    init[init.index("--out") + 1] = str(out)
    init[init.index("-c") + 1] = str(OVERLAY / "policy.yaml")
    assert cli_main(init) == 0
    # The CA as the Secret holds it, where the policy (in the pod) reads it.
    text = (OVERLAY / "policy.yaml").read_text()
    text = text.replace("/etc/quota-proxy/ca/tls.crt", str(out / "ca.pem"))
    text = text.replace("/etc/quota-proxy/ca/tls.key", str(out / "ca-key.pem"))
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(text)
    capsys.readouterr()
    check = commands[1][1:]
    check[check.index("-c") + 1] = str(policy_file)
    assert cli_main(check) == 0
    printed = capsys.readouterr()
    assert printed.err == ""  # no warning: under vendor_limit in every window
    assert "at most 100 requests in any 1s, per value of Authorization" in printed.out
    assert "HTTP/1.1 429 Too Many Requests" in printed.out  # --answers: Stripe's preset, a defer
    (vendor,) = load_policy(str(policy_file)).vendors
    assert (vendor.name, vendor.connect, vendor.answers.name, vendor.hosts) == (
        "stripe",
        "intercept",
        "stripe",
        ("api.stripe.com",),
    )


async def test_the_workers_task_creates_a_customer_and_re_enqueues_a_long_defer(guide, sdk_proxies) -> None:  # noqa: F811
    trust, mock = sdk_proxies.trust, sdk_proxies.vendor
    text = (OVERLAY / "policy.yaml").read_text()
    for real, stand_in in [
        ("listen: 0.0.0.0:8080", "listen: 127.0.0.1:0"),
        ("admin_listen: 0.0.0.0:9090", "admin_listen: 127.0.0.1:0"),
        ("url: redis://quota-proxy-redis:6379/0", "url: memory://"),
        ("/etc/quota-proxy/ca/tls.crt", str(trust.ca_cert)),
        ("/etc/quota-proxy/ca/tls.key", str(trust.ca_key)),
        ("upstream_verify: true", f"upstream_verify: true\n  upstream_ca_file: {mock.ca_file}"),
        ("hosts: [api.stripe.com]", f"hosts: [{HOSTS['stripe']}]\n    upstream: {mock.upstream}"),
        # One call an hour per key: the second is a defer beyond answers_max_wait.
        ("- {rate: 90, per: 1s, burst: 10}", "- {rate: 1, per: 1h, burst: 1}"),
    ]:
        assert real in text, real
        text = text.replace(real, stand_in)
    proxy = await sdk_proxies.start_proxy(parse_policy(text, "policy.yaml"))
    sdk_proxies.point_worker_at(proxy)
    ran = await guide.run(
        snippet("jobs"),
        "python",
        proxy.url,
        driver=celery_driver("create_customer", "first@example.com", "second@example.com"),
        env={"STRIPE_CA_BUNDLE": str(guide.etc / "bundle.pem")},
    )
    assert ran.status == 0, ran.err
    first, second = ran.out.splitlines()
    assert first.startswith("result: cus_")
    assert second.startswith("re-enqueued, countdown: ")
    assert 3000 < float(second.split()[-1]) <= 3600 * 1.2 + 1  # Retry-After plus up to 20 %
    assert outcomes(proxy, "stripe") == {"forwarded": 1, "deferred": 1}
