"""The lines held requests wait in under ``share:`` (proxy/pipeline/share_lines.py): one
asks the store at a time per tenant and class, in arrival order, the next as soon as the
one before it is served; a hold whose time runs out in the line gives up without asking."""

from __future__ import annotations

import asyncio

from proxy.clock import SystemClock
from proxy.limiter.store import AcquireResult
from proxy.pipeline.share_lines import ShareLines


def answer(granted: bool, wait: float = 0.0) -> AcquireResult:
    return AcquireResult(granted, wait, -1, (0.0,), wait)


REFUSED = answer(False, 0.02)


async def test_one_asks_at_a_time_in_arrival_order_the_next_at_once() -> None:
    lines, clock = ShareLines(), SystemClock()
    asked: list[tuple[str, float]] = []
    start = asyncio.get_running_loop().time()

    def asker(name: str, refusals: int) -> object:
        left = [refusals]

        async def ask(max_wait: float) -> AcquireResult:
            asked.append((name, asyncio.get_running_loop().time() - start))
            await asyncio.sleep(0)
            left[0] -= 1
            return REFUSED if left[0] >= 0 else answer(True)

        return ask

    results = await asyncio.gather(
        *(lines.turn("k", clock, 1.0, REFUSED, asker(n, 1)) for n in ("a", "b", "c"))  # type: ignore[arg-type]
    )
    assert all(r.granted for r, _ in results)
    assert [n for n, _ in asked] == ["a", "a", "b", "b", "c", "c"]  # never two of the line at once
    # Each first ask of "b" and "c" comes as soon as the one before was served, not after a wait.
    b_first = next(t for n, t in asked if n == "b")
    a_last = [t for n, t in asked if n == "a"][-1]
    assert b_first - a_last < 0.015
    assert len(lines) == 0  # forgotten when empty


async def test_a_hold_whose_time_runs_out_in_the_line_asks_nothing() -> None:
    lines, clock = ShareLines(), SystemClock()
    asked: list[str] = []

    async def slow(max_wait: float) -> AcquireResult:
        asked.append("first")
        await asyncio.sleep(0.2)
        return answer(True)

    async def never(max_wait: float) -> AcquireResult:
        asked.append("second")
        return answer(True)

    first = asyncio.ensure_future(lines.turn("k", clock, 1.0, answer(False, 0.0), slow))
    await asyncio.sleep(0)
    result, waited = await lines.turn("k", clock, 0.05, REFUSED, never)
    assert not result.granted and 0.04 <= waited < 0.2
    assert (await first)[0].granted
    assert asked == ["first"]
    assert len(lines) == 0


async def test_a_turn_told_beyond_its_hold_gives_up_at_once() -> None:
    lines, clock = ShareLines(), SystemClock()

    async def ask(max_wait: float) -> AcquireResult:
        return answer(False, 5.0)  # its turn is 5 s away

    result, waited = await lines.turn("k", clock, 0.5, answer(False, 0.01), ask)
    assert not result.granted and result.wait == 5.0 and waited < 0.1


async def test_a_hold_joining_the_line_is_never_told_the_grant_of_the_one_before() -> None:
    """While the second of a line asks, a hold that joins is told a refusal, not the grant
    the first had: that grant was the first's tokens (the joiner went to the vendor on it)."""
    lines, clock = ShareLines(), SystemClock()
    asking = asyncio.Event()
    answered = asyncio.Event()

    async def first(max_wait: float) -> AcquireResult:
        await asyncio.sleep(0)  # (the second queues behind it meanwhile)
        return answer(True)

    async def second(max_wait: float) -> AcquireResult:
        asking.set()
        await answered.wait()
        return answer(True)

    one = asyncio.ensure_future(lines.turn("k", clock, 1.0, answer(False, 0.0), first))
    two = asyncio.ensure_future(lines.turn("k", clock, 1.0, REFUSED, second))
    await asking.wait()  # the first was granted; the second holds the line and asks
    joined = lines.waiting("k")
    answered.set()
    assert (await one)[0].granted and (await two)[0].granted
    assert joined is not None and not joined.granted
