"""docs/guides/stripe-on-kubernetes.md, "Try it on your machine": ``deploy/k8s/stripe/local.py``
run as the page prints it, from a copy of the repository, with the real redis-server, celery,
Stripe's SDK and ``quota-proxy mock-vendor`` (without any of them the test fails, never skips):
every job succeeds through the proxy, the mock Stripe answers no 429, and every process the
command started is gone when it returns. Also: the worker runs the page's own task module, and
the policy it runs is the guide's with local.yaml's two changes only."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from proxy.devtools.mockvendor_tls import vendor_tls
from proxy.policy import load_policy
from tests.conftest import ProxyFactory
from tests.helpers.guide import GuideWorker, blocks, celery_driver, snippets
from tests.helpers.sdks import outcomes
from tests.helpers.vendor_process import vendor_process
from tests.sdk.test_k8s_guide import OVERLAY, PAGE, copy_of_the_repository, reader_shell, snippet

RUN_TIMEOUT = 240  # seconds: the command's own --timeout (120 s) plus starting and stopping


def local_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stripe_local", OVERLAY / "local.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_task_module_is_the_one_the_page_prints() -> None:
    assert (OVERLAY / "jobs.py").read_text() == snippet("jobs") + "\n"


def test_the_local_policy_is_the_guides_with_local_yamls_changes_only(tmp_path: Path) -> None:
    merged = local_module().laptop_policy(OVERLAY / "policy.yaml", OVERLAY / "local.yaml", 8443)
    (tmp_path / "policy.yaml").write_text(merged)
    vendor_tls(tmp_path / "ca")  # the CA `quota-proxy mock-vendor --tls ca` makes
    local, guide = yaml.safe_load(merged), yaml.safe_load((OVERLAY / "policy.yaml").read_text())
    assert local["tls"].pop("upstream_ca_file") == "ca/ca.pem" == local["tls"]["ca_cert"]
    assert local["vendors"][0].pop("upstream") == "https://127.0.0.1:8443"
    assert local == guide
    (vendor,) = load_policy(tmp_path / "policy.yaml").vendors
    assert (vendor.name, vendor.connect, vendor.hosts) == ("stripe", "intercept", ("api.stripe.com",))


def test_the_worker_environment_is_the_manifests_pointed_at_this_machine() -> None:
    (worker,) = [d for d in yaml.safe_load_all((OVERLAY / "worker.yaml").read_text()) if d]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    env = local_module().worker_environment(
        container["env"], proxy="http://127.0.0.1:1", bundle=Path("/b.pem"), broker="redis://127.0.0.1:2/1"
    )
    assert set(env) == {e["name"] for e in container["env"]}
    assert env["HTTPS_PROXY"] == env["https_proxy"] == "http://127.0.0.1:1"
    assert env["STRIPE_CA_BUNDLE"] == env["REQUESTS_CA_BUNDLE"] == env["SSL_CERT_FILE"] == "/b.pem"
    assert env["CELERY_BROKER_URL"] == "redis://127.0.0.1:2/1" and env["STRIPE_API_KEY"].startswith("sk_test_")
    assert "127.0.0.1" in env["NO_PROXY"].split(",")


def test_without_redis_server_the_command_says_so_and_starts_nothing(tmp_path: Path) -> None:
    work = copy_of_the_repository(tmp_path)
    env = {**reader_shell(work), "PATH": str(tmp_path / "empty")}  # quota-proxy is found beside python
    done = subprocess.run(
        [sys.executable, "deploy/k8s/stripe/local.py"], cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done
    assert (
        done.stderr
        == "local.py: redis-server is needed (Celery's broker): apt install redis-server, brew install redis\n"
    )
    assert not (work / "deploy" / "k8s" / "stripe" / ".local").exists()


@pytest.mark.long  # (asserts outcomes only: runs beside the timed tests)
def test_the_local_command_runs_as_printed(tmp_path: Path) -> None:
    assert shutil.which("redis-server"), "redis-server is required (Celery's broker): apt install redis-server"
    for module in ("celery", "stripe"):
        assert importlib.util.find_spec(module), f"{module} is required: pip install celery stripe"
    (line,) = snippet("local").splitlines()
    words = shlex.split(line)
    assert words[:2] == ["python", "deploy/k8s/stripe/local.py"], line
    jobs = int(words[words.index("--jobs") + 1])
    assert jobs > 100, "more than Stripe's 100 in a second, so the proxy has something to keep out"
    work = copy_of_the_repository(tmp_path)
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", line],
        cwd=work,
        env=reader_shell(work),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # local.py stops what it started, then exits
        out, err = process.communicate(timeout=90)
        pytest.fail(f"{line} did not finish within {RUN_TIMEOUT} s\n{out}\n{err}")
    run = work / "deploy" / "k8s" / "stripe" / ".local"
    logs = {p.name: p.read_text(errors="replace")[-3000:] for p in run.glob("*.log")} if run.is_dir() else {}
    assert process.returncode == 0, f"exit {process.returncode}\n{out}\n{err}\n{json.dumps(logs, indent=1)}"

    done = re.search(r"^jobs: (\d+) of (\d+) succeeded", out, re.M)
    assert done is not None and done.groups() == (str(jobs), str(jobs)), out
    proxy = re.search(r"^quota-proxy \(policy\.yaml \+ local\.yaml\): (.*)$", out, re.M)
    assert proxy is not None, out
    outcomes = dict(re.findall(r"(\w+) (\d+)", proxy[1]))
    assert outcomes["forwarded"] == str(jobs), out  # one call per job reached Stripe
    assert set(outcomes) <= {"forwarded", "deferred"}, out  # nothing shed, no error
    vendor = re.search(
        r"^mock Stripe .*: (\d+) requests answered, (\d+) answered 429; the most in any 1s: (\d+)$", out, re.M
    )
    assert vendor is not None, out
    assert (int(vendor[1]), int(vendor[2])) == (jobs, 0), out
    assert int(vendor[3]) <= 100, out
    # What the page says it prints, its figures aside.
    printed = next(b.code for b in blocks(PAGE.read_text()) if b.kind == "output" and b.name == "local-output")
    for line in printed.splitlines():
        parts = re.split(r"(\d+(?:\.\d+)?)", line)
        shape = "".join(re.escape(p) if i % 2 == 0 else r"\d+(?:\.\d+)?" for i, p in enumerate(parts))
        assert re.search(f"^{shape}$", out, re.M), f"the page says it prints {line!r}:\n{out}"

    # Through the proxy, intercepted: the proxy's access log has each call the vendor answered.
    access = [json.loads(x) for x in (run / "quota-proxy.log").read_text().splitlines() if x.startswith("{")]
    assert {a["host"] for a in access if a["method"] == "CONNECT"} == {"api.stripe.com:443"}
    forwarded = [a for a in access if a["outcome"] == "forwarded" and a["method"] != "CONNECT"]
    assert len(forwarded) == jobs, len(forwarded)
    assert {(a["host"], a["path"], a["upstream_status"]) for a in forwarded} == {
        ("api.stripe.com", "/v1/customers", 200)
    }
    assert (run / "worker.log").read_text().count("succeeded in") == jobs

    started = [int(pid) for pid in re.findall(r"^  started .* pid (\d+)", out, re.M)]
    stopped = [int(pid) for pid in re.findall(r"^  stopped .* pid (\d+)", out, re.M)]
    assert len(started) == 4 and sorted(stopped) == sorted(started), out
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "local.py" in PAGE.read_text()


async def test_the_workers_task_creates_a_customer_and_re_enqueues_a_long_defer(
    tmp_path: Path, start_proxy: ProxyFactory
) -> None:
    """The page's task module as the worker runs it (Celery's request, Stripe's SDK, the
    bundle the clients guide's snippet makes), through a proxy on the guide's policy as
    local.py runs it (local.yaml's changes) to ``quota-proxy mock-vendor --tls ca``: one call
    an hour per key, so the first creates a customer and the second, deferred beyond
    ``answers_max_wait``, is re-enqueued with the wait the proxy gave."""
    work = tmp_path / "reader"
    work.mkdir()
    with vendor_process(tmp_path, ca_dir=Path("ca"), cwd=work) as vendor:
        port = int(vendor.url.rsplit(":", 1)[1])
        text = local_module().laptop_policy(OVERLAY / "policy.yaml", OVERLAY / "local.yaml", port)
        policy = yaml.safe_load(text)
        policy["listen"] = policy["admin_listen"] = "127.0.0.1:0"
        policy["store"]["url"] = "memory://"
        (stripe,) = policy["vendors"]
        assert stripe["limits"] == [{"rate": 90, "per": "1s", "burst": 10}], stripe["limits"]
        stripe["limits"] = [{"rate": 1, "per": "1h", "burst": 1}]  # one call an hour per key
        text = yaml.safe_dump(policy, sort_keys=False)
        (work / "policy.yaml").write_text(text)
        proxy = await start_proxy(load_policy(work / "policy.yaml"))
        worker = GuideWorker(work)
        made = await worker.run(snippets()["bundle"].code, "sh", "http://127.0.0.1:9")
        assert made.status == 0, made.err
        ran = await worker.run(
            snippet("jobs"),
            "python",
            proxy.url,
            driver=celery_driver("create_customer", "first@example.com", "second@example.com"),
            env={"STRIPE_CA_BUNDLE": str(worker.etc / "bundle.pem")},
        )
    assert ran.status == 0, ran.err
    first, second = ran.out.splitlines()
    assert first.startswith("result: cus_")
    assert second.startswith("re-enqueued, countdown: ")
    assert 3000 < float(second.split()[-1]) <= 3600 * 1.2 + 1  # Retry-After plus up to 20 %
    assert outcomes(proxy, "stripe") == {"forwarded": 1, "deferred": 1}
