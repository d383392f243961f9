"""The layers of ARCHITECTURE.md, kept by a test: a layer imports only from the layers below it.

The layer table is read from ARCHITECTURE.md itself (top row = top layer), so the map and the
code cannot drift apart. Every module under proxy/ is read with ``ast``; each of its imports
(those under ``if TYPE_CHECKING:`` and inside functions included: a type-only import is still a
tie, as ../shared/tools/layers counts it) is resolved to a module of the package and compared
with the importer's layer. An import from a higher layer fails, unless ``KNOWN_UPWARD`` names
it; an entry of ``KNOWN_UPWARD`` that no longer occurs fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "proxy"

KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset(
    {
        # The request pipeline counts and logs through telemetry/ (operations).
        ("proxy.deps", "proxy.telemetry.accesslog"),
        ("proxy.deps", "proxy.telemetry.metrics"),
        ("proxy.deps", "proxy.telemetry.recent"),
        ("proxy.pipeline.accounting", "proxy.telemetry.metrics"),
        ("proxy.pipeline.accounting", "proxy.telemetry.recent"),
        ("proxy.pipeline.accounting", "proxy.telemetry.shares"),
        ("proxy.pipeline.feedback", "proxy.telemetry.metrics"),
        ("proxy.pipeline.flight", "proxy.telemetry.accesslog"),
        ("proxy.pipeline.handler", "proxy.telemetry.accesslog"),
        ("proxy.pipeline.handler", "proxy.telemetry.loudly"),
        ("proxy.pipeline.lane", "proxy.telemetry.loudly"),
        ("proxy.pipeline.ledger", "proxy.telemetry.accesslog"),
        ("proxy.pipeline.ledger", "proxy.telemetry.metrics"),
        ("proxy.pipeline.routes", "proxy.telemetry.accesslog"),
        # So do the TLS layer and the wire's connection cap.
        ("proxy.tls.blind_tunnel", "proxy.telemetry.accesslog"),
        ("proxy.tls.intercept", "proxy.telemetry.accesslog"),
        ("proxy.wire.connections", "proxy.telemetry.metrics"),
        # The policy reads header names from the wire and checks the CA files with ca/.
        ("proxy.policy.answer_presets", "proxy.wire.headers"),
        ("proxy.policy.values", "proxy.wire.headers"),
        ("proxy.policy.sections", "proxy.ca.authority"),
        ("proxy.policy.walker", "proxy.ca.authority"),
    }
)
"""Imports that run upward today, outside issue 35's item 7: strike one when it goes."""

NEVER_EXCUSED: frozenset[tuple[str, str]] = frozenset(
    {
        ("quota", "request pipeline"),
        ("quota", "operations"),
        ("wire", "request pipeline"),
        ("request pipeline", "TLS"),
    }
)
"""(importer's layer, imported layer) pairs ``KNOWN_UPWARD`` may not hold (issue 35, item 7):
the refusal vocabulary, a request's wish, sizing and the tunnel tag live below their users."""


class Layer(NamedTuple):
    rank: int
    """0 for the top layer."""
    name: str
    prefixes: tuple[str, ...]
    """Dotted names of the modules and packages the layer's row names."""


def layers() -> list[Layer]:
    """ARCHITECTURE.md's layer table, top first: ``| layer | package | its job |``."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    head = text.index("| layer | package | its job |")
    rows: list[Layer] = []
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, where = (cell.strip() for cell in line.strip("|").split("|")[:2])
        prefixes: list[str] = []
        for entry in re.findall(r"`([^`]+)`", where):
            if entry.startswith("proxy/") and entry.endswith("/"):
                prefixes.append(entry.rstrip("/").replace("/", "."))
            elif entry.endswith(".py") and "/" not in entry:
                stem = entry.removesuffix(".py")
                prefixes.append("proxy" if stem == "__init__" else f"proxy.{stem}")
            else:
                assert not (PACKAGE / entry).exists(), f"{entry!r}: name it as proxy/{entry}"
                assert not list((ROOT / entry).rglob("*.py")), f"{entry!r}: a Python package outside proxy/"
        rows.append(Layer(len(rows), name, tuple(prefixes)))
    assert len(rows) >= 6, "ARCHITECTURE.md's layer table was not found whole"
    return rows


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer_of(module: str, table: list[Layer]) -> Layer | None:
    """The layer whose entry names ``module`` most closely (``proxy`` itself only by name)."""
    best: tuple[int, Layer] | None = None
    for layer in table:
        for prefix in layer.prefixes:
            names = module == prefix or (prefix != "proxy" and module.startswith(prefix + "."))
            if names and (best is None or len(prefix) > best[0]):
                best = (len(prefix), layer)
    return None if best is None else best[1]


class Tie(NamedTuple):
    importer: str
    imported: str
    line: int


def ties(module: str, path: Path, known: dict[str, Path]) -> list[Tie]:
    """The package's modules ``module`` imports (the closest existing module of each name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.append(Tie(module, name, node.lineno))
    return found


def upward() -> dict[tuple[str, str], str]:
    """Every import from a higher layer: (importer, imported) -> how to say it."""
    table, known = layers(), modules()
    seen: dict[tuple[str, str], str] = {}
    for module, path in known.items():
        mine = layer_of(module, table)
        assert mine is not None
        for tie in ties(module, path, known):
            theirs = layer_of(tie.imported, table)
            assert theirs is not None
            if theirs.rank < mine.rank:
                seen.setdefault(
                    (tie.importer, tie.imported),
                    f"{path.relative_to(ROOT)}:{tie.line}: {tie.importer} ({mine.name}) imports "
                    f"{tie.imported} ({theirs.name}), a layer above it",
                )
    return seen


def test_every_module_has_its_layer_in_architecture_md():
    table = layers()
    unplaced = [m for m in modules() if layer_of(m, table) is None]
    assert not unplaced, f"add these to ARCHITECTURE.md's layer table: {unplaced}"


def test_every_entry_of_the_table_names_a_module():
    known = modules()
    for layer in layers():
        for prefix in layer.prefixes:
            assert prefix in known, f"ARCHITECTURE.md's {layer.name} row names {prefix}, which does not exist"


def test_no_import_runs_upward():
    found = upward()
    new = sorted(text for pair, text in found.items() if pair not in KNOWN_UPWARD)
    assert not new, "imports from a higher layer (ARCHITECTURE.md):\n" + "\n".join(new)


def test_each_known_upward_import_still_exists():
    """So the list only shrinks: an import that went is struck from ``KNOWN_UPWARD``."""
    gone = sorted(KNOWN_UPWARD - upward().keys())
    assert not gone, f"no longer imported: strike these from KNOWN_UPWARD: {gone}"


def test_known_upward_imports_never_excuse_issue_35s():
    table = layers()
    names: dict[tuple[str, str], tuple[str, str]] = {}
    for pair in KNOWN_UPWARD:
        importer, imported = (layer_of(m, table) for m in pair)
        assert importer is not None and imported is not None
        names[pair] = (importer.name, imported.name)
    excused = sorted(pair for pair, layer_pair in names.items() if layer_pair in NEVER_EXCUSED)
    assert not excused, f"these must be moved below their users, not listed: {excused}"
    assert {name for pair in NEVER_EXCUSED for name in pair} <= {layer.name for layer in table}


def test_the_check_sees_an_upward_import(tmp_path):
    """The walker itself: a quota module importing the pipeline, type-only and relative."""
    pkg = tmp_path / "proxy"
    (pkg / "quota").mkdir(parents=True)
    (pkg / "pipeline").mkdir()
    for path in (pkg / "__init__.py", pkg / "quota" / "__init__.py", pkg / "pipeline" / "__init__.py"):
        path.write_text("")
    (pkg / "pipeline" / "decide.py").write_text("X = 1\n")
    (pkg / "quota" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..pipeline.decide import X\n"
    )
    (pkg / "quota" / "b.py").write_text("def f():\n    import proxy.pipeline.decide\n")
    known = {
        "proxy": pkg / "__init__.py",
        "proxy.quota": pkg / "quota" / "__init__.py",
        "proxy.pipeline": pkg / "pipeline" / "__init__.py",
        "proxy.pipeline.decide": pkg / "pipeline" / "decide.py",
        "proxy.quota.a": pkg / "quota" / "a.py",
        "proxy.quota.b": pkg / "quota" / "b.py",
    }
    assert [t.imported for t in ties("proxy.quota.a", known["proxy.quota.a"], known)] == [
        "proxy.pipeline.decide",
        "proxy.pipeline.decide",
    ]
    assert [t.imported for t in ties("proxy.quota.b", known["proxy.quota.b"], known)] == ["proxy.pipeline.decide"]
    table = layers()
    assert layer_of("proxy.quota.a", table).rank > layer_of("proxy.pipeline.decide", table).rank  # type: ignore[union-attr]
