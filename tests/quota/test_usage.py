"""A request's actual cost, read from the vendor's answer (proxy/quota/usage.py): JSON answers,
streamed answers event by event (as proxy/wire/sse.py finds them), headers, the policy's
forms, and ``None`` (keep the estimate) for anything malformed, never an exception."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from proxy.quota.json_pointer import JsonPointer
from proxy.quota.usage import MAX_AMOUNT, Settle, settle_from_policy
from proxy.wire.sse import EventSplitter
from tests.helpers.meter_samples import (
    ANTHROPIC_JSON,
    ANTHROPIC_STREAM,
    OPENAI_CHAT_JSON,
    OPENAI_CHAT_STREAM,
    OPENAI_EMBEDDINGS_JSON,
    OPENAI_RESPONSES_JSON,
    OPENAI_RESPONSES_STREAM,
    SHOPIFY_JSON,
    SHOPIFY_THROTTLED_JSON,
)

OPENAI = Settle("openai")
ANTHROPIC_INPUT = Settle("anthropic_input")
ANTHROPIC_OUTPUT = Settle("anthropic_output")
SHOPIFY = settle_from_policy({"json": "/extensions/cost/actualQueryCost"})
HEADER = settle_from_policy({"header": "X-Cost"})


def streamed(settle: Settle, stream: bytes, *, chunk: int = 0) -> float | None:
    """What ``settle`` reads from ``stream`` relayed in chunks of ``chunk`` bytes (0: whole)."""
    splitter = EventSplitter()
    reader = settle.stream()
    step = chunk or len(stream) or 1
    for start in range(0, len(stream), step):
        for event in splitter.feed(stream[start : start + step]):
            reader.feed(event.name, event.data)
    return reader.amount()


def sse(*events: tuple[str | None, object]) -> bytes:
    out = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")
    return "".join(out).encode()


@pytest.mark.parametrize(
    ("settle", "body", "expected"),
    [
        (OPENAI, OPENAI_CHAT_JSON, 29),
        (OPENAI, OPENAI_RESPONSES_JSON, 380),
        (OPENAI, OPENAI_EMBEDDINGS_JSON, 8),
        (ANTHROPIC_INPUT, ANTHROPIC_JSON, 12 + 200),  # the 3,000 read from the cache do not count
        (ANTHROPIC_OUTPUT, ANTHROPIC_JSON, 11),
        (SHOPIFY, SHOPIFY_JSON, 3),
        (SHOPIFY, SHOPIFY_THROTTLED_JSON, None),
        (HEADER, SHOPIFY_JSON, None),  # a header form reads no body
        (OPENAI, SHOPIFY_JSON, None),
        (ANTHROPIC_INPUT, OPENAI_CHAT_JSON, None),
    ],
)
def test_json_answers(settle, body, expected):
    assert settle.from_json(body) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"total_tokens": 5, "input_tokens": 1, "output_tokens": 1}, 5),
        ({"input_tokens": 3, "output_tokens": 4}, 7),
        ({"prompt_tokens": 3, "completion_tokens": 4}, 7),
        ({"prompt_tokens": 3}, None),
        ({"total_tokens": "5", "input_tokens": 3, "output_tokens": 4}, 7),
        ({"total_tokens": -5}, None),
        ({"total_tokens": True}, None),
        ({"total_tokens": 2.0**60}, None),
        ({"total_tokens": 10**400}, None),
        ({"input_tokens": 2.0**53, "output_tokens": 2.0**52}, None),  # the sum is past the largest amount
        ({"total_tokens": 0}, 0),
        (None, None),
        ([], None),
        ("29", None),
    ],
)
def test_openai_usage(usage, expected):
    assert OPENAI.from_json(json.dumps({"usage": usage}).encode()) == expected


@pytest.mark.parametrize(
    ("usage", "input_tokens", "output_tokens"),
    [
        ({"input_tokens": 10, "output_tokens": 3}, 10, 3),
        (
            {"input_tokens": 10, "cache_creation_input_tokens": None, "cache_read_input_tokens": 9, "output_tokens": 3},
            10,
            3,
        ),
        ({"input_tokens": 10, "cache_creation_input_tokens": 5, "output_tokens": 3}, 15, 3),
        ({"input_tokens": 10, "cache_creation_input_tokens": "5", "output_tokens": 3}, None, 3),
        ({"output_tokens": 3}, None, 3),
        ({"input_tokens": -1, "output_tokens": -1}, None, None),
        ({"input_tokens": 1.5e300, "output_tokens": 2**64}, None, None),
    ],
)
def test_anthropic_usage(usage, input_tokens, output_tokens):
    body = json.dumps({"type": "message", "usage": usage}).encode()
    assert ANTHROPIC_INPUT.from_json(body) == input_tokens
    assert ANTHROPIC_OUTPUT.from_json(body) == output_tokens


@pytest.mark.parametrize(
    ("settle", "stream", "expected"),
    [
        (OPENAI, OPENAI_CHAT_STREAM, 29),
        (OPENAI, OPENAI_RESPONSES_STREAM, 48),
        (ANTHROPIC_INPUT, ANTHROPIC_STREAM, 25 + 100),
        (ANTHROPIC_OUTPUT, ANTHROPIC_STREAM, 15),
        (OPENAI, OPENAI_CHAT_STREAM.replace(b"\n", b"\r\n"), 29),
        (ANTHROPIC_OUTPUT, ANTHROPIC_STREAM.replace(b"\n", b"\r\n"), 15),
        (HEADER, OPENAI_CHAT_STREAM, None),
        (ANTHROPIC_OUTPUT, OPENAI_CHAT_STREAM, None),
        (OPENAI, ANTHROPIC_STREAM, None),
    ],
)
def test_streams(settle, stream, expected):
    assert streamed(settle, stream) == expected
    for chunk in (1, 3, 64):
        assert streamed(settle, stream, chunk=chunk) == expected


def test_an_openai_stream_without_include_usage_says_nothing():
    lines = [line for line in OPENAI_CHAT_STREAM.split(b"\n\n") if b'"choices":[]' not in line]
    stream = b"\n\n".join(lines)
    assert b'"usage":null' in stream
    assert streamed(OPENAI, stream) is None


def test_a_stream_cut_before_its_usage_says_nothing():
    cut = OPENAI_CHAT_STREAM.index(b'"choices":[]')
    assert streamed(OPENAI, OPENAI_CHAT_STREAM[:cut]) is None
    cut = OPENAI_RESPONSES_STREAM.index(b"event: response.completed")
    assert streamed(OPENAI, OPENAI_RESPONSES_STREAM[:cut]) is None


def test_an_anthropic_stream_cut_mid_answer():
    cut = ANTHROPIC_STREAM.index(b"event: content_block_stop")
    # The input is known from message_start; the output is not: message_start's one token is
    # only a first count, and the estimate (max_tokens) stays.
    assert streamed(ANTHROPIC_INPUT, ANTHROPIC_STREAM[:cut]) == 125
    assert streamed(ANTHROPIC_OUTPUT, ANTHROPIC_STREAM[:cut]) is None


def test_anthropic_stream_events_in_detail():
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 40, "output_tokens": 1}}}
    assert streamed(ANTHROPIC_OUTPUT, sse(("message_start", start), ("message_stop", {"type": "message_stop"}))) == 1
    deltas = sse(
        ("message_start", start),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 10}}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 25}}),  # cumulative: the last wins
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": "x"}}),
    )
    assert streamed(ANTHROPIC_OUTPUT, deltas) == 25
    assert streamed(ANTHROPIC_INPUT, deltas) == 40
    first = {"input_tokens": 40, "cache_creation_input_tokens": 7}
    again = {"output_tokens": 3, "input_tokens": 45, "cache_creation_input_tokens": None}  # null: not restated
    restated = sse(
        ("message_start", {"type": "message_start", "message": {"usage": first}}),
        ("message_delta", {"type": "message_delta", "usage": again}),
    )
    assert streamed(ANTHROPIC_INPUT, restated) == 45 + 7
    unnamed = sse((None, start), (None, {"type": "message_delta", "usage": {"output_tokens": 9}}))
    assert streamed(ANTHROPIC_INPUT, unnamed) == 40
    assert streamed(ANTHROPIC_OUTPUT, unnamed) == 9
    error = sse(("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))
    assert streamed(ANTHROPIC_INPUT, error) is None and streamed(ANTHROPIC_OUTPUT, error) is None


def test_openai_stream_events_in_detail():
    stream = sse(
        (None, {"choices": [], "usage": {"total_tokens": 10}}),
        (None, {"choices": [], "usage": {"total_tokens": -1}}),  # a bad one does not undo a good one
        (None, "[DONE]"),
    )
    assert streamed(OPENAI, stream) == 10
    assert (
        streamed(OPENAI, sse(("response.in_progress", {"type": "response.in_progress", "response": {"usage": None}})))
        is None
    )
    usage = {"input_tokens": 5, "output_tokens": 16, "total_tokens": 21}
    incomplete = {"type": "response.incomplete", "response": {"status": "incomplete", "usage": usage}}
    assert streamed(OPENAI, sse(("response.incomplete", incomplete))) == 21
    text = {
        "type": "response.output_text.delta",
        "delta": 'a "usage" of words',
        "response": {"usage": {"total_tokens": 1}},
    }
    assert streamed(OPENAI, sse(("response.output_text.delta", text))) is None


def test_a_pointer_reads_streamed_events_too():
    settle = settle_from_policy({"json": "/cost/actual"})
    stream = sse((None, {"cost": {"actual": 4}}), (None, {"other": 1}), ("done", {"cost": {"actual": 6}}), (None, "x"))
    assert streamed(settle, stream) == 6
    assert streamed(settle_from_policy({"json": ""}), sse((None, "3"), (None, "[DONE]"))) == 3
    assert streamed(settle_from_policy({"json": "/a~1b"}), sse((None, {"a/b": 2}))) == 2


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-Cost": "12"}, 12),
        ({"x-cost": "12.5"}, 12.5),
        ({"X-COST": " 3 "}, 3),
        ({"X-Cost": "0"}, 0),
        ({"X-Cost": "-1"}, None),
        ({"X-Cost": "1e3"}, None),
        ({"X-Cost": "1_000"}, None),
        ({"X-Cost": "nan"}, None),
        ({"X-Cost": "inf"}, None),
        ({"X-Cost": ""}, None),
        ({"X-Cost": "9" * 30}, None),
        ({"X-Cost": "99999999999999999999"}, None),  # past the largest amount
        ({"X-Other": "12"}, None),
        ({}, None),
    ],
)
def test_headers(headers, expected):
    assert HEADER.from_headers(headers) == expected
    assert OPENAI.from_headers(headers) is None


def test_a_case_insensitive_mapping_is_asked_directly():
    from multidict import CIMultiDict

    assert HEADER.from_headers(CIMultiDict({"x-COST": "4"})) == 4


def test_malformed_json_answers_say_nothing():
    good = SHOPIFY_JSON
    for cut in range(len(good)):
        assert SHOPIFY.from_json(good[:cut]) is None
    for cut in range(len(OPENAI_CHAT_JSON)):
        assert OPENAI.from_json(OPENAI_CHAT_JSON[:cut]) is None
    for body in (b"", b"null", b"[]", b"\xff", b'{"usage": {"total_tokens": NaN}}', b"[" * 100_000):
        for settle in (OPENAI, ANTHROPIC_INPUT, ANTHROPIC_OUTPUT, SHOPIFY, HEADER):
            assert settle.from_json(body) is None


def test_never_raises_on_any_events():
    rng = random.Random(35)
    names = ["message", "message_start", "message_delta", "message_stop", "response.completed", "ping", ""]
    pieces = ['"usage"', '"message_', "{", "}", "[", "]", ":", ",", "null", "-1", "1e999", '"type"', '"message"', "x"]
    settles = [OPENAI, ANTHROPIC_INPUT, ANTHROPIC_OUTPUT, SHOPIFY, HEADER, settle_from_policy({"json": ""})]
    for _ in range(3000):
        readers = [settle.stream() for settle in settles]
        for _ in range(rng.randint(1, 6)):
            data = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
            name = rng.choice(names)
            for reader in readers:
                reader.feed(name, data)
        for reader in readers:
            found = reader.amount()
            assert found is None or 0 <= found <= MAX_AMOUNT


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("openai", Settle("openai")),
        ("anthropic_input", Settle("anthropic_input")),
        ("anthropic_output", Settle("anthropic_output")),
        (
            {"json": "/extensions/cost/actualQueryCost"},
            Settle(
                "json",
                pointer=JsonPointer("/extensions/cost/actualQueryCost", ("extensions", "cost", "actualQueryCost")),
            ),
        ),
        ({"header": "X-Cost"}, Settle("header", header="X-Cost")),
    ],
)
def test_policy_forms(value, expected):
    assert settle_from_policy(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "anthropic",
            "unknown settle preset 'anthropic': one of openai, anthropic_input, anthropic_output, {json: /pointer}",
        ),
        ("json", "unknown settle preset 'json'"),
        (
            None,
            "a settle is one of openai, anthropic_input, anthropic_output, {json: /pointer} or {header: Name},"
            " not null",
        ),
        ({"fixed": 3}, 'not {"fixed": 3}'),
        ({"json": "/a", "default": 3}, "a settle is one of"),
        ({"json": "a"}, 'JSON pointer "a" must start with "/"'),
        ({"header": "X Cost"}, 'settle header must be a header field name such as X-Cost, not "X Cost"'),
        ({"header": ""}, "settle header must be a header field name"),
        ({"header": 3}, "settle header must be a header field name"),
        ({"header": "X-Cost", "json": "/a"}, "a settle is one of"),
    ],
)
def test_policy_errors_say_what_is_allowed(value, message):
    with pytest.raises(ValueError) as caught:
        settle_from_policy(value)
    assert message in str(caught.value)


def test_a_settle_is_frozen_and_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPENAI.kind = "json"  # type: ignore[misc]
    assert not HEADER.reads_body and SHOPIFY.reads_body and OPENAI.reads_body
    with pytest.raises(ValueError, match="unknown settle"):
        Settle("tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a pointer goes with"):
        Settle("json")
    with pytest.raises(ValueError, match="names one header field"):
        Settle("header")
    with pytest.raises(ValueError, match="names one header field"):
        Settle("openai", header="X-Cost")
