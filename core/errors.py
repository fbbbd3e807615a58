"""The exceptions taskonce raises.

Every error derives from :class:`TaskonceError`, so ``except TaskonceError`` catches all of
them. Messages name the thing that is wrong (the policy field, the key, the store URL) and never
contain a password.
"""

from __future__ import annotations


class TaskonceError(Exception):
    """Base class of every taskonce error."""


class ConfigError(TaskonceError, ValueError):
    """A policy, store URL or adapter setting is invalid; the message names the field."""


class InvalidInput(TaskonceError, ValueError):
    """A delivery cannot be keyed or fingerprinted: empty message id, non-string queue, a key
    longer than a store accepts, arguments or a result that JSON cannot represent."""


class SendRefused(InvalidInput):
    """A guarded handler sent a message the hand-off cannot store: an argument JSON cannot
    represent, or more than the size limit of captured sends. Raised at the send call; the
    message names the task and the argument."""


class StoreUnavailable(TaskonceError):
    """The store could not be reached or did not answer; with ``on_store_error="fail_closed"``
    the handler was not run and the message should go back to the broker."""


class LeaseLost(TaskonceError):
    """A fenced write (complete, release, renew) was refused: the owner token no longer matches,
    because the lease ran out and another delivery took the claim over (or an operator
    released it)."""

    def __init__(self, key: str, operation: str) -> None:
        super().__init__(
            f"{operation} refused for key {key!r}: this worker's claim is no longer the owner "
            "(its lease ran out and another delivery took it over, or it was released)"
        )
        self.key = key
        self.operation = operation

    def __reduce__(self) -> tuple[type[LeaseLost], tuple[str, str]]:
        # Celery hands exceptions from pool processes to the main process by pickling them.
        return (type(self), (self.key, self.operation))


class PayloadMismatch(TaskonceError):
    """A message arrived under a key whose recorded payload fingerprint differs: the same id was
    reused for different work. The handler is not run."""

    def __init__(self, key: str, recorded: str, received: str) -> None:
        super().__init__(
            f"payload mismatch for key {key!r}: recorded fingerprint {recorded[:12]}…, this "
            f"delivery's {received[:12]}… — the same message id carries different arguments; "
            "the handler was not run"
        )
        self.key = key
        self.recorded = recorded
        self.received = received

    def __reduce__(self) -> tuple[type[PayloadMismatch], tuple[str, str, str]]:
        return (type(self), (self.key, self.recorded, self.received))


class InProgressElsewhere(TaskonceError):
    """Another live owner holds the claim on this key; deliver again after ``retry_after``
    seconds (when the guard looks again: the lease's remaining time or sooner, e.g. while
    the owner's liveness is being checked — not necessarily the lease's end)."""

    def __init__(self, key: str, retry_after: float) -> None:
        super().__init__(
            f"key {key!r} is being processed elsewhere; deliver again in {retry_after:.1f} s"
        )
        self.key = key
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[type[InProgressElsewhere], tuple[str, float]]:
        return (type(self), (self.key, self.retry_after))


class Quarantined(TaskonceError):
    """The handler's process died ``count`` times running this key (its claim was taken over
    from a dead, silent or expired owner each time), more than ``Policy.crash_limit`` allows:
    the key is quarantined and the message dead-lettered instead of run again. Later copies
    are acknowledged and not run until ``taskonce release KEY`` (in a Django project
    ``manage.py taskonce release KEY``) re-arms the key; the message names both."""

    def __init__(self, key: str, count: int) -> None:
        # args are (key, count), so a result backend that stores an exception by its arguments
        # (Celery's JSON serializer) brings back a Quarantined, not a bare Exception.
        super().__init__(key, count)
        self.key = key
        self.count = count

    def __str__(self) -> str:
        return (
            f"key {self.key!r} quarantined: the process running it died {self.count} times "
            f"(crash_limit); not run again until released: taskonce release {self.key!r} "
            f"--store URL (in a Django project: python manage.py taskonce release {self.key!r})"
        )


__all__ = [
    "ConfigError",
    "InProgressElsewhere",
    "InvalidInput",
    "LeaseLost",
    "PayloadMismatch",
    "Quarantined",
    "SendRefused",
    "StoreUnavailable",
    "TaskonceError",
]
