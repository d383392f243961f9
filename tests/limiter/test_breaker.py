"""The store's circuit breaker, driven by a ManualClock.

closed → open after ``failures`` consecutive failures → half-open once the
cool-off has passed, where exactly one probe goes through → the probe's success
closes it, its failure re-opens it for another full cool-off.
"""

from __future__ import annotations

import pytest

from proxy.clock import ManualClock
from proxy.limiter.breaker import Breaker

FAILURES = 3
COOLOFF = 2.0


@pytest.fixture
def breaker(clock: ManualClock) -> Breaker:
    return Breaker(clock, failures=FAILURES, cooloff=COOLOFF)


def open_it(breaker: Breaker) -> None:
    for _ in range(FAILURES):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "open"


def test_starts_closed_and_lets_every_call_through(breaker: Breaker) -> None:
    assert breaker.state == "closed"
    assert all(breaker.allow() for _ in range(100))
    assert breaker.state == "closed"


def test_opens_after_n_consecutive_failures_only(breaker: Breaker) -> None:
    for _ in range(FAILURES - 1):
        assert breaker.allow()
        breaker.failure()
        assert breaker.state == "closed"
    breaker.success()  # the streak is broken: failures must be consecutive
    for _ in range(FAILURES - 1):
        breaker.failure()
        assert breaker.state == "closed"
        assert breaker.allow()
    breaker.failure()
    assert breaker.state == "open"
    assert not breaker.allow()


async def test_open_refuses_everything_until_the_cooloff_has_passed(breaker: Breaker, clock: ManualClock) -> None:
    open_it(breaker)
    for _ in range(10):
        assert not breaker.allow()
    await clock.advance(COOLOFF - 0.01)
    assert breaker.state == "open"
    assert not breaker.allow()
    await clock.advance(0.01)
    assert breaker.state == "half-open"


async def test_half_open_lets_exactly_one_probe_through(breaker: Breaker, clock: ManualClock) -> None:
    open_it(breaker)
    await clock.advance(COOLOFF)
    assert breaker.allow()  # the probe
    for _ in range(50):
        assert not breaker.allow()  # everyone else waits for the probe's verdict
    await clock.advance(COOLOFF * 10)  # however long the probe takes
    assert not breaker.allow()


async def test_probe_success_closes(breaker: Breaker, clock: ManualClock) -> None:
    open_it(breaker)
    await clock.advance(COOLOFF)
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed"
    assert all(breaker.allow() for _ in range(10))
    # Closed again means a fresh streak: it takes N failures to re-open.
    for _ in range(FAILURES - 1):
        breaker.failure()
    assert breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "open"


async def test_probe_failure_reopens_for_a_full_cooloff(breaker: Breaker, clock: ManualClock) -> None:
    open_it(breaker)
    await clock.advance(COOLOFF)
    assert breaker.allow()
    await clock.advance(0.5)  # the probe takes a while to fail
    breaker.failure()  # one failure is enough in half-open
    assert breaker.state == "open"
    assert not breaker.allow()
    await clock.advance(COOLOFF - 0.01)  # measured from the probe's failure, not from the first opening
    assert not breaker.allow()
    await clock.advance(0.01)
    assert breaker.state == "half-open"
    assert breaker.allow()
    assert not breaker.allow()


async def test_cancelled_probe_releases_the_slot(breaker: Breaker, clock: ManualClock) -> None:
    open_it(breaker)
    await clock.advance(COOLOFF)
    assert breaker.allow()
    assert not breaker.allow()
    breaker.release()  # the probe ended without a verdict
    assert breaker.state == "half-open"
    assert breaker.allow()  # a new probe may go
    assert not breaker.allow()


async def test_retry_after_is_at_least_the_cooloff_whenever_it_is_given(breaker: Breaker, clock: ManualClock) -> None:
    """A worker deferred because the store is down is told to come back no sooner
    than the breaker's cool-off (issue 2, item 6), in every state."""
    assert breaker.retry_after() >= COOLOFF  # closed: a single failed call
    for _ in range(FAILURES - 1):
        breaker.failure()
        assert breaker.retry_after() >= COOLOFF
    breaker.failure()
    assert breaker.state == "open"
    seen = [breaker.retry_after()]
    for _ in range(4):
        await clock.advance(COOLOFF / 4 - 0.001)
        assert breaker.state == "open"
        seen.append(breaker.retry_after())
    await clock.advance(0.01)
    assert breaker.state == "half-open"
    assert breaker.allow()
    seen.append(breaker.retry_after())
    assert all(s >= COOLOFF for s in seen), seen
