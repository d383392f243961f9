"""Node workers for the client tests: ``tests/node/`` holds undici (its ``EnvHttpProxyAgent``
reads HTTP_PROXY/HTTPS_PROXY, which Node's built-in fetch and https ignore) and
``client.mjs``, one request the way a Node worker makes it.

``scripts/test`` runs ``npm ci`` there; a machine without node, or without the installed
package, fails these tests rather than skipping them.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import ROOT, run_process

NODE_DIR = ROOT / "tests" / "node"


def node() -> str:
    """The ``node`` binary, with undici installed in tests/node; fails the test otherwise."""
    binary = shutil.which("node")
    if binary is None:
        pytest.fail("node is not installed: the Node client tests need Node 20+ (scripts/test installs it with apt)")
    if not (NODE_DIR / "node_modules" / "undici" / "package.json").is_file():
        pytest.fail(f"undici is not installed in {NODE_DIR}: run `npm ci` there (scripts/test does)")
    return binary


@dataclass
class NodeAnswer:
    status: int
    headers: dict[str, str]  # lower-case names (fetch's Headers)
    body: bytes


@dataclass
class NodeFailure:
    """The request failed below HTTP: ``code`` is Node's (SELF_SIGNED_CERT_IN_CHAIN, ECONNREFUSED...)."""

    error: str
    code: str | None
    cause: str


async def run_node(argv: list[str], env: Mapping[str, str], cwd: Path = NODE_DIR) -> tuple[int, str, str]:
    """``node ARGV`` in ``cwd`` with exactly ``env``: (exit status, stdout, stderr)."""
    return await run_process([node(), *argv], env=env, cwd=cwd, timeout=60)


async def node_fetch(
    method: str,
    url: str,
    headers: Mapping[str, str],
    body_file: Path | None,
    *,
    env: Mapping[str, str] | None = None,
) -> NodeAnswer | NodeFailure:
    """One request by tests/node/client.mjs (undici fetch through EnvHttpProxyAgent). The
    environment is the test's (``os.environ``, as monkeypatched) unless ``env`` is given."""
    argv = ["client.mjs", method, url, json.dumps(dict(headers))]
    if body_file is not None:
        argv.append(str(body_file))
    status, out, err = await run_node(argv, os.environ if env is None else env)
    parsed: Any = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
    if status == 3 and parsed is not None:
        return NodeFailure(parsed["error"], parsed["code"], parsed["cause"])
    assert status == 0 and parsed is not None, f"node exited {status}: {err}"
    return NodeAnswer(parsed["status"], parsed["headers"], base64.b64decode(parsed["body"]))


async def node_request(
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes | None,
    tmp: Path,
    *,
    env: Mapping[str, str] | None = None,
) -> NodeAnswer:
    """``node_fetch`` with ``body`` (uploaded from a file in ``tmp``); the answer must be HTTP."""
    upload = None
    if body is not None:
        upload = tmp / "node-upload"
        upload.write_bytes(body)
    got = await node_fetch(method, url, headers, upload, env=env)
    assert isinstance(got, NodeAnswer), got
    return got
