"""What goes over the wire to the Redis store and back: durations as milliseconds, reply items
as text, and which errors mean "Redis cannot answer". (The record itself: :mod:`.layout`.)"""

from __future__ import annotations

from typing import Any

import redis.exceptions

# Errors that mean "Redis cannot answer right now" rather than "this call is wrong". Connection
# errors include timeouts of the connect, authentication failures, BusyLoadingError and
# MaxConnectionsError; the response errors are a read-only replica after a failover, a full
# memory, and a cluster that is reconfiguring.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ChildDeadlockedError,
)


def cannot_answer(exc: BaseException) -> bool:
    """Whether ``exc`` means "Redis cannot answer right now" (a script that runs too long
    elsewhere blocks the server: ``BUSY Redis is busy …``)."""
    return isinstance(exc, UNAVAILABLE) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and str(exc).startswith(("BUSY", "LOADING", "MASTERDOWN"))
    )


def text(value: Any) -> str | None:
    """A reply item as text (clients may or may not decode responses)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds; a positive duration never rounds down to zero."""
    value = round(float(seconds) * 1000)
    if value <= 0 < seconds:
        return 1
    return value


__all__ = ["UNAVAILABLE", "cannot_answer", "ms", "text"]
