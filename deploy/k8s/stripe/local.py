"""The Kubernetes guide's Celery worker on one machine, against a mock Stripe, in one command.

    python deploy/k8s/stripe/local.py [--jobs N] [--timeout SECONDS]

docs/guides/stripe-on-kubernetes.md, "Try it on your machine". From a clone with quota-proxy,
celery and stripe installed (``pip install . celery stripe``) and ``redis-server`` on the PATH,
it starts, on free ports of 127.0.0.1 and with its files in ``deploy/k8s/stripe/.local/``:

1. ``redis-server``: Celery's broker (db 1) and results (db 2), and the proxy's buckets (db 0),
   as the guide's Redis is for its replicas;
2. ``quota-proxy mock-vendor --tls ca --rate 100 --window 1s``: Stripe, answering
   ``/v1/customers`` as Stripe does, at most 100 requests in any second (429 beyond), over
   HTTPS with certificates from the CA it makes in ``ca/``;
3. ``quota-proxy run`` on the guide's policy (``policy.yaml``) with ``local.yaml`` merged in: the
   upstream is the mock vendor, which the proxy trusts through the same CA; nothing else changes;
4. the worker of ``worker.yaml``: its command (``celery -A jobs worker --concurrency 8``) on the
   same task module (``jobs.py``), its environment with the local proxy, bundle and broker;

then enqueues ``--jobs`` calls of ``jobs.create_customer``, waits for them (``--timeout``), prints
what the proxy forwarded and deferred and what the mock vendor saw, and stops what it started,
by PID, on exit, on Ctrl-C and on SIGTERM. Exit 0: every job succeeded and the mock vendor
answered no 429; 1 otherwise; 2 when something it needs is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUN = HERE / ".local"
JOB = "jobs.create_customer"
API_KEY = "sk_test_local"  # the mock vendor takes any key
VENDOR_QUOTA = ["--rate", "100", "--window", "1s"]  # Stripe's 100 requests in any second
STARTUP = 30.0  # seconds each process has to be ready
STOP = 20.0  # seconds each process has to exit after SIGTERM (the proxy drains), then SIGKILL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="how many jobs to enqueue (default 200)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds to wait for the jobs (default 120)")
    args = parser.parse_args(argv)
    missing = _missing()
    if missing:
        for line in missing:
            print(f"local.py: {line}", file=sys.stderr)
        return 2
    # Ctrl-C reaches this process alone (each child has a session of its own); SIGTERM too.
    # Both explicitly: a shell that starts a command in the background has it ignore SIGINT.
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    with _processes() as start:
        try:
            return _run(start, args.jobs, args.timeout)
        except KeyboardInterrupt:
            print("\ninterrupted: stopping what local.py started", file=sys.stderr)
            return 130


def _missing() -> list[str]:
    """What the reader must install first, every item at once."""
    problems = []
    if _tool("redis-server") is None:
        problems.append("redis-server is needed (Celery's broker): apt install redis-server, brew install redis")
    if _tool("quota-proxy") is None:
        problems.append("quota-proxy is needed: pip install . (from the repository's root)")
    for module in ("celery", "stripe", "certifi", "yaml"):
        try:
            __import__(module)
        except ImportError:
            problems.append(f"the Python module {module} is needed: pip install . celery stripe")
    return problems


def _tool(name: str) -> str | None:
    """An executable of this Python's environment (an unactivated venv), else of the PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# -- the run ---------------------------------------------------------------------------------------


def _run(start: Callable[..., subprocess.Popen[bytes]], jobs: int, timeout: float) -> int:
    import yaml

    shutil.rmtree(RUN, ignore_errors=True)
    RUN.mkdir(parents=True)
    redis_port, vendor_port, proxy_port, admin_port = _free_ports(4)
    redis = f"redis://127.0.0.1:{redis_port}"
    print(f"local.py: the guide's Celery worker against a mock Stripe, on 127.0.0.1; files in {_shown(RUN)}/")

    no_disk = ["--save", "", "--appendonly", "no", "--dir", str(RUN)]
    start("redis-server", [_tool("redis-server"), "--port", str(redis_port), "--bind", "127.0.0.1", *no_disk])
    _wait_until("redis-server", lambda: _redis_ping(redis_port))

    ca = RUN / "ca"
    vendor = f"https://127.0.0.1:{vendor_port}"
    start(
        "mock Stripe",
        [_tool("quota-proxy"), "mock-vendor", "--tls", "ca", "--listen", f"127.0.0.1:{vendor_port}", *VENDOR_QUOTA],
        log="mock-vendor.log",
    )
    _wait_until("the mock vendor's CA", lambda: (ca / "ca.pem").is_file())
    trust = ssl.create_default_context(cafile=str(ca / "ca.pem"))
    _wait_until("mock Stripe", lambda: _get(f"{vendor}/__mock/stats", trust) is not None)

    policy = RUN / "policy.yaml"
    policy.write_text(laptop_policy(HERE / "policy.yaml", HERE / "local.yaml", vendor_port))
    proxy, admin = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}"
    start(
        "quota-proxy",
        [
            _tool("quota-proxy"),
            "run",
            "-c",
            "policy.yaml",
            "--listen",
            f"127.0.0.1:{proxy_port}",
            "--admin-listen",
            f"127.0.0.1:{admin_port}",
            "--store",
            f"{redis}/0",
        ],
    )
    _wait_until("quota-proxy", lambda: _get(f"{admin}/readyz") is not None)

    import certifi

    bundle = ca / "bundle.pem"  # what worker.yaml's init container writes: the public CAs plus the proxy's
    bundle.write_text(Path(certifi.where()).read_text() + (ca / "ca.pem").read_text())
    (worker,) = [d for d in yaml.safe_load_all((HERE / "worker.yaml").read_text()) if d]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:1] == ["celery"], command
    env = worker_environment(container["env"], proxy=proxy, bundle=bundle, broker=f"{redis}/1")
    env["CELERY_RESULT_BACKEND"] = f"{redis}/2"  # for local.py to read the jobs' results
    start(
        "celery worker",
        [sys.executable, "-m", "celery", *command[1:], "--loglevel", "INFO"],
        env={**os.environ, **env, "PYTHONPATH": str(HERE)},
        log="worker.log",
    )

    from celery import Celery

    # Celery prefers CELERY_BROKER_URL and CELERY_RESULT_BACKEND to its arguments: the reader's
    # (the guide's step 4 has one) would win over the local broker.
    os.environ.update(CELERY_BROKER_URL=env["CELERY_BROKER_URL"], CELERY_RESULT_BACKEND=env["CELERY_RESULT_BACKEND"])
    client = Celery("local", broker=f"{redis}/1", backend=f"{redis}/2")
    _wait_until("the celery worker", lambda: bool(client.control.ping(timeout=0.5)), within=60)

    began = time.monotonic()
    print(f"enqueueing {jobs} jobs: {JOB}('customer-N@example.com')")
    results = [client.send_task(JOB, args=[f"customer-{n}@example.com"]) for n in range(jobs)]
    states = _wait_for(results, began + timeout)
    took = time.monotonic() - began
    return _report(states, took, admin, _get(f"{vendor}/__mock/stats", trust))


def laptop_policy(policy: Path, overlay: Path, vendor_port: int) -> str:
    """``policy`` with ``overlay`` merged in (mappings key by key, ``vendors`` by name), as YAML."""
    import yaml

    base = yaml.safe_load(policy.read_text())
    changes = yaml.safe_load(overlay.read_text().replace("{mock_vendor_port}", str(vendor_port)))
    merged = _merge(base, changes, "")
    header = f"# {_shown(policy)} with {_shown(overlay)} merged in, by local.py: the policy it runs\n"
    return header + yaml.safe_dump(merged, sort_keys=False)


def _merge(base: Any, changes: Any, path: str) -> Any:
    if isinstance(base, dict) and isinstance(changes, dict):
        return {**base, **{k: _merge(base.get(k), v, f"{path}.{k}".lstrip(".")) for k, v in changes.items()}}
    if path == "vendors":
        named = {v["name"]: v for v in base}
        unknown = [c["name"] for c in changes if c["name"] not in named]
        if unknown:
            raise SystemExit(f"local.yaml: vendors {unknown} are not in policy.yaml")
        by_name = {c["name"]: c for c in changes}
        return [_merge(v, by_name.get(v["name"], {}), f"vendors[{v['name']}]") for v in base]
    return changes


def worker_environment(entries: list[dict[str, Any]], *, proxy: str, bundle: Path, broker: str) -> dict[str, str]:
    """worker.yaml's environment with this machine's values: the local proxy for the proxy's
    Service, the local bundle for /etc/quota-proxy/bundle.pem, no proxy for 127.0.0.1 (the
    broker), and for the two Secrets a test key and the local broker."""
    secrets = {"stripe": API_KEY, "celery-broker": broker}
    env = {}
    for entry in entries:
        if "valueFrom" in entry:
            env[entry["name"]] = secrets[entry["valueFrom"]["secretKeyRef"]["name"]]
            continue
        value = re.sub(r"^http://quota-proxy\.quota-proxy\.svc:\d+$", proxy, entry["value"])
        value = value.replace("/etc/quota-proxy/bundle.pem", str(bundle))
        env[entry["name"]] = "localhost,127.0.0.1" if entry["name"].lower() == "no_proxy" else value
    return env


def _wait_for(results: list[Any], deadline: float) -> dict[str, str]:
    """Each job's final state (SUCCESS, FAILURE) by id, or PENDING/RETRY at the deadline. Polled
    (one GET a job) rather than ``get()``: the result store's subscriptions would outlive the
    redis-server local.py stops."""
    states = {result.id: "PENDING" for result in results}
    waiting = list(results)
    while waiting and time.monotonic() < deadline:
        for result in waiting:
            states[result.id] = result.state
        waiting = [r for r in waiting if states[r.id] not in ("SUCCESS", "FAILURE", "REVOKED")]
        time.sleep(0.2)
    return states


def _report(states: dict[str, str], took: float, admin: str, vendor: dict[str, Any] | None) -> int:
    done = sum(state == "SUCCESS" for state in states.values())
    log = (RUN / "worker.log").read_text(errors="replace")
    retried = len(re.findall(r"\] retry: ", log))
    print(f"jobs: {done} of {len(states)} succeeded in {took:.1f} s; {retried} re-enqueued by the task after a defer")
    outcomes = _outcomes(_get(f"{admin}/metrics") or "")
    shown = ", ".join(f"{k} {v:g}" for k, v in outcomes.items()) or "nothing"
    print(f"quota-proxy (policy.yaml + local.yaml): {shown}")
    rejected = -1
    if vendor is not None:
        rejected = vendor["rejected"]
        print(
            f"mock Stripe (at most {vendor['window_limit']} in any 1s): {vendor['accepted']} requests answered, "
            f"{rejected} answered 429; the most in any 1s: {vendor['window_max']}"
        )
    ok = done == len(states) and rejected == 0
    if not ok:
        print(f"local.py: not every job succeeded within Stripe's limit: see {_shown(RUN)}/*.log", file=sys.stderr)
    return 0 if ok else 1


def _outcomes(metrics: str) -> dict[str, float]:
    """``ratelimit_requests_total`` of the stripe vendor by outcome, zeros left out."""
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(r"ratelimit_requests_total\{(.*)\} (\S+)$", line)
        if m and 'limiter="stripe"' in m[1] and float(m[2]):
            (outcome,) = re.findall(r'outcome="(\w+)"', m[1])
            counts[outcome] = counts.get(outcome, 0) + float(m[2])
    return counts


# -- processes -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``start(name, argv, env=None, log=None)`` runs ``argv`` from .local/, its output in
    .local/<log>; on leaving, each process started is stopped, the last started first."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(
        name: str, argv: list[str | None], env: dict[str, str] | None = None, log: str | None = None
    ) -> subprocess.Popen[bytes]:
        out = (RUN / (log or f"{name.replace(' ', '-')}.log")).open("wb")
        process = subprocess.Popen(
            [str(a) for a in argv],
            cwd=RUN,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        out.close()
        started.append((name, process))
        print(f"  started {name:<14} pid {process.pid:<7} {' '.join(_shown(a) for a in argv[:3])} ...")
        return process

    try:
        yield start
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not leave processes behind
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for name, process in reversed(started):
            _stop(name, process)


def _stop(name: str, process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its group: the worker's pool processes too
            process.wait()
    print(f"  stopped {name:<14} pid {process.pid}")


def _wait_until(what: str, ready: Callable[[], bool], within: float = STARTUP) -> None:
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(OSError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise SystemExit(f"local.py: {what} was not ready within {within:g} s: see {_shown(RUN)}/*.log")
        time.sleep(0.1)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")


def _get(url: str, context: ssl.SSLContext | None = None) -> Any:
    """The body of a 200 (JSON decoded if it is JSON), or None."""
    # No proxy from the environment: these are local.py's own calls to 127.0.0.1.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=5) as response:
            body = response.read().decode()
    except OSError:
        return None
    return json.loads(body) if body.startswith("{") else body


def _shown(path: Any) -> str:
    """A path relative to the working directory when it is under it."""
    text = str(path)
    with contextlib.suppress(ValueError):
        return str(Path(text).relative_to(Path.cwd()))
    return text


if __name__ == "__main__":
    sys.exit(main())
