"""docs/clients.md, run: every Python, Node and shell snippet of the client guide, as
printed, in a fresh process configured by the guide's own environment block, through a proxy
loaded from config/clients.yaml to ``quota-proxy mock-vendor --tls ca`` (a process of its
own), both started as the guide's "Try it on your machine" section prints them, on free
ports. The Anthropic, PyGithub and Slack snippets run against the tests' stand-in
(tests/helpers/guide.py says how). What each prints, what reached the proxy and the vendor,
and the claims around it (a bypass, a lost setting) are checked here.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path

import certifi
import pytest

from proxy.pipeline.responses import refusal_response
from proxy.policy import parse_policy
from proxy.server import ProxyServer
from proxy.wire.refusals import Limited
from tests.conftest import ProxyFactory, client_session
from tests.helpers.cli import ROOT, cli, server_process
from tests.helpers.guide import GUIDE, PROXY_ADDRESS, VENDOR_ADDRESS, GuideWorker, Ran, blocks, celery_driver, snippets
from tests.helpers.sdks import connects, outcomes
from tests.helpers.vendor_process import VendorProcess, vendor_process

pytestmark = pytest.mark.long  # fresh processes, seconds each; the one timed test is marked below

STRIPE = "api.stripe.com"
SPENT = "[{rate: 1, per: 1h, burst: 1}]"
"""One token, then an hour's wait: beyond answers_max_wait, so the SDKs raise at once."""
REPLY = "Hello from the mock vendor."

TESTED = {
    "try-mock-vendor",
    "try-proxy",
    "try-keys",
    "bundle",
    "env",
    "plain-http",
    "requests-env",
    "requests-session-verify",
    "requests-urllib3-retry",
    "httpx-env",
    "aiohttp-trust-env",
    "stripe-policy",
    "stripe-ca-bundle",
    "openai-env",
    "anthropic-env",
    "answers-override",
    "github-sdk",
    "slack-sdk",
    "celery-task",
    "curl-env",
    "curl-retry-shed",
    "node-builtin-fetch-bypasses",
    "node-global-dispatcher",
}
"""The snippets this module runs, one test (or more) each."""


def printed_command(name: str) -> list[str]:
    """A one-line shell snippet's words, as printed."""
    (line,) = snippets()[name].code.splitlines()
    return shlex.split(line)


class Mocked:
    """The guide's set-up: the reader's directory, the mock vendor, and proxies from
    config/clients.yaml (with the limits a test needs)."""

    def __init__(self, worker: GuideWorker, vendor: VendorProcess, start_proxy: ProxyFactory) -> None:
        self.worker = worker
        self.vendor = vendor
        self._start_proxy = start_proxy

    async def start(self, limits: str | None = None, on_limit: str | None = None) -> ProxyServer:
        """config/clients.yaml as printed, on free ports, pointing at the running mock vendor;
        ``limits`` and ``on_limit`` replace both vendors' (to spend the quota on purpose)."""
        config = self.write_config(limits, on_limit)
        text = config.read_text()
        return await self._start_proxy(parse_policy(text, str(config), base_dir=config.parent))

    def write_config(self, limits: str | None = None, on_limit: str | None = None) -> Path:
        """The reader's config/clients.yaml: as printed, on free ports, pointing at the running
        mock vendor (``start``)."""
        text = (ROOT / "config" / "clients.yaml").read_text()
        port = self.vendor.url.rsplit(":", 1)[1]
        for fixed, free in [
            ("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0"),
            ("admin_listen: 127.0.0.1:9090", "admin_listen: 127.0.0.1:0"),
            (f"upstream: https://{VENDOR_ADDRESS}", f"upstream: https://127.0.0.1:{port}"),
        ]:
            assert fixed in text, fixed
            text = text.replace(fixed, free)
        if limits is not None:
            text, count = re.subn(r"(?m)^    limits: .*$", f"    limits: {limits}", text)
            assert count == 5
        if on_limit is not None:
            text = text.replace("    limits: ", f"    on_limit: {on_limit}\n    limits: ")
        config = self.worker.work / "config" / "clients.yaml"
        config.write_text(text)
        return config

    async def run(self, name: str, proxy: ProxyServer, **kwargs) -> Ran:
        snippet = snippets()[name]
        return await self.worker.run(snippet.code, snippet.lang, proxy.url, **kwargs)

    async def paths(self) -> list[str]:
        return [r["path_qs"] for r in await self.vendor.requests()]


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[Path]:
    """The reader's directory (the repository's root in the guide)."""
    work = tmp_path / "reader"
    (work / "config").mkdir(parents=True)
    yield work


@pytest.fixture
async def mocked(reader: Path, tmp_path: Path, start_proxy: ProxyFactory) -> AsyncIterator[Mocked]:
    """The guide's "Try it" steps: the mock vendor as printed (a free port for 8443), then the
    bundle as printed, from the reader's directory."""
    argv = printed_command("try-mock-vendor")
    assert argv[:2] == ["quota-proxy", "mock-vendor"] and argv[2:] == ["--tls", "ca", "--listen", VENDOR_ADDRESS]
    assert printed_command("try-proxy") == ["quota-proxy", "run", "-c", "config/clients.yaml"]
    with ExitStack() as stack:
        vendor = stack.enter_context(vendor_process(tmp_path, ca_dir=Path(argv[3]), cwd=reader))
        worker = GuideWorker(reader)
        made = await worker.run(snippets()["bundle"].code, "sh", "http://127.0.0.1:9")
        assert made.status == 0, made.err
        yield Mocked(worker, vendor, start_proxy)


def ok(ran: Ran) -> list[str]:
    assert ran.status == 0, f"exit {ran.status}\nstdout:\n{ran.out}\nstderr:\n{ran.err}"
    return ran.out.splitlines()


async def spend_the_token(proxy: ProxyServer) -> None:
    """Take Stripe's token with a plain request of another worker."""
    async with client_session() as s, s.get(f"http://{STRIPE}/v1/customers/cus_0", proxy=proxy.url) as r:
        assert r.status == 200


# -- the guide itself ----------------------------------------------------------------------------


def test_every_runnable_block_is_a_snippet_this_module_runs() -> None:
    found = blocks()
    assert found, GUIDE
    unmarked = [b for b in found if b.kind is None]
    assert not unmarked, f"blocks without a snippet/untested marker: {[b.code[:60] for b in unmarked]}"
    names = [b.name for b in found]
    assert len(names) == len(set(names)), names
    untested = {b.name: b for b in found if b.kind == "untested"}
    assert set(untested) == {"go", "java"}, untested  # the guide says so of those two only
    assert set(snippets()) == TESTED
    assert {b.lang for b in snippets().values()} <= {"python", "js", "sh", "yaml"}
    assert "docs/clients.md" in (ROOT / "README.md").read_text()


async def test_the_bundle_is_the_public_cas_plus_the_one_ca_the_mock_vendor_made(mocked: Mocked) -> None:
    ca = mocked.worker.ca_dir
    assert (ca / "bundle.pem").read_text() == Path(certifi.where()).read_text() + (ca / "ca.pem").read_text()
    assert mocked.vendor.ca_file == ca / "ca.pem"


def test_the_env_block_points_at_the_proxy_of_config_clients_yaml() -> None:
    text = (ROOT / "config" / "clients.yaml").read_text()
    assert f"listen: {PROXY_ADDRESS.removeprefix('http://')}" in text
    assert snippets()["env"].code.count(PROXY_ADDRESS) == 4


def test_the_stripe_policy_fragment_is_a_valid_policy() -> None:
    text = "version: 1\n" + snippets()["stripe-policy"].code
    (vendor,) = parse_policy(text, "docs/clients.md", base_dir=ROOT).vendors
    assert (vendor.name, vendor.answers.name, vendor.hosts) == ("stripe", "stripe", ("api.stripe.com",))


# -- Python HTTP clients ----------------------------------------------------------------------------


async def test_requests_needs_nothing_but_the_environment(mocked: Mocked) -> None:
    proxy = await mocked.start()
    assert ok(await mocked.run("requests-env", proxy)) == ["200 customer"]
    assert await mocked.paths() == ["/v1/customers/cus_123"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}


async def test_an_exported_bundle_beats_session_verify(mocked: Mocked) -> None:
    proxy = await mocked.start()
    # A stale REQUESTS_CA_BUNDLE, without the proxy's CA, is exported.
    ran = await mocked.run("requests-session-verify", proxy, env={"REQUESTS_CA_BUNDLE": certifi.where()})
    assert ok(ran) == ["Session.verify lost to REQUESTS_CA_BUNDLE", "200"]
    assert await mocked.paths() == ["/v1/customers/cus_123"]


@pytest.mark.timing  # its snippet must start inside the 3 s slot it is deferred to
async def test_urllib3_retry_waits_out_a_defer_and_leaves_a_shed_alone(mocked: Mocked) -> None:
    deferring = await mocked.start(limits="[{rate: 1, per: 3s, burst: 1}]", on_limit="{action: defer}")
    await spend_the_token(deferring)
    started = time.monotonic()
    assert ok(await mocked.run("requests-urllib3-retry", deferring)) == ["200 -"]
    assert time.monotonic() - started >= 1  # it slept Retry-After's whole seconds
    assert outcomes(deferring, "stripe") == {"forwarded": 2, "deferred": 1}

    shedding = await mocked.start(limits=SPENT, on_limit="{action: shed}")
    await spend_the_token(shedding)
    assert ok(await mocked.run("requests-urllib3-retry", shedding)) == ["503 shed"]
    assert outcomes(shedding, "stripe") == {"forwarded": 1, "shed": 1}  # no Retry-After, no retry


async def test_httpx_needs_nothing_but_the_environment(mocked: Mocked) -> None:
    proxy = await mocked.start()
    assert ok(await mocked.run("httpx-env", proxy)) == ["200 customer"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}


async def test_aiohttp_goes_through_the_proxy_only_with_trust_env(mocked: Mocked) -> None:
    proxy = await mocked.start()
    assert ok(await mocked.run("aiohttp-trust-env", proxy)) == ["200 customer"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}
    # Without trust_env=True the same code goes straight to api.stripe.com: neither the proxy
    # nor the mock vendor hears of it.
    snippet = snippets()["aiohttp-trust-env"]
    bypass = snippet.code.replace("aiohttp.ClientSession(trust_env=True)", "aiohttp.ClientSession()")
    assert bypass != snippet.code
    ran = await mocked.worker.run(bypass, "python", proxy.url)
    assert ran.out != "200 customer\n", ran.out
    assert connects(proxy) == 1 and len(await mocked.paths()) == 1


# -- vendor SDKs -----------------------------------------------------------------------------------


async def test_stripe_trusts_only_its_ca_bundle_path(mocked: Mocked) -> None:
    proxy = await mocked.start()
    (customer,) = ok(await mocked.run("stripe-ca-bundle", proxy))
    assert re.fullmatch(r"cus_[A-Za-z0-9]{14}", customer), customer
    (seen,) = await mocked.vendor.requests()
    assert (seen["method"], seen["path_qs"]) == ("POST", "/v1/customers")
    assert seen["headers"]["authorization"] == "Bearer sk_test_mock"  # the guide's try-keys
    # Without the ca_bundle_path line the SDK trusts its own bundle, whatever REQUESTS_CA_BUNDLE
    # and SSL_CERT_FILE (both exported by the guide's env block) say.
    snippet = snippets()["stripe-ca-bundle"]
    without = "\n".join(line for line in snippet.code.splitlines() if "ca_bundle_path" not in line)
    ran = await mocked.worker.run(without, "python", proxy.url)
    assert ran.status != 0 and "stripe._error.APIConnectionError" in ran.err, ran.err
    assert "CERTIFICATE_VERIFY_FAILED" in ran.err
    assert len(await mocked.paths()) == 1


async def test_the_openai_sdk_needs_nothing_but_the_environment(mocked: Mocked) -> None:
    proxy = await mocked.start(limits=SPENT)
    assert ok(await mocked.run("openai-env", proxy)) == [REPLY]
    # The bucket is spent for an hour: longer than answers_max_wait, so the SDK raises at
    # once (no retry) and the wait is readable.
    (line,) = ok(await mocked.run("openai-env", proxy))
    assert line.startswith("rate limited; come back in ") and line.endswith(" s"), line
    assert 3000 < int(line.split()[-2]) <= 3600
    assert outcomes(proxy, "openai") == {"forwarded": 1, "deferred": 1}
    assert await mocked.paths() == ["/v1/chat/completions"]


async def test_the_anthropic_sdk_needs_nothing_but_the_environment(mocked: Mocked) -> None:
    proxy = await mocked.start(limits=SPENT)
    (reply,) = ok(await mocked.run("anthropic-env", proxy))
    assert reply, "the mock's made-up text"
    (seen,) = await mocked.vendor.requests()
    assert seen["path_qs"] == "/v1/messages", seen
    said = seen["headers"]  # try-keys' key (x-api-key, or a bearer token in newer SDKs)
    assert "sk-ant-mock" in (said.get("x-api-key", ""), said.get("authorization", "").removeprefix("Bearer ")), said
    (line,) = ok(await mocked.run("anthropic-env", proxy))
    assert line.startswith("rate limited; come back in ") and line.endswith(" s"), line
    assert 3000 < int(line.split()[-2]) <= 3600
    assert outcomes(proxy, "anthropic") == {"forwarded": 1, "deferred": 1}


async def test_the_plain_http_section_runs_against_the_example_policy(reader: Path, vendor, start_proxy) -> None:
    """config/example.yaml as written, but for its ports (free ones, the mock vendor's)."""
    text = (ROOT / "config" / "example.yaml").read_text()
    for fixed, free in [
        ("listen: 127.0.0.1:8080", "listen: 127.0.0.1:0"),
        ("admin_listen: 127.0.0.1:9090", "admin_listen: 127.0.0.1:0"),
        ("upstream: http://127.0.0.1:8081", f"upstream: {vendor.url}"),
    ]:
        assert fixed in text
        text = text.replace(fixed, free)
    proxy = await start_proxy(parse_policy(text, "config/example.yaml", base_dir=ROOT))
    code = snippets()["plain-http"].code.replace("http://127.0.0.1:8080", proxy.url)
    ran = await GuideWorker(reader).run(code, "python", proxy.url)
    assert ok(ran) == ["200 forwarded"]
    assert outcomes(proxy, "mock-vendor") == {"forwarded": 1}


def test_the_answers_override_fragment_sheds_with_its_status_and_body() -> None:
    text = "version: 1\n" + snippets()["answers-override"].code
    (vendor,) = parse_policy(text, "docs/clients.md", base_dir=ROOT).vendors
    shed = refusal_response(Limited("shed", 0.5, "global", "global 50/1s"), vendor)
    assert shed.status == 409
    body = json.loads(shed.body)  # type: ignore[arg-type]
    (error,) = body["errors"]
    assert (error["code"], error["retry_after"]) == ("shed", None) and "was shed" in error["message"]
    assert body["action"] == "shed"  # the generic keys follow the template's
    defer = refusal_response(Limited("defer", 1.5, "global", "global 50/1s", hint=1.5), vendor)
    assert defer.status == 429
    assert json.loads(defer.body)["errors"][0]["retry_after"] == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "vendor"), [("github-sdk", "github"), ("slack-sdk", "slack")])
async def test_pygithub_and_slack_sdk_with_their_presets(mocked: Mocked, name, vendor) -> None:
    proxy = await mocked.start(limits=SPENT)
    assert ok(await mocked.run(name, proxy)) == ["The Mock" if vendor == "github" else "True"]
    (seen,) = await mocked.vendor.requests()
    assert seen["path_qs"] == ("/users/octocat" if vendor == "github" else "/api/api.test"), seen
    # The bucket is spent for an hour: a long defer, raised at once by either SDK (their
    # retries would have slept it out as a 403 or a 429), the wait readable.
    (line,) = ok(await mocked.run(name, proxy))
    if vendor == "github":
        assert line.startswith("not now: 409 defer for ") and 3000 < int(line.split()[-2]) <= 3600, line
    else:
        assert line.startswith("rate limited; come back in ") and 3000 < int(line.split()[-2]) <= 3600, line
    assert outcomes(proxy, vendor) == {"forwarded": 1, "deferred": 1}


async def test_the_celery_task_re_enqueues_a_long_defer(mocked: Mocked) -> None:
    proxy = await mocked.start(limits=SPENT)
    snippet = snippets()["celery-task"]
    first, second = ok(
        await mocked.worker.run(snippet.code, "python", proxy.url, driver=celery_driver("summarize", "first", "second"))
    )
    assert first == f"result: {REPLY}"
    assert second.startswith("re-enqueued, countdown: ")
    countdown = float(second.split()[-1])
    assert 3000 < countdown <= 3600 * 1.2 + 1, countdown  # Retry-After plus up to 20 % jitter
    assert outcomes(proxy, "openai") == {"forwarded": 1, "deferred": 1}


async def test_the_try_it_steps_run_as_printed(mocked: Mocked, tmp_path: Path) -> None:
    """ "Try it on your machine" as printed: the mock vendor (the fixture), then ``quota-proxy
    run -c config/clients.yaml`` from the reader's directory, a process of its own (the other
    tests start config/clients.yaml in process, with the limits they need), and a client
    snippet through it: the environment and the bundle are all curl needs."""
    mocked.write_config()
    argv = printed_command("try-proxy")
    with server_process(cli(*argv[1:]), tmp_path, cwd=mocked.worker.work) as proxy:
        ready = proxy.wait_ready()
        assert ready.vendors == 5, ready
        snippet = snippets()["curl-env"]
        (line,) = ok(await mocked.worker.run(snippet.code, snippet.lang, ready.url))
        assert json.loads(line)["object"] == "customer"
        assert proxy.terminate_and_wait() == 0, proxy.stderr()


# -- curl -----------------------------------------------------------------------------------------


async def test_curl_needs_nothing_but_the_environment(mocked: Mocked) -> None:
    proxy = await mocked.start()
    (line,) = ok(await mocked.run("curl-env", proxy))
    assert json.loads(line)["object"] == "customer"
    (seen,) = await mocked.vendor.requests()
    assert seen["headers"]["authorization"].startswith("Basic ")


async def test_curl_retry_retries_a_shed(mocked: Mocked) -> None:
    proxy = await mocked.start(limits=SPENT, on_limit="{action: shed}")
    await spend_the_token(proxy)
    assert ok(await mocked.run("curl-retry-shed", proxy)) == ["503"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1, "shed": 3}  # x-should-retry: false, retried twice


# -- Node -------------------------------------------------------------------------------------------


async def test_nodes_built_in_fetch_ignores_https_proxy(mocked: Mocked) -> None:
    proxy = await mocked.start()
    ran = await mocked.run("node-builtin-fetch-bypasses", proxy)
    # It went for api.stripe.com itself, never the proxy (so never the mock vendor either).
    assert ran.out != "200\n", ran.out
    assert connects(proxy) == 0 and await mocked.paths() == []


async def test_node_with_undicis_global_dispatcher_goes_through_the_proxy(mocked: Mocked) -> None:
    proxy = await mocked.start()
    assert ok(await mocked.run("node-global-dispatcher", proxy)) == ["200 customer"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}
    assert await mocked.paths() == ["/v1/customers/cus_123"]
