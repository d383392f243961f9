"""The one framing reading (proxy/wire/framing.py), rule by rule; corpus.yaml holds
the same rules to the wire on both request paths."""

from __future__ import annotations

import pytest

from proxy.wire.framing import (
    CHUNKED,
    LENGTH,
    NO_CODINGS,
    NONE,
    AnswerCodings,
    FramingError,
    RequestFraming,
    answer_codings,
    codings,
    request_framing,
)


def _frame(
    version: str = "1.1",
    method: str = "POST",
    *,
    hosts: int = 1,
    lengths: tuple[bytes, ...] = (),
    transfers: tuple[bytes, ...] = (),
    keep_alive: bool = True,
) -> RequestFraming:
    return request_framing(
        version, method, hosts=hosts, lengths=list(lengths), transfers=list(transfers), keep_alive=keep_alive
    )


def test_the_codings_of_every_field_are_one_list() -> None:
    assert codings([b"gzip", b" Chunked "]) == [b"gzip", b"chunked"]
    assert codings([b", ,gzip,,\tchunked"]) == [b"gzip", b"chunked"]
    assert codings([b""]) == []


@pytest.mark.parametrize(
    ("kwargs", "framing"),
    [
        ({}, RequestFraming(NONE, 0, True)),
        ({"lengths": (b"5",)}, RequestFraming(LENGTH, 5, True)),
        ({"lengths": (b"0",)}, RequestFraming(NONE, 0, True)),
        ({"lengths": (b"005",)}, RequestFraming(LENGTH, 5, True)),
        ({"transfers": (b"chunked",)}, RequestFraming(CHUNKED, -1, True)),
        ({"transfers": (b", CHUNKED",)}, RequestFraming(CHUNKED, -1, True)),
        ({"keep_alive": False, "transfers": (b"chunked",)}, RequestFraming(CHUNKED, -1, False)),
        # HTTP/1.0 with Transfer-Encoding: served, then closed, whatever it asked (RFC 9112 §6.1)
        ({"version": "1.0", "transfers": (b"chunked",)}, RequestFraming(CHUNKED, -1, False)),
        ({"version": "1.0", "lengths": (b"5",)}, RequestFraming(LENGTH, 5, True)),
        ({"method": "CONNECT"}, RequestFraming(NONE, 0, False)),
        ({"hosts": 0}, RequestFraming(NONE, 0, True)),
    ],
)
def test_a_request_is_framed(kwargs: dict[str, object], framing: RequestFraming) -> None:
    assert _frame(**kwargs) == framing  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"hosts": 2}, "more than one Host field"),
        ({"lengths": (b"5",), "transfers": (b"chunked",)}, "both Content-Length and Transfer-Encoding"),
        ({"transfers": (b"gzip", b"chunked")}, "gzip, chunked: the proxy applies no coding but chunked"),
        ({"transfers": (b"identity, chunked",)}, "identity, chunked: the proxy applies no coding but chunked"),
        ({"transfers": (b"chunked", b"gzip")}, "chunked, gzip: chunked is not the final coding"),
        ({"transfers": (b"chunked", b"chunked")}, "chunked, chunked: chunked is applied more than once"),
        ({"transfers": (b"gzip",)}, "gzip: chunked is not among them"),
        ({"transfers": (b"",)}, "(no coding): chunked is not among them"),
        ({"transfers": (b'"chunked"',)}, "chunked is not among them"),
        ({"transfers": (b"chunked;q=1",)}, "chunked is not among them"),
        ({"version": "1.0", "transfers": (b"gzip, chunked",)}, "the proxy applies no coding but chunked"),
        ({"lengths": (b"5", b"5")}, "more than one Content-Length field"),
        ({"lengths": (b"+5",)}, "is not a number"),
        ({"lengths": (b"5, 5",)}, "is not a number"),
    ],
)
def test_a_request_whose_framing_cannot_be_trusted_is_refused(kwargs: dict[str, object], why: str) -> None:
    with pytest.raises(FramingError) as refused:
        _frame(**kwargs)  # type: ignore[arg-type]
    assert why in str(refused.value)


@pytest.mark.parametrize(
    ("values", "told"),
    [
        ([], NO_CODINGS),
        ([b"chunked"], NO_CODINGS),
        ([b"gzip, chunked"], AnswerCodings(b"gzip", b"")),
        ([b"gzip", b"Chunked"], AnswerCodings(b"gzip", b"")),
        ([b"br", b"gzip, chunked"], AnswerCodings(b"br, gzip", b"")),
        ([b"gzip"], AnswerCodings(b"", b"gzip")),
        ([b"chunked, gzip"], AnswerCodings(b"", b"chunked, gzip")),
    ],
)
def test_a_vendor_answers_codings_are_never_dropped(values: list[bytes], told: AnswerCodings) -> None:
    assert answer_codings(values) == told
