"""The mock vendor's token quotas (SPEC §14) on its OpenAI shape: a strict sliding window of
tokens, a request admitted by OpenAI's estimate at arrival (the proxy's own ``estimate: openai``)
and its estimate replaced by the answer's usage once produced; read by openai-python."""

from __future__ import annotations

import asyncio
import json
import math
import re
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.cli import main
from proxy.clock import ManualClock
from proxy.devtools import mockvendor_openai
from proxy.devtools.mockvendor import MockVendor
from proxy.devtools.mockvendor_openai import REPLY, count_tokens
from proxy.devtools.mockvendor_shapes import OUTPUT_TOKENS_HEADER, write_events
from proxy.devtools.mockvendor_tokens import Demand, Refused, Reservation, TokenWindow, reserve
from proxy.quota.estimates import Estimate
from tests.helpers.vendor_process import vendor_process

CHAT = "/v1/chat/completions"


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
async def openai_client() -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    """OpenAI's async client for a base URL (no retries), closed after the test."""
    clients: list[openai.AsyncOpenAI] = []

    def make(base: str) -> openai.AsyncOpenAI:
        clients.append(openai.AsyncOpenAI(api_key="sk-mock", base_url=f"{base}/v1", max_retries=0))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


def chat(max_tokens: int | None, prompt: str = "hi", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": prompt}], **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def estimate(body: dict[str, Any], path: str = CHAT) -> int:
    """The proxy's estimate of ``body``, the bytes aiohttp's ``json=`` sends."""
    return math.ceil(Estimate("openai").cost(json.dumps(body).encode(), 0.0, path=path))


def tokens(vendor: MockVendor) -> dict[str, Any]:
    return dict(vendor.stats()["token_windows"]["openai"]["tokens"])


# -- the window ------------------------------------------------------------------------------------


def test_a_window_holds_its_limit_and_says_when_a_request_fits() -> None:
    window = TokenWindow("tokens", 600, window=10)  # 600 a minute: 100 in any 10 s
    assert window.limit == 100
    entry = window.take(0.0, 60)
    assert (window.wait(1.0, 40), window.wait(1.0, 50)) == (0.0, 9.0)  # the 60 leave at t = 10
    assert window.wait(1.0, 101) == math.inf  # more than any window holds: never
    window.settle(entry, 10, now=2.0)  # the answer used 10
    assert (window.used(2.0), window.wait(2.0, 90), window.full_in(2.0)) == (10, 0.0, 8.0)
    assert window.used(10.0) == 0 and window.full_in(10.0) == 0.0  # a window is (now - 10, now]
    assert (window.window_max, window.accepted) == (60, 10)


def test_bad_token_quotas_are_refused() -> None:
    for per_minute, window, problem in (
        (0, 60.0, "must be a positive number"),
        (math.inf, 60.0, "must be a positive number"),
        (100, 0.0, "must be a positive number"),
        (5, 10.0, "5 tokens per minute over a 10s window is less than 1 token"),
    ):
        with pytest.raises(ValueError, match=problem):
            TokenWindow("tokens", per_minute, window)


def test_reserve_takes_from_every_window_or_from_none() -> None:
    source = TokenWindow("input_tokens", 100)
    sink = TokenWindow("output_tokens", 50)
    first = reserve((source, sink), Demand((30, 40), None), 0.0, lambda: 1.0)
    assert isinstance(first, Reservation)
    refused = reserve((source, sink), Demand((30, 20), None), 0.5, lambda: 1.0)
    assert isinstance(refused, Refused)
    assert (refused.binding, refused.used, refused.wait) == ((sink,), (30, 40), 59.5)
    assert (source.used(0.5), sink.used(0.5)) == (30, 40)  # the refused one took nothing
    assert (source.rejected, sink.rejected) == (0, 1)  # only the window that lacked room refused
    assert (source.window_max, sink.window_max) == (60, 60)  # a refused arrival counts at its estimate
    first.settle(output_tokens=5)  # input not named: it keeps its estimate
    first.settle(output_tokens=40)  # only the first settlement counts
    assert (source.used(1.0), sink.used(1.0)) == (30, 5)
    assert isinstance(reserve((source, sink), Demand((30, 20), None), 1.0, lambda: 1.0), Reservation)


# -- OpenAI's estimate, OpenAI's headers -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat(50, "Tell me about the weather in Lyon", n=2, tools=[{"type": "function", "function": {}}])),
        (CHAT, chat(None, "no cap: the default one")),
        ("/v1/completions", {"model": "m", "prompt": ["one", "two"], "max_tokens": 9, "best_of": 3}),
        ("/v1/embeddings", {"model": "e", "input": ["a cat", "a dog"]}),
        ("/v1/responses", {"model": "m", "input": "Hello", "instructions": "Be brief", "max_output_tokens": 20}),
    ],
)
async def test_a_request_takes_the_proxys_own_estimate(aiohttp_client, path, body) -> None:
    vendor = MockVendor(rate=None, tokens_per_minute=100_000)
    client = await aiohttp_client(vendor.app())
    async with client.post(path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 100_000 - estimate(body, path)
        usage = (await r.json())["usage"]
    assert tokens(vendor)["used"] == usage["total_tokens"]  # the answer's usage replaced it


async def test_the_sdk_reads_the_token_headers_and_the_window_keeps_the_usage(served, openai_client) -> None:
    vendor = MockVendor(rate=10, burst=10, tokens_per_minute=1000)
    client = openai_client(await served(vendor))
    raw = await client.chat.completions.with_raw_response.create(**chat(600))
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.total_tokens == 1 + 7
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000"
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(1000 - 601)  # ceil(2 / 4) + 600, at arrival
    assert raw.headers["x-ratelimit-reset-tokens"] == "1m0s"
    assert raw.headers["x-ratelimit-remaining-requests"] == "9"  # the request quota counts as before


async def test_estimates_that_would_not_fit_together_fit_once_replaced_by_usage(served, openai_client) -> None:
    vendor = MockVendor(rate=None, tokens_per_minute=1000)
    client = openai_client(await served(vendor))
    for _ in range(2):  # 601 + 601 > 1000, but the first holds its usage (8) when the second arrives
        reply = await client.chat.completions.create(**chat(600))
        assert reply.choices[0].message.content == REPLY
    stats = tokens(vendor)
    assert (stats["tokens_window_max"], stats["used"], stats["tokens_accepted"]) == (8 + 601, 16, 16)
    assert (stats["limit"], stats["rejected"], vendor.rejected) == (1000, 0, 0)


async def test_an_answer_holds_its_estimate_until_it_is_produced(aiohttp_client, clock, monkeypatch) -> None:
    """The second request arrives while the first's stream is held back: refused on the first's
    estimate; once the stream is written, the window keeps its usage and the second fits."""
    writing, release = asyncio.Event(), asyncio.Event()

    async def held(*args: Any) -> Any:
        writing.set()
        await release.wait()
        return await write_events(*args)

    monkeypatch.setattr(mockvendor_openai, "write_events", held)
    vendor = MockVendor(rate=None, tokens_per_minute=1000, clock=clock.monotonic)
    client = await aiohttp_client(vendor.app())

    async def first() -> str:
        async with client.post(CHAT, json=chat(600, stream=True)) as r:
            return await r.text()

    streaming = asyncio.create_task(first())
    await writing.wait()
    async with client.post(CHAT, json=chat(600)) as r:
        assert r.status == 429
        message = (await r.json())["error"]["message"]
    assert "Limit 1000, Used 601, Requested 601." in message
    release.set()
    assert (await streaming).endswith("data: [DONE]\n\n")
    assert tokens(vendor)["used"] == 8  # the stream's usage, told or not (no include_usage)
    async with client.post(CHAT, json=chat(600)) as r:
        assert r.status == 200
    assert (tokens(vendor)["tokens_accepted"], tokens(vendor)["rejected"]) == (16, 1)


# -- OpenAI's 429 for tokens -----------------------------------------------------------------------


async def test_a_token_overrun_is_openais_429_for_tokens(served, openai_client, clock) -> None:
    vendor = MockVendor(rate=10, burst=10, tokens_per_minute=1000, clock=clock.monotonic)
    client = openai_client(await served(vendor))
    await client.chat.completions.create(**chat(600))  # holds 8 once answered
    await clock.advance(15)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(**chat(993))  # 1 + 993 > 1000 - 8
    error = refused.value
    assert (error.status_code, error.code, error.type, error.param) == (429, "rate_limit_exceeded", "tokens", None)
    said = json.loads(error.response.text)["error"]["message"]
    assert re.fullmatch(
        r"Rate limit reached for gpt-4o-mini in organization org-mock on tokens per min \(TPM\): "
        r"Limit 1000, Used 8, Requested 994\. Please try again in 45s\. Visit https://\S+ to learn more\.",
        said,
    ), said
    headers = error.response.headers
    assert headers["Retry-After"] == "45"  # the 8 leave the window 60 s after they arrived
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("1000", "992")
    assert headers["x-ratelimit-reset-tokens"] == "45s"
    assert headers["x-ratelimit-remaining-requests"] == "10"  # the bucket is full: the refused one took nothing
    assert (vendor.accepted, vendor.rejected, tokens(vendor)["rejected"]) == (1, 1, 1)
    assert tokens(vendor)["tokens_window_max"] == 8 + 994  # the refused one arrived: above the limit

    await clock.advance(45)
    reply = await client.chat.completions.create(**chat(993))
    assert reply.usage is not None and reply.usage.completion_tokens == count_tokens(REPLY)


async def test_a_request_larger_than_the_window_can_never_fit(served, openai_client) -> None:
    client = openai_client(await served(MockVendor(rate=None, tokens_per_minute=100)))
    with pytest.raises(openai.RateLimitError) as refused:
        await client.embeddings.create(model="text-embedding-3-small", input="x" * 404)  # 101 tokens
    error = refused.value
    assert json.loads(error.response.text)["error"]["message"].startswith(
        "Request too large for text-embedding-3-small in organization org-mock on tokens per min (TPM): "
        "Limit 100, Requested 101. The input or output tokens must be reduced"
    )
    assert "Retry-After" not in error.response.headers  # waiting would not help
    assert error.response.headers["x-ratelimit-remaining-tokens"] == "100"


async def test_every_answer_carries_the_token_headers(aiohttp_client) -> None:
    vendor = MockVendor(rate=1, burst=1, tokens_per_minute=1000, token_window=10)  # 166 in any 10 s
    client = await aiohttp_client(vendor.app())
    async with client.post(CHAT, json={"model": "m", "max_tokens": 10}) as r:  # no messages: a 400, using nothing
        assert r.status == 400 and r.headers["x-ratelimit-remaining-tokens"] == "156"  # told at arrival
    async with client.post(CHAT, json=chat(10)) as r:  # the request quota's 429
        assert r.status == 429 and (await r.json())["error"]["type"] == "requests"
        assert r.headers["x-ratelimit-limit-tokens"] == "1000"
        assert r.headers["x-ratelimit-remaining-tokens"] == "166"
    assert tokens(vendor)["tokens_window_max"] == 11  # it arrived all the same
    async with client.post("/__mock/reset") as r:
        assert r.status == 200
    assert tokens(vendor) | {"per_minute": 0} == {
        "per_minute": 0,
        "window": 10.0,
        "limit": 166,
        "used": 0,
        "tokens_window_max": 0,
        "tokens_accepted": 0,
        "rejected": 0,
    }


# -- completion caps -------------------------------------------------------------------------------


async def test_a_small_completion_cap_cuts_the_reply(served, openai_client) -> None:
    client = openai_client(await served(MockVendor(rate=None)))
    cut = await client.chat.completions.create(**chat(3))
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (REPLY[:12], "length")
    assert cut.usage is not None and cut.usage.completion_tokens == 3
    response = await client.responses.create(model="m", input="Hello", max_output_tokens=2)
    assert (response.status, response.output_text) == ("incomplete", REPLY[:8])
    assert response.usage is not None and response.usage.output_tokens == 2
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(**chat(0))
    assert bad.value.param == "max_tokens" and "Expected a value >= 1" in bad.value.message


# -- the command -----------------------------------------------------------------------------------


def test_the_command_counts_tokens_as_told(tmp_path: Path) -> None:
    args = ("--rate", "0", "--tokens-per-minute", "600", "--input-tokens-per-minute", "300")
    with (
        vendor_process(tmp_path, *args, "--token-window", "10s") as vendor,
        urllib.request.urlopen(f"{vendor.url}/__mock/stats", timeout=10) as r,
    ):
        counted = json.load(r)["token_windows"]
    assert counted["openai"]["tokens"]["limit"] == 100
    assert counted["anthropic"]["input_tokens"]["limit"] == 50
    assert "output_tokens" not in counted["anthropic"]


def test_main_rejects_bad_token_quotas(capsys) -> None:
    for argv, problem in (
        (["--tokens-per-minute", "0"], "expected a positive number of tokens per minute"),
        (["--output-tokens-per-minute", "lots"], "expected a positive number of tokens per minute"),
        (["--token-window", "10s"], "--token-window needs --tokens-per-minute"),
        (["--tokens-per-minute", "5", "--token-window", "1s"], "over a 1s window is less than 1 token"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["mock-vendor", *argv])
        assert exc.value.code == 2, argv
        assert problem in capsys.readouterr().err, argv


def test_help_names_the_token_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["mock-vendor", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--tokens-per-minute", "--input-tokens-per-minute", "--output-tokens-per-minute", "--token-window"):
        assert flag in text


# -- a reply of the size the request asks for (X-Mock-Output-Tokens) -------------------------------

ASK = OUTPUT_TOKENS_HEADER


async def test_a_request_asks_for_its_replys_size_up_to_its_cap(served, openai_client) -> None:
    vendor = MockVendor(rate=None, tokens_per_minute=100_000)
    client = openai_client(await served(vendor))
    body = chat(1000, "x" * 400)  # 100 prompt tokens
    sized = await client.chat.completions.create(**body, extra_headers={ASK: "300"})
    text = sized.choices[0].message.content or ""
    assert (len(text), count_tokens(text), sized.choices[0].finish_reason) == (1200, 300, "stop")
    assert sized.usage is not None and (sized.usage.prompt_tokens, sized.usage.completion_tokens) == (100, 300)
    assert tokens(vendor)["used"] == 400  # the estimate (100 + 1000) became the usage
    capped = await client.chat.completions.create(**chat(100, n=2), extra_headers={ASK: "300"})
    assert [c.finish_reason for c in capped.choices] == ["length", "length"]  # the cap cut it
    assert capped.usage is not None and capped.usage.completion_tokens == 2 * 100
    response = await client.responses.create(model="m", input="Hello", max_output_tokens=50, extra_headers={ASK: "20"})
    assert response.usage is not None and response.usage.output_tokens == 20
    assert (response.status, len(response.output_text)) == ("completed", 80)
    plain = await client.chat.completions.create(**chat(1000))
    assert plain.choices[0].message.content == REPLY  # without the header: as before


async def test_a_sized_reply_streams_in_pieces_and_its_usage_says_so(served, openai_client) -> None:
    vendor = MockVendor(rate=None, tokens_per_minute=100_000)
    client = openai_client(await served(vendor))
    stream = await client.chat.completions.create(
        **chat(2000), stream=True, stream_options={"include_usage": True}, extra_headers={ASK: "1500"}
    )
    chunks = [chunk async for chunk in stream]
    said = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len("".join(said)) == 4 * 1500
    assert 50 <= len(said) <= 150  # runs of words of about 64 characters: not one event a word
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 1500
    assert tokens(vendor)["tokens_accepted"] == usage.total_tokens


async def test_anthropic_replies_at_the_size_asked_streamed_or_not(aiohttp_client) -> None:
    vendor = MockVendor(rate=None, input_tokens_per_minute=100_000, output_tokens_per_minute=100_000)
    client = await aiohttp_client(vendor.app())
    body = {"model": "claude", "max_tokens": 500, "messages": [{"role": "user", "content": "x" * 40}]}
    async with client.post("/v1/messages", json=body, headers={ASK: "120"}) as r:
        made = await r.json()
    assert made["usage"] == {"input_tokens": 10, "output_tokens": 120} and made["stop_reason"] == "end_turn"
    assert len(made["content"][0]["text"]) == 480
    async with client.post("/v1/messages", json={**body, "stream": True}, headers={ASK: "900"}) as r:
        events = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line.startswith("data: ")]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert (len(text), delta["usage"]["output_tokens"], delta["delta"]["stop_reason"]) == (2000, 500, "max_tokens")
    output = vendor.stats()["token_windows"]["anthropic"]["output_tokens"]
    assert (output["used"], output["tokens_accepted"]) == (120 + 500, 120 + 500)


@pytest.mark.parametrize("value", ["0", "-3", "lots", "1.5", ""])
async def test_a_bad_size_is_the_shapes_400(aiohttp_client, value) -> None:
    client = await aiohttp_client(MockVendor(rate=None, tokens_per_minute=100_000).app())
    async with client.post(CHAT, json=chat(10), headers={ASK: value}) as r:
        assert r.status == 400
        assert ASK in (await r.json())["error"]["message"]
    async with client.post("/v1/messages", json={**chat(10), "model": "c"}, headers={ASK: value}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"


def test_help_names_the_size_header(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["mock-vendor", "--help"])
    assert "X-Mock-Output-Tokens" in re.sub(r"\s+", "", capsys.readouterr().out)  # argparse may wrap it
