"""One JSON access-log line per request, written in batches."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json

import pytest

from proxy.telemetry.accesslog import FLUSH_INTERVAL, AccessLog
from tests.conftest import client_session, vendor_policy


@pytest.fixture
def stream() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def access(stream: io.StringIO) -> AccessLog:
    return AccessLog(stream)


def lines(access: AccessLog, stream: io.StringIO) -> list[dict[str, object]]:
    """The lines written, parsed; each exactly as compact json.dumps writes it (the line is built by hand)."""
    access.flush()
    parsed = []
    for line in stream.getvalue().splitlines():
        parsed.append(json.loads(line))
        assert json.dumps(parsed[-1], separators=(",", ":")) == line
    return parsed


async def get(proxy_url: str, path: str = "/x") -> None:
    async with client_session() as s, s.get(f"http://api.payments.example{path}", proxy=proxy_url) as r:
        await r.read()


async def test_one_line_per_request_with_every_field(vendor, start_proxy, access, stream) -> None:
    proxy = await start_proxy(
        vendor_policy(vendor.url, limits="[{rate: 1, per: 1h, burst: 1}]", on_limit="{action: defer}"),
        access_log=access,
    )
    async with client_session() as s:
        for path in ("/v1/charges?api_key=secret", "/v1/again"):
            async with s.get(
                f"http://api.payments.example{path}", proxy=proxy.url, headers={"X-Tenant-Id": "acme"}
            ) as r:
                await r.read()
        async with s.get("http://elsewhere.example/", proxy=proxy.url) as r:
            await r.read()
    first, second, third = lines(access, stream)
    assert first["vendor"] == "payments" and first["tenant"] == "acme"
    assert (first["outcome"], first["status"], first["upstream_status"]) == ("forwarded", 200, 200)
    assert first["path"] == "/v1/charges"  # never the query string: it carries keys
    assert first["method"] == "GET" and first["host"] == "api.payments.example"
    assert first["hold_ms"] == 0.0 and isinstance(first["duration_ms"], float)
    assert (second["outcome"], second["status"], second["upstream_status"]) == ("deferred", 429, None)
    assert (third["outcome"], third["status"], third["vendor"]) == ("denied", 403, None)
    assert "no vendor" in str(third["detail"])


async def test_lines_wait_at_most_the_flush_interval(vendor, start_proxy, access, stream) -> None:
    proxy = await start_proxy(vendor_policy(vendor.url), access_log=access)
    await get(proxy.url)
    assert stream.getvalue() == ""  # batched, not written per request
    await asyncio.sleep(FLUSH_INTERVAL * 2)  # the flush timer is the thing under test
    assert len(stream.getvalue().splitlines()) == 1


async def test_off_means_nothing_is_kept(vendor, start_proxy, access, stream) -> None:
    proxy = await start_proxy(dataclasses.replace(vendor_policy(vendor.url), access_log=False), access_log=access)
    await get(proxy.url)
    access.flush()
    assert stream.getvalue() == ""


async def test_a_reload_switches_it_for_the_next_request(vendor, start_proxy, access, stream) -> None:
    policy = vendor_policy(vendor.url)
    proxy = await start_proxy(policy, access_log=access)
    await get(proxy.url, "/logged")
    proxy.runtime.apply(dataclasses.replace(policy, access_log=False))
    await get(proxy.url, "/not-logged")
    proxy.runtime.apply(policy)
    await get(proxy.url, "/logged-again")
    assert [line["path"] for line in lines(access, stream)] == ["/logged", "/logged-again"]
