"""``quota-proxy demo``: the growth schedule, its policy, and short runs as real subprocesses.

The subprocess runs are not TTYs, so the demo prints one plain ``key=value`` line per second.
"""

from __future__ import annotations

import os
import re
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.cli import main as cli_main
from proxy.devtools.demo import MAX_HOLD_MS, DemoConfig, policy_text
from proxy.devtools.demo_defaults import DEFAULT_PLOT
from proxy.devtools.demo_fleet import workers_at
from proxy.devtools.demo_report import Row, plain_line
from proxy.policy import parse_policy

pytestmark = pytest.mark.busy  # (its runs: two fleets and their proxies, with the timing tests that keep a core busy)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LINE = re.compile(
    r"^t=\s*([\d.]+)s workers=\s*(\d+) \| A sent=\s*([\d.]+)/s accepted=\s*([\d.]+)/s "
    r"vendor_429=\s*([\d.]+)/s \| B sent=\s*([\d.]+)/s forwarded=\s*([\d.]+)/s held=\s*(\d+) "
    r"deferred=\s*([\d.]+)/s vendor_429=\s*([\d.]+)/s \| quota=(\d+)/s$",
    re.MULTILINE,
)


def demo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", "demo", *args]


def demo_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = str(ROOT)
    env["MPLBACKEND"] = "Agg"
    return env


# -- pure helpers ------------------------------------------------------------------------


def test_growth_schedule_holds_ramps_and_plateaus() -> None:
    duration = 60.0
    assert workers_at(0, duration, 4, 40) == 4
    assert workers_at(6, duration, 4, 40) == 4  # the first 10 %
    assert workers_at(45, duration, 4, 40) == 40  # reached at 75 %
    assert workers_at(60, duration, 4, 40) == 40
    assert workers_at(1000, duration, 4, 40) == 40
    assert workers_at(25.5, duration, 4, 40) == 22  # halfway up the ramp
    sizes = [workers_at(t / 10, duration, 4, 40) for t in range(0, 601)]
    assert sizes == sorted(sizes)
    assert set(sizes) == set(range(4, 41))  # one worker at a time, none skipped


def test_growth_schedule_short_runs_grow_faster_and_other_shapes() -> None:
    # --duration 15: 4 workers for 1.5 s, 40 from 11.25 s on.
    assert workers_at(1.5, 15, 4, 40) == 4
    assert workers_at(11.25, 15, 4, 40) == 40
    assert workers_at(3.0, 15, 4, 40) >= 10  # over the quota (10 x 10/s) within 3 s
    # A shrinking fleet and a constant one stay within their bounds.
    shrink = [workers_at(t, 20, 30, 5) for t in range(21)]
    assert shrink[0] == 30 and shrink[-1] == 5 and shrink == sorted(shrink, reverse=True)
    assert {workers_at(t, 20, 7, 7) for t in range(21)} == {7}
    assert workers_at(0, 0, 4, 40) == 40


def test_demo_policy_is_valid_and_under_the_quota() -> None:
    config = DemoConfig(quota=100)
    policy = parse_policy(policy_text(config, "http://127.0.0.1:9"), "<demo policy>", base_dir=ROOT)
    (vendor,) = policy.vendors
    (limit,) = vendor.limits
    assert limit.per_second == pytest.approx(95)
    assert limit.per_second < config.quota
    assert vendor.on_limit.action == "hold"
    assert vendor.on_limit.max_hold == pytest.approx(MAX_HOLD_MS / 1000)
    assert policy.store.url == "memory://"
    assert policy.access_log is False
    assert config.vendor_burst == 15 and config.proxy_burst == 10


def test_plain_line_is_parseable() -> None:
    row = Row(
        elapsed=3.0,
        workers=12,
        a_sent=120,
        a_accepted=100,
        a_429=20,
        b_sent=130,
        b_forwarded=95,
        b_held=11,
        b_deferred=35,
        b_429=0,
        b_at_vendor=95,
    )
    match = LINE.fullmatch(plain_line(row, 100))
    assert match is not None
    assert match.group(2) == "12" and float(match.group(5)) == 20 and match.group(11) == "100"


def test_cli_lists_demo_and_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "--workers-from" in capsys.readouterr().out
    for bad in (
        ["--duration", "0"],
        ["--duration", "2"],
        ["--workers-to", "0"],
        ["--workers-to", "1000"],
        ["--quota", "-5"],
        ["--quota", "nan"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["demo", *bad])
        assert exit_info.value.code == 2, bad
        capsys.readouterr()


# -- real runs ---------------------------------------------------------------------------


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 800 <= width <= 2000 and 500 <= height <= 1500, (width, height)

    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[:2] == (height, width)
    rgb = (pixels[..., :3] * 255).round().astype(int)
    colours = {tuple(p) for p in rgb.reshape(-1, 3)[::7]}
    assert len(colours) > 50  # text, lines and fills, not a blank canvas

    def share_near(colour: tuple[int, int, int]) -> float:
        close = (abs(rgb - colour) <= 12).all(axis=-1)
        return float(close.mean())

    assert share_near((214, 39, 40)) > 0.001  # fleet A's lines (tab:red)
    assert share_near((31, 119, 180)) > 0.001  # fleet B's lines (tab:blue)


def readme_demo_command() -> list[str]:
    """The demo command the README prints (``.venv/bin/quota-proxy demo ...``), as words."""
    found = re.findall(r"^\.venv/bin/quota-proxy demo( .*)?$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert len(found) == 1, found
    return ["demo", *found[0].split()]


@pytest.mark.slow
def test_the_readmes_demo_shows_both_fleets_and_writes_the_plot(tmp_path: Path) -> None:
    """As printed (``--duration 30``), by the installed command, from a reader's directory:
    the plot goes to its default path there."""
    argv = readme_demo_command()
    assert argv == ["demo", "--duration", "30"], argv  # (the row count below follows the duration)
    command = Path(sys.executable).parent / "quota-proxy"
    result = subprocess.run(
        [str(command), *argv],
        cwd=tmp_path,
        env=demo_env(),
        capture_output=True,
        text=True,
        timeout=70,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    plot = tmp_path / DEFAULT_PLOT

    rows = [m.groups() for m in LINE.finditer(out)]
    assert 28 <= len(rows) <= 31, out
    workers = [int(r[1]) for r in rows]
    assert workers[0] == 4 and workers[-1] == 40, workers
    assert workers == sorted(workers), workers
    last = rows[-1]
    assert float(last[2]) > 2 * 100, last  # fleet A sends far more than the quota at 40 workers
    assert float(last[4]) > 0, last  # ... and the vendor refuses the excess
    assert all(float(r[9]) == 0 for r in rows), out  # fleet B never hears a vendor 429
    assert all(float(r[6]) <= 100 + 15 for r in rows), out  # the proxy forwards within quota (+ burst)
    assert sum(float(r[8]) for r in rows) > 0, out  # and defers what it cannot hold

    assert f"plot: {plot.resolve()}" in out
    a_429 = int(re.search(r"^  fleet A .*vendor 429s (\d+)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    b_429 = int(re.search(r"^  fleet B .*vendor 429s (\d+)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert a_429 > 500, out
    assert b_429 == 0, out
    check_png(plot)


@pytest.mark.slow
def test_ctrl_c_stops_early_and_still_writes_the_plot(tmp_path: Path) -> None:
    plot = tmp_path / "early.png"
    proc = subprocess.Popen(
        demo_cmd("--duration", "60", "--plot", str(plot)),
        cwd=tmp_path,
        env=demo_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.monotonic() + 15
        while seen.count("\nt=") < 3:  # three seconds of rows, then Ctrl-C
            assert time.monotonic() < deadline, seen
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                assert line, seen
                seen += "\n" + line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "stopped early" in out, out
    assert f"plot: {plot.resolve()}" in out
    assert re.search(r"^  fleet B .*vendor 429s 0$", out, re.MULTILINE), out
    assert plot.read_bytes()[:8] == PNG_MAGIC
