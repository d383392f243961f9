"""YAML policy → the frozen ``Policy`` model, validated once at the boundary.

The loader walks PyYAML's node tree (``yaml.compose``) instead of loaded Python
objects, so every problem names the 1-based line of the offending node as well
as its path (``vendors[0].limits[1].per``). It never stops at the first problem:
all of them are collected and raised together as ``ConfigErrors``, sorted by line.

In parts:

- ``walker``: the node tree, file:line and YAML paths, unknown keys with a did-you-mean,
  ``<<`` merges, and the list of problems found so far (``Walk``);
- ``values``: leaf parsers ``(key, value) -> T`` that raise ValueError with the message
  an operator sees;
- ``sections`` and ``vendors``: one builder ``(walk, node, path) -> model object`` per
  section, falling back to the model's defaults where a value is missing or wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

from proxy.policy.errors import ConfigError, ConfigErrors
from proxy.policy.model import Policy
from proxy.policy.sections import build_policy
from proxy.policy.values import mask_password, parse_address, parse_admin_token, parse_store_url
from proxy.policy.walker import Walk, compose

__all__ = [
    "load_policy",
    "mask_password",
    "parse_address",
    "parse_admin_token",
    "parse_policy",
    "parse_store_url",
    "read_policy_text",
]


def load_policy(path: str | os.PathLike[str], *, check_ca: bool = True) -> Policy:
    """Read and validate a policy file; ConfigErrors lists every problem found.

    ``check_ca=False`` skips loading the files ``tls.ca_cert`` and ``tls.ca_key`` name
    (``quota-proxy ca init -c`` reads the policy to create them).
    """
    source = os.fspath(path)
    return parse_policy(read_policy_text(source), source, check_ca=check_ca)


def read_policy_text(path: str | os.PathLike[str]) -> str:
    """A policy file's text; ConfigErrors (naming the file) when it cannot be read as UTF-8."""
    source = os.fspath(path)
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        message = f"cannot read policy: {exc.strerror or exc}"
        raise ConfigErrors([ConfigError(source, None, "", message)]) from None
    except UnicodeDecodeError as exc:
        message = f"cannot read policy: not UTF-8 ({exc.reason} at byte {exc.start})"
        raise ConfigErrors([ConfigError(source, None, "", message)]) from None


def parse_policy(
    text: str, source: str, *, base_dir: str | os.PathLike[str] | None = None, check_ca: bool = True
) -> Policy:
    """Validate policy text; ``source`` names it in messages and becomes ``Policy.source``.

    Relative TLS file paths resolve against ``base_dir``, by default the directory of ``source``.
    When both ``tls.ca_cert`` and ``tls.ca_key`` are set, the files must hold a usable CA
    (``proxy.ca.authority.CertificateAuthority.load``), unless ``check_ca`` is false.
    """
    root = compose(text, source)
    walk = Walk(source, Path(base_dir) if base_dir is not None else Path(source).parent, check_ca=check_ca)
    policy = build_policy(walk, root)
    errors = walk.errors()
    if errors:
        raise ConfigErrors(errors)
    return policy
