"""RFC 6901 pointers and JSON bodies as the meters read them (proxy/quota/json_pointer.py)."""

from __future__ import annotations

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
