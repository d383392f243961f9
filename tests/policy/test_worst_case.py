"""The most requests a set of buckets lets through in any window: ``burst + rate*W/per`` per
bucket, the tightest bucket wins, divided by the cost, rounded down."""

import pytest

from proxy.policy.model import Limit
from proxy.policy.worst_case import WorstCase, most_requests, worst_cases


def test_a_full_burst_on_top_of_a_window_of_refill():
    # The case: 95/s with a burst of 10 lets 105 through in the first second.
    assert most_requests([Limit(95, 1, 10)], 1) == 105
    assert most_requests([Limit(95, 1, 5)], 1) == 100


def test_each_bucket_bounds_on_its_own_and_the_tightest_wins():
    limits = [Limit(80, 1, 40), Limit(4000, 60, 4000)]
    assert most_requests(limits, 1) == 120  # 80 + 40; the minute bucket allows 4066
    assert most_requests(limits, 60) == 4840  # 80*60 + 40 < 4000 + 4000


def test_fractions_round_down_without_float_noise():
    assert most_requests([Limit(4000, 60, 4000)], 1) == 4066  # 4066.67
    assert most_requests([Limit(0.1, 1, 1)], 30) == 4  # 1 + 3.0000000000000004
    assert most_requests([Limit(1, 3, 1)], 1) == 1  # 1.33


def test_cost_divides_the_tokens():
    assert most_requests([Limit(100, 1, 100)], 1, cost=5) == 40
    assert most_requests([Limit(100, 1, 100)], 1, cost=1.5) == 133


def test_no_limits_bound_nothing_and_bad_input_is_refused():
    assert most_requests([], 1) is None
    with pytest.raises(ValueError):
        most_requests([Limit(1, 1, 1)], 1, cost=0)
    with pytest.raises(ValueError):
        most_requests([Limit(1, 1, 1)], -1)


def test_one_case_per_distinct_window_shortest_first_bounded_by_the_enclosing_buckets():
    vendor = (Limit(4000, 60, 4000), Limit(90, 1, 10), Limit(50, 1, 20))
    assert worst_cases(vendor) == (WorstCase(1, 70), WorstCase(60, 3020))
    # An endpoint of 20/s burst 20 inside it: its own 40, and over a minute the vendor's
    # 1 s buckets bind before its own 1220.
    assert worst_cases((Limit(20, 1, 20),), vendor) == (WorstCase(1, 40),)
    assert worst_cases((Limit(20, 1, 20), Limit(600, 60, 600)), vendor, cost=2) == (
        WorstCase(1, 20),
        WorstCase(60, 600),
    )
    assert worst_cases(()) == ()
