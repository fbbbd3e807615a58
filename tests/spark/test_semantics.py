"""The pure parts of the audit: rounding a recommended window, durations, broker bounds."""

from __future__ import annotations

import pytest

from taskonce.spark_ext.semantics import (
    MIN_ADVICE_GAPS,
    advise,
    human_duration,
    known_bound,
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
    # a broker with a known default, alone or with the user's own setting
    assert parse_broker_bound("celery-redis") == ("celery-redis", 3600)
    assert parse_broker_bound("Celery-RabbitMQ") == ("celery-rabbitmq", 1800)
    assert parse_broker_bound("celery-redis=2h") == ("celery-redis", 7200)
    with pytest.raises(ValueError, match="not a broker bound: 'redis' .*celery-redis"):
        parse_broker_bound("redis")


def test_known_bound_given_first_else_assumed_from_the_framework() -> None:
    assert known_bound({"a": 600.0, "b": 1200.0}, ["celery"]) == (1200.0, "b", "option")
    # Celery's brokers: Redis 1 h, SQS and RabbitMQ 30 min → the longest is assumed
    assert known_bound({}, ["celery"]) == (3600.0, "celery-redis", "framework")
    assert known_bound({}, ["dramatiq"]) == (1800.0, "dramatiq-rabbitmq", "framework")
    assert known_bound({}, ["dramatiq", "celery"]) == (3600.0, "celery-redis", "framework")
    assert known_bound({}, []) == (None, None, None)
    assert known_bound({"zero": 0.0}, []) == (None, None, None)


def test_advise_rule() -> None:
    # the log must span the window it would recommend
    assert advise(180.0, 9, 3600, 3600.0)[0] == "too_short"
    assert advise(3600.0, 0, 3600, 3600.0) == ("advise", [])
    # with no broker bound known, it needs MIN_ADVICE_GAPS duplicates with a measured gap
    assert advise(86400.0, MIN_ADVICE_GAPS - 1, 120, None)[0] == "too_short"
    assert advise(86400.0, MIN_ADVICE_GAPS, 120, None) == ("advise", [])
    verdict, reasons = advise(60.0, 0, 120, None)
    assert verdict == "too_short" and len(reasons) == 2


def test_human_duration() -> None:
    assert human_duration(45) == "45 s"
    assert human_duration(8100) == "2.2 h"
    assert human_duration(7 * 86400) == "7 d"
