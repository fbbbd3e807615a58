"""Checks of a configured or passed value, written once: a number of seconds, a count.

Each returns the value (as a ``float`` for seconds) or raises the error it is given (default
:class:`~taskonce.errors.ConfigError`) with ``name`` and the value in its text, so every place
that reads a setting says a bad one the same way: ``Policy.lease=-1 must be a positive number
of seconds``. A name that is a call (``Guard(dispatch_lease=…)``) has the value put in place
of its ``…``: ``Guard(dispatch_lease=-1) must be …``. ``bool`` is never a number here, though
Python says ``True == 1``.
"""

from __future__ import annotations

import math

from taskonce.errors import ConfigError, TaskonceError

__all__ = ["check_count", "check_seconds", "said"]


def check_seconds(
    name: str,
    value: object,
    *,
    zero: bool = False,
    note: str = "",
    error: type[TaskonceError] = ConfigError,
) -> float:
    """``value`` as seconds: a finite ``int``/``float`` above 0 (or at least 0 with ``zero``).

    :param name: how the user writes the value (``Policy.lease``, ``setting
        taskonce_relay_every``, ``IdempotencyMiddleware(start_timeout=…)``).
    :param zero: whether 0 is allowed (0 meaning "off" where the caller says so).
    :param note: said after the rule, in brackets: what 0 means (``0 turns the relay off``).
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
        raise error(f"{said(name, value)} must be {what}{_bracketed(note)}")
    return float(value)


def check_count(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    unit: str = "",
    note: str = "",
    error: type[TaskonceError] = ConfigError,
) -> int:
    """``value`` as a count: an ``int`` at least ``minimum`` (default 1).

    :param name: how the user writes the value.
    :param minimum: the smallest count allowed (0 where 0 means "off").
    :param unit: what is counted, when the name does not say (``bytes``, ``milliseconds``).
    :param note: said after the rule, in brackets: what 0 means.
    :param error: the error raised (``InvalidInput`` for a call's argument).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        counted = f" of {unit}" if unit else ""
        rule = f"a whole number{counted}, {minimum} or more"
        raise error(f"{said(name, value)} must be {rule}{_bracketed(note)}")
    return value


def said(name: str, value: object) -> str:
    """``name=value`` as the user wrote it: the value in place of the ``…`` of a call's name
    (``Guard(dispatch_lease=…)``), else after ``=``."""
    if "…" in name:
        return name.replace("…", repr(value), 1)
    return f"{name}={value!r}"


def _bracketed(note: str) -> str:
    return f" ({note})" if note else ""
