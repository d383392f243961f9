"""docs/clients.md, run: every Python, Node and shell snippet of the client guide, as
written, in a fresh process configured by the guide's own environment block, against a
running proxy (the stand-ins are listed in tests/helpers/guide.py). What each prints, what
reached the proxy and the vendor, and the claims around it (a bypass, a lost setting) are
checked here.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import certifi
import pytest

from proxy.pipeline.refusals import Limited
from proxy.pipeline.responses import refusal_response
from proxy.policy import parse_policy
from proxy.server import ProxyServer
from tests.conftest import client_session
from tests.helpers.cli import ROOT
from tests.helpers.guide import GUIDE, GuideWorker, Ran, blocks, celery_driver, snippets
from tests.helpers.sdks import HOSTS, connects, outcomes

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

CUSTOMER = f"https://{HOSTS['stripe']}/v1/customers/cus_123"
SPENT = "[{rate: 1, per: 1h, burst: 1}]"
"""One token, then an hour's wait: beyond answers_max_wait, so the SDKs raise at once."""

TESTED = {
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


@pytest.fixture
async def guide(sdk_proxies, tmp_path: Path) -> GuideWorker:
    """A worker machine set up by the guide: /etc/quota-proxy holds the CA, and the bundle
    the guide's ``bundle`` snippet makes from it."""
    etc = tmp_path / "etc-quota-proxy"
    etc.mkdir()
    shutil.copy(sdk_proxies.trust.ca_cert, etc / "ca.pem")
    work = tmp_path / "work"
    work.mkdir()
    worker = GuideWorker(etc, work)
    made = await worker.run(snippets()["bundle"].code, "sh", "http://127.0.0.1:9")
    assert made.status == 0, made.err
    return worker


async def run(guide: GuideWorker, name: str, proxy: ProxyServer, **kwargs) -> Ran:
    snippet = snippets()[name]
    return await guide.run(snippet.code, snippet.lang, proxy.url, **kwargs)


def ok(ran: Ran) -> list[str]:
    assert ran.status == 0, f"exit {ran.status}\nstdout:\n{ran.out}\nstderr:\n{ran.err}"
    return ran.out.splitlines()


async def spend_the_token(proxy: ProxyServer) -> None:
    """Take the bucket's token with a plain request of another worker."""
    async with client_session() as s, s.get(f"http://{HOSTS['stripe']}/v1/other", proxy=proxy.url) as r:
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


def test_the_bundle_is_the_public_cas_plus_the_proxys(guide: GuideWorker) -> None:
    bundle = (guide.etc / "bundle.pem").read_text()
    assert bundle == Path(certifi.where()).read_text() + (guide.etc / "ca.pem").read_text()


def test_the_stripe_policy_fragment_is_a_valid_policy() -> None:
    text = "version: 1\n" + snippets()["stripe-policy"].code
    (vendor,) = parse_policy(text, "docs/clients.md", base_dir=ROOT).vendors
    assert (vendor.name, vendor.answers.name, vendor.hosts) == ("stripe", "stripe", ("api.stripe.com",))


# -- Python HTTP clients ----------------------------------------------------------------------------


async def test_requests_needs_nothing_but_the_environment(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    assert ok(await run(guide, "requests-env", proxy)) == ["200 customer"]
    assert sdk_proxies.vendor.mock.paths() == ["/v1/customers/cus_123"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}


async def test_an_exported_bundle_beats_session_verify(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    # A stale REQUESTS_CA_BUNDLE, without the proxy's CA, is exported.
    ran = await run(guide, "requests-session-verify", proxy, env={"REQUESTS_CA_BUNDLE": certifi.where()})
    assert ok(ran) == ["Session.verify lost to REQUESTS_CA_BUNDLE", "200"]
    assert sdk_proxies.vendor.mock.paths() == ["/v1/customers/cus_123"]


async def test_urllib3_retry_waits_out_a_defer_and_leaves_a_shed_alone(guide, sdk_proxies) -> None:
    deferring = await sdk_proxies.start(limits="[{rate: 1, per: 3s, burst: 1}]", on_limit="{action: defer}")
    await spend_the_token(deferring)
    started = time.monotonic()
    assert ok(await run(guide, "requests-urllib3-retry", deferring)) == ["200 -"]
    assert time.monotonic() - started >= 1  # it slept Retry-After's whole seconds
    assert outcomes(deferring, "stripe") == {"forwarded": 2, "deferred": 1}

    shedding = await sdk_proxies.start(limits=SPENT, on_limit="{action: shed}")
    await spend_the_token(shedding)
    assert ok(await run(guide, "requests-urllib3-retry", shedding)) == ["503 shed"]
    assert outcomes(shedding, "stripe") == {"forwarded": 1, "shed": 1}  # no Retry-After, no retry


async def test_httpx_needs_nothing_but_the_environment(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    assert ok(await run(guide, "httpx-env", proxy)) == ["200 customer"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}


async def test_aiohttp_goes_through_the_proxy_only_with_trust_env(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    assert ok(await run(guide, "aiohttp-trust-env", proxy)) == ["200 customer"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}
    # Without trust_env=True the same code goes straight to the vendor (whose name resolves
    # nowhere here): the proxy never hears of it.
    snippet = snippets()["aiohttp-trust-env"]
    bypass = snippet.code.replace("aiohttp.ClientSession(trust_env=True)", "aiohttp.ClientSession()")
    assert bypass != snippet.code
    ran = await guide.run(bypass, "python", proxy.url)
    assert ran.status != 0 and "ClientConnectorDNSError" in ran.err, ran.err
    assert connects(proxy) == 1


# -- vendor SDKs -----------------------------------------------------------------------------------


async def test_stripe_trusts_only_its_ca_bundle_path(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    assert ok(await run(guide, "stripe-ca-bundle", proxy)) == ["cus_test1"]
    (seen,) = sdk_proxies.vendor.mock.seen
    assert (seen.method, seen.path, seen.headers["authorization"]) == ("POST", "/v1/customers", "Bearer sk_test_guide")
    # Without the ca_bundle_path line the SDK trusts its own bundle, whatever REQUESTS_CA_BUNDLE
    # and SSL_CERT_FILE (both exported by the guide's env block) say.
    snippet = snippets()["stripe-ca-bundle"]
    without = "\n".join(line for line in snippet.code.splitlines() if "ca_bundle_path" not in line)
    ran = await guide.run(without, "python", proxy.url)
    assert ran.status != 0 and "stripe._error.APIConnectionError" in ran.err, ran.err
    assert "CERTIFICATE_VERIFY_FAILED" in ran.err
    assert len(sdk_proxies.vendor.mock.seen) == 1


@pytest.mark.parametrize(("name", "vendor"), [("openai-env", "openai"), ("anthropic-env", "anthropic")])
async def test_the_openai_and_anthropic_sdks_need_nothing_but_the_environment(guide, sdk_proxies, name, vendor) -> None:
    proxy = await sdk_proxies.start(limits=SPENT)
    assert ok(await run(guide, name, proxy)) == ["hello from the mock"]
    # The bucket is spent for an hour: longer than answers_max_wait, so the SDK raises at
    # once (no retry) and the wait is readable.
    (line,) = ok(await run(guide, name, proxy))
    assert line.startswith("rate limited; come back in ") and line.endswith(" s"), line
    assert 3000 < int(line.split()[-2]) <= 3600
    assert outcomes(proxy, vendor) == {"forwarded": 1, "deferred": 1}


async def test_the_plain_http_section_runs_against_the_example_policy(guide, vendor, start_proxy) -> None:
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
    ran = await guide.run(code, "python", proxy.url)
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
async def test_pygithub_and_slack_sdk_with_their_presets(guide, sdk_proxies, name, vendor) -> None:
    proxy = await sdk_proxies.start(limits=SPENT)
    assert ok(await run(guide, name, proxy)) == ["The Mock" if vendor == "github" else "True"]
    # The bucket is spent for an hour: a long defer, raised at once by either SDK (their
    # retries would have slept it out as a 403 or a 429), the wait readable.
    (line,) = ok(await run(guide, name, proxy))
    if vendor == "github":
        assert line.startswith("not now: 409 defer for ") and 3000 < int(line.split()[-2]) <= 3600, line
    else:
        assert line.startswith("rate limited; come back in ") and 3000 < int(line.split()[-2]) <= 3600, line
    assert outcomes(proxy, vendor) == {"forwarded": 1, "deferred": 1}


async def test_the_celery_task_re_enqueues_a_long_defer(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start(limits=SPENT)
    snippet = snippets()["celery-task"]
    first, second = ok(
        await guide.run(snippet.code, "python", proxy.url, driver=celery_driver("summarize", "first", "second"))
    )
    assert first == "result: hello from the mock"
    assert second.startswith("re-enqueued, countdown: ")
    countdown = float(second.split()[-1])
    assert 3000 < countdown <= 3600 * 1.2 + 1, countdown  # Retry-After plus up to 20 % jitter
    assert outcomes(proxy, "openai") == {"forwarded": 1, "deferred": 1}


# -- curl -----------------------------------------------------------------------------------------


async def test_curl_needs_nothing_but_the_environment(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    (line,) = ok(await run(guide, "curl-env", proxy))
    assert json.loads(line)["object"] == "customer"
    (seen,) = sdk_proxies.vendor.mock.seen
    assert seen.headers["authorization"].startswith("Basic ")


async def test_curl_retry_retries_a_shed(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start(limits=SPENT, on_limit="{action: shed}")
    await spend_the_token(proxy)
    assert ok(await run(guide, "curl-retry-shed", proxy)) == ["503"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1, "shed": 3}  # x-should-retry: false, retried twice


# -- Node -------------------------------------------------------------------------------------------


async def test_nodes_built_in_fetch_ignores_https_proxy(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    ran = await run(guide, "node-builtin-fetch-bypasses", proxy)
    # It went for the vendor's own address (which resolves nowhere here), never the proxy.
    assert ran.status != 0 and "ENOTFOUND" in ran.err and HOSTS["stripe"] in ran.err, ran.err
    assert connects(proxy) == 0


async def test_node_with_undicis_global_dispatcher_goes_through_the_proxy(guide, sdk_proxies) -> None:
    proxy = await sdk_proxies.start()
    assert ok(await run(guide, "node-global-dispatcher", proxy)) == ["200 customer"]
    assert outcomes(proxy, "stripe") == {"forwarded": 1}
    assert sdk_proxies.vendor.mock.paths() == ["/v1/customers/cus_123"]
