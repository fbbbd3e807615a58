"""What a worker of any framework is told beside its guard, read once and checked once.

Celery's settings (``taskonce_relay_every``, …), the Dramatiq middleware's keyword arguments
(``IdempotencyMiddleware(relay_every=…)``, …) and Django's ``settings.TASKONCE``
(``RELAY_EVERY``, …) say the same few things; each adapter builds one :class:`WorkerOptions`
from its own words, and a bad value is refused here, in the same text everywhere but for the
name the user wrote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from taskonce.checks import check_seconds
from taskonce.outage import BACKOFF_CAP, BACKOFF_FIRST, START_TIMEOUT, Backoff

#: Seconds between two sweeps of a worker's hand-off relay, unless told otherwise.
RELAY_EVERY = 30.0


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """A worker's options, each checked when the object is made.

    :param relay_every: seconds between two sweeps of the worker's hand-off relay (it publishes
        deferred sends a worker that died after recording left pending); 0 turns it off.
    :param start_timeout: seconds a starting worker waits for its store to answer before it
        refuses to start (a store unreachable at start is almost always a wrong URL); 0: one try.
    :param backoff_first: seconds before a delivery that met an unusable store is tried again
        the first time (:class:`~taskonce.outage.Backoff`).
    :param backoff_cap: the longest of those waits; a ``backoff_first`` above it is the cap.
    :param names: how the user wrote each field (``{"relay_every": "setting
        taskonce_relay_every"}``), for the error; a field not named is ``WorkerOptions.field``.
    :raises ConfigError: a value is not a number of seconds it may be, naming it.
    """

    relay_every: float = RELAY_EVERY
    start_timeout: float = START_TIMEOUT
    backoff_first: float = BACKOFF_FIRST
    backoff_cap: float = BACKOFF_CAP
    names: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    #: the back-off after a store error, by the one rule (:class:`~taskonce.outage.Backoff`)
    backoff: Backoff = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        for field, zero, note in (
            ("relay_every", True, "0 turns the relay off"),
            ("start_timeout", True, "0: one try"),
            ("backoff_first", False, ""),
            ("backoff_cap", False, ""),
        ):
            value = getattr(self, field)
            seconds = check_seconds(self.name(field), value, zero=zero, note=note)
            object.__setattr__(self, field, seconds)
        cap = max(self.backoff_first, self.backoff_cap)
        backoff = Backoff(self.backoff_first, cap, name=self.name("backoff_first"))
        object.__setattr__(self, "backoff", backoff)

    def name(self, field: str) -> str:
        """How the user wrote ``field``."""
        return self.names.get(field, f"WorkerOptions.{field}")


__all__ = ["RELAY_EVERY", "WorkerOptions"]
