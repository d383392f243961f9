"""docs/clients.md's snippets, run as printed against the set-up its "Try it on your machine"
section prints.

Each runnable fenced block of the guide follows a marker, ``<!-- snippet: NAME -->``; the
Go and Java ones follow ``<!-- untested: NAME -->``. A snippet runs in a fresh process, from
the reader's directory (``ca/`` and ``config/`` in it, as in the repository's root), whose
environment is the guide's own ``env`` and ``try-keys`` snippets, sourced by bash, on top
of the test's clean environment. The one change: the proxy listens on a free port, not
127.0.0.1:8080, so that address in the ``env`` block is the running proxy's.
The Kubernetes guide's worker runs the same way (tests/sdk/test_k8s_local.py), against the
mock vendor too.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.cli import ROOT, TRUST_VARS, clean_env, run_process
from tests.helpers.node import NODE_DIR, node

GUIDE = ROOT / "docs" / "clients.md"

_BLOCK = re.compile(
    r"(?:<!-- (?P<kind>snippet|untested|excerpt|output): (?P<name>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```",
    re.S,
)
_CLIENT_ENV = (
    *TRUST_VARS,
    "NODE_OPTIONS",
    "CELERY_BROKER_URL",
    "STRIPE_API_KEY",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "GITHUB_TOKEN",
    "SLACK_BOT_TOKEN",
)
PROXY_ADDRESS = "http://127.0.0.1:8080"
"""Where the guide's proxy listens (config/clients.yaml, the env block)."""
VENDOR_ADDRESS = "127.0.0.1:8443"
"""Where the guide's mock vendor listens (its command, config/clients.yaml's upstreams)."""


@dataclass(frozen=True)
class Block:
    kind: str | None
    """snippet (run), untested (runnable, said not run), excerpt (part of a file, compared with
    it), output (what a snippet prints, compared with what it printed), or None (no marker)"""
    name: str | None
    lang: str
    code: str


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the guide, with its marker if it has one."""
    source = GUIDE.read_text() if text is None else text
    return [Block(m["kind"], m["name"], m["lang"], m["code"]) for m in _BLOCK.finditer(source)]


def snippets() -> dict[str, Block]:
    return {b.name: b for b in blocks() if b.kind == "snippet" and b.name}


@dataclass(frozen=True)
class Ran:
    status: int
    out: str
    err: str


@dataclass
class GuideWorker:
    """A reader's machine set up as the guide says: ``work`` is the directory the guide's
    commands run from (the repository's root for a reader), with the CA and the bundle in
    ``work/ca``."""

    work: Path

    @property
    def ca_dir(self) -> Path:
        return self.work / "ca"

    @property
    def etc(self) -> Path:
        """Where the guides' CA and bundle are (/etc/quota-proxy/ in a deployment)."""
        return self.ca_dir

    def environment(self) -> dict[str, str]:
        """The test's clean environment, this venv's executables first on PATH, and a Celery
        broker."""
        env = {k: v for k, v in clean_env(checkout=False).items() if k not in _CLIENT_ENV}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["CELERY_BROKER_URL"] = "memory://"
        return env

    async def run(
        self,
        code: str,
        lang: str,
        proxy_url: str,
        *,
        env: Mapping[str, str] | None = None,
        argv: tuple[str, ...] = (),
        driver: str | None = None,
    ) -> Ran:
        """Run ``code`` (a snippet, as a ``lang`` file) from ``work`` in the guide's environment
        (the proxy at ``proxy_url``), then ``env`` exported on top of it; with ``driver``, run
        that Python script instead, given the snippet's path first."""
        guide = snippets()
        assert guide["env"].code.count(PROXY_ADDRESS) == 4, guide["env"].code
        setup = guide["env"].code.replace(PROXY_ADDRESS, proxy_url) + "\n" + guide["try-keys"].code
        body = code
        scratch = self.work / ".snippet"
        scratch.mkdir(exist_ok=True)
        if lang == "python":
            path = scratch / "snippet.py"
            command = ["python", str(path)]
        elif lang == "js":
            path = scratch / "snippet.mjs"
            modules = scratch / "node_modules"
            if not modules.exists():
                modules.symlink_to(NODE_DIR / "node_modules", target_is_directory=True)
            command = [node(), str(path)]
        elif lang == "sh":
            path = scratch / "snippet.sh"
            command = ["bash", "-e", str(path)]
        else:
            raise ValueError(f"cannot run a {lang!r} block")
        path.write_text(body + "\n")
        if driver is not None:
            script = scratch / "driver.py"
            script.write_text(driver)
            command = ["python", str(script), str(path)]
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        (scratch / "env.sh").write_text(setup + "\n" + exports)
        status, out, err = await run_process(
            ["bash", "-ec", 'source "$1"; shift; exec "$@"', "guide", str(scratch / "env.sh"), *command, *argv],
            env=self.environment(),
            cwd=self.work,
        )
        return Ran(status, out, err)


def celery_driver(task: str, *args: str) -> str:
    """A script that runs a guide's Celery task module (its path, the first argument) as a
    worker runs a delivered job, once per item of ``args``: with a request of its own, and
    prints its result or the countdown of its re-enqueue."""
    return f"""
import importlib.util
import sys

from celery.exceptions import Retry

spec = importlib.util.spec_from_file_location("jobs", sys.argv[1])
jobs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(jobs)
for arg in {list(args)!r}:
    jobs.{task}.push_request(id=f"job-{{arg}}", args=[arg], kwargs={{}}, retries=0, called_directly=False)
    try:
        print("result:", jobs.{task}.run(arg))
    except Retry as retry:
        print("re-enqueued, countdown:", retry.when)
    finally:
        jobs.{task}.pop_request()
"""
