"""The value checks every setting and argument goes through (taskonce.checks)."""

from __future__ import annotations

import math

import pytest

import taskonce
from taskonce.checks import check_count, check_seconds


@pytest.mark.parametrize("value", [0.5, 1, 300, 1e9])
def test_seconds_accepted(value: float) -> None:
    assert check_seconds("Policy.lease", value) == float(value)


@pytest.mark.parametrize("value", [0, -1, True, "5", None, math.nan, math.inf])
def test_seconds_refused(value: object) -> None:
    with pytest.raises(taskonce.ConfigError) as caught:
        check_seconds("Policy.lease", value)
    assert str(caught.value) == f"Policy.lease={value!r} must be a positive number of seconds"


def test_seconds_zero_allowed_where_it_means_off() -> None:
    assert check_seconds("Policy.confirm_within", 0, zero=True) == 0.0
    with pytest.raises(taskonce.ConfigError, match="must be a number of seconds, 0 or more"):
        check_seconds("Policy.confirm_within", -0.1, zero=True)


def test_count() -> None:
    assert check_count("batch", 3) == 3
    assert check_count("Policy.crash_limit", 0, minimum=0) == 0
    for bad in (0, True, 2.0, "3", None):
        with pytest.raises(taskonce.InvalidInput) as caught:
            check_count("batch", bad, error=taskonce.InvalidInput)
        assert str(caught.value) == f"batch={bad!r} must be a whole number, 1 or more"


def test_a_call_has_the_value_in_place_of_its_ellipsis() -> None:
    with pytest.raises(taskonce.ConfigError) as caught:
        check_seconds("Guard(dispatch_lease=…)", -1)
    assert str(caught.value) == "Guard(dispatch_lease=-1) must be a positive number of seconds"
    with pytest.raises(taskonce.ConfigError) as caught:
        check_count("PeriodicPurge(batch=…)", 0)
    assert str(caught.value) == "PeriodicPurge(batch=0) must be a whole number, 1 or more"


def test_a_count_may_say_what_it_counts() -> None:
    with pytest.raises(taskonce.ConfigError) as caught:
        check_count("Guard(send_limit=…)", 0, unit="bytes")
    assert str(caught.value) == "Guard(send_limit=0) must be a whole number of bytes, 1 or more"
