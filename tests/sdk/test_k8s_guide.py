"""docs/guides/stripe-on-kubernetes.md, run: every overlay under deploy/ built by the real
``kubectl kustomize`` (required: without kubectl these tests fail, never skip) and checked
against Kubernetes' own schemas (kubernetes-validate, offline); the guide's shell commands run
as printed from a copy of the repository, those that need a cluster or a registry through what
they would send (``kubectl kustomize``, ``create --dry-run=client``, ``label --local``). The
worker's code runs against ``quota-proxy mock-vendor`` in tests/sdk/test_k8s_local.py."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

import proxy
from proxy.policy import load_policy
from tests.helpers.cli import ROOT, clean_env
from tests.helpers.guide import blocks

PAGE = ROOT / "docs" / "guides" / "stripe-on-kubernetes.md"
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "k8s" / "base"
OVERLAY = DEPLOY / "k8s" / "stripe"
K8S_VERSION = "1.31"
# What a reader's shell has: the commands of this checkout, and the guide's two variables.
READER_ENV = {"STRIPE_API_KEY": "sk_test_guide", "CELERY_BROKER_URL": "redis://broker.jobs.svc:6379/0"}


def snippet(name: str) -> str:
    found = {b.name: b.code for b in blocks(PAGE.read_text()) if b.kind == "snippet"}
    return found[name]


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kubectl(*args: str, cwd: Path = ROOT) -> str:
    """The real kubectl, offline; its output. Missing kubectl fails the test."""
    found = shutil.which("kubectl")
    assert found, "kubectl (with kustomize v5) is required: https://kubernetes.io/docs/tasks/tools/"
    done = subprocess.run([found, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl {shlex.join(args)}: {done.stderr}"
    return done.stdout


def kustomized(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """``kubectl kustomize folder``: what ``kubectl apply -k folder`` sends, by (kind, name)."""
    built = [d for d in yaml.safe_load_all(kubectl("kustomize", str(folder))) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in built}


def reader_shell(workdir: Path) -> dict[str, str]:
    env = clean_env(READER_ENV, checkout=False)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # quota-proxy, as installed
    return env


def copy_of_the_repository(tmp_path: Path) -> Path:
    """What the guide's commands read (deploy/, the Dockerfile), where they may write (ca/, and
    .local/ for local.py), without what a run in this checkout left there."""
    work = tmp_path / "repo"
    shutil.copytree(DEPLOY, work / "deploy", ignore=shutil.ignore_patterns("ca", ".local"))
    shutil.copy(ROOT / "Dockerfile", work / "Dockerfile")
    return work


def run_shell(code: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=workdir,
        env=reader_shell(workdir),
        capture_output=True,
        text=True,
        timeout=120,
    )


def offline(line: str, workdir: Path) -> list[dict[str, Any]]:
    """One kubectl line of the guide, as far as it runs without a cluster: the objects it would
    send. Any line this does not know fails, so a new command cannot go untested."""
    words = shlex.split(line)
    assert words[0] == "kubectl", line
    if words[1] == "-n":  # the namespace comes with what the command makes
        words = [words[0], *words[3:]]
    verb = words[1]
    if words[1:3] == ["apply", "-k"]:
        return list(kustomized(workdir / words[3]).values())
    if words[1:3] == ["apply", "-f"]:
        return documents(workdir / words[3])
    if verb == "create":
        # The shell expands "$(openssl rand -hex 32)" and "$STRIPE_API_KEY" as the reader's would.
        done = run_shell(f"{line} --dry-run=client -o yaml", workdir)
        assert done.returncode == 0, f"{line}: {done.stderr}"
        return [yaml.safe_load(done.stdout)]
    if verb == "label":
        (kind, name, label) = [w for w in words[2:] if not w.startswith("-")]
        namespace = yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        (workdir / "namespace.yaml").write_text(namespace)
        assert kind == "namespace", line
        return [yaml.safe_load(kubectl("label", "--local", "-f", "namespace.yaml", label, "-o", "yaml", cwd=workdir))]
    if verb == "rollout":  # waits on a running cluster: nothing to send; the page says so
        assert "need a cluster" in PAGE.read_text()
        return []
    raise AssertionError(f"the test does not know how to run {line!r} offline")


def contained(part: Any, whole: Any) -> bool:
    """Whether YAML ``part`` is a piece of ``whole``: its keys there with values contained in
    the whole's, each of its list items contained in one of the whole's, its scalars equal."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contained(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and all(any(contained(p, w) for w in whole) for p in part)
    return bool(part == whole)


def test_every_block_of_the_page_is_run_or_compared() -> None:
    """A block added to the guide without a marker fails here: it would go untested."""
    found = blocks(PAGE.read_text())
    unmarked = [b.code[:60] for b in found if b.kind is None]
    assert not unmarked, f"blocks without a snippet, excerpt or output marker: {unmarked}"
    assert [(b.kind, b.name) for b in found] == [
        ("snippet", "images"),  # test_the_guide_commands_run_as_printed
        ("excerpt", "policy"),  # test_the_pages_excerpts_are_parts_of_the_files
        ("snippet", "check"),  # test_the_guide_commands_run_as_printed
        ("snippet", "deploy"),  # (the same)
        ("snippet", "workers-namespace"),  # (the same)
        ("excerpt", "worker-env"),  # test_the_pages_excerpts_are_parts_of_the_files
        ("snippet", "jobs"),  # test_k8s_local.py: the task module is the one the page prints
        ("snippet", "local"),  # test_k8s_local.py: the local command runs as printed
        ("output", "local-output"),  # (the same: what it printed)
    ]


def test_the_pages_excerpts_are_parts_of_the_files() -> None:
    """The policy the page shows is part of the overlay's policy, and the worker's environment
    it shows is the manifest's (the other way round: the test below)."""
    found = {b.name: b.code for b in blocks(PAGE.read_text()) if b.kind == "excerpt"}
    policy = yaml.safe_load(found["policy"])
    assert policy and contained(policy, yaml.safe_load((OVERLAY / "policy.yaml").read_text())), found["policy"]
    (worker,) = documents(OVERLAY / "worker.yaml")
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    manifest = {e["name"]: e.get("value") for e in container["env"]}
    shown = {e["name"]: e["value"] for e in yaml.safe_load(found["worker-env"])["env"]}
    assert shown and all(manifest.get(name) == value for name, value in shown.items()), (shown, manifest)


def test_kubectl_kustomize_builds_every_kustomization_under_deploy() -> None:
    folders = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
    assert BASE in folders and OVERLAY in folders, folders
    for folder in folders:
        manifests = list(kustomized(folder).values())
        assert len(manifests) > 8, folder
        for manifest in manifests:
            assert manifest["metadata"].get("namespace", "quota-proxy") == "quota-proxy", manifest["metadata"]
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    for manifest in documents(OVERLAY / "worker.yaml"):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_the_proxy_finds_the_ca_secret_where_the_policy_names_it() -> None:
    resources = kustomized(OVERLAY)
    deployment = resources[("Deployment", "quota-proxy")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = Path(container["command"][container["command"].index("-c") + 1])
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == config.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    files: dict[str, tuple[str, str]] = {}  # path in the folder -> (source, key)
    for source in volume["projected"]["sources"]:
        kind, ref = next(iter(source.items()))
        items = ref.get("items") or [{"key": config.name, "path": config.name}]
        files.update({item["path"]: (f"{kind}/{ref['name']}", item["key"]) for item in items})
    assert files[config.name] == ("configMap/quota-proxy-policy", "policy.yaml")
    text = resources[("ConfigMap", "quota-proxy-policy")]["data"]["policy.yaml"]
    assert text == (OVERLAY / "policy.yaml").read_text()
    tls = yaml.safe_load(text)["tls"]
    # A kubernetes.io/tls Secret (kubectl create secret tls) holds tls.crt and tls.key.
    assert files[tls["ca_cert"]] == ("secret/quota-proxy-ca", "tls.crt")
    assert files[tls["ca_key"]] == ("secret/quota-proxy-ca", "tls.key")
    images = {c["image"] for c in pod["containers"]}
    assert images == {f"quota-proxy:{proxy.__version__}"}, images  # the tag step 1 builds


def test_the_guide_commands_run_as_printed(tmp_path: Path) -> None:
    work = copy_of_the_repository(tmp_path)
    (build,) = snippet("images").splitlines()  # needs a registry: the tag is the overlay's
    assert f"docker build -t REGISTRY/quota-proxy:{proxy.__version__} . " in build
    assert (work / "Dockerfile").is_file()

    checked = run_shell(snippet("check"), work)
    assert checked.returncode == 0, checked.stderr
    assert "warning" not in checked.stderr  # under vendor_limit in every window
    assert "at most 100 requests in any 1s, per value of Authorization" in checked.stdout
    assert "HTTP/1.1 429 Too Many Requests" in checked.stdout  # --answers: Stripe's preset, a defer
    assert "Stripe-Should-Retry: true" in checked.stdout
    assert (work / "deploy/k8s/stripe/ca/ca.pem").is_file()
    assert "ca/" in (OVERLAY / ".gitignore").read_text().split(), "the CA key never goes to git"
    (vendor,) = load_policy(str(work / "deploy/k8s/stripe/policy.yaml")).vendors
    assert (vendor.name, vendor.connect, vendor.answers.name, vendor.hosts) == (
        "stripe",
        "intercept",
        "stripe",
        ("api.stripe.com",),
    )

    sent: dict[tuple[str, str], dict[str, Any]] = {}
    for line in [*snippet("deploy").splitlines(), *snippet("workers-namespace").splitlines()]:
        for obj in offline(line, work):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            sent[(obj["kind"], obj["metadata"]["name"])] = obj
    ca = sent[("Secret", "quota-proxy-ca")]
    assert ca["type"] == "kubernetes.io/tls" and ca["metadata"]["namespace"] == "quota-proxy"
    assert set(sent[("Secret", "quota-proxy-admin")]["data"]) == {"token"}
    assert sent[("Namespace", "jobs")]["metadata"]["labels"] == {"quota-proxy/client": "true"}
    worker = sent[("Deployment", "billing-worker")]
    assert worker["metadata"]["namespace"] == "jobs"
    # Everything the worker reads, the commands made, under the names and keys it reads.
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    for env in container["env"]:
        if ref := env.get("valueFrom", {}).get("secretKeyRef"):
            secret = sent[("Secret", ref["name"])]
            assert secret["metadata"]["namespace"] == "jobs" and ref["key"] in secret["data"], env
    broker = sent[("Secret", "celery-broker")]["data"]["url"]
    assert broker  # base64 of $CELERY_BROKER_URL
    for volume in worker["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in volume:
            made = sent[("ConfigMap", volume["configMap"]["name"])]
            assert made["metadata"]["namespace"] == "jobs" and "ca.pem" in made["data"]
            assert made["data"]["ca.pem"] == (work / "deploy/k8s/stripe/ca/ca.pem").read_text()
    network = "\n".join(yaml.safe_dump(d) for d in documents(BASE / "networkpolicy.yaml"))
    assert "quota-proxy/client" in network  # the label the proxy's NetworkPolicy admits


def test_the_worker_goes_through_the_proxy_service_and_trusts_the_bundle_its_init_container_writes() -> None:
    (worker,) = documents(OVERLAY / "worker.yaml")
    pod = worker["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    services = kustomized(OVERLAY)
    port = next(p["port"] for p in services[("Service", "quota-proxy")]["spec"]["ports"] if p["name"] == "proxy")
    address = f"http://quota-proxy.quota-proxy.svc:{port}"
    assert env["HTTPS_PROXY"] == env["https_proxy"] == address
    written = re.search(r"> (\S+)'?$", init["command"][-1])
    assert written is not None
    bundle = written.group(1).rstrip("'")
    assert env["REQUESTS_CA_BUNDLE"] == env["SSL_CERT_FILE"] == env["STRIPE_CA_BUNDLE"] == bundle
    assert "CELERY_BROKER_URL" in env  # Celery("jobs") takes its broker from it (the jobs snippet)
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    worker_mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert Path(bundle).parent == Path(init_mounts["bundle"]) == Path(worker_mounts["bundle"])
    assert f"{init_mounts['proxy-ca']}/ca.pem" in init["command"][-1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["proxy-ca"]["configMap"]["name"] == "quota-proxy-ca"
    page = PAGE.read_text()
    for name, value in env.items():  # the page shows the environment the manifest sets
        if value is not None:
            assert f"{name}, value: {value}" in page or f'{name}, value: "{value}"' in page, name
