"""One JSON access-log line per request, written in batches."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator

import pytest

from proxy import accesslog
from tests.conftest import client_session, vendor_policy


@pytest.fixture
def access() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    accesslog.configure(stream)
    accesslog.enable(True)
    yield stream
    accesslog.configure(None)
    accesslog.enable(False)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    accesslog.ACCESS.flush()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_one_line_per_request_with_every_field(vendor, start_proxy, access) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url, limits="[{rate: 1, per: 1h, burst: 1}]",
                                            on_limit="{action: defer}"))
    async with client_session() as s:
        for path in ("/v1/charges?api_key=secret", "/v1/again"):
            async with s.get(f"http://api.payments.example{path}", proxy=proxy.url,
                              headers={"X-Tenant-Id": "acme"}) as r:
                await r.read()
        async with s.get("http://elsewhere.example/", proxy=proxy.url) as r:
            await r.read()
    first, second, third = lines(access)
    assert first["vendor"] == "payments" and first["tenant"] == "acme"
    assert (first["outcome"], first["status"], first["upstream_status"]) == ("forwarded", 200, 200)
    assert first["path"] == "/v1/charges"  # never the query string: it carries keys
    assert first["method"] == "GET" and first["host"] == "api.payments.example"
    assert first["hold_ms"] == 0.0 and isinstance(first["duration_ms"], float)
    assert (second["outcome"], second["status"], second["upstream_status"]) == ("deferred", 429, None)
    assert (third["outcome"], third["status"], third["vendor"]) == ("denied", 403, None)
    assert "no vendor" in str(third["detail"])


async def test_lines_wait_at_most_the_flush_interval(vendor, start_proxy, access) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url))
    async with client_session() as s, s.get("http://api.payments.example/x", proxy=proxy.url) as r:
        await r.read()
    assert access.getvalue() == ""  # batched, not written per request
    await asyncio.sleep(accesslog.FLUSH_INTERVAL * 2)  # the flush timer is the thing under test
    assert len(access.getvalue().splitlines()) == 1


def test_off_means_nothing_is_kept() -> None:
    stream = io.StringIO()
    accesslog.configure(stream)
    accesslog.enable(False)
    try:
        record = accesslog.AccessRecord("GET", "h", "/p")
        record.emit()
        accesslog.ACCESS.flush()
        assert stream.getvalue() == ""
    finally:
        accesslog.configure(None)
