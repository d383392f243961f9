"""The mock vendor's Stripe- and OpenAI-shaped answers, read by the vendors' own SDKs
(stripe-python, openai-python) over real HTTP, and its vendors' 429s as those SDKs raise them."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pytest
import requests
import stripe

from proxy.devtools.mockvendor import MockVendor
from proxy.devtools.mockvendor_openai import REPLY, count_tokens


@pytest.fixture
async def served(aiohttp_server: Any) -> Any:
    async def serve(vendor: MockVendor) -> str:
        server = await aiohttp_server(vendor.app())
        return f"http://127.0.0.1:{server.port}"

    return serve


@pytest.fixture
def stripe_client() -> Iterator[Callable[[str], stripe.StripeClient]]:
    """Stripe's client for a base URL (no retries), its connections closed after the test."""
    sessions: list[requests.Session] = []

    def make(base: str) -> stripe.StripeClient:
        sessions.append(requests.Session())
        http = stripe.RequestsClient(session=sessions[-1])
        return stripe.StripeClient(
            "sk_test_mock", base_addresses={"api": base}, max_network_retries=0, http_client=http
        )

    yield make
    for session in sessions:
        session.close()


@pytest.fixture
async def openai_client() -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    """OpenAI's async client for a base URL (no retries), closed after the test."""
    clients: list[openai.AsyncOpenAI] = []

    def make(base: str) -> openai.AsyncOpenAI:
        clients.append(openai.AsyncOpenAI(api_key="sk-mock", base_url=f"{base}/v1", max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


# -- Stripe ----------------------------------------------------------------------------------------


async def test_stripe_sdk_creates_reads_lists_updates_and_deletes_a_customer(served, stripe_client) -> None:
    vendor = MockVendor(rate=None)
    client = stripe_client(await served(vendor))

    def calls() -> tuple[Any, ...]:
        made = client.v1.customers.create(params={"email": "jane@example.com", "metadata": {"plan": "pro"}})
        read = client.v1.customers.retrieve(made.id)
        listed = client.v1.customers.list(params={"limit": 1})
        updated = client.v1.customers.update(made.id, params={"name": "Jane"})
        deleted = client.v1.customers.delete(made.id)
        return made, read, listed, updated, deleted

    made, read, listed, updated, deleted = await asyncio.to_thread(calls)
    assert re.fullmatch(r"cus_[A-Za-z0-9]{14}", made.id), made.id
    assert (made.object, made.email, made.metadata["plan"]) == ("customer", "jane@example.com", "pro")
    assert (read.id, read.email) == (made.id, "jane@example.com")
    assert [c.id for c in listed.data] == [made.id] and listed.has_more is False
    assert (updated.name, updated.email) == ("Jane", "jane@example.com")
    assert deleted.deleted is True
    (first, *_) = vendor.requests
    assert first["headers"]["authorization"] == "Bearer sk_test_mock"


async def test_every_customer_id_exists(served, stripe_client) -> None:
    client = stripe_client(await served(MockVendor(rate=None)))
    customer = await asyncio.to_thread(client.v1.customers.retrieve, "cus_123")
    assert (customer.id, customer.object) == ("cus_123", "customer")


async def test_stripe_payment_intents_need_an_amount_and_a_currency(served, stripe_client) -> None:
    client = stripe_client(await served(MockVendor(rate=None)))
    intent = await asyncio.to_thread(client.v1.payment_intents.create, {"amount": 1999, "currency": "EUR"})
    assert (intent.object, intent.amount, intent.currency, intent.status) == (
        "payment_intent",
        1999,
        "eur",
        "requires_payment_method",
    )
    assert intent.client_secret.startswith(f"{intent.id}_secret_")
    with pytest.raises(stripe.InvalidRequestError) as missing:
        await asyncio.to_thread(client.v1.payment_intents.create, {"amount": 1999})
    assert (missing.value.http_status, missing.value.code, missing.value.param) == (
        400,
        "parameter_missing",
        "currency",
    )
    with pytest.raises(stripe.InvalidRequestError) as bad:
        await asyncio.to_thread(client.v1.payment_intents.create, {"amount": "lots", "currency": "usd"})
    assert (bad.value.code, bad.value.param) == ("parameter_invalid_integer", "amount")


async def test_an_idempotency_key_replays_the_first_answer(served, stripe_client) -> None:
    vendor = MockVendor(rate=None)
    client = stripe_client(await served(vendor))
    options: Any = {"idempotency_key": "order-42"}

    def twice() -> tuple[Any, Any]:
        first = client.v1.customers.create(params={"email": "a@example.com"}, options=options)
        return first, client.v1.customers.create(params={"email": "a@example.com"}, options=options)

    first, second = await asyncio.to_thread(twice)
    assert first.id == second.id
    assert second.last_response.headers["Idempotent-Replayed"] == "true"
    listed = await asyncio.to_thread(client.v1.customers.list)
    assert [c.id for c in listed.data] == [first.id]  # one customer made


async def test_stripe_bad_input_is_stripes_400(served, aiohttp_client) -> None:
    vendor = MockVendor(rate=None)
    client = await aiohttp_client(vendor.app())
    async with client.post("/v1/customers", json={"email": "x"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"
    async with client.post(
        "/v1/customers", data="colour=blue", headers={"Content-Type": "application/x-www-form-urlencoded"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"] == {
            "type": "invalid_request_error",
            "message": "Received unknown parameter: colour",
            "code": "parameter_unknown",
            "doc_url": "https://stripe.com/docs/error-codes/parameter-unknown",
            "param": "colour",
        }
    async with client.get("/v1/customers?limit=0") as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "limit"
    async with client.delete("/v1/payment_intents/pi_1") as r:
        assert r.status == 404 and "Unrecognized request URL" in (await r.json())["error"]["message"]
    async with client.get("/v1/customers/pi_1") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "resource_missing"


async def test_the_quota_refuses_in_stripes_words(served, stripe_client) -> None:
    vendor = MockVendor(rate=1, burst=1)
    client = stripe_client(await served(vendor))
    await asyncio.to_thread(client.v1.customers.retrieve, "cus_1")
    with pytest.raises(stripe.RateLimitError) as refused:
        await asyncio.to_thread(client.v1.customers.retrieve, "cus_1")
    error = refused.value
    assert error.error is not None
    assert (error.http_status, error.error.code) == (429, "rate_limit")
    assert error.headers is not None
    assert error.headers["Retry-After"] == "1" and error.headers["Stripe-Rate-Limited-Reason"] == "global-rate"
    assert error.request_id is not None and error.request_id.startswith("req_")
    assert "X-RateLimit-Remaining" not in error.headers  # Stripe tells no quota in headers
    assert (vendor.accepted, vendor.rejected) == (1, 1)


# -- OpenAI ----------------------------------------------------------------------------------------


async def test_openai_chat_completion_with_usage_and_quota_headers(served, openai_client) -> None:
    vendor = MockVendor(rate=10, burst=10)
    client = openai_client(await served(vendor))
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Hello there, mock"}], n=2
    )
    reply = raw.parse()
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert [c.message.content for c in reply.choices] == [REPLY, REPLY]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (count_tokens("Hello there, mock"), 2 * 7)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert raw.headers["x-ratelimit-limit-requests"] == "600"
    assert raw.headers["x-ratelimit-remaining-requests"] == "9"
    assert raw.headers["x-request-id"].startswith("req_")


async def test_openai_streams_end_with_done_and_the_usage_chunk_when_asked(served, openai_client) -> None:
    client = openai_client(await served(MockVendor(rate=None)))
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8
    plain = await client.completions.create(model="m", prompt="hi", stream=True)
    pieces = [chunk async for chunk in plain]
    assert "".join(c.choices[0].text for c in pieces) == REPLY
    assert all(c.usage is None for c in pieces)  # no usage chunk unless asked


async def test_the_stream_is_server_sent_events_ending_in_done(aiohttp_client) -> None:
    client = await aiohttp_client(MockVendor(rate=None).app())
    body = {"model": "m", "prompt": "hi", "stream": True}
    async with client.post("/v1/completions", json=body) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = (await r.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


async def test_openai_completions_embeddings_and_responses(served, openai_client) -> None:
    client = openai_client(await served(MockVendor(rate=None)))
    completion = await client.completions.create(model="m", prompt=["one", "two"])
    assert completion.object == "text_completion" and completion.choices[0].text == REPLY
    assert completion.usage is not None and completion.usage.prompt_tokens == 2

    # The SDK asks for base64 by default and decodes it: the same text, the same vector.
    packed = await client.embeddings.create(model="e", input=["a cat", "a dog"], dimensions=8)
    floats = await client.embeddings.create(model="e", input="a cat", dimensions=8, encoding_format="float")
    assert [len(d.embedding) for d in packed.data] == [8, 8]
    assert packed.data[0].embedding == pytest.approx(floats.data[0].embedding, rel=1e-6)
    assert packed.data[0].embedding != packed.data[1].embedding
    assert packed.usage.prompt_tokens == 4

    response = await client.responses.create(model="m", input="Hello", instructions="Be brief")
    assert response.output_text == REPLY and response.status == "completed"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (2 + 2, 7)
    async with client.responses.stream(model="m", input="Hello") as events:
        kinds = [event.type async for event in events]
        final = await events.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 5 and final.output_text == REPLY


async def test_openai_bad_input_is_openais_400_and_other_methods_405(aiohttp_client) -> None:
    client = await aiohttp_client(MockVendor(rate=None).app())
    cases = [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": ["x"]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user"}], "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "messages": [{"role": "user"}], "n": 0}, "n"),
    ]
    for body, param in cases:
        async with client.post("/v1/chat/completions", json=body) as r:
            assert r.status == 400, body
            error = (await r.json())["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    async with client.post("/v1/embeddings", data=b"{not json") as r:
        assert r.status == 400 and "parse the JSON" in (await r.json())["error"]["message"]
    async with client.post("/v1/embeddings", json={"model": "e", "input": "x", "encoding_format": "hex"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "encoding_format"
    async with client.get("/v1/chat/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"


async def test_the_quota_refuses_in_openais_words(served, openai_client) -> None:
    vendor = MockVendor(rate=1, burst=1)
    client = openai_client(await served(vendor))
    await client.embeddings.create(model="e", input="x")
    with pytest.raises(openai.RateLimitError) as refused:
        await client.embeddings.create(model="e", input="x")
    error = refused.value
    assert (error.status_code, error.code, error.type) == (429, "rate_limit_exceeded", "requests")
    headers = error.response.headers
    assert headers["Retry-After"] == "1" and headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert json.loads(error.response.text)["error"]["code"] == "rate_limit_exceeded"


async def test_shapes_take_one_token_a_request_and_reset_forgets(served, aiohttp_client) -> None:
    vendor = MockVendor(rate=None)
    client = await aiohttp_client(vendor.app())
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    async with client.post("/v1/customers", data="email=a%40example.com", headers=form) as r:
        made = await r.json()
    async with client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user"}]}) as r:
        assert r.status == 200
    async with client.get("/v1/ping") as r:
        assert (await r.json())["path"] == "/v1/ping"  # other paths keep the plain answer
    assert vendor.accepted == 3
    async with client.post("/__mock/reset") as r:
        assert r.status == 200
    async with client.get(f"/v1/customers/{made['id']}") as r:
        assert (await r.json())["email"] is None  # forgotten: made up again
