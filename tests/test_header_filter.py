"""Header hygiene's filter (headers.py), memoised per field name: the same fields kept and
dropped, in the same order, whatever the spelling, the order of calls or the memo's bound."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.wire import headers as h


def fields(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def plain(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> h.Fields:
    """The filter without a memo: what it must equal."""
    if "Connection" in headers:
        drop = drop | h._connection_tokens(headers)
    return [(n, v) for n, v in headers.items() if n.lower() not in drop and not n.lower().startswith(h.QUOTA_PREFIX)]


REQUEST_DROP = h.HOP_BY_HOP | {"host", "expect", "content-length", "x-tenant"}
"""What a vendor is never sent of a worker's fields (besides X-Quota-*), the tenant header being X-Tenant."""


def raw(headers: CIMultiDictProxy[str]) -> list[tuple[bytes, bytes]]:
    return [(n.encode("latin-1"), v.encode("latin-1")) for n, v in headers.items()]


CASES = [
    fields(("Host", "a"), ("User-Agent", "x"), ("Accept", "*/*"), ("X-Tenant", "acme"), ("Content-Type", "j")),
    fields(
        ("host", "a"), ("KEEP-ALIVE", "5"), ("x-quota-on-limit", "hold"), ("X-Quota-Max-Hold", "1s"), ("Accept", "a")
    ),
    fields(("Connection", "X-Secret, close"), ("X-Secret", "s"), ("Accept", "a"), ("TE", "trailers")),
    fields(("Accept", "1"), ("accept", "2"), ("Proxy-Authorization", "Basic x"), ("Upgrade", "h2c")),
    fields(("Transfer-Encoding", "chunked"), ("Content-Length", "3"), ("Trailer", "x"), ("Idempotency-Key", "k")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_memo_keeps_and_drops_what_the_plain_filter_does(case: int) -> None:
    headers = CASES[case]
    for _ in range(2):  # the first call fills the memo, the second reads it
        want = [f"{n}: {v}\r\n" for n, v in plain(headers, REQUEST_DROP)]
        assert h.upstream_request_lines(raw(headers), "X-Tenant") == want
        assert h.downstream_response_headers(headers) == plain(headers, h.HOP_BY_HOP)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_one_pass_lines_are_the_filtered_fields_as_written(case: int) -> None:
    """The data plane's one-pass forms: the same fields in the same order, as lines; the
    request's without Content-Length (the data plane frames the body), the answer's with its
    Content-Length taken out as the length and a Date noted."""
    headers = CASES[case]
    for _ in range(2):
        want = [f"{n}: {v}\r\n" for n, v in plain(headers, REQUEST_DROP)]
        assert h.upstream_request_lines(raw(headers), "X-Tenant") == want
        written = h.answer_lines(block(headers), h.answer_fields(), False)
        if "Connection" in headers:  # it names a field to drop: the relay takes the general filter
            assert written is None
            continue
        kept = plain(headers, h.HOP_BY_HOP)
        assert written is not None
        lines, length, date = written
        assert lines == "".join(f"{n}: {v}\r\n" for n, v in kept if n.lower() != "content-length").encode()
        lengths = [int(v) for n, v in kept if n.lower() == "content-length"]
        assert length == (lengths[-1] if lengths else -1)
        assert date is any(n.lower() == "date" for n, _ in kept)


def block(headers: CIMultiDictProxy[str], spacing: str = " ") -> bytes:
    """The fields as the lines of a vendor's answer head (``Response.block``)."""
    return "".join(f"{n}:{spacing}{v}\r\n" for n, v in headers.items()).encode("latin-1")


def test_the_answers_lines_are_copied_as_the_vendor_wrote_them() -> None:
    """Kept lines are the vendor's bytes (its spacing, trailing whitespace, case); only the
    dropped ones are taken out, wherever they are."""
    head = b"A:b\r\nConnection: keep-alive\r\nB:  c  \r\nkeep-alive: 5\r\nx-quota-action: fake\r\nC: d\r\n"
    assert h.answer_lines(head, h.answer_fields(), False) == (b"A:b\r\nB:  c  \r\nC: d\r\n", -1, False)
    assert h.answer_lines(b"Connection: close\r\n", h.answer_fields(), False) == (b"", -1, False)
    assert h.answer_lines(b"Connection: Keep-Alive, TE\r\n", h.answer_fields(), False) is None


def test_the_answers_length_and_date_are_read_whatever_their_spelling() -> None:
    head = b"date: Tue, 01 Dec 2026 16:00:00 GMT\r\nCONTENT-LENGTH:  12 \r\nX-Quota-Action: x\r\n"
    for _ in range(2):
        assert h.answer_lines(head, h.answer_fields(), False) == (b"date: Tue, 01 Dec 2026 16:00:00 GMT\r\n", 12, True)
    assert h.answer_lines(b"Content-Length: 12x\r\n", h.answer_fields(), False) == (b"", -1, False)


def test_the_straight_relay_takes_only_an_answer_it_can_copy_with_its_length() -> None:
    """lane.py relays an answer's body with the length it says: not without one, not a
    chunked one, not one whose remaining quota feedback must read."""
    watched = h.answer_fields("x-ratelimit-remaining")
    assert h.answer_lines(b"Content-Length: 2\r\nA: b\r\n", watched, True) == (b"A: b\r\n", 2, False)
    assert h.answer_lines(b"A: b\r\n", watched, True) is None
    assert h.answer_lines(b"Content-Length: x\r\n", watched, True) is None
    assert h.answer_lines(b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n", watched, True) is None
    assert h.answer_lines(b"X-RateLimit-Remaining: 3\r\nContent-Length: 2\r\n", watched, True) is None
    # The general relay copies the watched field (feedback has read it already).
    assert h.answer_lines(b"X-RateLimit-Remaining: 3\r\n", watched, False) == (
        b"X-RateLimit-Remaining: 3\r\n",
        -1,
        False,
    )


def test_a_name_named_in_connection_once_is_not_dropped_for_ever() -> None:
    h.downstream_response_headers(fields(("Connection", "X-Secret"), ("X-Secret", "s")))
    assert h.downstream_response_headers(fields(("X-Secret", "s"))) == [("X-Secret", "s")]


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h, "_KEPT_MAX", 16)
    for i in range(100):
        headers = fields((f"X-Field-{i}", "v"), ("X-Quota-Action", "defer"))
        assert h.downstream_response_headers(headers) == [(f"X-Field-{i}", "v")]
        lines, _, _ = h.answer_lines(block(headers), h.answer_fields(), False) or (b"", 0, False)
        assert lines == f"X-Field-{i}: v\r\n".encode()
        assert h.upstream_request_lines(raw(headers), "X-Tenant") == [f"X-Field-{i}: v\r\n"]
        # The memos this test fills (others, filled by earlier tests under the real bound, stay as they are).
        assert len(h._KINDS[h.HOP_BY_HOP]) <= 16
        assert len(h.request_kinds("X-Tenant")) <= 16


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Type: a\r\nDate: d\r\nContent-Length: 2\r\n",
        b"Content-Length: 2\r\nContent-Type: a\r\n",
        b"content-length:2\r\n",
        b"X-A: content-length: 3\r\nContent-Length:  2 \r\nDate: d\r\n",
        b"Content-Length: 2\r\nContent-Length: 2\r\n",
        b"Content-Type: a\r\n",
        b"Content-Length: 2x\r\nA: b\r\n",
        b"",
    ],
)
def test_the_usual_answers_short_cut_reads_what_the_general_loop_reads(head: bytes) -> None:
    """answer_lines's short cut (no line but Content-Length and Date to look at) against the
    loop over every line it looks at, for the straight relay and the general one."""
    fields = h.answer_fields("x-ratelimit-remaining")
    for straight in (False, True):
        assert h.answer_lines(head, fields, straight) == h._answer_lines(
            head, b"\r\n" + head.lower(), fields.read, straight
        )


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Type: application/json; charset=utf-8\r\nContent-Encoding:gzip\r\n",
        b"X-A: content-type: text/plain\r\nCONTENT-TYPE:  text/event-stream \r\ncontent-type: second\r\n",
        b"Content-Encoding:\r\nX-Content-Type: no\r\n",
        b"Content-Typed: no\r\n",
        b"",
    ],
)
def test_an_answers_first_field_is_the_one_its_headers_name(head: bytes) -> None:
    """``Response.first`` finds a field in the head's bytes: the value (without its leading
    whitespace) a lookup in ``headers`` gives, or None as it does."""
    from proxy.wire.vendor_answer import Response

    for name in ("Content-Type", "Content-Encoding", "X-A", "Date"):
        answer = Response(None, 200, "OK", head)  # type: ignore[arg-type]
        assert answer.first(name.lower().encode()) == answer.headers.get(name), (head, name)
