"""A request's estimated cost for a meter (proxy/quota/estimates.py): each preset counts what
its vendor's admission rule counts, the general forms, the policy's forms, and never an
exception on any body."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from proxy.quota.estimates import DEFAULT_COMPLETION_CAP, MAX_ESTIMATE, Estimate, estimate_from_policy
from proxy.quota.json_pointer import JsonPointer

OPENAI = Estimate("openai")
ANTHROPIC_INPUT = Estimate("anthropic_input")
ANTHROPIC_OUTPUT = Estimate("anthropic_output")


def cost(estimate: Estimate, body: object, default: float = 7.0, **kwargs: object) -> float:
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return estimate.cost(raw, default, **kwargs)  # type: ignore[arg-type]


def chars(*texts: str) -> int:
    return sum(len(t) for t in texts)


def compact(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


SYSTEM = "You are a terse assistant."  # 26 characters
QUESTION = "What is the capital of France? Answer in one word."  # 50
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

OPENAI_CASES = [
    pytest.param(
        {
            "model": "gpt-4.1",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        },
        {},
        math.ceil(chars(SYSTEM, QUESTION) / 4) + DEFAULT_COMPLETION_CAP,
        id="chat, no cap: the caller's",
    ),
    pytest.param(
        {"model": "gpt-4.1", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 100, "n": 3},
        {},
        13 + 300,
        id="chat, max_tokens x n",
    ),
    pytest.param(
        {
            "model": "o3",
            "messages": [{"role": "user", "content": "abcd"}],
            "max_completion_tokens": 50,
            "max_tokens": 9,
        },
        {},
        1 + 50,
        id="max_completion_tokens before max_tokens",
    ),
    pytest.param(
        {"model": "gpt-4.1", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": None},
        {"completion_cap": 16},
        1 + 16,
        id="a null cap is none",
    ),
    pytest.param(
        {
            "model": "gpt-4o",
            "messages": [
                {
                    "role": "user",
                    "name": "alice",
                    "content": [
                        {"type": "text", "text": "Describe"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}},
                        {"type": "text", "text": " this."},
                    ],
                },
            ],
            "max_tokens": 10,
        },
        {},
        math.ceil(chars("alice", "Describe", " this.") / 4) + 10,
        id="chat parts: text counts, images do not",
    ),
    pytest.param(
        {
            "model": "gpt-4.1",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
            ],
            "tools": [TOOL],
            "max_tokens": 20,
        },
        {},
        math.ceil((chars("Weather in Paris?", "get_weather", '{"city":"Paris"}', "18C, sunny") + compact([TOOL])) / 4)
        + 20,
        id="chat with tools: calls, results, definitions",
    ),
    pytest.param(
        {"model": "gpt-3.5-turbo-instruct", "prompt": "Say this is a test", "max_tokens": 7},
        {},
        5 + 7,
        id="completions",
    ),
    pytest.param(
        {
            "model": "gpt-3.5-turbo-instruct",
            "prompt": ["abcd", "efgh", [1, 2, 3], 9],
            "max_tokens": 7,
            "n": 2,
            "best_of": 5,
        },
        {},
        2 + 4 + 7 * 5,
        id="completions: strings, token ids, best_of",
    ),
    pytest.param(
        {"model": "gpt-3.5-turbo-instruct", "prompt": "abcd", "suffix": "efgh", "max_tokens": 1, "best_of": 1, "n": 4},
        {},
        2 + 4,
        id="completions: suffix, n larger than best_of",
    ),
    pytest.param(
        {"model": "gpt-4.1", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 64},
        {},
        math.ceil(chars(SYSTEM, QUESTION) / 4) + 64,
        id="responses: instructions and input",
    ),
    pytest.param(
        {
            "model": "gpt-4.1",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "abcd"}, {"type": "input_image", "image_url": "x"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "efgh"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "18C"},
                {"role": "user", "content": "ijkl"},
            ],
            "prompt": {"id": "pmpt_123", "variables": {}},
        },
        {"completion_cap": 100},
        math.ceil(chars("abcd", "efgh", "get_weather", '{"city":"Paris"}', "18C", "ijkl") / 4) + 100,
        id="responses: items",
    ),
    pytest.param(
        {"model": "text-embedding-3-small", "input": "The food was delicious and the waiter..."},
        {"path": "/v1/embeddings"},
        10,
        id="embeddings: no completion",
    ),
    pytest.param(
        {"model": "text-embedding-3-small", "input": ["abcd", "efghi"], "encoding_format": "float"},
        {},
        3,
        id="embeddings without a path, by its fields",
    ),
    pytest.param(
        {"model": "text-embedding-ada-002", "input": [[1, 2, 3], [4, 5]]},
        {},
        5,
        id="embeddings of token ids, by its model",
    ),
    pytest.param(
        {"model": "my-embedder", "input": "abcd"},
        {"path": "/openai/v1/embeddings?api-version=1"},
        1,
        id="embeddings by path, query ignored",
    ),
    pytest.param(
        {"model": "gpt-4.1", "input": "abcd"},
        {"path": "/v1/responses", "completion_cap": 3},
        1 + 3,
        id="a path that is not embeddings",
    ),
    pytest.param(
        {"model": "gpt-4.1", "messages": [{"role": "user", "content": "é" * 8 + "😀" * 4}], "max_tokens": 0},
        {},
        3,
        id="characters, not bytes",
    ),
    pytest.param(
        {"model": "gpt-4.1", "messages": "not a list", "max_tokens": "ten", "n": True},
        {"completion_cap": 5},
        5,
        id="wrong types count nothing",
    ),
    pytest.param(
        {"model": "gpt-4.1", "messages": [], "max_tokens": -5, "n": 0},
        {"completion_cap": 5},
        5,
        id="a negative cap is none, n under 1 is 1",
    ),
    pytest.param({"messages": [], "max_tokens": 1e300, "n": 10**30}, {}, MAX_ESTIMATE, id="huge: held at the maximum"),
    pytest.param({"messages": [], "max_tokens": 10**400}, {}, MAX_ESTIMATE, id="an int past a float"),
    pytest.param({}, {"completion_cap": 0}, 0, id="an empty object"),
]


@pytest.mark.parametrize(("body", "kwargs", "expected"), OPENAI_CASES)
def test_openai(body, kwargs, expected):
    assert cost(OPENAI, body, **kwargs) == expected


ANTHROPIC_BODY = {
    "model": "claude-sonnet-5-5",
    "max_tokens": 1024,
    "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "x" * 400, "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 4000}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "a plain text"}},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "B" * 999}},
            ],
        },
    ],
}
ANTHROPIC_CHARACTERS = chars(
    SYSTEM, QUESTION, "Let me check.", "get_weather", '{"city":"Paris"}', "18C", "sunny", "a plain text"
) + compact(ANTHROPIC_BODY["tools"])


@pytest.mark.parametrize(
    ("estimate", "body", "expected"),
    [
        (ANTHROPIC_INPUT, ANTHROPIC_BODY, math.ceil(ANTHROPIC_CHARACTERS / 4)),
        (ANTHROPIC_OUTPUT, ANTHROPIC_BODY, 1024),
        (ANTHROPIC_INPUT, {"system": "abcd", "messages": [{"role": "user", "content": "efghi"}]}, 3),
        (ANTHROPIC_INPUT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, "bc"]}]}, 1),
        (ANTHROPIC_INPUT, {"messages": [{"role": "user"}, "junk", {"content": 5}], "system": 3}, 0),
        (ANTHROPIC_OUTPUT, {"messages": []}, 7),  # no max_tokens: the meter's default
        (ANTHROPIC_OUTPUT, {"max_tokens": "1024"}, 7),
        (ANTHROPIC_OUTPUT, {"max_tokens": 64000}, 64000),
        (ANTHROPIC_OUTPUT, {"max_tokens": 1e15}, 1e15),
        (ANTHROPIC_OUTPUT, {"max_tokens": 1e20}, MAX_ESTIMATE),
        (ANTHROPIC_OUTPUT, {"max_tokens": 1e300}, MAX_ESTIMATE),
    ],
)
def test_anthropic(estimate, body, expected):
    assert cost(estimate, body) == expected


def test_fixed_costs_its_number_whatever_the_body():
    fixed = Estimate("fixed", fixed=100)
    assert not fixed.reads_body and OPENAI.reads_body
    for body in (None, b"", b"not json", b'{"query": "{ shop { name } }"}'):
        assert fixed.cost(body, 7) == 100


POINTER = estimate_from_policy({"json": "/variables/cost", "default": 50})


@pytest.mark.parametrize(
    ("estimate", "body", "expected"),
    [
        (POINTER, {"variables": {"cost": 12}}, 12),
        (POINTER, {"variables": {"cost": 2.5}}, 2.5),
        (POINTER, {"variables": {"cost": 0}}, 0),
        (POINTER, {"variables": {"cost": -1}}, 50),
        (POINTER, {"variables": {"cost": "12"}}, 50),
        (POINTER, {"variables": {"cost": True}}, 50),
        (POINTER, {"variables": {"cost": None}}, 50),
        (POINTER, {"variables": {}}, 50),
        (POINTER, {"variables": [12]}, 50),
        (POINTER, [1, 2], 50),
        (POINTER, {"variables": {"cost": 1e300}}, MAX_ESTIMATE),
        (POINTER, b"not json", 50),
        (POINTER, None, 50),
        (estimate_from_policy({"json": "/cost"}), b"not json", 7),  # no default of its own: the meter's
        (estimate_from_policy({"json": "/cost"}), {"cost": 3}, 3),
        (estimate_from_policy({"json": "/items/1/n"}), {"items": [{"n": 1}, {"n": 2}]}, 2),
        (estimate_from_policy({"json": "/a~1b/~0c"}), {"a/b": {"~c": 4}}, 4),
        (estimate_from_policy({"json": ""}), 9, 9),
    ],
)
def test_json_pointer_form(estimate, body, expected):
    assert cost(estimate, body) == expected


@pytest.mark.parametrize("estimate", [OPENAI, ANTHROPIC_INPUT, ANTHROPIC_OUTPUT], ids=lambda e: e.kind)
@pytest.mark.parametrize(
    "body",
    [
        None,
        b"",
        b"not json",
        b"[1, 2]",
        b'"a string"',
        b"null",
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b"\xff\xfe{",
        b"{" * 5,
    ],
)
def test_a_body_that_is_not_a_json_object_costs_the_default(estimate, body):
    assert estimate.cost(body, 7.0) == 7.0


@pytest.mark.parametrize(
    "content_type", ["multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "text/plain"]
)
def test_a_body_of_another_type_costs_the_default(content_type):
    body = json.dumps({"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 1}).encode()
    assert OPENAI.cost(body, 7.0, content_type=content_type) == 7.0
    for json_type in (None, "", "application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"):
        assert OPENAI.cost(body, 7.0, content_type=json_type) == 2


VALUES: list[object] = [None, True, -1, 0, 1.5, 1e308, "x", [], {}, [1, "a", [2]], {"text": 1}]
KEYS = [
    *("messages", "content", "text", "prompt", "input", "instructions", "system", "max_tokens", "n", "best_of"),
    *("tools", "type", "name", "arguments", "tool_calls", "function", "output", "source", "data"),
    *("max_output_tokens", "max_completion_tokens"),
]


def shape(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value made of the keys the presets read."""
    if depth > 3 or rng.random() < 0.3:
        return rng.choice(VALUES)
    if rng.random() < 0.5:
        return [shape(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): shape(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def test_never_raises_and_stays_in_range():
    rng = random.Random(35)
    nested = b"[" * 100_000 + b"]" * 100_000
    deep_object: dict[str, object] = {"messages": [{"content": [{"text": "a"}]}]}
    for _ in range(200):
        deep_object = {"messages": [deep_object], "input": [deep_object], "tools": [deep_object]}
        if len(json.dumps(deep_object)) > 200_000:
            break
    bodies = [nested, b"9" * 5000, b'{"max_tokens": ' + b"9" * 5000 + b"}", json.dumps(deep_object).encode()]
    for _ in range(2000):
        bodies.append(json.dumps(shape(rng)).encode())
        bodies.append(rng.randbytes(rng.randint(0, 40)))
    estimates = [OPENAI, ANTHROPIC_INPUT, ANTHROPIC_OUTPUT, POINTER, Estimate("fixed", fixed=3)]
    for body in bodies:
        for estimate in estimates:
            found = estimate.cost(body, 7.0, completion_cap=rng.choice([0.0, 16.0, math.inf]))
            assert isinstance(found, float | int) and 0 <= found <= MAX_ESTIMATE


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("openai", Estimate("openai")),
        ("anthropic_input", Estimate("anthropic_input")),
        ("anthropic_output", Estimate("anthropic_output")),
        ({"fixed": 100}, Estimate("fixed", fixed=100)),
        ({"fixed": 0.5}, Estimate("fixed", fixed=0.5)),
        ({"json": "/cost", "default": 5}, Estimate("json", pointer=JsonPointer("/cost", ("cost",)), default=5)),
        ({"json": "/cost"}, Estimate("json", pointer=JsonPointer("/cost", ("cost",)))),
    ],
)
def test_policy_forms(value, expected):
    assert estimate_from_policy(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("opeani", "unknown estimate preset 'opeani': one of openai, anthropic_input, anthropic_output, {fixed: N}"),
        ("fixed", "unknown estimate preset 'fixed'"),
        (
            3,
            "an estimate is one of openai, anthropic_input, anthropic_output, {fixed: N}"
            " or {json: /pointer, default: N}, not 3",
        ),
        (None, "not null"),
        ({}, "an estimate is one of"),
        ({"fixed": -1}, "estimate fixed must be a number from 0 to 9007199254740992, not -1"),
        ({"fixed": "100"}, 'estimate fixed must be a number from 0 to 9007199254740992, not "100"'),
        ({"fixed": True}, "estimate fixed must be a number"),
        ({"fixed": 1e300}, "estimate fixed must be a number"),
        ({"fixed": 1, "default": 2}, 'not {"fixed": 1, "default": 2}'),
        ({"json": "cost"}, 'JSON pointer "cost" must start with "/"'),
        ({"json": "/a~2"}, '"~" must be written "~0" and "/" as "~1"'),
        ({"json": 5}, "a JSON pointer is a string"),
        ({"json": "/cost", "default": -3}, "estimate default must be a number"),
        ({"json": "/cost", "fixed": 3}, "an estimate is one of"),
        ({"default": 3}, "an estimate is one of"),
    ],
)
def test_policy_errors_say_what_is_allowed(value, message):
    with pytest.raises(ValueError) as caught:
        estimate_from_policy(value)
    assert message in str(caught.value)


def test_an_estimate_is_frozen_and_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPENAI.kind = "fixed"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown estimate"):
        Estimate("tiktoken")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a pointer goes with"):
        Estimate("json")
    with pytest.raises(ValueError, match="must be a number from 0"):
        Estimate("fixed", fixed=-1)
