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

HOSTS = {"stripe": "api.stripe.example", "openai": "api.openai.example", "anthropic": "api.anthropic.example"}
"""Where each SDK is pointed (its base URL): names that resolve nowhere, so a request that
arrives anywhere came through the proxy, which maps them to the mock vendor."""

DIALECTS = {"stripe": "stripe", "openai": "openai", "anthropic": "openai"}
"""``answers:`` per vendor: Anthropic's SDK is generated like OpenAI's (x-should-retry, retry-after-ms)."""

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
) -> Policy:
    """The three SDK vendors, intercepted, each in its dialect, all sent to ``upstream``
    (the mock vendor) with the same limits."""
    vendors = "".join(
        string.Template(SDK_VENDOR).substitute(name=name, host=host, dialect=DIALECTS[name])
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


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def call_stripe(*, max_retries: int = 2, idempotency_key: str | None = None) -> SdkCall:
    """``client.v1.customers.create``: POST /v1/customers."""
    call = SdkCall()
    session = requests.Session()

    def seen(r: requests.Response, *args: object, **kwargs: object) -> None:
        now = time.monotonic()
        call.attempts.append(Attempt(now - r.elapsed.total_seconds(), now, r.status_code, _lower(r.headers)))

    session.hooks["response"].append(seen)
    client = stripe.StripeClient(
        "sk_test_quota_proxy",
        base_addresses={"api": f"https://{HOSTS['stripe']}"},
        max_network_retries=max_retries,
        http_client=stripe.RequestsClient(session=session),
    )
    options: Any = {"idempotency_key": idempotency_key} if idempotency_key else {}
    try:
        call.result = client.v1.customers.create(params={"email": "worker@example.com"}, options=options)
    except stripe.StripeError as exc:
        call.error = exc
    finally:
        session.close()
    return call


def _httpx_hooks(call: SdkCall) -> dict[str, list[Callable[[Any], None]]]:
    sent: list[float] = []

    def request(_: Any) -> None:
        sent.append(time.monotonic())

    def response(r: Any) -> None:
        call.attempts.append(Attempt(sent[-1], time.monotonic(), r.status_code, _lower(r.headers)))

    return {"request": [request], "response": [response]}


def _call_generated(
    sdk: Any, client_class: Any, base_url: str, send: Callable[[Any, dict[str, str] | None], Any], **options: Any
) -> SdkCall:
    """One call of an SDK generated like OpenAI's (``sdk`` is its module): ``send(client,
    extra_headers)`` makes it."""
    call = SdkCall()
    key = options.pop("idempotency_key", None)
    hooks = _httpx_hooks(call)
    with client_class(
        api_key="sk-test-quota-proxy",
        base_url=base_url,
        http_client=sdk.DefaultHttpxClient(event_hooks=hooks),
        **options,
    ) as client:
        try:
            call.result = send(client, {"Idempotency-Key": key} if key else None)
        except (openai.OpenAIError, anthropic.AnthropicError) as exc:
            call.error = exc
    return call


def call_openai(*, max_retries: int = 2, idempotency_key: str | None = None) -> SdkCall:
    """``client.chat.completions.create``: POST /v1/chat/completions."""
    return _call_generated(
        openai,
        openai.OpenAI,
        f"https://{HOSTS['openai']}/v1",
        lambda client, extra: client.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "hello"}], extra_headers=extra
        ),
        max_retries=max_retries,
        idempotency_key=idempotency_key,
    )


def call_anthropic(*, max_retries: int = 2, idempotency_key: str | None = None) -> SdkCall:
    """``client.messages.create``: POST /v1/messages."""
    return _call_generated(
        anthropic,
        anthropic.Anthropic,
        f"https://{HOSTS['anthropic']}",
        lambda client, extra: client.messages.create(
            model="claude-test", max_tokens=16, messages=[{"role": "user", "content": "hello"}], extra_headers=extra
        ),
        max_retries=max_retries,
        idempotency_key=idempotency_key,
    )


@dataclass(frozen=True)
class Sdk:
    name: str
    call: Callable[..., SdkCall]
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


SDKS = {
    "stripe": Sdk("stripe", call_stripe, "/v1/customers", stripe.RateLimitError, stripe.APIError, False),
    "openai": Sdk(
        "openai", call_openai, "/v1/chat/completions", openai.RateLimitError, openai.InternalServerError, True
    ),
    "anthropic": Sdk(
        "anthropic", call_anthropic, "/v1/messages", anthropic.RateLimitError, anthropic.InternalServerError, True
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
