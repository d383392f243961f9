"""Retry hints a worker reads off a defer (SPEC §5, §9): exact, and spread.

Workers refused together are pointed at successive refill slots (``retry-after-ms``),
so precise retriers come back paced instead of as a herd; ``X-Quota-Retry-After-Ms``
stays the real wait and ``Retry-After`` whole seconds at least the hint. A shed gives
no hint at all and takes no slot.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time

import pytest

from tests.conftest import client_session, vendor_policy

pytestmark = pytest.mark.timing  # asserts rates or time bounds: run apart from the other timed tests

BASE = "http://api.payments.example"


async def test_workers_refused_together_are_told_successive_slots(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url, store=redis_url, limits="[{rate: 10, per: 1s, burst: 1}]", on_limit="{action: defer}"
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]

    async def call(i: int):
        sent = time.monotonic()
        async with client_session() as s, s.get(f"{BASE}/x{i}", proxy=proxies[i % 2].url) as r:
            # The proxy answered between sent and now: on a busy machine either end may be
            # tens of ms from the moment itself, so a slot is known as a range.
            return r.status, r.headers, await r.json(content_type=None), (sent, time.monotonic())

    # Nine workers (each its own connection: a worker's slot is its connection's), one after
    # another, within a few ms.
    answers = [await call(i) for i in range(9)]
    assert [a[0] for a in answers] == [200] + [429] * 8
    refused = answers[1:]
    hints = [int(h["retry-after-ms"]) for _, h, _, _ in refused]
    waits = [int(h["X-Quota-Retry-After-Ms"]) for _, h, _, _ in refused]
    # Each is given its own slot, one refill (100 ms) after the one before, and kept for it
    # (acquire.lua, "Kept slots"): its slot is its real wait too. The slots, as times (the
    # answer's moment, somewhere in its call's span, + its hint), are 100 ms apart: each
    # step's possible range must reach into 80-120 ms.
    assert 0 < waits[0] <= 100, waits
    assert hints == waits
    slots = [
        (sent * 1000 + hint, got * 1000 + hint) for (_, _, _, (sent, got)), hint in zip(refused, hints, strict=True)
    ]
    steps = [(b[0] - a[1], b[1] - a[0]) for a, b in itertools.pairwise(slots)]
    assert all(shortest <= 120 and longest >= 80 for shortest, longest in steps), (hints, steps)
    for _, headers, body, _ in refused:
        assert headers["X-Quota-Action"] == "defer"
        assert headers["x-should-retry"] == "true"
        assert int(headers["Retry-After"]) == max(1, math.ceil(int(headers["retry-after-ms"]) / 1000))
        assert body["retry_after_ms"] == int(headers["retry-after-ms"])
        assert body["retry_after"] == int(headers["Retry-After"])


async def test_precise_retriers_come_back_paced_not_as_a_herd(vendor, redis_url, start_proxy):
    policy = vendor_policy(
        vendor.url, store=redis_url, limits="[{rate: 20, per: 1s, burst: 1}]", on_limit="{action: defer}"
    )
    proxies = [await start_proxy(policy), await start_proxy(policy)]
    deferrals = 0
    async with client_session() as s:

        async def worker(i: int) -> None:
            nonlocal deferrals
            while True:
                async with s.get(f"{BASE}/w{i}", proxy=proxies[i % 2].url) as r:
                    await r.read()
                    if r.status == 200:
                        return
                    assert r.status == 429 and r.headers["X-Quota-Action"] == "defer"
                    deferrals += 1
                    await asyncio.sleep(int(r.headers["retry-after-ms"]) / 1000)

        await asyncio.gather(*(worker(i) for i in range(20)))
    # 20 workers at once against one token and 20/s: one defer each is the paced ideal;
    # told all the same wait, they would come back together and be refused again and
    # again (about 20 x 20 / 2 deferrals in all).
    assert vendor.mock.accepted == 20
    assert deferrals <= 2 * 20, deferrals


async def test_a_shed_carries_no_hint(vendor, start_proxy):
    policy = vendor_policy(vendor.url, limits="[{rate: 1, per: 1h, burst: 1}]", on_limit="{action: shed}")
    proxy = await start_proxy(policy)
    async with client_session() as s:
        for i, want in enumerate((200, 503, 503)):
            async with s.get(f"{BASE}/s{i}", proxy=proxy.url) as r:
                assert r.status == want
                if want == 503:
                    assert "Retry-After" not in r.headers
                    assert "retry-after-ms" not in r.headers
                    assert r.headers["x-should-retry"] == "false"  # SDK retries must not undo a shed
