"""A fleet of OpenAI SDK workers through the proxy against a vendor that counts tokens per
minute in a strict sliding window (SPEC §14, issue 35): the proxy's meter, taken at OpenAI's
own estimate and settled to each answer's usage, keeps the vendor's window whole (no token
429) while the tokens, not the requests, set the pace.

The vendor is ``quota-proxy mock-vendor --tokens-per-minute`` in a process of its own, its
window shortened to 2 s (600 tokens) so that the run is short; it admits a call by the same
estimate at arrival and replaces it with the call's usage once answered."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import openai
import pytest

from proxy.policy.model import Limit, Meter, MeterEstimate, MeterSettle
from tests.conftest import ProxyFactory, vendor_policy
from tests.helpers.vendor_process import vendor_process

pytestmark = [pytest.mark.timing, pytest.mark.busy]  # asserts rates: run apart from the other timed tests

WINDOW = 2.0
WINDOW_TOKENS = 600  # --tokens-per-minute 18000 over a 2-s window
RATE, BURST = 250.0, 100.0  # 2 s x 250/s + 100 = 600: a bucket that never grants more in a window
SECONDS = 6.0
WORKERS = 8


async def test_an_sdk_fleet_stays_inside_a_strict_token_window(
    start_proxy: ProxyFactory, redis_url: str, tmp_path: Path
) -> None:
    args = ("--tokens-per-minute", "18000", "--token-window", "2s")
    with vendor_process(tmp_path, *args) as mock:
        policy = vendor_policy(mock.url, store=redis_url, on_limit="{action: hold, max_hold: 2s}")
        (vendor,) = policy.vendors
        tokens = Meter("tokens", (Limit(RATE, 1.0, BURST),), MeterEstimate("openai"), MeterSettle("openai"))
        proxy = await start_proxy(dataclasses.replace(policy, vendors=(dataclasses.replace(vendor, meters=(tokens,)),)))
        client = openai.AsyncOpenAI(api_key="sk-mock", base_url=f"{proxy.url}/payments/v1", max_retries=2)
        done = 0
        end = time.monotonic() + SECONDS

        async def worker(i: int) -> None:
            nonlocal done
            while time.monotonic() < end:
                await client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": f"worker {i} says hi"}], max_tokens=50
                )
                done += 1

        await asyncio.gather(*(worker(i) for i in range(WORKERS)))
        await client.close()
        window = (await mock.stats())["token_windows"]["openai"]["tokens"]
    assert window["limit"] == WINDOW_TOKENS
    assert window["rejected"] == 0, window  # not one token 429
    assert window["tokens_window_max"] <= WINDOW_TOKENS, window
    # The meter set the pace: what was settled (the calls' usage) came at about the meter's
    # rate, 250 tokens/s (an unmetered fleet of 8 would have sent far more, and met 429s).
    per_second = window["tokens_accepted"] / SECONDS
    assert 0.7 * RATE <= per_second <= RATE + BURST / SECONDS, (per_second, done)
