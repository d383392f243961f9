"""loudly.py: warnings that stay loud without flooding the log."""

from __future__ import annotations

import logging

import pytest

from proxy.clock import ManualClock
from proxy.telemetry.loudly import Loudly


async def test_one_line_per_subject_per_interval_then_a_count_of_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    log = logging.getLogger("quota_proxy.test_loudly")
    loudly = Loudly(log, clock)
    caplog.set_level(logging.WARNING, logger=log.name)
    for _ in range(3):
        loudly.warn("a", 60.0, "vendor %s capped", "a")
    loudly.warn("b", 60.0, "vendor %s capped", "b")  # another subject has its own interval
    await clock.advance(59.9)
    loudly.warn("a", 60.0, "vendor %s capped", "a")
    await clock.advance(0.1)
    loudly.warn("a", 60.0, "vendor %s capped", "a")
    loudly.warn("a", 60.0, "vendor %s capped", "a")
    await clock.advance(60)
    loudly.warn("a", 60.0, "vendor %s capped", "a")
    assert [r.getMessage() for r in caplog.records] == [
        "vendor a capped",
        "vendor b capped",
        "vendor a capped (and 3 more like it since the last such line)",
        "vendor a capped (and 1 more like it since the last such line)",
    ]
    assert {r.levelno for r in caplog.records} == {logging.WARNING}
