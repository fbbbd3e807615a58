"""What goes over the wire to the Redis store's scripts and back: arguments encoded, replies
decoded, the record's status field as an enum, and which errors mean "Redis cannot answer"."""

from __future__ import annotations

from typing import Any

import redis.exceptions

from taskonce.stores.base import Status, StrEnum

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


class Code(StrEnum):
    """A record's ``st`` field, as the scripts write it."""

    #: a claim (in progress)
    CLAIMED = "i"
    #: completed: an eager claim's completion or a lazy mark
    COMPLETED = "c"
    #: completed, its deferred sends not all published yet (the hand-off)
    SENDING = "p"

    @property
    def status(self) -> Status:
        """The :class:`~taskonce.stores.base.Status` a record with this field has."""
        return Status.IN_PROGRESS if self is Code.CLAIMED else Status.COMPLETED

    @staticmethod
    def of(value: Any) -> Code | None:
        """The code of a reply item, or None when it is none of them (a foreign key)."""
        return CODES.get(text(value) or "")


#: each code by its value: a dict lookup, cheaper than ``Code(value)`` on the hot path
CODES: dict[str, Code] = {code.value: code for code in Code}


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


def optional(value: str | None) -> tuple[str, str]:
    """An optional string as the (present flag, value) pair the scripts take."""
    return ("0", "") if value is None else ("1", value)


__all__ = ["CODES", "UNAVAILABLE", "Code", "cannot_answer", "ms", "optional", "text"]
