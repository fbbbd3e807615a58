"""The pure parts of the audit: rounding a recommended window, durations, broker bounds."""

from __future__ import annotations

import pytest

from taskonce.spark_ext.semantics import (
    human_duration,
    nice_window,
    parse_broker_bound,
    parse_duration,
    recommend,
)


@pytest.mark.parametrize(
    ("seconds", "window"),
    [
        (0, 60),
        (59.9, 60),
        (60, 60),
        (60.001, 120),
        (1398.602, 1440),  # whole minutes up to an hour
        (3600, 3600),
        (3600.5, 4500),  # quarter hours up to a day
        (7988, 8100),
        (86400, 86400),
        (86401, 90000),  # whole hours beyond
        (float("nan"), 60),
    ],
)
def test_nice_window(seconds: float, window: int) -> None:
    assert nice_window(seconds) == window


def test_recommend_takes_the_larger_of_gap_and_broker_bound() -> None:
    assert recommend(100.0, 2.0, []) == 240  # 200 → whole minutes
    assert recommend(100.0, 2.0, [3600.0, 300.0]) == 3600  # the longest bound wins
    assert recommend(3000.0, 1.5, [3600.0]) == 4500  # 4500 beats the bound
    assert recommend(None, 2.0, []) == 60  # no evidence: the minimum
    assert recommend(None, 2.0, [43200.0]) == 43200


def test_parse_duration() -> None:
    assert parse_duration("90") == 90
    assert parse_duration("90s") == 90
    assert parse_duration("5m") == 300
    assert parse_duration("1.5h") == 5400
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("250ms") == 0.25
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_parse_broker_bound() -> None:
    assert parse_broker_bound("redis-visibility=1h") == ("redis-visibility", 3600)
    assert parse_broker_bound("300") == ("300", 300)


def test_human_duration() -> None:
    assert human_duration(45) == "45 s"
    assert human_duration(8100) == "2.2 h"
    assert human_duration(7 * 86400) == "7 d"
