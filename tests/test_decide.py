"""decide.py: the per-request wish and the decision, pure functions."""

from __future__ import annotations

import pytest

from proxy.limiter.store import AcquireResult
from proxy.pipeline.decide import FORWARD, Defer, Hold, Shed, decide, request_wish
from proxy.policy.model import OnLimit, Wish
from proxy.wire.refusals import BadRequest

HOLD = OnLimit("hold", 0.5)
DEFER = OnLimit("defer", 0.5)


def granted(wait: float = 0.0) -> AcquireResult:
    return AcquireResult(True, wait, 0 if wait else -1, (0.0,))


def refused(wait: float) -> AcquireResult:
    return AcquireResult(False, wait, 0, (0.0,))


def test_the_vendors_choice_applies_without_headers() -> None:
    assert request_wish(HOLD, {}) == Wish("hold", 0.5)
    assert request_wish(DEFER, {}).max_wait == 0.0
    assert request_wish(HOLD, {}).max_wait == 0.5


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-Quota-On-Limit": "defer"}, Wish("defer", 0.5)),
        ({"X-Quota-On-Limit": " SHED "}, Wish("shed", 0.5)),
        ({"X-Quota-Max-Hold": "100ms"}, Wish("hold", 0.1)),
        ({"X-Quota-Max-Hold": "10s"}, Wish("hold", 0.5)),  # capped by the vendor's max_hold
        ({"X-Quota-On-Limit": "hold", "X-Quota-Max-Hold": "0"}, Wish("hold", 0.0)),
    ],
)
def test_headers_override_per_request(headers: dict[str, str], expected: Wish) -> None:
    assert request_wish(HOLD, headers) == expected


def test_a_worker_may_ask_to_hold_on_a_defer_vendor_up_to_its_max_hold() -> None:
    assert request_wish(DEFER, {"X-Quota-On-Limit": "hold"}) == Wish("hold", 0.5)


@pytest.mark.parametrize(
    "headers", [{"X-Quota-On-Limit": "wait"}, {"X-Quota-Max-Hold": "soon"}, {"X-Quota-Max-Hold": "-1s"}]
)
def test_bad_headers_are_a_400(headers: dict[str, str]) -> None:
    with pytest.raises(BadRequest):
        request_wish(HOLD, headers)


def test_decisions() -> None:
    hold, defer, shed = Wish("hold", 0.5), Wish("defer", 0.5), Wish("shed", 0.5)
    assert decide(granted(), hold) is FORWARD
    assert decide(granted(0.2), hold) == Hold(0.2)
    assert decide(refused(0.7), hold) == Defer(0.7, 0.7)  # beyond max_hold: defer
    assert decide(refused(0.7), defer) == Defer(0.7, 0.7)
    # The queue slot is the hint to retry on; the real wait stays what it is.
    assert decide(AcquireResult(False, 0.7, 0, (0.0,), 1.2), defer) == Defer(0.7, 1.2)
    # A slot kept: its time is the hint; offered an earlier one its owner left, that one's.
    kept = AcquireResult(False, 0.7, 0, (0.0,), 0.7, reserved="1:1:a")
    assert decide(kept, defer) == Defer(0.7, 0.7)
    assert decide(kept._replace(hint=0.3), defer) == Defer(0.3, 0.3)
    assert decide(refused(0.7), shed) == Shed(0.7)
