"""The deploying pages' commands (docs/compose.md, kubernetes.md, sizing.md, alerts.md,
upgrades.md), run as printed where this machine has what they need, and checked against the
files they name where it does not (issue 36, item 4).

Every fenced ``sh`` block of these pages follows ``<!-- commands: NAME -->``; every line of it
is run or checked here, and a line this module does not know fails. What runs as printed:
``promtool`` (required: fails without it), ``kubectl kustomize`` (required), ``quota-proxy
check``, the ``python`` one-liner, ``export``, all from a copy of the repository. What cannot
run here (no container engine, no cluster, no registry) must say so next to it (``needs
Docker``, ``needs a cluster``, ``needs the stack``), and is checked as far as it goes offline:
``kubectl apply -k`` as ``kubectl kustomize``, ``create`` with ``--dry-run=client``, ``label
--local``; ``docker compose`` against compose.yaml (its file, profile, services, build context,
healthchecks); the Compose stack's ``curl`` lines against a stand-in of the stack (the real
mock vendor and two real ``quota-proxy run`` processes on the Compose policy, sharing a real
Redis), with only the host ports changed to free ones. The 2000-request load line is checked,
not run (2000 processes on the suite's two cores).
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import proxy
from tests.conftest import ROOT, RedisServer
from tests.helpers.cli import ProxyProcess, cli, server_process
from tests.helpers.vendor_process import vendor_process
from tests.sdk.test_k8s_guide import copy_of_the_repository, documents, kubectl, kustomized, run_shell
from tests.test_deploy import METRICS

DOCS = ROOT / "docs"
PAGES = [DOCS / f"{name}.md" for name in ("compose", "kubernetes", "sizing", "alerts", "upgrades")]
COMPOSE = ROOT / "deploy" / "compose.yaml"
COMPOSE_POLICY = ROOT / "deploy" / "compose" / "policy.yaml"
BASE = ROOT / "deploy" / "k8s" / "base"
TOKEN = "deploy-pages-admin-token"
_BLOCK = re.compile(
    r"(?:<!-- (?P<kind>commands|output): (?P<name>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```", re.S
)


@dataclass(frozen=True)
class Line:
    page: str
    block: str
    command: str
    note: str
    """Its trailing comment, and the comment lines just above it."""


def blocks(page: Path) -> list[re.Match[str]]:
    return list(_BLOCK.finditer(page.read_text()))


def lines() -> list[Line]:
    out: list[Line] = []
    for page in PAGES:
        for block in blocks(page):
            if block["lang"] != "sh":
                continue
            code = block["code"].replace("\\\n", " ")
            above: list[str] = []
            for raw in code.splitlines():
                if raw.lstrip().startswith("#"):
                    above.append(raw.lstrip("# "))
                    continue
                command, _, comment = raw.partition("  # ")
                out.append(Line(page.name, block["name"], command.strip(), " ".join([*above, comment])))
                above = []
    return out


def test_every_shell_block_on_the_deploying_pages_is_marked_and_named_once() -> None:
    names: list[str] = []
    for page in PAGES:
        for block in blocks(page):
            if block["lang"] == "sh":
                assert block["kind"] == "commands", f"{page.name}: a sh block without <!-- commands: NAME -->"
                names.append(block["name"])
    assert len(names) == len(set(names)) >= 10, names


KNOWN = {"export", "promtool", "quota-proxy", "python", "kubectl", "docker", "curl", "seq"}
"""The commands the tests below run or check: a line starting with another one fails."""


def test_every_command_says_what_it_needs_when_it_cannot_run_here() -> None:
    for line in lines():
        first = line.command.split()[0]
        assert first in KNOWN, f"{line.page}: the tests do not know how to run or check {line.command!r}"
        needs = {"docker": "needs Docker", "curl": "needs the stack", "seq": "needs the stack"}.get(first)
        if first == "kubectl" and line.command.split()[1:2] != ["kustomize"]:
            needs = "needs a cluster"
        if needs is not None:
            assert needs.lower() in line.note.lower(), f"{line.page}: {line.command!r} does not say {needs!r}"
        else:
            assert "needs" not in line.note, f"{line.page}: {line.command!r} runs here, yet says it needs something"


# -- what runs here, as printed ------------------------------------------------------------------


def test_the_commands_that_run_here_run_as_printed(tmp_path: Path) -> None:
    work = copy_of_the_repository(tmp_path)
    ran: set[str] = set()
    for line in lines():
        words = shlex.split(line.command)
        if words[0] == "export":
            name = words[1].split("=", 1)[0]
            done = run_shell(f'{line.command}\nprintf %s "${name}"', work)
            assert done.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}", done.stdout), (line, done.stderr)
        elif words[0] in ("promtool", "quota-proxy", "python") or words[:2] == ["kubectl", "kustomize"]:
            done = run_shell(line.command, work)
            assert done.returncode == 0, (line, done.stdout, done.stderr)
            if words[0] == "promtool":
                assert "SUCCESS" in done.stdout, done.stdout
            if words[0] == "quota-proxy":
                assert done.stdout.startswith("OK "), done.stdout
                _output_shown(line, done.stdout)
            if words[:2] == ["kubectl", "kustomize"]:
                kinds = {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}
                assert {"Deployment", "ConfigMap", "Service"} <= kinds, kinds
        else:
            continue
        ran.add(words[0] if words[0] != "kubectl" else "kubectl kustomize")
    assert ran == {"export", "promtool", "quota-proxy", "python", "kubectl kustomize"}, ran


def _output_shown(line: Line, stdout: str) -> None:
    """An ``<!-- output: NAME -->`` block shows lines of what its ``commands: NAME`` printed."""
    page = DOCS / line.page
    for block in blocks(page):
        if block["kind"] == "output" and block["name"] == line.block:
            missing = [s for s in block["code"].splitlines() if s not in stdout.splitlines()]
            assert not missing, f"{line.page}: {line.command} does not print {missing}"


# -- Kubernetes, offline -------------------------------------------------------------------------


def test_the_kubectl_lines_that_need_a_cluster_send_what_the_base_defines(tmp_path: Path) -> None:
    work = copy_of_the_repository(tmp_path)
    base = kustomized(work / "deploy" / "k8s" / "base")
    checked = 0
    for line in lines():
        words = shlex.split(line.command)
        if words[0] != "kubectl" or words[1] == "kustomize":
            continue
        checked += 1
        namespace = words[2] if words[1] == "-n" else None
        verb = words[3:] if namespace else words[1:]
        if namespace is not None:
            assert base[("Namespace", namespace)], line
        if verb[:2] == ["apply", "-k"]:
            assert kustomized(work / verb[2]), line
        elif verb[:2] == ["apply", "-f"]:
            assert documents(work / verb[2]), line
        elif verb[0] == "create":
            # What it would create, for real (offline); piped to apply, what that would send.
            made, _, then = line.command.partition(" | ")
            if "--dry-run=client" not in made:
                made += " --dry-run=client -o yaml"
            done = run_shell(made, work)
            assert done.returncode == 0, (line, done.stderr)
            secret = yaml.safe_load(done.stdout)
            assert secret["kind"] == "Secret" and secret["metadata"]["namespace"] == namespace
            assert then in ("", "kubectl apply -f -"), line
        elif verb[0] == "label":
            kind, name, label = verb[1:]
            (work / "ns.yaml").write_text(
                yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
            )
            labelled = yaml.safe_load(kubectl("label", "--local", "-f", "ns.yaml", label, "-o", "yaml", cwd=work))
            assert kind == "namespace" and labelled["metadata"]["labels"] == {"quota-proxy/client": "true"}
        elif verb[0] == "rollout":
            assert verb[1] in ("status", "restart", "undo"), line
            kind, name = verb[2].split("/")
            assert kind == "deploy" and base[("Deployment", name)]["metadata"]["namespace"] == namespace
        elif verb[0] == "port-forward":
            kind, name = verb[1].split("/")
            ports = [p["port"] for p in base[("Service", name)]["spec"]["ports"]]
            assert kind == "svc" and int(verb[2]) in ports, line
        else:
            raise AssertionError(f"{line.page}: the test does not know how to check {line.command!r}")
    assert checked >= 10


# -- Docker, offline -------------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def _proxies(compose: dict[str, Any]) -> set[str]:
    return {n for n, s in compose["services"].items() if any("compose/policy.yaml" in v for v in s.get("volumes", []))}


def test_the_docker_lines_name_what_compose_yaml_and_the_repository_have() -> None:
    compose = _compose()
    services = compose["services"]
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    version = proxy.__version__
    tags = {i["newTag"] for i in yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]}
    checked = 0
    for line in lines():
        if not line.command.startswith("docker "):
            continue
        for part in line.command.split(" && "):
            checked += 1
            words = shlex.split(part)
            if words[1] in ("build", "push"):
                assert words[-1 if words[1] == "push" else 3] == f"REGISTRY/quota-proxy:{version}" and tags == {version}
                assert words[1] == "push" or (words[2] == "-t" and (ROOT / words[4] / "Dockerfile").is_file())
                continue
            assert words[1:4] == ["compose", "-f", "deploy/compose.yaml"], line
            rest = words[4:]
            if rest[:1] == ["--profile"]:
                assert rest[1] in profiles, line
                rest = rest[2:]
            sub, args = rest[0], rest[1:]
            named = [a for a in args if not a.startswith("-") and a not in ("SIGHUP",)]
            assert set(named) <= set(services), line
            if sub == "kill":
                assert args[:2] == ["-s", "SIGHUP"] and set(named) == _proxies(compose), line  # what reloads
            elif sub in ("up", "build"):
                for name in named or [n for n, s in services.items() if "build" in s]:
                    build = services[name]["build"]
                    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve().is_file(), name
                if "--wait" in args:
                    assert all("healthcheck" in services[n] for n in named), line
                assert set(args) - set(named) <= {"--build", "-d", "--no-deps", "--wait"}, line
            else:
                assert sub == "stop" and not args, line
    assert checked >= 10


# -- the Compose stack's curl lines, against a stand-in of the stack ---------------------------------


@dataclass
class Stack:
    ports: dict[int, int]
    """Compose's published host port → the stand-in's."""
    proxies: list[ProxyProcess]


@pytest.fixture
def stack(tmp_path: Path, redis_server: RedisServer) -> Iterator[Stack]:
    """The Compose stack without Docker: the real mock vendor (100/s), two ``quota-proxy run``
    on compose/policy.yaml, changed only where Docker's names and ports stood."""
    compose = _compose()
    with vendor_process(tmp_path, "--rate", "100") as vendor:
        text = COMPOSE_POLICY.read_text()
        for real, stand_in in [
            ("listen: 0.0.0.0:8080", "listen: 127.0.0.1:0"),
            ("admin_listen: 0.0.0.0:9090", "admin_listen: 127.0.0.1:0"),
            ("url: redis://redis:6379/0", f"url: {redis_server.url}"),
            ("upstream: http://mock-vendor:8081", f"upstream: {vendor.url}"),
        ]:
            assert real in text, real
            text = text.replace(real, stand_in)
        policy = tmp_path / "policy.yaml"
        policy.write_text(text)
        env = {"QUOTA_PROXY_ADMIN_TOKEN": TOKEN}
        with (
            server_process(cli("run", "-c", str(policy)), tmp_path, env=env, name="proxy-1") as one,
            server_process(cli("run", "-c", str(policy)), tmp_path, env=env, name="proxy-2") as two,
        ):
            ports: dict[int, int] = {}
            for name, process in (("proxy-1", one), ("proxy-2", two)):
                ready = process.wait_ready()
                published = {int(p.split(":")[2]): int(p.split(":")[1]) for p in compose["services"][name]["ports"]}
                ports[published[8080]] = ready.port
                ports[published[9090]] = ready.admin_port
            mock_port = int(compose["services"]["mock-vendor"]["ports"][0].split(":")[1])
            ports[mock_port] = int(vendor.url.rsplit(":", 1)[1])
            yield Stack(ports, [one, two])
            for process in (one, two):
                assert process.terminate_and_wait() == 0


def test_the_curl_lines_run_against_a_stand_in_of_the_compose_stack(stack: Stack, tmp_path: Path) -> None:
    ran = 0
    for line in lines():
        if line.command.startswith("seq "):
            # Checked, not run: its replicas are the published proxy ports, its host the vendor's.
            inner = re.search(r"\$\(\( (\d+) \+ \{\} % 2 \* 2 \)\)", line.command)
            assert inner is not None and {int(inner[1]) + i % 2 * 2 for i in (0, 1)} <= set(stack.ports)
            assert "http://api.mock-vendor.example/v1/x" in line.command
            continue
        if not line.command.startswith("curl "):
            continue
        command = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{stack.ports[int(m[1])]}", line.command)
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            env={"PATH": "/usr/bin:/bin", "QUOTA_PROXY_ADMIN_TOKEN": TOKEN},  # no proxy variables but -x
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (line, done.stderr)
        out = done.stdout
        if "/status" in command:
            assert [v["name"] for v in json.loads(out)["vendors"]] == ["mock-vendor"]
            assert "sizing" in json.loads(out)["vendors"][0]
        elif "/reload" in command:
            assert json.loads(out)["result"] == "success", out
        elif "/__mock/stats" in command:
            assert json.loads(out)["rejected"] == 0, out
        elif "/metrics" in command:
            metric = re.search(r"grep '\^(\w+)'", command)
            assert metric is not None and metric[1] in METRICS and out.startswith(f"{metric[1]}{{")
        else:
            assert "ping" in command and out, (line, out)
        ran += 1
    assert ran >= 7
    # `docker compose kill -s SIGHUP proxy-1 proxy-2`, what it does to the replicas: each reloads.
    for process in stack.proxies:
        process.send_signal(signal.SIGHUP)
    for process in stack.proxies:
        _logged(process, "policy reloaded (SIGHUP)")


def _logged(process: ProxyProcess, text: str, within: float = 10.0) -> None:
    """Wait until the process's log (a file) has ``text``: polled, a condition, not a guess."""
    deadline = time.monotonic() + within
    while text not in process.stderr():
        assert process.proc.poll() is None, f"exited; stderr:\n{process.stderr()}"
        assert time.monotonic() < deadline, f"{text!r} not in the log within {within}s:\n{process.stderr()}"
        time.sleep(0.01)
