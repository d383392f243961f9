"""What ``quota-proxy --version`` prints: this release, the Python it runs on and the version
of every library it depends on, read from the installed package's own requirements (so the
list cannot drift from ``pyproject.toml``), for bug reports."""

from __future__ import annotations

import platform
import re
from importlib import metadata

from proxy import __version__

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def _runtime_requirements() -> list[str]:
    """Names of the installed package's runtime requirements, and of the extras they ask for
    (``redis[hiredis]`` gives redis and hiredis); test and demo extras left out."""
    names: list[str] = []
    for requirement in metadata.requires("quota-proxy") or []:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:
            continue
        match = _NAME.match(spec)
        if match is None:
            continue
        names.append(match[1])
        names += [extra.strip() for extra in (match[2] or "").split(",") if extra.strip()]
    return list(dict.fromkeys(names))


def version_report() -> str:
    lines = [f"quota-proxy {__version__}", f"{platform.python_implementation()} {platform.python_version()}"]
    try:
        names = _runtime_requirements()
    except metadata.PackageNotFoundError:
        return "\n".join([*lines, "(not installed as a package: library versions unknown)"])
    for name in names:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} (not installed)")
    return "\n".join(lines)
