"""An asyncio pool of OpenAI SDK workers calling chat completions through quota-proxy
(docs/guides/llm-tokens.md):

    python examples/llm/worker.py --calls 30 --concurrency 8 --proxy http://127.0.0.1:8080

Each call has a size of its own (a prompt of about 200 to 850 characters, ``max_tokens`` 50 to
200), the same in every run; every other call is streamed, asking for its usage with
``stream_options``. The SDK sends them to the proxy's route for the vendor (``PROXY/openai/v1``)
with the key in ``OPENAI_API_KEY``; a call the proxy holds just takes longer, and the SDK
retries a 429 of the proxy's by itself. A 429 that the vendor sent (the proxy's own carry
``X-Quota-Action``) means the quota was overrun: it is counted apart. Exits 0 when every call
succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import openai

MODEL = "gpt-4o-mini"
WORDS = ("the", "fleet", "shares", "one", "quota", "of", "tokens", "per", "minute", "and", "every", "worker", "asks")


class Answer(Protocol):
    """What the SDK's HTTP client hands a response hook (an ``httpx2.Response``)."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    tokens: int = 0
    vendor_429s: int = 0
    proxy_429s: int = 0

    async def seen(self, answer: Answer) -> None:
        """Every HTTP answer the SDK receives, retried ones included."""
        if answer.status_code == 429:
            if "x-quota-action" in answer.headers:
                self.proxy_429s += 1  # a defer: the SDK waits retry-after-ms and retries
            else:
                self.vendor_429s += 1  # the vendor's own: the quota was overrun


def job(i: int) -> tuple[str, int, bool]:
    """Call ``i``'s prompt, ``max_tokens``, and whether it is streamed."""
    rng = random.Random(i)
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(40, 150)))
    return f"Summarise in one line: {prompt}", rng.randint(50, 200), i % 2 == 1


async def call(client: openai.AsyncOpenAI, i: int) -> int:
    """One chat completion; the tokens its answer says it used."""
    prompt, max_tokens, streamed = job(i)
    if not streamed:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
        )
        return reply.usage.total_tokens if reply.usage else 0
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},  # a last chunk with the usage, which the proxy settles
    )
    used = 0
    async for chunk in stream:
        if chunk.usage is not None:
            used = chunk.usage.total_tokens
    return used


async def pool(calls: int, concurrency: int, proxy: str) -> Tally:
    tally = Tally()
    client = openai.AsyncOpenAI(  # the key: OPENAI_API_KEY
        base_url=f"{proxy}/openai/v1",
        max_retries=5,  # a 429 of the proxy's too: it waits retry-after-ms, then retries
        http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [tally.seen]}),
    )
    todo = iter(range(calls))

    async def worker() -> None:
        for i in todo:  # shared by the workers: each call is made once
            try:
                used = await call(client, i)
            except openai.OpenAIError as err:
                tally.failed += 1
                print(f"call {i}: {err!r}", file=sys.stderr)
            else:
                tally.ok += 1
                tally.tokens += used

    async with client:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="chat completions to make (default 30)")
    parser.add_argument("--concurrency", type=int, default=8, help="workers calling at once (default 8)")
    parser.add_argument("--proxy", default="http://127.0.0.1:8080", help="the proxy's listen URL")
    args = parser.parse_args()
    start = time.monotonic()
    tally = asyncio.run(pool(args.calls, args.concurrency, args.proxy.rstrip("/")))
    took = time.monotonic() - start
    print(
        f"openai: {tally.ok} of {args.calls} calls succeeded in {took:.1f} s, {tally.tokens} tokens "
        f"({tally.tokens / took:.0f}/s); 429s: {tally.vendor_429s} from the vendor, {tally.proxy_429s} from the proxy"
    )
    return 0 if tally.ok == args.calls else 1


if __name__ == "__main__":
    sys.exit(main())
