"""The vendors' own Python SDKs as workers run them: one call each, configured only by
what a worker sets (HTTPS_PROXY and the CA bundle in the environment, the base URL, and
``stripe.ca_bundle_path``), through the proxy to tests/helpers/sdk_vendor.py.

Each call is also watched, passively, at the SDK's own HTTP layer (a requests response
hook for Stripe, httpx2 event hooks for OpenAI and Anthropic): every attempt the SDK
made, when it went out, and what came back. That is how the tests see the SDK's own
retries and how long it waited between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import requests
import stripe

from proxy.policy import Policy
from tests.conftest import make_policy

HOSTS = {"stripe": "api.stripe.example", "openai": "api.openai.example", "anthropic": "api.anthropic.example"}
"""Where each SDK is pointed (its base URL): names that resolve nowhere, so a request that
arrives anywhere came through the proxy, which maps them to the mock vendor."""

DIALECTS = {"stripe": "stripe", "openai": "openai", "anthropic": "openai"}
"""``answers:`` per vendor: Anthropic's SDK is generated like OpenAI's (x-should-retry, retry-after-ms)."""

SDK_POLICY = """
    version: 1
    listen: 127.0.0.1:0
    admin_listen: 127.0.0.1:0
    store: {url: "$store", timeout: 1s}
    tls:
      ca_cert: $ca_cert
      ca_key: $ca_key
      upstream_ca_file: $vendor_ca
    vendors:
      - name: stripe
        hosts: [api.stripe.example]
        upstream: $upstream
        answers: stripe
        limits: $limits
        on_limit: $on_limit
        timeouts: {read: $read}
        $vendor_extra
      - name: openai
        hosts: [api.openai.example]
        upstream: $upstream
        answers: openai
        limits: $limits
        on_limit: $on_limit
        timeouts: {read: $read}
        $vendor_extra
      - name: anthropic
        hosts: [api.anthropic.example]
        upstream: $upstream
        answers: openai
        limits: $limits
        on_limit: $on_limit
        timeouts: {read: $read}
        $vendor_extra
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
    """The three SDK vendors, intercepted, all sent to ``upstream`` (the mock vendor)."""
    return make_policy(
        SDK_POLICY,
        store=store,
        ca_cert=ca_cert,
        ca_key=ca_key,
        vendor_ca=vendor_ca,
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


def call_openai(*, max_retries: int = 2, idempotency_key: str | None = None) -> SdkCall:
    """``client.chat.completions.create``: POST /v1/chat/completions."""
    call = SdkCall()
    with openai.OpenAI(
        api_key="sk-test-quota-proxy",
        base_url=f"https://{HOSTS['openai']}/v1",
        max_retries=max_retries,
        http_client=openai.DefaultHttpxClient(event_hooks=_httpx_hooks(call)),
    ) as client:
        try:
            call.result = client.chat.completions.create(
                model="gpt-test",
                messages=[{"role": "user", "content": "hello"}],
                extra_headers={"Idempotency-Key": idempotency_key} if idempotency_key else None,
            )
        except openai.OpenAIError as exc:
            call.error = exc
    return call


def call_anthropic(*, max_retries: int = 2, idempotency_key: str | None = None) -> SdkCall:
    """``client.messages.create``: POST /v1/messages."""
    call = SdkCall()
    with anthropic.Anthropic(
        api_key="sk-ant-test-quota-proxy",
        base_url=f"https://{HOSTS['anthropic']}",
        max_retries=max_retries,
        http_client=anthropic.DefaultHttpxClient(event_hooks=_httpx_hooks(call)),
    ) as client:
        try:
            call.result = client.messages.create(
                model="claude-test",
                max_tokens=16,
                messages=[{"role": "user", "content": "hello"}],
                extra_headers={"Idempotency-Key": idempotency_key} if idempotency_key else None,
            )
        except anthropic.AnthropicError as exc:
            call.error = exc
    return call


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
