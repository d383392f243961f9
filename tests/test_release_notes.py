"""CHANGELOG.md stays release notes (issue 26): what an operator or a worker sees, one entry
per release in Keep a Changelog 1.1.0's shape, with what an upgrade must check. Benchmark
figures and the bench tools' history belong in bench/README.md ("History of the figures").

Each check is a function of the file's text, so that the same checks can be run on any
version of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import proxy

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"
BENCH_README = ROOT / "bench" / "README.md"

MAX_LINES = 300
RELEASE = re.compile(r"^## \[(?P<version>\d+\.\d+\.\d+)\] - (?P<date>\d{4}-\d{2}-\d{2})$")
SECTIONS = {
    "Upgrade notes",
    "Breaking changes",
    "Added",
    "Changed",
    "Deprecated",
    "Removed",
    "Fixed",
    "Security",
}
# What the bench and the profilers say belongs in bench/README.md, not in release notes.
BENCH_INTERNALS = re.compile(
    r"bench/(?!README\.md)\S+|instructions\.py|py-spy|callgrind|valgrind|cProfile|perf stat|"
    r"instructions per request",
    re.IGNORECASE,
)


def _text() -> str:
    return CHANGELOG.read_text(encoding="utf-8")


def _headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def _entry(text: str, heading: str) -> list[str]:
    """The lines of the entry under ``heading`` (a ``## `` line), up to the next one."""
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _subsections(entry: list[str]) -> dict[str, list[str]]:
    """The entry's ``### `` sections and the non-blank lines of each."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in entry:
        if line.startswith("### "):
            current = found.setdefault(line[4:].strip(), [])
        elif current is not None and line.strip() and not line.startswith("[") and not line.startswith("#### "):
            current.append(line)
    return found


def test_unreleased_comes_first_with_items_under_its_kinds() -> None:
    """Unreleased says "Nothing yet." right after a release, and from then on what changed
    since, each item under one of Keep a Changelog's kinds."""
    text = _text()
    headings = _headings(text)
    assert headings[0] == "## [Unreleased]", headings[:2]
    body = [line for line in _entry(text, "## [Unreleased]") if line.strip() and not line.startswith("[")]
    if body == ["Nothing yet."]:
        return
    kinds = {"### Added", "### Changed", "### Deprecated", "### Removed", "### Fixed", "### Security"}
    assert body[0] in kinds, body[:2]
    assert all(line in kinds or line.startswith(("- ", "  ")) for line in body), body


def test_the_latest_release_is_the_package_version() -> None:
    headings = _headings(_text())
    assert len(headings) >= 2, "no release entry under Unreleased"
    latest = RELEASE.match(headings[1])
    assert latest is not None, f"{headings[1]!r} is not '## [X.Y.Z] - YYYY-MM-DD'"
    assert latest["version"] == proxy.__version__, (latest["version"], proxy.__version__)


def test_the_release_of_issue_26() -> None:
    assert "## [0.2.0] - 2026-12-03" in _headings(_text())


def test_every_release_has_a_date_and_the_versions_descend() -> None:
    releases = [RELEASE.match(heading) for heading in _headings(_text())[1:]]
    assert all(release is not None for release in releases), _headings(_text())[1:]
    versions = [tuple(int(part) for part in release["version"].split(".")) for release in releases if release]
    assert versions == sorted(versions, reverse=True), versions
    assert len(set(versions)) == len(versions), versions


def test_the_latest_release_says_how_to_upgrade() -> None:
    text = _text()
    headings = _headings(text)
    assert len(headings) >= 2, "no release entry under Unreleased"
    sections = _subsections(_entry(text, headings[1]))
    for name in ("Upgrade notes", "Breaking changes"):
        assert name in sections, f"the latest release has no '### {name}'"
        assert sections[name], f"'### {name}' is empty (write 'None.' when there are none)"


def test_release_sections_are_keep_a_changelog_ones() -> None:
    text = _text()
    for heading in _headings(text)[1:]:
        unknown = set(_subsections(_entry(text, heading))) - SECTIONS
        assert not unknown, f"{heading}: sections {sorted(unknown)} (allowed: {sorted(SECTIONS)})"


def test_the_changelog_is_short() -> None:
    count = len(_text().splitlines())
    assert count < MAX_LINES, f"CHANGELOG.md has {count} lines: say less per item, move figures to bench/README.md"


def test_no_bench_internals_in_the_changelog() -> None:
    hits = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(_text().splitlines(), start=1)
        if BENCH_INTERNALS.search(line)
    ]
    assert not hits, "bench figures and tooling belong in bench/README.md:\n" + "\n".join(hits)


def test_bench_readme_keeps_the_history_of_the_figures() -> None:
    assert "\n## History of the figures\n" in BENCH_README.read_text(encoding="utf-8")
