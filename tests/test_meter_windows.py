"""A meter's settlements never overrun the vendor's window (SPEC §14, issue 35): what a call
did not use goes back to its buckets, and a hold may then take it, but only as of now.

The mock vendor in a process of its own counts tokens as OpenAI does, in a strict sliding
window (admitted by its estimate at arrival, holding the answer's usage once answered); the
proxy in process, on a real Redis; workers are plain aiohttp clients that ask the mock for an
answer of a given size (``X-Mock-Output-Tokens``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ProxyFactory, vendor_policy
from tests.helpers.vendor_process import VendorProcess, vendor_process

pytestmark = [pytest.mark.slow, pytest.mark.timing]

CHAT = "/payments/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 90}
"""Estimated at 10 + 90 = 100 tokens by the vendor and by the meter alike."""
LIMIT = 330  # tokens in any 0.5 s at the vendor: the meter's 400/s x 0.5 s + 100, and 30 to spare


@pytest.fixture
def token_vendor(tmp_path: Path) -> Iterator[VendorProcess]:
    with vendor_process(tmp_path, "--tokens-per-minute", str(LIMIT * 120), "--token-window", "0.5s") as vendor:
        yield vendor


async def test_a_refund_never_moves_a_held_call_into_a_window_that_is_full(
    token_vendor: VendorProcess, redis_url: str, start_proxy: ProxyFactory
) -> None:
    """Ten calls held at once take the meter's next 2.5 s (a 100-token call every 0.25 s); the
    first four use 11 tokens each and give 89 back. Four more calls held 0.9 s in: before,
    the refunds moved their slots 0.9 s earlier, among the ten's, and a 0.5-s window held 400
    tokens where the vendor allows 330 (a vendor 429); a metered hold now reserves no
    further ahead than a shared one, so the tokens given back are taken as of now."""
    policy = vendor_policy(
        token_vendor.url,
        store=redis_url,
        on_limit="{action: hold, max_hold: 10s}",
        extra_vendor="meters: {tokens: {limits: [{rate: 400, per: 1s, burst: 100}], estimate: openai, settle: openai}}",
    )
    proxy = await start_proxy(policy)
    statuses: list[int] = []

    async def call(after: float, output: int) -> None:
        await asyncio.sleep(after)  # (the order they are booked in: 20 ms apart)
        headers = {"X-Mock-Output-Tokens": str(output), "Authorization": "Bearer sk-mock"}
        async with aiohttp.ClientSession() as s, s.post(proxy.url + CHAT, json=BODY, headers=headers) as r:
            await r.read()
            statuses.append(r.status)

    first = [call(0.02 * i, 1 if i < 4 else 90) for i in range(10)]
    later = [call(0.9 + 0.02 * i, 90) for i in range(4)]
    await asyncio.gather(*first, *later)
    stats = await token_vendor.stats()
    window = stats["token_windows"]["openai"]["tokens"]
    print(f"statuses {statuses}; vendor window {window}")
    assert window["limit"] == LIMIT
    assert statuses == [200] * 14
    assert window["tokens_window_max"] <= LIMIT, window
