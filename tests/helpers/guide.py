"""docs/clients.md's snippets, run as written against a running proxy.

Each runnable fenced block of the guide follows a marker, ``<!-- snippet: NAME -->``; the
Go and Java ones follow ``<!-- untested: NAME -->``. A snippet runs in a fresh process
whose environment is the guide's own ``env`` snippet, sourced by bash, on top of the test's
clean environment. Only these stand-ins differ from a real deployment:

- ``http://quota-proxy:8080`` is the running proxy's address and ``/etc/quota-proxy/`` a
  directory of the test (with the proxy's ``ca.pem``, and ``bundle.pem`` made by the
  guide's ``bundle`` snippet);
- the vendors' real host names (``api.stripe.com``...) are their ``.example`` stand-ins,
  which resolve nowhere and which the test proxy maps to the mock vendor; the SDKs' default
  base URLs are pointed there too (OPENAI_BASE_URL, ANTHROPIC_BASE_URL, and for Stripe,
  which has no such variable, a ``sitecustomize`` that changes its default API base);
- API keys are dummies and Celery's broker is ``memory://``.
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
from tests.helpers.sdks import HOSTS

GUIDE = ROOT / "docs" / "clients.md"

_BLOCK = re.compile(
    r"(?:<!-- (?P<kind>snippet|untested): (?P<name>[\w-]+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```", re.S
)
_CLIENT_ENV = (*TRUST_VARS, "NODE_OPTIONS", "CELERY_BROKER_URL")
_REAL_HOSTS = {
    "stripe": "api.stripe.com",
    "openai": "api.openai.com",
    "anthropic": "api.anthropic.com",
    "github": "api.github.com",
    "slack": "slack.com",
}

SITECUSTOMIZE = f"""
# Test stand-in (tests/helpers/guide.py): Stripe's SDK has no base-URL variable, so its
# default API base becomes the test vendor's host name.
import stripe
import stripe._stripe_client

stripe.api_base = stripe._stripe_client.DEFAULT_API_BASE = "https://{HOSTS["stripe"]}"
"""


@dataclass(frozen=True)
class Block:
    kind: str | None
    """snippet, untested, or None (no marker)"""
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
    """A worker machine set up as the guide says: the proxy's CA and bundle in ``etc``
    (standing in for /etc/quota-proxy), the guide's environment."""

    etc: Path
    work: Path

    def substitute(self, text: str, proxy_url: str) -> str:
        text = text.replace("http://quota-proxy:8080", proxy_url).replace("/etc/quota-proxy/", f"{self.etc}/")
        for name, real in _REAL_HOSTS.items():
            text = text.replace(real, HOSTS[name])
        return text

    def environment(self) -> dict[str, str]:
        """The test's clean environment, this venv's executables first on PATH, the stand-ins."""
        env = {k: v for k, v in clean_env(checkout=False).items() if k not in _CLIENT_ENV}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        site = self.work / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["PYTHONPATH"] = str(site)
        env.update(
            OPENAI_BASE_URL=f"https://{HOSTS['openai']}/v1",
            ANTHROPIC_BASE_URL=f"https://{HOSTS['anthropic']}",
            OPENAI_API_KEY="sk-test-guide",
            ANTHROPIC_API_KEY="sk-ant-test-guide",
            STRIPE_API_KEY="sk_test_guide",
            GITHUB_TOKEN="ghp_test_guide",
            SLACK_BOT_TOKEN="xoxb-test-guide",
            CELERY_BROKER_URL="memory://",
        )
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
        """Run ``code`` (a snippet, as a ``lang`` file) in the guide's environment, then
        ``env`` exported on top of it; with ``driver``, run that Python script instead,
        given the snippet's path first."""
        setup = self.substitute(snippets()["env"].code, proxy_url)
        body = self.substitute(code, proxy_url)
        cwd = self.work
        if lang == "python":
            path = self.work / "snippet.py"
            command = ["python", str(path)]
        elif lang == "js":
            path = self.work / "snippet.mjs"
            modules = self.work / "node_modules"
            if not modules.exists():
                modules.symlink_to(NODE_DIR / "node_modules", target_is_directory=True)
            command = [node(), str(path)]
        elif lang == "sh":
            path = self.work / "snippet.sh"
            command = ["bash", "-e", str(path)]
        else:
            raise ValueError(f"cannot run a {lang!r} block")
        path.write_text(body + "\n")
        if driver is not None:
            script = self.work / "driver.py"
            script.write_text(driver)
            command = ["python", str(script), str(path)]
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
        (self.work / "env.sh").write_text(setup + "\n" + exports)
        status, out, err = await run_process(
            ["bash", "-ec", 'source "$1"; shift; exec "$@"', "guide", str(self.work / "env.sh"), *command, *argv],
            env=self.environment(),
            cwd=cwd,
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
