"""The documentation site (mkdocs.yml, docs/) and the README that leads into it.

The site builds with ``mkdocs build --strict``: mkdocs.yml's ``validation`` makes a broken
link or anchor, a page missing from the nav and a nav entry without its page warnings, and
strict mode makes every warning fail the build, so a broken page fails the suite (which is
what CI runs). The policy reference documents every key the loader accepts, read from the
loader's own key tuples, with the default the model really has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import importlib
import math
import os
import pkgutil
import re
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

import proxy.policy
from proxy.policy import answer_presets, limits, meters, model, sections, shapes, share_policy, vendors
from proxy.policy.durations import parse_duration
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DEPLOY = ROOT / "deploy"
POLICY_PAGE = ROOT / "docs" / "policy.md"

# Each mapping of the policy file: the heading of its table in docs/policy.md, the loader's
# tuple of the keys it accepts there, and the model class whose field defaults are the
# keys' defaults (None: defaults the model does not hold as fields).
SECTIONS: dict[str, tuple[tuple[str, ...], type | None]] = {
    "Top level": (sections._ROOT_KEYS, model.Policy),
    "`connections`": (sections._CONNECTIONS_KEYS, model.Connections),
    "`store`": (sections._STORE_KEYS, model.StoreSettings),
    "`store.breaker`": (sections._BREAKER_KEYS, model.Breaker),
    "`tenant`": (sections._TENANT_KEYS, model.TenantSettings),
    "`tenant.credentials`": (sections._CREDENTIAL_KEYS, None),
    "`vendors[]`": (vendors._VENDOR_KEYS, model.Vendor),
    "Limits": (limits._LIMIT_KEYS, None),
    "`vendors[].tenant_limits`": (limits._TENANT_LIMITS_KEYS, model.TenantLimits),
    "`vendors[].on_limit`": (vendors._ON_LIMIT_KEYS, model.OnLimit),
    "`vendors[].feedback`": (vendors._FEEDBACK_KEYS, model.Feedback),
    "`vendors[].timeouts`": (vendors._TIMEOUTS_KEYS, model.Timeouts),
    "`vendors[].partition`": (shapes._PARTITION_KEYS, None),
    "`vendors[].share`": (share_policy._SHARE_KEYS, model.Share),
    "`vendors[].answers` and `answer_presets`": (answer_presets._PRESET_KEYS, None),
    "Answer kinds": (answer_presets._KIND_KEYS, None),
    "`vendors[].endpoints[]`": (shapes._ENDPOINT_KEYS, model.Endpoint),
    "`vendors[].endpoints[].match`": (shapes._MATCH_KEYS, model.EndpointMatch),
    "`vendors[].meters`": (meters._METER_KEYS, model.Meter),
    "Meter estimates": (meters._ESTIMATE_KEYS, None),
    "Meter settles": (meters._SETTLE_KEYS, None),
    "`tls`": (sections._TLS_KEYS, model.TlsSettings),
}
ATTRIBUTE = {"from": "from_"}  # a key whose model field is named otherwise


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it: ``mkdocs build --strict`` (any warning fails)."""
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's notice about its successor
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "policy" / "index.html").is_file()
    assert (site / "admin-page.png").is_file(), "the live page's screenshot (docs/operating.md)"


def test_links_to_deploy_files_are_links_to_their_pages_on_the_site(site: Path) -> None:
    """Every link a page writes for GitHub to a file or folder of deploy/ (issue 36: they were
    plain text on the site) is, on the site, a link to a page there that shows the file."""
    sources = [*sorted(DOCS.rglob("*.md")), DEPLOY / "README.md"]
    checked: set[Path] = set()
    for source in sources:
        built = _built(site, source)
        hrefs = _hrefs(built.read_text())
        for target in _links(source.read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path = (source.parent / target.partition("#")[0]).resolve()
            if not path.is_relative_to(DEPLOY):
                continue
            page = _built(site, path)
            shown = {(built.parent / h.partition("#")[0]).resolve() for h in hrefs}
            assert page.parent.resolve() in shown, f"{source.relative_to(ROOT)}: {target} is no link on the site"
            text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
            if path.is_file() and path.name != "README.md":
                lines = [line for line in path.read_text().splitlines() if line.strip()]
                assert lines[0] in text and lines[-1] in text, f"{page}: does not show {target}"
            checked.add(path)
    assert {DEPLOY / "compose.yaml", DEPLOY / "k8s" / "base", DEPLOY / "prometheus" / "alerts.yml"} <= checked
    assert len(checked) >= 15, sorted(checked)


def _built(site: Path, path: Path) -> Path:
    """The HTML page the site has for a file of docs/ or of deploy/ (use_directory_urls)."""
    if path.is_relative_to(DOCS):
        stem = path.relative_to(DOCS).with_suffix("")
        folder = stem.parent if stem.name in ("index", "README") else stem
    elif path.is_dir() or path.name == "README.md":
        folder = (path if path.is_dir() else path.parent).relative_to(ROOT)
    else:
        folder = path.relative_to(ROOT)
    return site / folder / "index.html"


def _links(markdown: str) -> list[str]:
    """The targets of a Markdown page's links, outside fenced blocks."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.findall(r"(?<!!)\[[^\]\n]+\]\(([^)\s]+)\)", text)


def _hrefs(page: str) -> list[str]:
    found: list[str] = []

    class Anchors(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            href = dict(attrs).get("href")
            if tag == "a" and href and "://" not in href:
                found.append(href)

    Anchors().feed(page)
    return found


def test_every_key_tuple_of_the_loader_has_its_section() -> None:
    """A new mapping in the policy file (a new ``_..._KEYS`` tuple) needs a table of its own."""
    documented = [keys for keys, _ in SECTIONS.values()]
    for info in pkgutil.iter_modules(proxy.policy.__path__):
        module = importlib.import_module(f"proxy.policy.{info.name}")
        for name, value in vars(module).items():
            if re.fullmatch(r"_[A-Z_]+_KEYS", name) and isinstance(value, tuple):
                assert any(value is keys for keys in documented), f"proxy/policy/{info.name}.py {name}: no section"


def test_the_policy_reference_documents_every_key_with_its_default() -> None:
    tables = _tables(POLICY_PAGE.read_text())
    for heading, (keys, defaults) in SECTIONS.items():
        assert heading in tables, f"docs/policy.md has no section {heading!r}"
        rows = tables[heading]
        missing = [key for key in keys if key not in rows]
        assert not missing, f"docs/policy.md, {heading}: no row for {missing} (a row starts | `key` |)"
        unknown = [key for key in rows if key not in keys]
        assert not unknown, f"docs/policy.md, {heading}: {unknown} are not keys the loader accepts"
        for key, cell in rows.items():
            assert cell.strip(), f"{heading} {key}: no default"
            default = _model_default(defaults, key)
            if default is None or cell.startswith("required"):
                continue
            assert _states(cell, default), f"{heading} {key}: the default is {default!r}, the page says {cell!r}"


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150, "README.md: at most 150 lines; the rest belongs in docs/"
    assert "\n## Install and run\n\n```sh\npython3 -m venv .venv && .venv/bin/pip install . && " in text
    assert "\n## Test\n\n```sh\nbash scripts/test\n```\n" in text
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links {target}, which does not exist"
        if anchor:
            assert anchor in _github_anchors((ROOT / path).read_text()), f"README.md links {target}: no such heading"


def _tables(page: str) -> dict[str, dict[str, str]]:
    """Per heading, its table rows: key (the first cell, one code span) → the default cell."""
    found: dict[str, dict[str, str]] = {}
    heading, fenced = "", False
    for line in page.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            continue
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
            assert heading not in found, f"docs/policy.md: two sections {heading!r}"
            found[heading] = {}
        elif match := re.match(r"\| `([^`]+)` \| (.*?) \|", line):
            rows = found.setdefault(heading, {})
            assert match[1] not in rows, f"docs/policy.md, {heading}: {match[1]} twice"
            rows[match[1]] = match[2]
    return found


def _model_default(cls: type | None, key: str) -> bool | int | float | str | None:
    """The model's default for ``key``, when it is a plain value (not a section, list or None)."""
    if cls is None:
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    field = fields.get(ATTRIBUTE.get(key, key))
    if field is None or not isinstance(field.default, bool | int | float | str):
        return None
    return field.default


def _states(cell: str, default: bool | int | float | str) -> bool:
    """Whether one of the cell's code spans is ``default``, as YAML or as a duration."""
    for token in re.findall(r"`([^`]+)`", cell):
        values: list[object] = []
        with contextlib.suppress(yaml.YAMLError):
            values.append(yaml.safe_load(token))
        with contextlib.suppress(ValueError):
            values.append(parse_duration(token))
        for value in values:
            if isinstance(default, bool) or isinstance(value, bool):
                if value is default:
                    return True
            elif isinstance(default, int | float) and isinstance(value, int | float):
                if math.isclose(value, default):
                    return True
            elif value == default:
                return True
    return False


def _github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_page_tables_list_every_page_of_the_site() -> None:
    """README's and docs/index.md's page tables name every page of the site's nav."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = [page for page in _nav_pages(nav) if page != "index.md"]
    index = (ROOT / "docs" / "index.md").read_text()
    readme = README.read_text()
    for page in pages:
        assert f"]({page})" in index, f"docs/index.md: the table of pages has no row for {page}"
        assert f"](docs/{page})" in readme, f"README.md: the table of pages has no row for docs/{page}"


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_the_readmes_mkdocs_serve_serves_the_site() -> None:
    """``.venv/bin/mkdocs serve`` as the README prints it, on a free port (``--dev-addr``): the
    site's front page, then a clean stop."""
    printed = re.findall(r"`(\.venv/bin/mkdocs serve)`", (ROOT / "README.md").read_text())
    assert printed == [".venv/bin/mkdocs serve"], printed
    port = free_port()
    mkdocs = Path(sys.executable).parent / "mkdocs"
    server = subprocess.Popen(
        [str(mkdocs), "serve", "--dev-addr", f"127.0.0.1:{port}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    try:
        said = ""
        deadline = time.monotonic() + 120
        while f"Serving on http://127.0.0.1:{port}/" not in said:  # (its log line, once built)
            assert server.stderr is not None and time.monotonic() < deadline, said
            line = server.stderr.readline()
            assert line or server.poll() is None, said
            said += line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert page.status == 200
            assert "<title>quota-proxy" in page.read().decode()
    finally:
        server.terminate()
        assert server.wait(timeout=30) in (0, -15)
        if server.stderr is not None:
            server.stderr.close()
