"""MkDocs hooks (mkdocs.yml's ``hooks``): the pages under docs/ read the same on GitHub and on the site.

- A link from a page to a file of the repository outside docs/ (``../deploy/README.md``,
  ``../config/llm.yaml``) works on GitHub, but the site has no such page: there it becomes a
  plain mention of the file. Only a target that exists is rewritten, so a link to a file
  that does not exist stays a link and fails the strict build like any broken link.
- GitHub needs a ``|`` inside a code span in a table row written ``\\|``; Python-Markdown
  keeps code spans whole when it splits a row, and would show the backslash.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

_LINK = re.compile(r"(?<!!)\[(?P<label>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repository = docs.parent
    source = docs / page.file.src_uri
    out: list[str] = []
    fenced = False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            line = _LINK.sub(lambda m: _mention(m, source, docs, repository), line)
            if line.lstrip().startswith("|"):
                line = _CODE_SPAN.sub(lambda m: m.group(0).replace("\\|", "|"), line)
        out.append(line)
    return "\n".join(out)


def _mention(match: re.Match[str], source: Path, docs: Path, repository: Path) -> str:
    target = match["target"]
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return match.group(0)
    path = target.partition("#")[0]
    resolved = Path(posixpath.normpath((source.parent / path).as_posix()))
    if resolved.is_relative_to(docs) or not resolved.is_relative_to(repository) or not resolved.exists():
        return match.group(0)
    where = resolved.relative_to(repository).as_posix()
    label = match["label"]
    if label.strip("`") == where:
        return label
    return f"{label} (`{where}`)"
