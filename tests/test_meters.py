"""Meters end to end (SPEC §14, issue 35): a metered call takes its estimate from its meter's
buckets with its request buckets, is refused on the meter when it lacks the tokens, and
settles to the vendor's ``usage`` (its JSON answer, or its stream's last event).

The vendor is the mock vendor's OpenAI shape (``proxy/devtools/mockvendor_openai.py``):
``usage`` counts the prompt's words and a fixed reply."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.policy import Policy
from proxy.policy.model import Limit, Meter, MeterEstimate, MeterSettle, SettleKind
from proxy.server import ProxyServer
from tests.conftest import ProxyFactory, Vendor, eventually, vendor_policy
from tests.helpers.meter_samples import SHOPIFY_JSON

BURST = 1000.0
CHAT = "/payments/v1/chat/completions"


def metered(upstream: str, store: str, settle: SettleKind = "openai", on_limit: str = "{action: shed}") -> Policy:
    policy = vendor_policy(upstream, store=store, on_limit=on_limit)
    (vendor,) = policy.vendors
    tokens = Meter(
        "tokens",
        (Limit(rate=60, per=60, burst=BURST),),  # 1 token/s: nothing refills to speak of meanwhile
        MeterEstimate("openai"),
        MeterSettle(settle),
    )
    return dataclasses.replace(policy, vendors=(dataclasses.replace(vendor, meters=(tokens,)),))


def chat(max_tokens: int, prompt: str = "hello there, how are you", **extra: Any) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **extra,
    }


def estimate(body: dict[str, Any]) -> float:
    """OpenAI's admission rule on ``chat``'s body: the prompt's characters / 4, rounded up, plus the cap."""
    return math.ceil(len(body["messages"][0]["content"]) / 4) + body["max_tokens"]


async def tokens_left(proxy: ProxyServer) -> float:
    limiter = proxy.runtime.limiter
    (vendor,) = proxy.runtime.policy.vendors
    b, levels = await limiter.peek(vendor, "default")
    return levels[b.request_count]


@pytest.fixture(params=["memory", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    return "memory://" if request.param == "memory" else str(request.getfixturevalue("redis_url"))


async def test_a_call_takes_its_estimate_and_settles_to_the_vendors_usage(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = await start_proxy(metered(vendor.url, store_url))
    body = chat(300)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + CHAT, json=body) as r:
        assert r.status == 200, await r.text()
        used = (await r.json())["usage"]["total_tokens"]
    assert used < estimate(body)  # (the settlement has something to give back)

    async def settled() -> bool:
        return await tokens_left(proxy) == pytest.approx(BURST - used, abs=3)

    await eventually(settled, f"the meter at {BURST} - {used} once settled")


async def test_a_streamed_answer_settles_from_its_last_event(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = await start_proxy(metered(vendor.url, store_url))
    body = chat(400, stream=True, stream_options={"include_usage": True})
    events = []
    async with aiohttp.ClientSession() as s, s.post(proxy.url + CHAT, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    used = events[-1]["usage"]["total_tokens"]

    async def settled() -> bool:
        return await tokens_left(proxy) == pytest.approx(BURST - used, abs=3)

    await eventually(settled, f"the meter at {BURST} - {used} once the stream settled")


async def test_a_call_the_meter_cannot_cover_is_refused_on_it(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    """No settlement (the estimate stands): 600 + 600 tokens do not fit a burst of 1000."""
    proxy = await start_proxy(metered(vendor.url, store_url, settle="none"))
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + CHAT, json=chat(600)) as r:
            assert r.status == 200
        async with s.post(proxy.url + CHAT, json=chat(600)) as r:
            assert r.status == 503 and r.headers["X-Quota-Action"] == "shed"
            assert "tokens 60/1m burst 1000" in (await r.text())
    assert vendor.mock.accepted == 1
    assert await tokens_left(proxy) == pytest.approx(BURST - estimate(chat(600)), abs=3)


async def test_a_deferred_call_of_a_meter_that_does_not_settle_keeps_its_slot(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    """SPEC §6 on a meter (§14): a meter whose estimate is its cost (no ``settle``) is counted
    as requests are, and a deferred call keeps its slot: its estimate is taken at once (the
    meter goes below empty, where a deferral queue's hint takes nothing), an early retry on
    its connection is told the same slot, and its retry at the slot is served on it without
    taking the estimate again. (A meter that settles keeps none: Limiter.keeps_slots.)"""
    policy = metered(vendor.url, store_url, settle="none", on_limit="{action: defer}")
    (v,) = policy.vendors
    fast = dataclasses.replace(v.meters[0], limits=(Limit(rate=200, per=1, burst=BURST),))
    proxy = await start_proxy(dataclasses.replace(policy, vendors=(dataclasses.replace(v, meters=(fast,)),)))
    later = chat(394)  # 400 tokens: 2 s of the meter once it is empty

    async def deferred(s: aiohttp.ClientSession) -> tuple[float, float]:
        """When the slot the answer names matures, as a range: the answer came between sent and got."""
        sent = time.monotonic()
        async with s.post(proxy.url + CHAT, json=later) as r:
            assert r.status == 429 and r.headers["X-Quota-Action"] == "defer", await r.text()
            hint = int(r.headers["retry-after-ms"]) / 1000
        return sent + hint, time.monotonic() + hint

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:  # one connection
        async with s.post(proxy.url + CHAT, json=chat(994)) as r:  # 1000 tokens: the meter empty
            assert r.status == 200, await r.text()
        first = await deferred(s)
        assert 1.5 < first[1] - time.monotonic() <= 2.1  # 400 tokens at 200/s
        assert await tokens_left(proxy) < -200  # its 400 taken, 2 s of the meter ahead of now
        again = await deferred(s)  # early: the same slot, not one after it
        assert again[0] - 0.05 <= first[1] and first[0] - 0.05 <= again[1], (first, again)
        await asyncio.sleep(max(first[1] - time.monotonic(), 0))
        async with s.post(proxy.url + CHAT, json=later) as r:
            assert r.status == 200, await r.text()
        assert await tokens_left(proxy) > -100  # served on its slot: its tokens not taken twice
    assert vendor.mock.accepted == 2


async def test_a_deferred_call_of_a_meter_that_settles_keeps_no_slot(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    """A meter that settles (here from a header the vendor never sends: the estimate stands)
    paces its deferred calls by the deferral queue, taking nothing until they come back
    (Limiter.keeps_slots: what a settlement gives back would fund a slot kept seconds ahead)."""
    policy = metered(vendor.url, store_url, on_limit="{action: defer}")
    (v,) = policy.vendors
    meter = dataclasses.replace(
        v.meters[0], limits=(Limit(rate=200, per=1, burst=BURST),), settle=MeterSettle("header", header="x-cost")
    )
    proxy = await start_proxy(dataclasses.replace(policy, vendors=(dataclasses.replace(v, meters=(meter,)),)))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        async with s.post(proxy.url + CHAT, json=chat(994)) as r:
            assert r.status == 200, await r.text()
        async with s.post(proxy.url + CHAT, json=chat(394)) as r:
            assert r.status == 429 and r.headers["X-Quota-Action"] == "defer", await r.text()
            assert 1500 < int(r.headers["retry-after-ms"]) <= 2000  # its place in the queue
        assert await tokens_left(proxy) >= 0  # nothing taken for it
    assert vendor.mock.accepted == 1


async def test_an_estimate_beyond_what_the_meter_can_ever_hold_is_refused_at_once(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = await start_proxy(metered(vendor.url, store_url, on_limit="{action: hold, max_hold: 30s}"))
    async with aiohttp.ClientSession() as s, s.post(proxy.url + CHAT, json=chat(5000)) as r:
        text = await r.text()
        assert r.status == 400, text
    assert f"{estimate(chat(5000)):g}" in text and "1000" in text  # both numbers
    assert vendor.mock.accepted == 0
    assert await tokens_left(proxy) == pytest.approx(BURST)


async def test_a_call_without_a_body_costs_a_preset_nothing(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = await start_proxy(metered(vendor.url, store_url))
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/payments/v1/ping") as r:
        assert r.status == 200
    assert await tokens_left(proxy) == pytest.approx(BURST)


async def test_a_body_that_is_not_json_costs_the_meters_default(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    policy = metered(vendor.url, store_url, settle="none")
    (v,) = policy.vendors
    policy = dataclasses.replace(
        policy, vendors=(dataclasses.replace(v, meters=(dataclasses.replace(v.meters[0], default=250.0),)),)
    )
    proxy = await start_proxy(policy)
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/payments/v1/ping", data=b"not json") as r:
        assert r.status == 200
    assert await tokens_left(proxy) == pytest.approx(BURST - 250, abs=3)


async def test_under_a_share_the_schedule_divides_requests_and_the_meter_is_taken(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    """The share's schedule reads the global request buckets, not the meter's after them (a
    meter's level read as the quota's would hold every call back for tokens: 1000 left
    against a request bucket's burst)."""
    policy = vendor_policy(
        vendor.url, store=store_url, on_limit="{action: shed}", extra_vendor="share: {weights: {default: 1}}"
    )
    (v,) = metered(vendor.url, store_url).vendors
    policy = dataclasses.replace(policy, vendors=(dataclasses.replace(policy.vendors[0], meters=v.meters),))
    proxy = await start_proxy(policy)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(proxy.url + CHAT, json=chat(100)) as r:
                assert r.status == 200, await r.text()
    assert vendor.mock.accepted == 3


async def test_a_vendor_429_blocks_the_meter_too(vendor: Vendor, start_proxy: ProxyFactory, store_url: str) -> None:
    proxy = await start_proxy(metered(vendor.url, store_url))
    (v,) = proxy.runtime.policy.vendors
    await proxy.runtime.limiter.block(v, 5.0)
    assert await tokens_left(proxy) <= 0  # (refilling from empty after the block)


async def test_status_shows_each_meter_and_its_buckets(
    vendor: Vendor, start_proxy: ProxyFactory, store_url: str
) -> None:
    proxy = await start_proxy(metered(vendor.url, store_url, settle="none"))
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + CHAT, json=chat(300)) as r:
            assert r.status == 200
        async with s.get(proxy.admin_url + "/status") as r:
            (entry,) = (await r.json())["vendors"]
    (meter,) = entry["meters"]
    assert (meter["name"], meter["estimate"], meter["settle"]) == ("tokens", "openai", "none")
    assert meter["long_run_per_second"] == 1.0
    (bucket,) = meter["buckets"]
    assert bucket["bucket"] == "tokens 60/1m burst 1000"
    assert bucket["tokens"] == pytest.approx(BURST - estimate(chat(300)), abs=3)


async def test_a_graphql_answers_throttle_status_teaches_its_points_meter(
    aiohttp_server: Any, start_proxy: ProxyFactory, store_url: str
) -> None:
    """Shopify's GraphQL answers state the shop's bucket in ``extensions.cost.throttleStatus``
    (here 2000 points, 1997 available, 100/s): with ``feedback.headers: auto`` the points
    meter learns it (a policy that says 4000 points at 200/s holds no more than the shop's)."""

    async def graphql(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=SHOPIFY_JSON, content_type="application/json")

    app = web.Application()
    app.router.add_post("/admin/api/2025-01/graphql.json", graphql)
    shop = await aiohttp_server(app)
    policy = vendor_policy(
        str(shop.make_url("")),
        store=store_url,
        extra_vendor="feedback: {headers: auto}\n            meters: {points: {"
        "limits: [{rate: 200, per: 1s, burst: 4000}], estimate: {fixed: 12}, "
        "settle: {json: /extensions/cost/actualQueryCost}}}",
    )
    proxy = await start_proxy(policy)
    url = proxy.url + "/payments/admin/api/2025-01/graphql.json"
    async with aiohttp.ClientSession() as s, s.post(url, json={"query": "{ shop { name } }"}) as r:
        assert r.status == 200 and (await r.json())["extensions"]["cost"]["actualQueryCost"] == 3

    async def learned() -> bool:
        return await tokens_left(proxy) <= 1997.5

    await eventually(learned, "the points meter at most the 1997 the shop said were available")
