"""The mock vendor's Anthropic shape (``POST /v1/messages``), read by anthropic-python over real
HTTP: its messages and their events, its 400s and 429s, and its input and output token quotas
(SPEC §14), each a strict sliding window, the output taken as ``max_tokens`` and corrected to the
answer's usage."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any

import anthropic
import pytest

from proxy.clock import ManualClock
from proxy.devtools import mockvendor_anthropic
from proxy.devtools.mockvendor import MockVendor
from proxy.devtools.mockvendor_openai import REPLY, count_tokens
from proxy.devtools.mockvendor_shapes import write_events
from proxy.quota.estimates import Estimate

MESSAGES = "/v1/messages"
MODEL = "claude-sonnet-5-5"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def served(aiohttp_server: Any) -> Any:
    async def serve(vendor: MockVendor) -> str:
        server = await aiohttp_server(vendor.app())
        return f"http://127.0.0.1:{server.port}"

    return serve


@pytest.fixture
async def anthropic_client() -> AsyncIterator[Callable[[str], anthropic.AsyncAnthropic]]:
    """Anthropic's async client for a base URL (no retries), closed after the test."""
    clients: list[anthropic.AsyncAnthropic] = []

    def make(base: str) -> anthropic.AsyncAnthropic:
        clients.append(anthropic.AsyncAnthropic(api_key="sk-ant-mock", base_url=base, max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


def ask(max_tokens: int = 256, prompt: str = "Hello there, mock", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}], **extra}


def input_estimate(body: dict[str, Any]) -> int:
    """The proxy's ``anthropic_input`` estimate of ``body``."""
    return math.ceil(Estimate("anthropic_input").cost(json.dumps(body).encode(), 0.0))


def windows(vendor: MockVendor) -> dict[str, Any]:
    return vendor.stats()["token_windows"]["anthropic"]


def instant(text: str) -> float:
    """An RFC 3339 reset, in epoch seconds."""
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", text), text
    return datetime.fromisoformat(text).timestamp()


# -- messages ---------------------------------------------------------------------------------------


async def test_the_sdk_creates_a_message_and_reads_its_usage(served, anthropic_client) -> None:
    vendor = MockVendor(rate=None)
    client = anthropic_client(await served(vendor))
    body = ask(system="Be brief.", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}])
    raw = await client.messages.with_raw_response.create(**body)
    message = await raw.parse()
    assert re.fullmatch(r"msg_[A-Za-z0-9]{24}", message.id), message.id
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [("text", REPLY)]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (input_estimate(body), count_tokens(REPLY))
    assert message.usage.input_tokens == math.ceil(len("Be brief.Hi there") / 4)
    assert raw.headers["request-id"].startswith("req_")
    assert vendor.requests[0]["headers"]["anthropic-version"]  # the SDK's; the mock checks none


async def test_the_answer_is_anthropics_json(aiohttp_client) -> None:
    client = await aiohttp_client(MockVendor(rate=None).app())
    async with client.post(MESSAGES, json=ask(prompt="x" * 41)) as r:
        assert (r.status, r.content_type) == (200, "application/json")
        made = await r.json()
    assert set(made) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert made["content"] == [{"type": "text", "text": REPLY}]
    assert made["usage"] == {"input_tokens": 11, "output_tokens": 7}


async def test_a_stream_is_anthropics_events(served, anthropic_client) -> None:
    client = anthropic_client(await served(MockVendor(rate=None)))
    events = [event async for event in await client.messages.create(**ask(), stream=True)]
    kinds = [event.type for event in events]
    assert kinds == [  # the SDK passes over the ping (the raw stream has it: below)
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 5,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and delta.type == "message_delta"
    assert (start.message.content, start.message.stop_reason) == ([], None)
    assert (start.message.usage.input_tokens, start.message.usage.output_tokens) == (5, 1)
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == ("end_turn", 7)
    assert "".join(
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ) == (REPLY)


async def test_the_sdks_stream_helper_gathers_the_message(served, anthropic_client) -> None:
    client = anthropic_client(await served(MockVendor(rate=None)))
    async with client.messages.stream(**ask(3)) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == REPLY[:12]  # three tokens of it: max_tokens cut it
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("max_tokens", 5, 3)


async def test_the_stream_is_named_server_sent_events(aiohttp_client) -> None:
    client = await aiohttp_client(MockVendor(rate=None).app())
    async with client.post(MESSAGES, json=ask(stream=True)) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = (await r.text()).split("\n\n")
    assert events[-1] == ""
    named = [event.split("\n")[0] for event in events[:-1]]
    assert named[:3] == ["event: message_start", "event: content_block_start", "event: ping"]
    assert named[-3:] == ["event: content_block_stop", "event: message_delta", "event: message_stop"]
    for event in events[:-1]:
        head, data = event.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), event
        assert json.loads(data[6:])["type"] == head[7:]


async def test_bad_input_is_anthropics_400(aiohttp_client) -> None:
    client = await aiohttp_client(MockVendor(rate=None).app())
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"max_tokens": 5, "messages": user}, "model: Field required"),
        ({"model": MODEL, "messages": user}, "max_tokens: Field required"),
        ({"model": MODEL, "max_tokens": "5", "messages": user}, "max_tokens: Input should be a valid integer"),
        ({"model": MODEL, "max_tokens": 0, "messages": user}, "max_tokens: Input should be greater than or equal to 1"),
        ({"model": MODEL, "max_tokens": 5}, "messages: Field required"),
        ({"model": MODEL, "max_tokens": 5, "messages": []}, "messages: at least one message is required"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": ""}]}, "non-empty content"),
        ({**ask(), "stream": "yes"}, "stream: Input should be a valid boolean"),
    ]
    for body, problem in cases:
        async with client.post(MESSAGES, json=body) as r:
            assert r.status == 400, body
            said = await r.json()
        assert said["type"] == "error" and said["error"]["type"] == "invalid_request_error", said
        assert problem in said["error"]["message"], (body, said)
    prefill = {**ask(), "messages": [*user, {"role": "assistant", "content": ""}]}
    async with client.post(MESSAGES, json=prefill) as r:
        assert r.status == 200  # a final assistant turn may be empty
    async with client.post(MESSAGES, data=b"{not json") as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    async with client.get(MESSAGES) as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"


async def test_the_request_quota_refuses_in_anthropics_words(served, anthropic_client) -> None:
    vendor = MockVendor(rate=1, burst=1)
    client = anthropic_client(await served(vendor))
    raw = await client.messages.with_raw_response.create(**ask())
    assert (
        raw.headers["anthropic-ratelimit-requests-limit"],
        raw.headers["anthropic-ratelimit-requests-remaining"],
    ) == (
        "60",
        "0",
    )
    with pytest.raises(anthropic.RateLimitError) as refused:
        await client.messages.create(**ask())
    error = refused.value
    said = json.loads(error.response.text)
    assert (error.status_code, said["type"], said["error"]["type"]) == (429, "error", "rate_limit_error")
    assert "rate limit for your organization of 60 requests per minute" in said["error"]["message"]
    headers = error.response.headers
    assert headers["retry-after"] == "1" and headers["request-id"].startswith("req_")
    assert time.time() - 1 <= instant(headers["anthropic-ratelimit-requests-reset"]) <= time.time() + 2
    assert (vendor.accepted, vendor.rejected) == (1, 1)


# -- token quotas -----------------------------------------------------------------------------------


async def test_an_input_overrun_is_anthropics_429_with_its_token_headers(served, anthropic_client, clock) -> None:
    vendor = MockVendor(rate=None, input_tokens_per_minute=100, output_tokens_per_minute=1000, clock=clock.monotonic)
    client = anthropic_client(await served(vendor))
    first = ask(prompt="x" * 240)  # 60 input tokens
    raw = await client.messages.with_raw_response.create(**first)
    assert (await raw.parse()).usage.input_tokens == input_estimate(first) == 60
    assert (
        raw.headers["anthropic-ratelimit-input-tokens-limit"],
        raw.headers["anthropic-ratelimit-input-tokens-remaining"],
    ) == (
        "100",
        "40",
    )
    assert raw.headers["anthropic-ratelimit-output-tokens-remaining"] == str(1000 - 256)  # max_tokens, at arrival
    await clock.advance(20)
    with pytest.raises(anthropic.RateLimitError) as refused:
        await client.messages.create(**ask(prompt="y" * 200))  # 50 more: 110 > 100
    error = refused.value
    said = json.loads(error.response.text)["error"]
    assert said["type"] == "rate_limit_error"
    assert "rate limit for your organization of 100 input tokens per minute" in said["message"]
    headers = error.response.headers
    assert headers["retry-after"] == "40"  # the first 60 leave the window 60 s after they arrived
    assert headers["anthropic-ratelimit-input-tokens-remaining"] == "40"
    assert headers["anthropic-ratelimit-output-tokens-remaining"] == str(1000 - 7)  # the first's usage
    assert time.time() + 39 <= instant(headers["anthropic-ratelimit-input-tokens-reset"]) <= time.time() + 42
    stats = windows(vendor)
    assert (stats["input_tokens"]["rejected"], stats["output_tokens"]["rejected"]) == (1, 0)
    await clock.advance(40)
    await client.messages.create(**ask(prompt="y" * 200))


async def test_output_is_taken_as_max_tokens_and_corrected_to_usage(served, anthropic_client) -> None:
    vendor = MockVendor(rate=None, output_tokens_per_minute=1000)
    client = anthropic_client(await served(vendor))
    for _ in range(2):  # 600 + 600 > 1000, but the first holds its 7 when the second arrives
        message = await client.messages.create(**ask(600))
        assert message.usage.output_tokens == 7
    async with client.messages.stream(**ask(600)) as stream:
        await stream.get_final_message()
    output = windows(vendor)["output_tokens"]
    assert (output["tokens_window_max"], output["used"], output["tokens_accepted"]) == (14 + 600, 21, 21)
    assert (output["limit"], output["rejected"]) == (1000, 0)
    assert "input_tokens" not in windows(vendor)  # not counted unless asked
    with pytest.raises(anthropic.RateLimitError) as refused:
        await client.messages.create(**ask(1001))  # more than any window holds
    assert "retry-after" not in refused.value.response.headers  # waiting would not help


async def test_output_holds_max_tokens_until_the_answer_is_written(aiohttp_client, clock, monkeypatch) -> None:
    """The second request arrives while the first's stream is held back: refused on the first's
    ``max_tokens``; once the stream is written, the window keeps its 7 and the second fits."""
    writing, release = asyncio.Event(), asyncio.Event()

    async def held(*args: Any) -> Any:
        writing.set()
        await release.wait()
        return await write_events(*args)

    monkeypatch.setattr(mockvendor_anthropic, "write_events", held)
    vendor = MockVendor(rate=None, output_tokens_per_minute=1000, clock=clock.monotonic)
    client = await aiohttp_client(vendor.app())

    async def first() -> str:
        async with client.post(MESSAGES, json=ask(600, stream=True)) as r:
            return await r.text()

    streaming = asyncio.create_task(first())
    await writing.wait()
    async with client.post(MESSAGES, json=ask(600)) as r:
        assert r.status == 429
        assert "1,000 output tokens per minute" in (await r.json())["error"]["message"]
        assert r.headers["retry-after"] == "60"
        assert r.headers["anthropic-ratelimit-output-tokens-remaining"] == "400"
    release.set()
    assert (await streaming).endswith('event: message_stop\ndata: {"type": "message_stop"}\n\n')
    assert windows(vendor)["output_tokens"]["used"] == 7
    async with client.post(MESSAGES, json=ask(600)) as r:
        assert r.status == 200
    assert (windows(vendor)["output_tokens"]["tokens_accepted"], vendor.rejected) == (14, 1)


async def test_bad_input_takes_nothing_and_reset_empties_the_windows(aiohttp_client) -> None:
    vendor = MockVendor(rate=None, input_tokens_per_minute=600, output_tokens_per_minute=600, token_window=10)
    client = await aiohttp_client(vendor.app())
    async with client.post(MESSAGES, json={**ask(50), "stream": "yes"}) as r:
        assert r.status == 400
        assert r.headers["anthropic-ratelimit-output-tokens-remaining"] == "50"  # 100 in any 10 s, less 50
    assert (windows(vendor)["input_tokens"]["used"], windows(vendor)["output_tokens"]["used"]) == (0, 0)
    async with client.post(MESSAGES, json=ask(50)) as r:
        assert r.status == 200
    async with client.post("/__mock/reset") as r:
        assert r.status == 200
    for currency in ("input_tokens", "output_tokens"):
        stats = windows(vendor)[currency]
        assert (stats["limit"], stats["used"], stats["tokens_window_max"], stats["tokens_accepted"]) == (100, 0, 0, 0)
