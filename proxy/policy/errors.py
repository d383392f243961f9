"""Configuration problems, each naming the file, the line and the YAML path.

``ConfigError`` is one problem (a value, not an exception); ``ConfigErrors`` is
the exception the loader raises with every problem it found, so an operator
fixes a policy in one pass instead of one error per run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConfigError:
    """One problem: ``config/payments.yaml:14: vendors[0].limits[1].per: "1x" is not a duration``."""

    file: str
    line: int | None
    """1-based; None when the problem has no line (the file cannot be read)."""
    path: str
    """YAML path such as ``vendors[0].limits[1].per``; empty for the document as a whole."""
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class ConfigErrors(Exception):
    """A policy that must not be served; ``str()`` gives one line per problem."""

    def __init__(self, errors: Iterable[ConfigError]) -> None:
        self.errors: tuple[ConfigError, ...] = tuple(errors)
        super().__init__(*self.errors)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)
