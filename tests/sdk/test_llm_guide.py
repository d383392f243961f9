"""docs/guides/llm-tokens.md, run as printed: ``quota-proxy check`` on the guide's policy, the
mock vendor and the proxy started with the page's own command lines, then the page's worker
block (the real ``openai`` and ``anthropic`` SDKs, streamed and not, as examples/llm/ has
them) and its two ``curl`` lines, from a copy of the repository in a shell whose PATH has
this checkout's ``quota-proxy`` and ``python``. As the other guides' tests do, the one change
is the addresses: free ports instead of 127.0.0.1:8080, 8081 and 9090, in the commands and in
the copy of the policy (so that tests may run side by side).

Checked: every call succeeded with no vendor 429, while the tokens set the pace (the proxy
held calls for their tokens, and the tokens came no faster than the meter allows); at the
mock vendor, no window refused a call or held more than its limit; every forwarded call's
access-log line carries its meters, settled to what the worker was told it used; the metrics
say the same. The page's policy block is examples/llm/policy.yaml, its Python blocks are the
examples' code, its sample outputs have the shape of the real ones, and its step 5 policy
(the real vendor, which cannot run here) passes ``quota-proxy check``.

Every fenced block of the page follows ``<!-- snippet: NAME -->`` (run or compared) or
``<!-- output: NAME -->`` (what a snippet prints); a block without a marker, or a name this
module does not test, fails. Nothing here skips: a missing ``curl``, SDK or example fails.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from proxy.policy import load_policy
from proxy.policy.model import Limit
from tests.helpers.cli import ROOT, ProxyProcess, clean_env, server_process

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # meets a strict token window: run apart from the other timed tests

PAGE = ROOT / "docs" / "guides" / "llm-tokens.md"
EXAMPLES = ROOT / "examples" / "llm"
POLICY = EXAMPLES / "policy.yaml"
PROXY_URL = "http://127.0.0.1:8080"
VENDOR_URL = "http://127.0.0.1:8081"
ADMIN_URL = "http://127.0.0.1:9090"
"""The addresses the page prints (the policy's listen and admin_listen, the mock vendor's)."""

SNIPPETS = {
    "policy",
    "check",
    "mock-vendor",
    "proxy",
    "openai-pool",
    "openai-call",
    "anthropic-call",
    "workers",
    "stats",
    "metrics",
    "real-openai",
}
OUTPUTS = {"check", "workers", "stats", "access-log", "metrics"}
_BLOCK = re.compile(
    r"(?:<!-- (?P<kind>snippet|output): (?P<name>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```", re.S
)
SUMMARIES = {
    "openai": re.compile(
        r"openai: (?P<ok>\d+) of (?P<calls>\d+) calls succeeded in (?P<s>[\d.]+) s, (?P<tokens>\d+) tokens "
        r"\(\d+/s\); 429s: (?P<vendor>\d+) from the vendor, (?P<proxy>\d+) from the proxy"
    ),
    "anthropic": re.compile(
        r"anthropic: (?P<ok>\d+) of (?P<calls>\d+) calls succeeded in (?P<s>[\d.]+) s, (?P<input>\d+) input tokens "
        r"\(\d+/s\), (?P<output>\d+) output tokens; "
        r"429s: (?P<vendor>\d+) from the vendor, (?P<proxy>\d+) from the proxy"
    ),
}
"""The one line each worker prints at the end."""
_METRIC = re.compile(r"(?P<series>ratelimit_meter_\w+_total\{[^}]*\}) (?P<value>[\d.e+]+)")


def blocks() -> list[re.Match[str]]:
    return list(_BLOCK.finditer(PAGE.read_text()))


def block(kind: str, name: str) -> str:
    (found,) = [b["code"] for b in blocks() if (b["kind"], b["name"]) == (kind, name)]
    return found


def command_lines(name: str) -> list[str]:
    """A shell snippet's commands, a backslash-continued line joined as the shell joins it."""
    return [line.strip() for line in block("snippet", name).replace("\\\n", " ").splitlines() if line.strip()]


def reader_env() -> dict[str, str]:
    """A reader's shell: this checkout's quota-proxy and python first on PATH, no keys or proxy
    variables of the test's own environment, nothing imported from the checkout by path."""
    env = clean_env(checkout=False)
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"):
        env.pop(name, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def shell(code: str, work: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` run by bash from ``work`` in the reader's shell, in a session of its own: what it
    started (a worker under bash) is stopped with it if it outlives ``timeout``."""
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=work,
        env=reader_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s: {code}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # its session: bash and what it started
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def copy_of_the_repository(tmp_path: Path) -> Path:
    """What the guide's commands read (examples/llm/), where a reader runs them from."""
    work = tmp_path / "repo"
    shutil.copytree(EXAMPLES, work / "examples" / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    return work


def replaced(text: str, old: str, new: str, count: int = 1) -> str:
    assert text.count(old) == count, (old, text)
    return text.replace(old, new)


def per_second(limit: Limit) -> float:
    return limit.rate / limit.per


# -- the page and the files it shows ------------------------------------------------------------


def test_every_block_is_marked_and_tested() -> None:
    found: dict[str, list[str]] = {"snippet": [], "output": []}
    for b in blocks():
        assert b["kind"] is not None, f"a block without <!-- snippet: NAME --> or <!-- output: NAME -->:\n{b['code']}"
        found[b["kind"]].append(b["name"])
    assert sorted(found["snippet"]) == sorted(SNIPPETS), found["snippet"]
    assert sorted(found["output"]) == sorted(OUTPUTS), found["output"]
    text = PAGE.read_text()
    assert "tests/sdk/test_llm_guide.py" in text
    assert "the tests do not run it" in text  # step 5, next to its policy


def test_the_policy_on_the_page_is_the_file() -> None:
    assert block("snippet", "policy") + "\n" == POLICY.read_text()


def test_the_code_on_the_page_is_the_examples_code() -> None:
    worker = (EXAMPLES / "worker.py").read_text()
    anthropic_worker = (EXAMPLES / "anthropic_worker.py").read_text()
    for name, source in (("openai-pool", worker), ("openai-call", worker), ("anthropic-call", anthropic_worker)):
        code = block("snippet", name)
        assert code.startswith("async def "), name
        assert f"\n{code}\n\n\n" in source, f"{name}: not a whole function of the example as it is"
    assert 'stream_options={"include_usage": True}' in block("snippet", "openai-call")
    assert "messages.stream(" in block("snippet", "anthropic-call")


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"llm_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_costliest_call_fits_every_burst() -> None:
    """The page's arithmetic: no call of the workers is estimated above what a meter can hold."""
    worker, anthropic_worker = example("worker"), example("anthropic_worker")
    assert worker.WORDS == anthropic_worker.WORDS  # the same calls
    longest = len("Summarise in one line: ") + 150 * max(map(len, worker.WORDS)) + 149
    assert longest == 1072 and math.ceil(longest / 4) + 200 == 468  # what the page says
    for i in range(2000):
        assert worker.job(i) == anthropic_worker.job(i)
        prompt, max_tokens, _ = worker.job(i)
        assert len(prompt) <= longest and 50 <= max_tokens <= 200
    costliest = {("openai", "tokens"): 468, ("anthropic", "input_tokens"): 268, ("anthropic", "output_tokens"): 200}
    for vendor in load_policy(str(POLICY)).vendors:
        for meter in vendor.meters:
            burst = min(limit.burst for limit in meter.limits)
            assert burst >= costliest[vendor.name, meter.name], (vendor.name, meter.name, burst)


def test_the_real_vendor_policy_passes_check(tmp_path: Path) -> None:
    """Step 5 cannot run here (a real key, the real vendor): its vendor, put in place of the
    guide's, makes a policy ``quota-proxy check`` passes without a warning."""
    text = POLICY.read_text()
    start, end = text.index("  - name: openai\n"), text.index("\n  - name: anthropic\n")
    real = block("snippet", "real-openai")
    assert "upstream: https://api.openai.com" in real and "partition: {header: Authorization}" in real
    (tmp_path / "policy.yaml").write_text(text[:start] + real + "\n" + text[end:])
    done = shell("quota-proxy check -c policy.yaml", tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "tokens: 180000/1m burst 20000" in done.stdout
    assert "at most 200000 tokens in any 1m, per value of Authorization" in done.stdout
    assert "at most 500 requests in any 1m" in done.stdout


# -- the guide, run -----------------------------------------------------------------------------


def vendor_started(process: ProxyProcess) -> str:
    """The mock vendor's URL, from its ready line."""
    line = process.readline()
    found = re.match(r"mock-vendor listening on (http://127\.0\.0\.1:\d+) ", line)
    assert found, line
    return found[1]


def test_the_guide_runs_as_printed(tmp_path: Path) -> None:
    assert shutil.which("curl"), "curl is required (the guide's step 4)"
    work = copy_of_the_repository(tmp_path)
    env = reader_env()

    # Step 1: check, as printed, on the policy as it is.
    (check,) = command_lines("check")
    checked = shell(check, work)
    assert checked.returncode == 0 and checked.stderr == "", checked.stderr  # no warning
    shown = block("output", "check").splitlines()
    assert [line for line in shown if line not in checked.stdout.splitlines()] == [], checked.stdout

    # Step 2: the mock vendor and the proxy, with the page's command lines, on free ports.
    (mock_line,) = command_lines("mock-vendor")
    mock_line = replaced(mock_line, f"--listen {VENDOR_URL.removeprefix('http://')}", "--listen 127.0.0.1:0")
    (proxy_line,) = command_lines("proxy")
    assert shlex.split(proxy_line) == ["quota-proxy", "run", "-c", "examples/llm/policy.yaml"]
    policy = work / "examples" / "llm" / "policy.yaml"
    with server_process(["bash", "-c", f"exec {mock_line}"], tmp_path, env=env, cwd=work, name="mock-vendor") as mock:
        vendor_url = vendor_started(mock)
        text = policy.read_text()
        text = replaced(text, f"listen: {PROXY_URL.removeprefix('http://')}", "listen: 127.0.0.1:0")
        text = replaced(text, f"admin_listen: {ADMIN_URL.removeprefix('http://')}", "admin_listen: 127.0.0.1:0")
        policy.write_text(replaced(text, f"upstream: {VENDOR_URL}", f"upstream: {vendor_url}", count=2))
        with server_process(["bash", "-c", f"exec {proxy_line}"], tmp_path, env=env, cwd=work) as proxy:
            ready = proxy.wait_ready()
            proxy_url, admin_url = ready.url, ready.admin_url

            # Step 3: the keys and both pools, as one shell runs them.
            workers = block("snippet", "workers").replace(PROXY_URL, proxy_url)
            assert workers.count(proxy_url) == 2
            ran = shell(workers, work, timeout=120)
            assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}\n{proxy.stderr()[-3000:]}"
            # Step 4: what the mock vendor counted, and the proxy's metrics.
            (stats_line,) = command_lines("stats")
            stats = shell(replaced(stats_line, VENDOR_URL, vendor_url), work)
            assert stats.returncode == 0, stats.stderr
            (metrics_line,) = command_lines("metrics")
            metrics = shell(replaced(metrics_line, ADMIN_URL, admin_url), work)
            assert metrics.returncode == 0, metrics.stderr
            assert proxy.terminate_and_wait() == 0  # flushes the access log
            log = proxy.stderr()
        assert mock.terminate_and_wait() == 0
    for process in (proxy, mock):  # stopped by PID, and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid, 0)

    summaries = the_summaries(ran.stdout, block("snippet", "workers"))
    access = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    the_pace_was_the_tokens(summaries, access)
    the_vendor_was_never_overrun(json.loads(stats.stdout))
    every_call_was_settled(access, summaries)
    the_metrics_say_the_same(metrics.stdout, summaries)


def the_summaries(out: str, printed: str) -> dict[str, dict[str, int]]:
    """Each worker's summary line: every call of the printed ``--calls`` succeeded, no vendor
    429. The page's sample lines have the same shape."""
    calls: dict[str, int] = {}
    for line in printed.splitlines():
        words = shlex.split(line)
        if words[0] == "python":  # python examples/llm/NAME.py --calls N ...
            calls[{"worker.py": "openai", "anthropic_worker.py": "anthropic"}[Path(words[1]).name]] = int(
                words[words.index("--calls") + 1]
            )
    sample = block("output", "workers").splitlines()
    assert len(sample) == len(SUMMARIES)
    summaries: dict[str, dict[str, int]] = {}
    for name, pattern in SUMMARIES.items():
        assert [x for x in sample if pattern.fullmatch(x)], f"the page's sample has no {name} line"
        found = [m for m in map(pattern.fullmatch, out.splitlines()) if m]
        assert len(found) == 1, f"no {name} summary in:\n{out}"
        summary = {k: round(float(v) * 1000) if k == "s" else int(v) for k, v in found[0].groupdict().items()}
        assert summary["ok"] == summary["calls"] == calls[name], found[0][0]
        assert summary["vendor"] == 0, found[0][0]  # not one 429 from the vendor
        summaries[name] = summary
    return summaries


def the_pace_was_the_tokens(summaries: dict[str, dict[str, int]], access: list[dict[str, Any]]) -> None:
    """The meters bound: the proxy held calls for their tokens, and the tokens came no faster
    than the meter lets through in the run's time (its burst, then its rate)."""
    vendors = {v.name: v for v in load_policy(str(POLICY)).vendors}
    (tokens,) = vendors["openai"].meters[0].limits
    (inputs,) = vendors["anthropic"].meters[0].limits
    for name, used, limit in (
        ("openai", summaries["openai"]["tokens"], tokens),
        ("anthropic", summaries["anthropic"]["input"], inputs),
    ):
        held = [line for line in access if line["vendor"] == name and line["outcome"] == "held"]
        assert held and all(line["hold_ms"] > 0 for line in held), name  # waited for tokens
        seconds = summaries[name]["s"] / 1000 + 0.05  # the summary's rounding
        assert used <= limit.burst + per_second(limit) * seconds, (name, used, seconds)


def the_vendor_was_never_overrun(windows: dict[str, Any]) -> None:
    """At the mock vendor: no token window refused a call or held more than its limit, and the
    policy's meters fit the mock's windows as the page computes (rate x window + burst)."""
    meters = {(v.name, m.name): m for v in load_policy(str(POLICY)).vendors for m in v.meters}
    counted = {(v, c): w for v, currencies in windows.items() for c, w in currencies.items()}
    assert set(counted) == set(meters), counted
    sample = json.loads(block("output", "stats"))
    for key, window in counted.items():
        assert window["rejected"] == 0, (key, window)
        assert window["tokens_accepted"] > 0, (key, window)
        assert window["tokens_window_max"] <= window["limit"], (key, window)
        (limit,) = meters[key].limits
        assert per_second(limit) * window["window"] + limit.burst < window["limit"], (key, limit, window)
        shown = sample[key[0]][key[1]]
        assert set(shown) == set(window), shown
        for field in ("per_minute", "window", "limit", "rejected"):
            assert shown[field] == window[field], (key, field)
        assert shown["tokens_window_max"] <= shown["limit"]


def every_call_was_settled(access: list[dict[str, Any]], summaries: dict[str, dict[str, int]]) -> None:
    """Every forwarded call's access-log line (held first or not) has its meters, settled; a
    deferred one (a wait past max_hold) took nothing; the settled amounts add up to what the
    workers were told they used; the page's sample line is one of them."""
    settled: dict[tuple[str, str], float] = {}
    forwarded: dict[str, int] = {}
    for line in access:
        assert "partition" in line, line  # both SDKs' keys: Authorization
        meters = line["meters"]
        if line["outcome"] == "deferred":
            assert line["status"] == 429 and all(m["settled"] is None for m in meters.values()), line
            continue
        assert (line["status"], line["upstream_status"]) == (200, 200), line
        assert line["outcome"] in ("forwarded", "held"), line
        forwarded[line["vendor"]] = forwarded.get(line["vendor"], 0) + 1
        for meter, amounts in meters.items():
            assert amounts["settled"] is not None and 0 < amounts["settled"] <= amounts["estimated"], line
            settled[line["vendor"], meter] = settled.get((line["vendor"], meter), 0) + amounts["settled"]
    assert forwarded == {name: s["calls"] for name, s in summaries.items()}, forwarded
    assert settled == {
        ("openai", "tokens"): summaries["openai"]["tokens"],
        ("anthropic", "input_tokens"): summaries["anthropic"]["input"],
        ("anthropic", "output_tokens"): summaries["anthropic"]["output"],
    }
    (sample,) = [json.loads(line) for line in block("output", "access-log").splitlines()]
    real = {(a["estimated"], a["settled"]) for line in access for a in line["meters"].values()}
    like = [line for line in access if line["vendor"] == sample["vendor"] and line["outcome"] == sample["outcome"]]
    assert like and set(sample) == set(like[0]), sample  # the fields of a real line
    (amounts,) = sample["meters"].values()
    assert (amounts["estimated"], amounts["settled"]) in real, amounts  # the calls are the same every run
    said = re.search(r"⌈(\d+) ÷ 4⌉ \+ (\d+) = (\d+)\s+tokens, used (\d+), and (\d+) went back", PAGE.read_text())
    assert said is not None
    chars, cap, estimated, used, back = map(int, said.groups())
    assert math.ceil(chars / 4) + cap == estimated == amounts["estimated"] and used == amounts["settled"]
    assert back == estimated - used


def the_metrics_say_the_same(metrics: str, summaries: dict[str, dict[str, int]]) -> None:
    series = {m["series"]: float(m["value"]) for m in _METRIC.finditer(metrics)}
    assert len(series) == len(metrics.splitlines()), metrics  # the grep keeps nothing else
    settled = 'ratelimit_meter_settled_total{{limiter="{}",meter="{}"}}'
    assert series[settled.format("openai", "tokens")] == summaries["openai"]["tokens"]
    assert series[settled.format("anthropic", "input_tokens")] == summaries["anthropic"]["input"]
    assert series[settled.format("anthropic", "output_tokens")] == summaries["anthropic"]["output"]
    sample = {m["series"] for m in _METRIC.finditer(block("output", "metrics"))}
    assert sample and sample <= set(series), sample - set(series)
    assert len(sample) == len(block("output", "metrics").splitlines())
