"""Finds the Lua scripts: inside the installed package (a wheel maps ``lua/`` to
``proxy/lua``), or in the checkout's top-level ``lua/`` when run from source."""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

NAMES = ("acquire", "feedback", "inflight", "leave", "peek", "presence", "probe", "refund", "release", "renew")


@cache
def script(name: str) -> str:
    """The text of ``lua/<name>.lua``."""
    if name not in NAMES:
        raise KeyError(name)
    packaged = resources.files("proxy").joinpath("lua", f"{name}.lua")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    checkout = Path(__file__).resolve().parents[2] / "lua" / f"{name}.lua"
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8")
    raise FileNotFoundError(f"Lua script {name}.lua is in neither the package nor {checkout.parent}")
