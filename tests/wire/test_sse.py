"""The server-sent events splitter (proxy/wire/sse.py): the EventSource parsing rules, the same
events however the bytes are cut, bounded memory, and no exception on any bytes."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from proxy.wire.sse import DEFAULT_LIMIT, Event, EventSplitter
from tests.helpers.meter_samples import (
    ANTHROPIC_STREAM,
    EVENT_STREAM_EDGES,
    OPENAI_CHAT_STREAM,
    OPENAI_RESPONSES_STREAM,
)

SAMPLES = {
    "openai-chat": OPENAI_CHAT_STREAM,
    "openai-chat-crlf": OPENAI_CHAT_STREAM.replace(b"\n", b"\r\n"),
    "openai-responses": OPENAI_RESPONSES_STREAM,
    "anthropic": ANTHROPIC_STREAM,
    "anthropic-cr": ANTHROPIC_STREAM.replace(b"\n", b"\r"),
    "edges": EVENT_STREAM_EDGES,
}


def events_of(*chunks: bytes, limit: int = DEFAULT_LIMIT) -> list[Event]:
    splitter = EventSplitter(limit)
    return [event for chunk in chunks for event in splitter.feed(chunk)]


def test_an_openai_stream_is_its_chunks_then_done():
    events = events_of(OPENAI_CHAT_STREAM)
    assert [e.name for e in events] == ["message"] * 6
    assert events[-1].data == "[DONE]"
    assert json.loads(events[2].data)["choices"][0]["delta"]["content"] == " — café ☕ 😀"
    assert json.loads(events[4].data)["choices"] == []
    assert json.loads(events[4].data)["usage"]["total_tokens"] == 29


def test_an_anthropic_stream_names_its_events():
    events = events_of(ANTHROPIC_STREAM)
    assert [e.name for e in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert json.loads(events[6].data)["usage"] == {"output_tokens": 15}
    assert json.loads(events[4].data)["delta"]["text"] == "! Grüße, 日本 🎉"


def test_the_eventsource_rules_at_their_edges():
    assert events_of(EVENT_STREAM_EDGES) == [
        Event("update", "no space\n two spaces, one kept\n"),
        Event("message", "cr only\ncafé \ufffd bad byte"),
    ]


@pytest.mark.parametrize(
    ("stream", "expected"),
    [
        (b"data: a\n\n", [Event("message", "a")]),
        (b"data: a\ndata: b\n\n", [Event("message", "a\nb")]),
        (b"data\n\n", [Event("message", "")]),
        (b"data:\n\n", [Event("message", "")]),
        (b"data: \n\n", [Event("message", "")]),
        (b"data:a:b\n\n", [Event("message", "a:b")]),
        (b"event: x\n\n", []),  # no data: nothing dispatched
        (b"event: x\n\ndata: y\n\n", [Event("message", "y")]),  # the name went with the empty event
        (b"event: x\nevent: y\ndata: z\n\n", [Event("y", "z")]),
        (b"event:\ndata: z\n\n", [Event("message", "z")]),
        (b": comment\ndata: a\n: another\n\n", [Event("message", "a")]),
        (b"Data: a\n\n", []),  # field names are case-sensitive
        (b"data : a\n\n", []),  # "data " is another field
        (b"data: a", []),  # never finished
        (b"data: a\n", []),  # never dispatched
        (b"\xef\xbb\xbfdata: a\n\n", [Event("message", "a")]),
        (b"data: a\n\n\xef\xbb\xbfdata: b\n\n", [Event("message", "a")]),  # a BOM only opens the stream
        (
            b"data: a\r\n\r\ndata: b\r\rdata: c\n\n",
            [Event("message", "a"), Event("message", "b"), Event("message", "c")],
        ),
        (b"data: \x00\xc3\n\n", [Event("message", "\x00\ufffd")]),
        (b"\n\n\r\n\r\r\n", []),
    ],
)
def test_parses(stream, expected):
    assert events_of(stream) == expected


@pytest.mark.parametrize("name", SAMPLES)
def test_the_same_events_wherever_the_bytes_are_cut(name):
    stream = SAMPLES[name]
    whole = events_of(stream)
    assert whole
    for cut in range(len(stream) + 1):
        assert events_of(stream[:cut], stream[cut:]) == whole, f"cut at {cut}"
    for first in range(0, len(stream), 7):  # and at every pair of cuts, sampled
        for second in range(first, len(stream) + 1, 13):
            assert events_of(stream[:first], stream[first:second], stream[second:]) == whole
    assert events_of(*(stream[i : i + 1] for i in range(len(stream)))) == whole


@pytest.mark.parametrize("name", SAMPLES)
def test_random_cuts(name):
    stream = SAMPLES[name]
    whole = events_of(stream)
    rng = random.Random(name)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(stream) + 1), rng.randint(1, 12)))
        bounds = [0, *cuts, len(stream)]
        assert events_of(*(stream[a:b] for a, b in itertools.pairwise(bounds))) == whole


def test_an_event_comes_out_of_the_chunk_that_completes_it():
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\n") == []
    assert splitter.feed(b"\r") == [Event("message", "a")]  # a CR ends the empty line at once
    assert splitter.feed(b"\n") == []  # ... and the LF after it is its pair, not another line
    assert splitter.feed(b"data: b\r") == []
    assert splitter.feed(b"\r\n") == [Event("message", "b")]
    assert splitter.feed(b"") == []
    assert splitter.feed(bytearray(b"data: c\n\n")) == [Event("message", "c")]
    assert splitter.feed(memoryview(b"data: d\n\n")) == [Event("message", "d")]


def test_a_line_longer_than_the_limit_is_skipped_and_counted():
    limit = 16
    long_line = b"data: " + b"x" * 40 + b"\n"
    stream = b"data: a\n\n" + long_line + b"data: b\n\n" + b"data: c\n\n" + b": " + b"y" * 100 + b"\n" + b"data: d\n\n"
    expected = [Event("message", "a"), Event("message", "c"), Event("message", "d")]
    splitter = EventSplitter(limit)
    assert [e for i in range(len(stream)) for e in splitter.feed(stream[i : i + 1])] == expected
    assert splitter.lines_discarded == 2
    assert splitter.events_discarded == 1  # "b" lost a line: it never comes out partial; "d" lost a comment
    assert events_of(stream, limit=limit) == expected
    for cut in range(len(stream) + 1):
        assert events_of(stream[:cut], stream[cut:], limit=limit) == expected


def test_a_line_of_exactly_the_limit_is_kept():
    assert events_of(b"data: " + b"x" * 10 + b"\r\n\r\n", limit=16) == [Event("message", "x" * 10)]
    assert events_of(b"data: " + b"x" * 11 + b"\r\n\r\n", limit=16) == []


def test_an_event_whose_data_grows_past_the_limit_is_dropped():
    splitter = EventSplitter(16)
    stream = b"data: 12345678\n" * 3 + b"\n" + b"data: ok\n\n"
    assert splitter.feed(stream) == [Event("message", "ok")]
    assert splitter.events_discarded == 1 and splitter.lines_discarded == 0
    assert events_of(b"data: 1234567\ndata: 12345678\n\n", limit=16) == [Event("message", "1234567\n12345678")]


def test_memory_stays_bounded_on_an_endless_line():
    splitter = EventSplitter(1024)
    for _ in range(1000):
        assert splitter.feed(b"z" * 4096) == []
        assert len(splitter._pending) <= 1024
    assert splitter.feed(b"\n\ndata: after\n\n") == [Event("message", "after")]
    assert splitter.lines_discarded == 1 and splitter.events_discarded == 1


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        EventSplitter(0)


def test_never_raises_on_any_bytes():
    rng = random.Random(35)
    alphabet = [b"\r", b"\n", b":", b" ", b"data", b"event", b"\xef\xbb\xbf", b"\xff", b"\xc3", b"x", b"\x00"]
    for _ in range(2000):
        splitter = EventSplitter(rng.choice([1, 8, 64, DEFAULT_LIMIT]))
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.5:
                chunk = rng.randbytes(rng.randint(0, 64))
            else:
                chunk = b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 32)))
            for event in splitter.feed(chunk):
                assert isinstance(event.name, str) and isinstance(event.data, str)
