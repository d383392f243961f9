"""RFC 6901 pointers and JSON bodies as the meters read them (proxy/quota/json_pointer.py)."""

from __future__ import annotations

import json
import math

import pytest

from proxy.quota.json_pointer import JsonPointer, json_number, load_json

# RFC 6901 section 5's document and its pointers.
RFC_DOCUMENT = {
    "foo": ["bar", "baz"],
    "": 0,
    "a/b": 1,
    "c%d": 2,
    "e^f": 3,
    "g|h": 4,
    "i\\j": 5,
    'k"l': 6,
    " ": 7,
    "m~n": 8,
}


@pytest.mark.parametrize(
    ("pointer", "expected"),
    [
        ("", RFC_DOCUMENT),
        ("/foo", ["bar", "baz"]),
        ("/foo/0", "bar"),
        ("/", 0),
        ("/a~1b", 1),
        ("/c%d", 2),
        ("/e^f", 3),
        ("/g|h", 4),
        ("/i\\j", 5),
        ('/k"l', 6),
        ("/ ", 7),
        ("/m~0n", 8),
    ],
)
def test_the_rfc_examples(pointer, expected):
    assert JsonPointer.parse(pointer).resolve(RFC_DOCUMENT) == expected


@pytest.mark.parametrize(
    ("pointer", "document", "expected"),
    [
        ("/~01", {"~1": "tilde one", "/": "slash"}, "tilde one"),  # "~1" first, then "~0"
        ("/foo/1", RFC_DOCUMENT, "baz"),
        ("/foo/2", RFC_DOCUMENT, None),
        ("/foo/-", RFC_DOCUMENT, None),
        ("/foo/01", RFC_DOCUMENT, None),
        ("/foo/-1", RFC_DOCUMENT, None),
        ("/foo/" + "9" * 40, RFC_DOCUMENT, None),
        ("/foo/0/x", RFC_DOCUMENT, None),
        ("/missing", RFC_DOCUMENT, None),
        ("/0", {"0": "a key that looks like an index"}, "a key that looks like an index"),
        ("/a", None, None),
        ("/a", "a string", None),
    ],
)
def test_resolves(pointer, document, expected):
    assert JsonPointer.parse(pointer).resolve(document) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("foo", 'JSON pointer "foo" must start with "/"'),
        ("/a~", '"~" must be written "~0" and "/" as "~1"'),
        ("/a~2", '"~" must be written "~0"'),
        (None, "a JSON pointer is a string"),
        (3, "a JSON pointer is a string"),
    ],
)
def test_refuses(text, message):
    with pytest.raises(ValueError) as caught:
        JsonPointer.parse(text)
    assert message in str(caught.value)


def test_a_pointer_reads_as_written():
    assert str(JsonPointer.parse("/a~1b/0")) == "/a~1b/0"
    assert JsonPointer.parse("/a~1b/0").tokens == ("a/b", "0")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"a": 1}', {"a": 1}),
        ('{"a": 1}', {"a": 1}),
        ('{"a": "\u00e9"}'.encode("utf-16"), {"a": "é"}),
        (b"null", None),
        (None, None),
        (b"", None),
        (b"{", None),
        (b"\xff", None),
        (b'{"a": NaN}', None),
        (b"[-Infinity]", None),
        (b"9" * 5000, None),
        (b"[" * 100_000, None),
        (b"[" * 100_000 + b"]" * 100_000, None),
    ],
)
def test_load_json(body, expected):
    assert load_json(body) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0.0),
        (3, 3.0),
        (2.5, 2.5),
        (10**400, math.inf),
        (-1, None),
        (-0.5, None),
        (-(10**400), None),
        (math.nan, None),
        (True, None),
        ("3", None),
        (None, None),
        ([3], None),
    ],
)
def test_json_number(value, expected):
    assert json_number(value) == expected


def _json_alone(body: bytes) -> object:
    """What ``load_json`` reads with Python's json alone (before orjson read it first)."""
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
        return json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except (ValueError, RecursionError):
        return None


def _alike(a: object, b: object) -> bool:
    """Equal, but an int past 64 bits may be the float orjson reads it as."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_alike(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_alike(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is float and type(b) is int and abs(b) >= 2**63:
        return a == float(b)
    return type(a) is type(b) and a == b


_CHAT = '{"model": "m", "messages": [{"role": "user", "content": "%s"}], "max_tokens": %s, "n": %s}'
DIFFERENTIAL = [
    (_CHAT % ("hi", "256", "1")).encode(),
    (_CHAT % ("h\u00e9 \u2603 \U0001f600", "16", "2")).encode(),
    (_CHAT % ("\\ud800 lone", "16", "1")).encode(),  # a lone surrogate: orjson refuses, json reads
    (_CHAT % ("x", "18446744073709551615", "1")).encode(),  # the largest u64
    (_CHAT % ("x", "1" + "0" * 30, "1" + "0" * 25)).encode(),  # past 64 bits
    (_CHAT % ("x", "-" + "9" * 20, "3.0")).encode(),
    (_CHAT % ("x", "1e400", "1e20")).encode(),
    (_CHAT % ("x", "2.5e-400", "1")).encode(),
    b'{"model": "m", "prompt": [1, 2, 99999999999999999999999, -99999999999999999999], "max_tokens": 5}',
    b'{"input": [[1, 2], [3, 18446744073709551616]], "model": "text-embedding-3"}',
    b'{"a": 1, "a": 2, "usage": {"total_tokens": 5}, "usage": {"total_tokens": 7}}',
    b'{"usage": {"prompt_tokens": 3, "completion_tokens": 1e2, "input_tokens": 4, "output_tokens": 5}}',
    b'{"usage": {"input_tokens": 10, "cache_creation_input_tokens": null, "output_tokens": 7}}',
    b'\xef\xbb\xbf{"usage": {"total_tokens": 9}}',  # a BOM: json reads it
    '{"usage": {"total_tokens": 9}, "note": "\u00e9"}'.encode("utf-16"),
    b'{"usage": {"total_tokens": NaN}}',
    b'{"usage": {"total_tokens": 5}} trailing',
    b'{"usage": {"total_tokens": 5}}\n\t ',
    b"[" * 1500 + b"]" * 1500,  # past orjson's depth, not json's
    b'{"k": "\x01"}',  # a control character in a string: neither reads it
    b"",
    b"   ",
]


@pytest.mark.parametrize("body", DIFFERENTIAL)
def test_load_json_reads_as_json_alone_does(body: bytes) -> None:
    """load_json reads with orjson first, then json: the same documents as json alone, and the
    same estimates and settlements from them (an integer past 64 bits, a float to orjson,
    counts as the integer it is)."""
    from proxy.quota.estimates import Estimate
    from proxy.quota.usage import Settle

    fast, alone = load_json(body), _json_alone(body) if body.strip() else None
    assert _alike(fast, alone), (fast, alone)
    for kind in ("openai", "anthropic_input", "anthropic_output"):
        cost = Estimate(kind).cost(body, 7.0, document=fast)
        assert cost == Estimate(kind).cost(body, 7.0, document=alone), kind
        settle = Settle(kind)
        assert settle.from_document(fast) == settle.from_document(alone), kind
