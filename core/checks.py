"""Checks of a configured or passed value, written once: a number of seconds, a count.

Each returns the value (as a ``float`` for seconds) or raises the error it is given (default
:class:`~taskonce.errors.ConfigError`) with ``name`` and the value in its text, so every place
that reads a setting says a bad one the same way: ``Policy.lease=-1 must be a positive number
of seconds``. ``bool`` is never a number here, though Python says ``True == 1``.
"""

from __future__ import annotations

import math

from taskonce.errors import ConfigError, TaskonceError

__all__ = ["check_count", "check_seconds"]


def check_seconds(
    name: str,
    value: object,
    *,
    zero: bool = False,
    error: type[TaskonceError] = ConfigError,
) -> float:
    """``value`` as seconds: a finite ``int``/``float`` above 0 (or at least 0 with ``zero``).

    :param name: how the caller names the value in the error (``Policy.lease``,
        ``taskonce_relay_every``, ``IdempotencyMiddleware(start_timeout=…)``).
    :param zero: whether 0 is allowed (0 meaning "off" where the caller says so).
    :param error: the error raised (``InvalidInput`` for a call's argument).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        what = "a number of seconds, 0 or more" if zero else "a positive number of seconds"
        raise error(f"{name}={value!r} must be {what}")
    return float(value)


def check_count(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    error: type[TaskonceError] = ConfigError,
) -> int:
    """``value`` as a count: an ``int`` at least ``minimum`` (default 1).

    :param name: how the caller names the value in the error.
    :param minimum: the smallest count allowed (0 where 0 means "off").
    :param error: the error raised (``InvalidInput`` for a call's argument).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name}={value!r} must be a whole number, {minimum} or more")
    return value
