"""Header hygiene's filter (headers.py), memoised per field name: the same fields kept and
dropped, in the same order, whatever the spelling, the order of calls or the memo's bound."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy import headers as h


def fields(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(pairs))


def plain(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> h.Fields:
    """The filter without a memo: what it must equal."""
    if "Connection" in headers:
        drop = drop | h._connection_tokens(headers)
    return [(n, v) for n, v in headers.items() if n.lower() not in drop and not n.lower().startswith(h.QUOTA_PREFIX)]


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
        assert h.upstream_request_headers(headers, "X-Tenant") == plain(headers, h._request_drop("X-Tenant"))
        assert h.downstream_response_headers(headers) == plain(headers, h.HOP_BY_HOP)


def test_a_name_named_in_connection_once_is_not_dropped_for_ever() -> None:
    h.downstream_response_headers(fields(("Connection", "X-Secret"), ("X-Secret", "s")))
    assert h.downstream_response_headers(fields(("X-Secret", "s"))) == [("X-Secret", "s")]


def test_the_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h, "_KEPT_MAX", 16)
    for i in range(100):
        headers = fields((f"X-Field-{i}", "v"), ("X-Quota-Action", "defer"))
        assert h.downstream_response_headers(headers) == [(f"X-Field-{i}", "v")]
        assert all(len(kept) <= 16 for kept in h._KEPT.values())
