"""The worker pool of worker.py with Anthropic's SDK: Messages API calls through quota-proxy
(docs/guides/llm-tokens.md):

    python examples/llm/anthropic_worker.py --calls 30 --concurrency 8 --proxy http://127.0.0.1:8080

The same calls as worker.py (a prompt of about 200 to 850 characters, ``max_tokens`` 50 to
200, every other one streamed with ``messages.stream``), sent to the proxy's route for the
vendor (``PROXY/anthropic``) with the key in ``ANTHROPIC_API_KEY``. Anthropic counts input and
output tokens apart, and so does the summary. Exits 0 when every call succeeded, 1 otherwise.
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

import anthropic

MODEL = "claude-sonnet-5-5"
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
    input_tokens: int = 0
    output_tokens: int = 0
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


async def call(client: anthropic.AsyncAnthropic, i: int) -> anthropic.types.Usage:
    """One message; the usage its answer reports."""
    prompt, max_tokens, streamed = job(i)
    if not streamed:
        message = await client.messages.create(
            model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}]
        )
        return message.usage
    async with client.messages.stream(
        model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": prompt}]
    ) as stream:
        async for _text in stream.text_stream:
            pass  # the reply, as it comes
        return (await stream.get_final_message()).usage


async def pool(calls: int, concurrency: int, proxy: str) -> Tally:
    tally = Tally()
    client = anthropic.AsyncAnthropic(  # the key: ANTHROPIC_API_KEY
        base_url=f"{proxy}/anthropic",
        max_retries=5,  # a 429 of the proxy's too: it waits retry-after-ms, then retries
        http_client=anthropic.DefaultAsyncHttpxClient(event_hooks={"response": [tally.seen]}),
    )
    todo = iter(range(calls))

    async def worker() -> None:
        for i in todo:  # shared by the workers: each call is made once
            try:
                usage = await call(client, i)
            except anthropic.AnthropicError as err:
                tally.failed += 1
                print(f"call {i}: {err!r}", file=sys.stderr)
            else:
                tally.ok += 1
                tally.input_tokens += usage.input_tokens
                tally.output_tokens += usage.output_tokens

    async with client:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="messages to send (default 30)")
    parser.add_argument("--concurrency", type=int, default=8, help="workers calling at once (default 8)")
    parser.add_argument("--proxy", default="http://127.0.0.1:8080", help="the proxy's listen URL")
    args = parser.parse_args()
    start = time.monotonic()
    tally = asyncio.run(pool(args.calls, args.concurrency, args.proxy.rstrip("/")))
    took = time.monotonic() - start
    print(
        f"anthropic: {tally.ok} of {args.calls} calls succeeded in {took:.1f} s, {tally.input_tokens} input tokens "
        f"({tally.input_tokens / took:.0f}/s), {tally.output_tokens} output tokens; "
        f"429s: {tally.vendor_429s} from the vendor, {tally.proxy_429s} from the proxy"
    )
    return 0 if tally.ok == args.calls else 1


if __name__ == "__main__":
    sys.exit(main())
