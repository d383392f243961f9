"""Every policy in ``config/`` is one an operator can copy: ``quota-proxy check`` accepts it
without a warning, and the quota-shape examples say what the vendor will see."""

import shutil
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.devtools.mockvendor_tls import vendor_tls
from proxy.policy import load_policy

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "config").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_the_examples_are_all_here():
    assert {
        "config/example.yaml",
        "config/payments.yaml",
        "config/llm.yaml",
        "config/anthropic.yaml",
        "config/clients.yaml",
    } <= set(CONFIGS)


@pytest.mark.parametrize("path", CONFIGS)
def test_check_accepts_the_example_without_warnings(
    path: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "config/clients.yaml":  # its CA is made by its first step, `mock-vendor --tls ca`, in a copy
        (tmp_path / "config").mkdir()
        shutil.copy(ROOT / path, tmp_path / path)
        vendor_tls(tmp_path / "ca").close()
        monkeypatch.chdir(tmp_path)
    assert main(["check", "-c", path]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith(f"OK {path}: ")
    assert load_policy(path).warnings == ()


def test_llm_example_is_per_key_with_streams_capped_and_embeddings_weighed():
    vendor = load_policy("config/llm.yaml").vendor("llm-api")
    assert vendor.partition is not None and vendor.partition.header == "Authorization"
    assert vendor.answers.name == "openai" and vendor.feedback.headers == "auto"
    assert vendor.concurrency == 64
    by_name = {e.name: e for e in vendor.endpoints}
    assert by_name["chat"].concurrency == 32 and by_name["embeddings"].cost == 4
    (tokens,) = vendor.meters
    assert (tokens.name, tokens.estimate.kind, tokens.settle.kind) == ("tokens", "openai", "openai")


def test_the_anthropic_example_meters_input_and_output_apart(capsys: pytest.CaptureFixture[str]) -> None:
    vendor = load_policy("config/anthropic.yaml").vendor("anthropic")
    assert [(m.name, m.estimate.kind, m.settle.kind) for m in vendor.meters] == [
        ("input_tokens", "anthropic_input", "anthropic_input"),
        ("output_tokens", "anthropic_output", "anthropic_output"),
    ]
    assert vendor.answers.name == "anthropic"
    assert main(["check", "-c", "config/anthropic.yaml"]) == 0
    out = capsys.readouterr().out
    # Each meter's worst case is the vendor's per-minute quota, and one call's most its burst.
    assert "worst case at most 40000 input_tokens in any 1m, per value of x-api-key" in out
    assert "worst case at most 8000 output_tokens in any 1m, per value of x-api-key" in out


@pytest.mark.parametrize(
    ("path", "vendor", "worst"),
    [
        ("config/payments.yaml", "payments-api", "at most 100 requests in any 1s, per value of Authorization"),
        ("config/llm.yaml", "llm-api", "at most 20 requests in any 1s, 500 in any 1m, per value of Authorization"),
    ],
)
def test_the_examples_never_exceed_the_vendors_window(
    path: str, vendor: str, worst: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """rate + burst stays within the vendor's own window, so the fleet never overruns it."""
    assert main(["check", "-c", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = lines[lines.index(f"vendor {vendor}") :]
    assert next(row for row in rows if row.startswith("  worst case")) == f"  worst case  {worst}"
