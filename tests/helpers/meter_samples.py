"""Vendors' answers as they come on the wire, for the meters' tests (tests/wire/test_sse.py,
tests/quota/test_usage.py): shaped after the vendors' documented examples, ids and numbers
made up. Streams are bytes as the vendor writes them (OpenAI: ``data:`` lines; Anthropic and
the Responses API: an ``event:`` line too), each event closed by an empty line.
"""

from __future__ import annotations

from typing import Final

OPENAI_CHAT_JSON: Final = b"""{
  "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
  "object": "chat.completion",
  "created": 1741569952,
  "model": "gpt-4.1-2025-04-14",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant", "content": "Hello! How can I assist you today?", "refusal": null, "annotations": []
      },
      "logprobs": null,
      "finish_reason": "stop"
    }
  ],
  "usage": {
    "prompt_tokens": 19,
    "completion_tokens": 10,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
    "completion_tokens_details": {
      "reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
    }
  },
  "service_tier": "default"
}"""

_CHUNK: Final = '{"id":"chatcmpl-123","object":"chat.completion.chunk","created":1694268190,"model":"gpt-4o-mini","system_fingerprint":"fp_44709d6fcb",'  # noqa: E501

OPENAI_CHAT_STREAM: Final = (
    "data: " + _CHUNK + '"choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},'
    '"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    "data: " + _CHUNK + '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],'
    '"usage":null}\n\n'
    "data: " + _CHUNK + '"choices":[{"index":0,"delta":{"content":" — café ☕ 😀"},"logprobs":null,'
    '"finish_reason":null}],"usage":null}\n\n'
    "data: " + _CHUNK + '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}\n\n'
    "data: " + _CHUNK + '"choices":[],"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,'
    '"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,'
    '"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}\n\n'
    "data: [DONE]\n\n"
).encode()
"""A chat completion streamed with ``stream_options: {include_usage: true}``: 29 tokens."""

OPENAI_RESPONSES_STREAM: Final = (
    b"event: response.created\n"
    b'data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_67c9fdcecf488190bdd9a0409de3a1ec",'
    b'"object":"response","created_at":1741290958,"status":"in_progress","model":"gpt-4.1-2025-04-14","output":[],'
    b'"usage":null}}\n\n'
    b"event: response.in_progress\n"
    b'data: {"type":"response.in_progress","sequence_number":1,'
    b'"response":{"id":"resp_67c9fdcecf488190bdd9a0409de3a1ec","object":"response","status":"in_progress",'
    b'"output":[],"usage":null}}\n\n'
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_67c9fdcf37fc8190ba82116e33fb28c5",'
    b'"output_index":0,"content_index":0,"delta":"Hi there"}\n\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","sequence_number":9,"response":{"id":"resp_67c9fdcecf488190bdd9a0409de3a1ec",'
    b'"object":"response","status":"completed","output":[{"type":"message","role":"assistant","content":'
    b'[{"type":"output_text","text":"Hi there","annotations":[]}]}],"usage":{"input_tokens":37,'
    b'"input_tokens_details":{"cached_tokens":0},"output_tokens":11,"output_tokens_details":{"reasoning_tokens":0},'
    b'"total_tokens":48}}}\n\n'
)
"""A Responses API stream: 48 tokens, in ``response.completed``."""

OPENAI_RESPONSES_JSON: Final = b"""{
  "id": "resp_67ccd3a9da748190baa7f1570fe91ac604becb25c45c1d41",
  "object": "response",
  "created_at": 1741476777,
  "status": "completed",
  "model": "gpt-4o-2024-08-06",
  "output": [{"type": "message", "id": "msg_67ccd3acc8d48190a77525dc6de64b4104becb25c45c1d41", "status": "completed",
              "role": "assistant",
              "content": [{"type": "output_text", "text": "The image depicts...", "annotations": []}]}],
  "usage": {"input_tokens": 328, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 52,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 380}
}"""

OPENAI_EMBEDDINGS_JSON: Final = b"""{
  "object": "list",
  "data": [{"object": "embedding", "embedding": [0.0023064255, -0.009327292, -0.0028842222], "index": 0}],
  "model": "text-embedding-3-small",
  "usage": {"prompt_tokens": 8, "total_tokens": 8}
}"""

ANTHROPIC_JSON: Final = b"""{
  "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
  "type": "message",
  "role": "assistant",
  "model": "claude-sonnet-4-5-20250929",
  "content": [{"type": "text", "text": "Hello! How can I help you today?"}],
  "stop_reason": "end_turn",
  "stop_sequence": null,
  "usage": {
    "input_tokens": 12,
    "cache_creation_input_tokens": 200,
    "cache_read_input_tokens": 3000,
    "output_tokens": 11,
    "service_tier": "standard"
  }
}"""
"""Input 12 + 200 written to the cache (3,000 read from it do not count); output 11."""

ANTHROPIC_STREAM: Final = (
    "event: message_start\n"
    'data: {"type":"message_start","message":{"id":"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY","type":"message",'
    '"role":"assistant","content":[],"model":"claude-sonnet-4-5-20250929","stop_reason":null,"stop_sequence":null,'
    '"usage":{"input_tokens":25,"cache_creation_input_tokens":100,"cache_read_input_tokens":2000,'
    '"output_tokens":1}}}\n\n'
    "event: content_block_start\n"
    'data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}\n\n'
    "event: ping\n"
    'data: {"type": "ping"}\n\n'
    "event: content_block_delta\n"
    'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}\n\n'
    "event: content_block_delta\n"
    'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"! Grüße, 日本 🎉"}}\n\n'
    "event: content_block_stop\n"
    'data: {"type":"content_block_stop","index":0}\n\n'
    "event: message_delta\n"
    'data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    '"usage":{"output_tokens":15}}\n\n'
    "event: message_stop\n"
    'data: {"type":"message_stop"}\n\n'
).encode()
"""A Messages stream: input 25 + 100 written to the cache; output 15 (message_delta)."""

SHOPIFY_JSON: Final = b"""{
  "data": {"products": {"edges": [{"node": {"id": "gid://shopify/Product/1", "title": "Snowboard"}}]}},
  "extensions": {
    "cost": {
      "requestedQueryCost": 12,
      "actualQueryCost": 3,
      "throttleStatus": {"maximumAvailable": 2000.0, "currentlyAvailable": 1997, "restoreRate": 100.0}
    }
  }
}"""
"""A Shopify Admin GraphQL answer: 12 points requested, 3 used."""

SHOPIFY_THROTTLED_JSON: Final = b"""{
  "errors": [{"message": "Throttled", "extensions": {"code": "THROTTLED",
              "documentation": "https://shopify.dev/api/usage/rate-limits"}}],
  "extensions": {
    "cost": {
      "requestedQueryCost": 1002,
      "actualQueryCost": null,
      "throttleStatus": {"maximumAvailable": 1000.0, "currentlyAvailable": 996, "restoreRate": 50.0}
    }
  }
}"""
"""A query that was not run: no actual cost stated."""

EVENT_STREAM_EDGES: Final = (
    b"\xef\xbb\xbf: a comment, then a retry the proxy ignores\r\n"
    b"retry: 10000\r\n"
    b"\r\n"
    b"id: 1\r\n"
    b"event: update\r\n"
    b"data:no space\r\n"
    b"data:  two spaces, one kept\r\n"
    b"data\r\n"
    b"\r\n"
    b"event: skipped, no data\r"
    b"\r"
    b"data: cr only\r"
    b"unknown: field\r"
    b"data: caf\xc3\xa9 \xff bad byte\n"
    b"\n"
    b"data: last event lacks its empty line"
)
"""What the EventSource rules say about edges: a BOM, comments, CRLF, CR, fields without a
space or a value, an event without data, bytes that are not UTF-8, an unfinished event."""
