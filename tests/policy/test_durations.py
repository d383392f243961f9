import math

import pytest

from proxy.policy import format_duration, parse_duration


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (0, 0.0),
        (2, 2.0),
        (0.25, 0.25),
        ("2", 2.0),
        ("0.5", 0.5),
        ("250ms", 0.25),
        ("1s", 1.0),
        ("1.5s", 1.5),
        (".5s", 0.5),
        ("1m", 60.0),
        ("1h", 3600.0),
        ("1d", 86400.0),
        (" 30s ", 30.0),
    ],
)
def test_parses(value, seconds):
    assert parse_duration(value) == seconds
    assert isinstance(parse_duration(value), float)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1x", '"1x" is not a duration'),
        ("", '"" is not a duration'),
        ("s", '"s" is not a duration'),
        ("1 s", '"1 s" is not a duration'),
        ("1.s", '"1.s" is not a duration'),
        ("-1s", '"-1s" is not a duration'),
        ("1S", '"1S" is not a duration'),
        ("1e3", '"1e3" is not a duration'),
        (-1, "-1 is not a duration"),
        (-0.5, "-0.5 is not a duration"),
        (math.inf, "inf is not a duration"),
        (math.nan, "nan is not a duration"),
        (True, "true is not a duration"),
        (None, "null is not a duration"),
        ([1], "[1] is not a duration"),
    ],
)
def test_rejects_with_one_message(value, message):
    with pytest.raises(ValueError) as raised:
        parse_duration(value)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.25, "250ms"), (0.05, "50ms"), (1, "1s"), (90, "90s"), (60, "1m"), (3600, "1h"), (86400, "1d")],
)
def test_format_is_shortest_exact_and_round_trips(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds
