"""PyGithub and slack_sdk, unchanged, through HTTPS_PROXY with interception (SPEC §9): SDKs
whose retries do not read x-should-retry. PyGithub's default ``GithubRetry`` retries every
5xx whatever the headers, a 403 with ``Retry-After`` or a rate-limit message, and a 429
with ``Retry-After``; slack_sdk's ``RateLimitErrorRetryHandler`` retries every 429 after
``Retry-After``. The ``github`` and ``slack`` presets answer a shed and a long defer with a
status those retries leave alone, and a defer as the vendor's own rate limit."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import github
import pytest
from github.GithubRetry import GithubRetry
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry import builtin_handlers as slack_retry
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler

from proxy.tls import intercept
from tests.helpers.sdks import HOSTS, outcomes

pytestmark = pytest.mark.timing  # waits out real Retry-After seconds

SHED = {"limits": "[{rate: 1, per: 1h, burst: 1}]", "on_limit": "{action: shed}"}
LONG = {"limits": "[{rate: 1, per: 1h, burst: 1}]", "on_limit": "{action: defer}"}
DEFER = {"limits": "[{rate: 1, per: 2s, burst: 1}]", "on_limit": "{action: defer}"}
"""One token, then: a shed; a defer for an hour (beyond answers_max_wait); a defer of ~2 s."""


def pygithub(retry: Any = "default") -> github.Github:
    """A PyGithub client as a worker builds one (its default GithubRetry unless told)."""
    auth = github.Auth.Token("ghp_quota_proxy_test")
    base = f"https://{HOSTS['github']}"
    if retry == "default":
        return github.Github(auth=auth, base_url=base)
    return github.Github(auth=auth, base_url=base, retry=retry)


def github_user(client: github.Github) -> tuple[Any, BaseException | None, float]:
    """One call, and the client closed (its keep-alive connection would hold the proxy's
    drain at the end of the test)."""
    start = time.monotonic()
    try:
        return client.get_user("octocat").name, None, time.monotonic() - start
    except Exception as exc:  # what the SDK raised, for the test to judge
        return None, exc, time.monotonic() - start
    finally:
        client.close()


async def test_github_forwarded(sdk_proxies):
    await sdk_proxies.start()
    name, error, _ = await asyncio.to_thread(github_user, pygithub())
    assert error is None and name == "The Mock"
    assert sdk_proxies.vendor.mock.paths() == ["/users/octocat"]


async def test_github_a_shed_under_the_generic_preset_is_sent_eleven_times(sdk_proxies, monkeypatch):
    # The defect the github preset exists for: GithubRetry retries every 5xx, x-should-retry
    # or not, so one shed call reached the proxy 11 times, 0 ms apart. (Its retries leave a
    # connection open and unread: the proxy's stop waits out its close_notify, shortened.)
    monkeypatch.setattr(intercept, "_SHUTDOWN_TIMEOUT", 0.5)
    proxy = await sdk_proxies.start(**SHED, answers={"github": "generic"})
    assert (await asyncio.to_thread(github_user, pygithub()))[1] is None
    _, error, _ = await asyncio.to_thread(github_user, pygithub())
    assert isinstance(error, Exception)
    assert outcomes(proxy, "github") == {"forwarded": 1, "shed": 11}


async def test_github_a_shed_reaches_the_proxy_once_and_raises_at_once(sdk_proxies):
    proxy = await sdk_proxies.start(**SHED)
    assert (await asyncio.to_thread(github_user, pygithub()))[1] is None
    _, error, took = await asyncio.to_thread(github_user, pygithub())
    assert isinstance(error, github.GithubException) and error.status == 429, repr(error)
    assert error.data["action"] == "shed"
    assert took < 1.0
    assert outcomes(proxy, "github") == {"forwarded": 1, "shed": 1}
    assert sdk_proxies.vendor.mock.paths() == ["/users/octocat"]


async def test_github_a_defer_is_retried_after_its_wait_and_served(sdk_proxies):
    proxy = await sdk_proxies.start(**DEFER)
    assert (await asyncio.to_thread(github_user, pygithub()))[1] is None
    name, error, took = await asyncio.to_thread(github_user, pygithub())
    assert error is None and name == "The Mock"
    assert took >= 1.0  # GithubRetry slept Retry-After (whole seconds, at least the wait)
    counts = outcomes(proxy, "github")
    assert counts["forwarded"] == 2 and counts["deferred"] >= 1
    assert len(sdk_proxies.vendor.mock.paths()) == 2


async def test_github_a_defer_without_retries_is_githubs_own_rate_limit_error(sdk_proxies):
    await sdk_proxies.start(**DEFER)
    assert (await asyncio.to_thread(github_user, pygithub(retry=None)))[1] is None
    _, error, took = await asyncio.to_thread(github_user, pygithub(retry=None))
    assert isinstance(error, github.RateLimitExceededException), repr(error)
    assert error.headers is not None
    assert int({k.lower(): v for k, v in error.headers.items()}["retry-after"]) >= 1
    assert took < 1.0


async def test_github_a_long_defer_raises_at_once_with_the_wait_readable(sdk_proxies):
    proxy = await sdk_proxies.start(**LONG)
    assert (await asyncio.to_thread(github_user, pygithub(GithubRetry(total=3))))[1] is None
    _, error, took = await asyncio.to_thread(github_user, pygithub(GithubRetry(total=3)))
    assert isinstance(error, github.GithubException) and error.status == 409, repr(error)
    assert error.data["retry_after"] > 60
    assert took < 1.0
    assert outcomes(proxy, "github") == {"forwarded": 1, "deferred": 1}


def slack(retries: int | None) -> WebClient:
    """slack_sdk's WebClient as a worker builds one: with its RateLimitErrorRetryHandler on
    (``retries`` of them), or its defaults (None)."""
    client = WebClient(token="xoxb-quota-proxy-test", base_url=f"https://{HOSTS['slack']}/api/")
    if retries is not None:
        client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=retries))
    return client


def slack_call(client: WebClient) -> tuple[Any, BaseException | None, float]:
    start = time.monotonic()
    try:
        return client.api_test(), None, time.monotonic() - start
    except SlackApiError as exc:
        return None, exc, time.monotonic() - start


async def test_slack_forwarded(sdk_proxies):
    await sdk_proxies.start()
    result, error, _ = await asyncio.to_thread(slack_call, slack(None))
    assert error is None and result["ok"] is True
    assert sdk_proxies.vendor.mock.paths() == ["/api/api.test"]


async def test_slack_a_shed_reaches_the_proxy_once_and_raises_at_once(sdk_proxies):
    proxy = await sdk_proxies.start(**SHED)
    assert (await asyncio.to_thread(slack_call, slack(3)))[1] is None
    _, error, took = await asyncio.to_thread(slack_call, slack(3))
    assert isinstance(error, SlackApiError), repr(error)
    assert error.response.status_code == 409 and error.response["error"] == "ratelimited"
    assert took < 1.0
    assert outcomes(proxy, "slack") == {"forwarded": 1, "shed": 1}


@pytest.mark.parametrize("jitter", [None, 0.0, 0.99])
async def test_slack_a_defer_is_retried_after_its_wait_and_served_by_its_first_retry(sdk_proxies, monkeypatch, jitter):
    # The handler sleeps the whole-second Retry-After plus up to a second of jitter, so its
    # retry comes up to 2 s after the slot matured (None: the handler's own random jitter).
    # It must be served then: slack_sdk sends a second retry through a proxy on the urllib
    # Request of the first, whose proxy set-up is not idempotent (CONNECT to port 80, then
    # plain HTTP), so a call deferred twice fails with URLError whatever its retry count.
    if jitter is not None:
        monkeypatch.setattr(slack_retry, "random", SimpleNamespace(random=lambda: jitter))
    proxy = await sdk_proxies.start(**DEFER)
    assert (await asyncio.to_thread(slack_call, slack(1)))[1] is None
    result, error, took = await asyncio.to_thread(slack_call, slack(1))
    assert error is None and result["ok"] is True
    assert took >= 1.0  # the handler slept Retry-After
    assert outcomes(proxy, "slack") == {"forwarded": 2, "deferred": 1}
    assert len(sdk_proxies.vendor.mock.paths()) == 2


async def test_slack_a_defer_once_retries_are_spent_is_slacks_own_ratelimited_error(sdk_proxies):
    await sdk_proxies.start(**DEFER)
    assert (await asyncio.to_thread(slack_call, slack(None)))[1] is None
    _, error, took = await asyncio.to_thread(slack_call, slack(None))
    assert isinstance(error, SlackApiError), repr(error)
    assert error.response.status_code == 429 and error.response["error"] == "ratelimited"
    assert int(error.response.headers["Retry-After"]) >= 1
    assert took < 1.0


async def test_slack_a_long_defer_raises_at_once_with_the_wait_readable(sdk_proxies):
    proxy = await sdk_proxies.start(**LONG)
    assert (await asyncio.to_thread(slack_call, slack(3)))[1] is None
    _, error, took = await asyncio.to_thread(slack_call, slack(3))
    assert isinstance(error, SlackApiError), repr(error)
    assert error.response.status_code == 409 and error.response["retry_after"] > 60
    assert took < 1.0
    assert outcomes(proxy, "slack") == {"forwarded": 1, "deferred": 1}
