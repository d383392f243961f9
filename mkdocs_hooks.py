"""MkDocs hooks (mkdocs.yml's ``hooks``): the pages under docs/ read the same on GitHub and on the site.

- The deployment files (``deploy/``: Compose, Kubernetes, Prometheus, Grafana) are published
  on the site: each YAML or JSON file as a page that shows it (``deploy/compose.yaml`` →
  ``deploy/compose.yaml/``), each folder as a page listing its files, ``deploy/README.md``
  as the folder's own page. A link from a page to one of them, written for GitHub
  (``../deploy/compose.yaml``), is pointed at its page on the site.
- A link to any other file of the repository outside docs/ (``../config/llm.yaml``) works on
  GitHub, but the site has no such page: there it becomes a plain mention of the file. Only
  a target that exists is rewritten, so a link to a file that does not exist stays a link
  and fails the strict build like any broken link.
- GitHub needs a ``|`` inside a code span in a table row written ``\\|``; Python-Markdown
  keeps code spans whole when it splits a row, and would show the backslash.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

_LINK = re.compile(r"(?<!!)\[(?P<label>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")

PUBLISHED = "deploy"
"""The repository folder published on the site beside docs/."""
_SHOWN = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}
"""The files of it shown on the site, by suffix, with their highlighting (never keys: *.pem)."""


def _repository(config: Any) -> Path:
    return Path(config["docs_dir"]).resolve().parent


def site_uri(path: Path, repository: Path) -> str | None:
    """The site page (docs-relative src_uri) of a file or folder of the repository, or None."""
    docs = repository / "docs"
    if path.is_relative_to(docs):
        return path.relative_to(docs).as_posix() if path.exists() else None
    published = repository / PUBLISHED
    if not path.is_relative_to(published) or not path.exists():
        return None
    where = path.relative_to(repository).as_posix()
    if path.is_dir():
        if not any(p.suffix in _SHOWN for p in path.rglob("*")):
            return None  # nothing to show (deploy/k8s/stripe/ca/: the CA's keys, kept out of git)
        readme = path / "README.md"
        return f"{where}/README.md" if readme.is_file() else f"{where}/index.md"
    if path.name == "README.md":
        return where
    return f"{where}.md" if path.suffix in _SHOWN else None


def _source(src_uri: str, repository: Path) -> Path:
    """Where a page's text comes from: docs/, or the published file or folder it shows."""
    if not src_uri.startswith(f"{PUBLISHED}/"):
        return repository / "docs" / src_uri
    if src_uri.endswith("/README.md") or src_uri.endswith("/index.md"):
        return repository / src_uri  # a folder's page: its links are relative to the folder
    return repository / src_uri.removesuffix(".md")


def on_files(files: Files, config: Any) -> Files:
    repository = _repository(config)
    root = repository / PUBLISHED
    for path in sorted([root, *root.rglob("*")]):
        if any(part.startswith(".") for part in path.relative_to(repository).parts):
            continue
        uri = site_uri(path, repository)
        if uri is None or (path.is_dir() and uri.endswith("/README.md")):
            continue  # a folder with a README: the README is its page (below)
        if path.is_dir():
            text = _folder_page(path, repository)
        elif path.name == "README.md":
            text = path.read_text()
        else:
            text = _file_page(path, repository)
        page = File.generated(config, uri, content=text)
        page.inclusion = InclusionLevel.NOT_IN_NAV  # reached from docs/deploying.md and its pages
        files.append(page)
    return files


def _file_page(path: Path, repository: Path) -> str:
    text = path.read_text()
    fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    where = path.relative_to(repository).as_posix()
    folder = path.parent.relative_to(repository).as_posix()
    return (
        f"# `{where}`\n\nThe file as it is in the repository, in [`{folder}/`](./).\n\n"
        f"{fence}{_SHOWN[path.suffix]}\n{text.rstrip()}\n{fence}\n"
    )


def _folder_page(path: Path, repository: Path) -> str:
    where = path.relative_to(repository).as_posix()
    lines = [f"# `{where}/`", "", f"The files in `{where}/`, as they are in the repository:", ""]
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or site_uri(entry, repository) is None:
            continue
        name = f"{entry.name}/" if entry.is_dir() else entry.name
        lines.append(f"- [`{name}`]({name})")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    repository = _repository(config)
    source = _source(page.file.src_uri, repository)
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            line = _LINK.sub(lambda m: _pointed(m, page.file.src_uri, source, repository), line)
            if line.lstrip().startswith("|"):
                line = _CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)
        out.append(line)
    return "\n".join(out)


def _pointed(match: re.Match[str], src_uri: str, source: Path, repository: Path) -> str:
    """A link written for GitHub (relative to the page's file in the repository), as the site has it."""
    target = match["target"]
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return match.group(0)
    path, hash_, anchor = target.partition("#")
    base = source if source.is_dir() else source.parent
    resolved = Path(posixpath.normpath((base / path).as_posix()))
    if not resolved.is_relative_to(repository) or not resolved.exists():
        return match.group(0)  # outside, or missing: mkdocs judges it (strict: a broken link fails)
    uri = site_uri(resolved, repository)
    if uri is not None:
        relative = posixpath.relpath(uri, posixpath.dirname(src_uri) or ".")
        return f"[{match['label']}]({relative}{hash_}{anchor})"
    where = resolved.relative_to(repository).as_posix()
    label = match["label"]
    if label.strip("`") == where:
        return label
    return f"{label} (`{where}`)"
