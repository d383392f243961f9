"""The vendors' own Python SDKs as workers run them: one call each, configured only by
what a worker sets (HTTPS_PROXY and the CA bundle in the environment, the base URL, and
``stripe.ca_bundle_path``), through the proxy to tests/helpers/sdk_vendor.py.

Each call is also watched, passively, at the SDK's own HTTP layer (a requests response
hook for Stripe, httpx2 event hooks for OpenAI and Anthropic): every attempt the SDK
made, when it went out, and what came back. That is how the tests see the SDK's own
retries and how long it waited between them.
"""

from __future__ import annotations

import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import requests
import stripe

from proxy.policy import Policy
from proxy.server import ProxyServer
from tests.conftest import make_policy
from tests.helpers.intercept import INTERCEPT_HEAD

HOSTS = {
    "stripe": "api.stripe.example",
    "openai": "api.openai.example",
    "anthropic": "api.anthropic.example",
    "github": "api.github.example",
    "slack": "slack.example",
}
"""Where each SDK is pointed (its base URL): names that resolve nowhere, so a request that
arrives anywhere came through the proxy, which maps them to the mock vendor."""

DIALECTS = {name: name for name in HOSTS}
"""``answers:`` per vendor: each SDK's own built-in preset."""

SDK_VENDOR = """
      - name: $name
        hosts: [$host]
        upstream: $$upstream
        answers: $dialect
        limits: $$limits
        on_limit: $$on_limit
        timeouts: {read: $$read}
        $$vendor_extra
"""


def sdk_policy(
    *,
    ca_cert: object,
    ca_key: object,
    vendor_ca: object,
    upstream: str,
    store: str = "memory://",
    limits: str = "[{rate: 1000, per: 1s}]",
    on_limit: str = "{action: defer}",
    read: str = "30s",
    vendor_extra: str = "",
    answers: dict[str, str] | None = None,
) -> Policy:
    """The three SDK vendors, intercepted, each in its dialect, all sent to ``upstream``
    (the mock vendor) with the same limits."""
    vendors = "".join(
        string.Template(SDK_VENDOR).substitute(name=name, host=host, dialect={**DIALECTS, **(answers or {})}[name])
        for name, host in HOSTS.items()
    )
    return make_policy(
        INTERCEPT_HEAD + "\n    vendors:" + vendors,
        store=store,
        ca_cert=ca_cert,
        ca_key=ca_key,
        leaf_validity="1d",
        upstream_ca=f"upstream_ca_file: {vendor_ca}",
        tls_extra="",
        upstream=upstream,
        limits=limits,
        on_limit=on_limit,
        read=read,
        vendor_extra=vendor_extra,
    )


@dataclass(frozen=True)
class Attempt:
    """One HTTP exchange the SDK made."""

    sent: float
    answered: float
    """time.monotonic(): the request went out, its answer's head came back"""
    status: int
    headers: dict[str, str]
    """lower-case names"""


@dataclass
class SdkCall:
    """What one SDK call did: its attempts, and its result or the exception it raised."""

    attempts: list[Attempt] = field(default_factory=list)
    result: Any = None
    error: BaseException | None = None

    def gaps(self) -> list[float]:
        """Seconds the SDK waited between an answer and its next attempt."""
        return [b.sent - a.answered for a, b in zip(self.attempts, self.attempts[1:], strict=False)]


class Caller:
    """A worker's SDK client, configured once (building one loads its CA bundle, which
    can hold the GIL for a while: done before the measured part of a test), whose calls
    are watched."""

    errors: tuple[type[BaseException], ...] = ()

    def __init__(self) -> None:
        self.current = SdkCall()

    def call(self, idempotency_key: str | None = None) -> SdkCall:
        self.current = SdkCall()
        try:
            self.current.result = self.send(idempotency_key)
        except self.errors as exc:
            self.current.error = exc
        return self.current

    def send(self, idempotency_key: str | None) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def seen(self, sent: float, answered: float, status: int, headers: Any) -> None:
        self.current.attempts.append(Attempt(sent, answered, status, {k.lower(): v for k, v in headers.items()}))


class StripeCaller(Caller):
    """``client.v1.customers.create``: POST /v1/customers (a requests response hook watches)."""

    errors = (stripe.StripeError,)

    def __init__(self, max_retries: int) -> None:
        super().__init__()
        self.session = requests.Session()
        self.session.hooks["response"].append(self._response)
        self.client = stripe.StripeClient(
            "sk_test_quota_proxy",
            base_addresses={"api": f"https://{HOSTS['stripe']}"},
            max_network_retries=max_retries,
            http_client=stripe.RequestsClient(session=self.session),
        )

    def _response(self, r: requests.Response, *args: object, **kwargs: object) -> None:
        now = time.monotonic()
        self.seen(now - r.elapsed.total_seconds(), now, r.status_code, r.headers)

    def send(self, idempotency_key: str | None) -> Any:
        options: Any = {"idempotency_key": idempotency_key} if idempotency_key else {}
        return self.client.v1.customers.create(params={"email": "worker@example.com"}, options=options)

    def close(self) -> None:
        self.session.close()


class GeneratedCaller(Caller):
    """An SDK generated like OpenAI's (``sdk`` is its module; httpx2 event hooks watch)."""

    errors = (openai.OpenAIError, anthropic.AnthropicError)

    def __init__(self, sdk: Any, client_class: Any, base_url: str, max_retries: int) -> None:
        super().__init__()
        self._sent = 0.0
        hooks = {"request": [self._request], "response": [self._response]}
        self.client = client_class(
            api_key="sk-test-quota-proxy",
            base_url=base_url,
            max_retries=max_retries,
            http_client=sdk.DefaultHttpxClient(event_hooks=hooks),
        )

    def _request(self, _: Any) -> None:
        self._sent = time.monotonic()

    def _response(self, r: Any) -> None:
        self.seen(self._sent, time.monotonic(), r.status_code, r.headers)

    def extra(self, idempotency_key: str | None) -> dict[str, str] | None:
        return {"Idempotency-Key": idempotency_key} if idempotency_key else None

    def close(self) -> None:
        self.client.close()


class OpenAICaller(GeneratedCaller):
    """``client.chat.completions.create``: POST /v1/chat/completions."""

    def __init__(self, max_retries: int) -> None:
        super().__init__(openai, openai.OpenAI, f"https://{HOSTS['openai']}/v1", max_retries)

    def send(self, idempotency_key: str | None) -> Any:
        return self.client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "hello"}], extra_headers=self.extra(idempotency_key)
        )


class AnthropicCaller(GeneratedCaller):
    """``client.messages.create``: POST /v1/messages."""

    def __init__(self, max_retries: int) -> None:
        super().__init__(anthropic, anthropic.Anthropic, f"https://{HOSTS['anthropic']}", max_retries)

    def send(self, idempotency_key: str | None) -> Any:
        return self.client.messages.create(
            model="claude-test",
            max_tokens=16,
            messages=[{"role": "user", "content": "hello"}],
            extra_headers=self.extra(idempotency_key),
        )


@dataclass(frozen=True)
class Sdk:
    name: str
    opener: Callable[[int], Caller]
    path: str
    """what the call sends: POST ``path``"""
    rate_limit_error: type[Exception]
    server_error: type[Exception]
    """what a 5xx the SDK does not retry becomes"""
    honours_hint: bool
    """whether its retries wait retry-after-ms (Stripe's use their own backoff)"""

    @property
    def host(self) -> str:
        return HOSTS[self.name]

    def open(self, max_retries: int = 2) -> Caller:
        return self.opener(max_retries)

    def call(self, *, max_retries: int = 2, idempotency_key: str | None = None) -> SdkCall:
        """One call by a client made for it (blocking: run it in a thread)."""
        caller = self.open(max_retries)
        try:
            return caller.call(idempotency_key)
        finally:
            caller.close()


SDKS = {
    "stripe": Sdk("stripe", StripeCaller, "/v1/customers", stripe.RateLimitError, stripe.APIError, False),
    "openai": Sdk(
        "openai", OpenAICaller, "/v1/chat/completions", openai.RateLimitError, openai.InternalServerError, True
    ),
    "anthropic": Sdk(
        "anthropic", AnthropicCaller, "/v1/messages", anthropic.RateLimitError, anthropic.InternalServerError, True
    ),
}


def outcomes(proxy: ProxyServer, vendor: str) -> dict[str, float]:
    """``ratelimit_requests_total`` of ``vendor`` by outcome, every tenant, zeros left out."""
    counts: dict[str, float] = {}
    for family in proxy.runtime.registry.collect():
        for s in family.samples:
            if s.name == "ratelimit_requests_total" and s.labels["limiter"] == vendor and s.value:
                counts[s.labels["outcome"]] = counts.get(s.labels["outcome"], 0) + s.value
    return counts


def connects(proxy: ProxyServer) -> float:
    """Every CONNECT the proxy has seen (``ratelimit_connects_total``, all labels)."""
    return sum(
        s.value
        for family in proxy.runtime.registry.collect()
        for s in family.samples
        if s.name == "ratelimit_connects_total"
    )
