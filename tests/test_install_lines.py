"""Every ``pip install`` line the pages print (README, docs/), run as printed by a real pip in a
fresh venv, with ``--dry-run`` and ``--report`` added: pip builds this checkout's metadata,
resolves the extra or the packages the line names against the index a reader's pip uses, and
finds a release of each for this Python; nothing is installed. (``pip install .`` itself is
installed for real: tests/test_packaging.py, tests/test_readme_quickstart.py.)"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import ROOT, clean_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINE = re.compile(r"`((?:\.venv/bin/)?pip install [^`]+)`|^((?:\.venv/bin/)?pip install .+)$", re.MULTILINE)
NOT_RUN = {
    "pip install quota-proxy": "the published package (contributing.md's prose), not this checkout",
    "pip install .": "installed for real by tests/test_packaging.py and tests/test_readme_quickstart.py",
}
WANTED = {  # what each line is there for: found in what pip would install
    "pip install '.[demo]'": {"quota-proxy", "rich", "matplotlib"},
    "pip install . celery stripe": {"quota-proxy", "celery", "stripe"},
    "pip install . openai anthropic": {"quota-proxy", "openai", "anthropic"},
}


def printed() -> dict[str, list[str]]:
    """Each distinct line (``.venv/bin/`` dropped), and the pages that print it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for m in _LINE.finditer(page.read_text()):
            line = (m[1] or m[2]).strip().removeprefix(".venv/bin/")
            found.setdefault(line, []).append(str(page.relative_to(ROOT)))
    return found


def test_every_install_line_a_page_prints_is_run_here_or_said_why_not() -> None:
    lines = printed()
    assert set(lines) == set(WANTED) | set(NOT_RUN), lines


@pytest.fixture(scope="module")
def fresh_pip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("reader") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, capture_output=True)
    return venv / "bin" / "pip"


@pytest.mark.parametrize("line", list(WANTED))
def test_the_install_line_resolves_as_printed(line: str, fresh_pip: Path, tmp_path: Path) -> None:
    words = shlex.split(line)
    assert words[:2] == ["pip", "install"], words
    report = tmp_path / "report.json"
    done = subprocess.run(
        [str(fresh_pip), *words[1:], "--dry-run", "--quiet", "--report", str(report)],
        cwd=ROOT,
        env=clean_env(checkout=False),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert WANTED[line] <= names, sorted(names)
