"""feedback.py: reading a vendor's Retry-After and remaining-quota headers."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from proxy.clock import ManualClock
from proxy.limiter import Breaker, Limiter
from proxy.limiter.memory_store import MemoryStore
from proxy.pipeline.feedback import apply_feedback, block_seconds, parse_retry_after, remaining_is_low
from proxy.policy.model import Feedback, Limit, Vendor
from tests.conftest import eventually, vendor_policy
from tests.dataplane.wire import Peer


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2", 2.0),
        (" 30 ", 30.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("-3", None),
        ("soon", None),
        (None, None),
        ("nan", None),
        ("inf", None),
    ],
)
def test_retry_after_in_seconds(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value) == expected


def test_retry_after_as_http_date_is_measured_against_the_vendors_date() -> None:
    # The vendor's clock says 12:00:00 and asks for 12:00:45: 45 s, whatever our clock says.
    when = "Mon, 30 Nov 2026 12:00:45 GMT"
    assert parse_retry_after(when, date="Mon, 30 Nov 2026 12:00:00 GMT") == 45.0
    # Without a Date header, our own clock is the reference.
    now = 1796040000.0  # 2026-11-30 12:00:00 UTC
    assert parse_retry_after(when, now=now) == 45.0
    assert parse_retry_after("Mon, 30 Nov 2026 11:00:00 GMT", now=now) == 0.0  # in the past


def test_block_length_defaults_and_is_capped() -> None:
    fb = Feedback(retry_after_default=7.0, max_retry_after=60.0)
    assert block_seconds(fb, {}) == 7.0
    assert block_seconds(fb, {"Retry-After": "garbage"}) == 7.0
    assert block_seconds(fb, {"Retry-After": "3"}) == 3.0
    assert block_seconds(fb, {"Retry-After": "86400"}) == 60.0


def test_low_watermark() -> None:
    fb = Feedback(remaining_header="X-RateLimit-Remaining", low_watermark=10)
    assert remaining_is_low(fb, {"X-RateLimit-Remaining": "9"})
    assert not remaining_is_low(fb, {"X-RateLimit-Remaining": "10"})
    assert not remaining_is_low(fb, {"X-RateLimit-Remaining": "n/a"})
    assert not remaining_is_low(fb, {})
    assert not remaining_is_low(Feedback(low_watermark=0), {"X-RateLimit-Remaining": "0"})


async def test_apply_feedback_blocks_drains_and_adds_retry_after() -> None:
    clock = ManualClock()
    limiter = Limiter(MemoryStore(clock), clock, key_prefix="t", breaker=Breaker(clock, 3, 1.0))
    vendor = Vendor(
        "v",
        hosts=("v.example",),
        limits=(Limit(10, 1, 10),),
        feedback=Feedback(low_watermark=5, retry_after_default=4.0),
    )
    applied = await apply_feedback(limiter, vendor, 429, {})
    assert applied.blocked_for == pytest.approx(4.0)
    assert applied.added_retry_after == "4"
    assert limiter.blocked_for("v") == pytest.approx(4.0)
    assert not (await limiter.acquire(vendor, "x", 0)).granted

    applied = await apply_feedback(limiter, vendor, 429, {"Retry-After": "2"})
    assert applied.added_retry_after is None  # the vendor's own stays

    await clock.advance(10)
    assert (await limiter.acquire(vendor, "x", 0)).granted
    applied = await apply_feedback(limiter, vendor, 200, {"X-RateLimit-Remaining": "1"})
    assert applied.drained
    _, levels = await limiter.peek(vendor)
    assert levels == (0.0,)
    assert not (await apply_feedback(limiter, vendor, 200, {"X-RateLimit-Remaining": "50"})).drained


def test_a_vendor_retry_after_blocks_at_most_five_minutes_by_default() -> None:
    """An hour-long Retry-After would stop the whole fleet for an hour (issue 9): the default
    cap is one an operator accepts without noticing."""
    assert Feedback().max_retry_after == 300.0
    assert block_seconds(Feedback(), {"Retry-After": "3600"}) == 300.0


async def test_a_capped_retry_after_is_logged_loudly_once_a_minute(aiohttp_raw_server, start_proxy, caplog) -> None:
    arrived, together = 0, asyncio.Event()

    async def vendor(request: web.BaseRequest) -> web.Response:
        # Three requests granted before any answer, then three 429s asking for an hour.
        nonlocal arrived
        arrived += 1
        if arrived == 3:
            together.set()
        await together.wait()
        return web.Response(status=429, headers={"Retry-After": "3600"})

    server = await aiohttp_raw_server(vendor)
    proxy = await start_proxy(
        vendor_policy(str(server.make_url("")).rstrip("/"), extra_vendor="feedback: {max_retry_after: 2m}")
    )
    caplog.set_level(logging.WARNING, logger="quota_proxy")
    async with aiohttp.ClientSession() as s:

        async def call() -> None:
            async with s.get("http://api.payments.example/v1", proxy=proxy.url) as r:
                assert r.status == 429
                assert r.headers["Retry-After"] == "3600"  # the vendor's answer is passed on untouched
                assert "X-Quota-Action" not in r.headers

        await asyncio.gather(call(), call(), call())
    assert proxy.runtime.limiter.blocked_for("payments") <= 120.0
    capped = [r for r in caplog.records if "max_retry_after" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in capped] == [
        (
            logging.WARNING,
            "vendor payments asked to be left alone for 1h (Retry-After: 3600): the block is capped at "
            "feedback.max_retry_after 2m",
        )
    ]


async def test_a_vendor_429_to_a_worker_that_went_away_still_blocks_the_fleet(raw_vendor, start_proxy) -> None:
    """The worker gave up before the vendor answered; the answer, heard out, is a 429: the
    fleet is blocked all the same (before, it was never read)."""
    answer = asyncio.Event()
    requests = 0

    async def vendor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        while True:
            await reader.readuntil(b"\r\n\r\n")
            requests += 1
            await answer.wait()
            writer.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 30\r\nContent-Length: 4\r\n\r\nslow")
            await writer.drain()

    raw = await raw_vendor(vendor)
    proxy = await start_proxy(vendor_policy(raw.url, on_limit="{action: defer}"))
    gone = await Peer.connect(proxy.address.port)
    await gone.send(b"GET http://api.payments.example/a HTTP/1.1\r\nHost: api.payments.example\r\n\r\n")
    await eventually(lambda: requests == 1, "the request at the vendor")
    await gone.close()  # the worker gives up
    blocks = proxy.runtime.deps.metrics.vendor_blocks.labels("payments")
    answer.set()
    await eventually(lambda: blocks._value.get() == 1, "the heard-out 429 to block the vendor")
    later = await Peer.connect(proxy.address.port)
    try:
        reply = await later.exchange(
            b"GET http://api.payments.example/b HTTP/1.1\r\nHost: api.payments.example\r\n\r\n"
        )
        assert reply.status == 429 and reply.headers["X-Quota-Action"] == "defer"  # the proxy's, not the vendor's
        assert requests == 1
    finally:
        await later.close()
