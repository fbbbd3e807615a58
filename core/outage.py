"""A store's reachability, told in the log once per change rather than once per message.

During an outage every delivery and every liveness beat meets the unreachable store. Each of
them still acts as its policy says (``fail_closed``: the message goes back to the broker), but
the log says only what changed: the store stopped answering, it is still down (once a minute),
it answers again (with how long it was down). The per-message lines are at DEBUG. A store that
has not answered yet in this process (a wrong URL, most likely) is not called down until a
minute has passed: at a worker's start, the start check speaks for it in one line.

At a worker's start an unreachable store is almost always a mistake in its URL, not an outage:
:func:`wait_for_store` lets the adapters give it a short time and then refuse to start.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from taskonce.checks import check_seconds
from taskonce.errors import ConfigError, StoreUnavailable

if TYPE_CHECKING:
    from taskonce.stores.base import Store

logger = logging.getLogger("taskonce")

#: Seconds between two "still unreachable" lines of one outage.
REMIND_EVERY = 60.0
#: Seconds a worker waits at its start for the store to answer before it refuses to start.
START_TIMEOUT = 30.0
#: Seconds between two tries while waiting at start.
_START_POLL = 1.0
#: The back-off after a store error (:class:`Backoff`): the first, and the longest, in seconds.
BACKOFF_FIRST = 1.0
BACKOFF_CAP = 60.0
#: Doublings after which the back-off stops growing (far beyond any cap: 2**32 s).
_MAX_DOUBLINGS = 32


@dataclasses.dataclass(frozen=True)
class Backoff:
    """How long a delivery that met an unusable store waits before it is tried again: the one
    rule of both adapters, carried in :attr:`Action.delay <taskonce.action.Action>` of a
    ``BACK_OFF``.

    The ``n``-th consecutive back-off of one message (``attempt`` ``n - 1``, counted on the
    copy the adapter publishes again) waits ``first × 2**attempt`` seconds, at most ``cap``,
    drawn in the upper half of that (jitter): the copies one outage held back do not all come
    back at the same moment. Defaults 1 s and 60 s: 0.5–1 s, 1–2 s, 2–4 s, … 30–60 s.

    :raises ConfigError: ``first`` or ``cap`` is not a positive finite number of seconds, or
        ``cap`` is less than ``first``; ``name`` says whose setting it is.
    """

    first: float = BACKOFF_FIRST
    cap: float = BACKOFF_CAP
    name: str = "Backoff"

    def __post_init__(self) -> None:
        for field in ("first", "cap"):
            check_seconds(f"{self.name}: {field}", getattr(self, field))
        if self.cap < self.first:
            raise ConfigError(
                f"{self.name}: cap={self.cap!r} is less than first={self.first!r} seconds"
            )

    def longest(self, attempt: int) -> float:
        """The longest wait of back-off number ``attempt`` (0: the first)."""
        return min(self.first * 2.0 ** min(max(attempt, 0), _MAX_DOUBLINGS), self.cap)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before back-off number ``attempt`` (0: the first) is tried again."""
        longest = self.longest(attempt)
        return random.uniform(longest / 2, longest)  # jitter: copies of one outage spread out


#: The back-off when an adapter is given none.
DEFAULT_BACKOFF = Backoff()


class StoreHealth:
    """Whether the store answered last time, and the log lines of each change.

    Failures come from deliveries and liveness writes; answers from the liveness writes only
    (every few seconds, each a round trip): a delivery may touch no store at all (lazy with
    ``check_first=False``), so its success says nothing of the store.

    :param describe: the store as the log shows it (its URL without a password).
    :param remind_every: seconds between two "still unreachable" lines; default 60.
    :param clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        describe: str,
        remind_every: float = REMIND_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.describe = describe
        self.remind_every = remind_every
        self._clock = clock
        self._lock = threading.Lock()
        self.down_since: float | None = None
        #: whether the store has answered in this process (before, a failure is no outage)
        self.ever_answered = False
        self._reminded_at = 0.0
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_lock(ref))

    def failed(self, exc: BaseException) -> None:
        """The store did not answer: log it if this starts an outage or a minute has passed.
        A store that has never answered in this process is not down but not reached yet (a
        worker's start check says the rest): that is logged at INFO until a minute has passed."""
        now = self._clock()
        with self._lock:
            if self.down_since is None:
                self.down_since = self._reminded_at = now
                if self.ever_answered:
                    logger.warning(
                        "store %s stopped answering (%s); guarded deliveries follow "
                        "on_store_error until it answers",
                        self.describe,
                        reason(exc),
                    )
                else:
                    logger.info("store %s does not answer yet (%s)", self.describe, reason(exc))
            elif now - self._reminded_at >= self.remind_every:
                self._reminded_at = now
                logger.warning(
                    "store %s still unreachable after %.0f s (%s)",
                    self.describe,
                    now - self.down_since,
                    reason(exc),
                )

    def answered(self) -> None:
        """The store answered: log the end of an outage, if there was one."""
        if self.down_since is None:
            self.ever_answered = True
            return
        with self._lock:
            since, self.down_since = self.down_since, None
            first, self.ever_answered = not self.ever_answered, True
        if since is not None:
            logger.log(
                logging.INFO if first else logging.WARNING,
                "store %s answers %s after %.1f s",
                self.describe,
                "now" if first else "again",
                self._clock() - since,
            )


def reason(exc: BaseException) -> str:
    """What went wrong, in few words: the driver's error behind a store's StoreUnavailable
    (``ConnectionError: Error 111 connecting to …``), else the error itself."""
    cause = exc.__cause__
    if isinstance(exc, StoreUnavailable) and cause is not None:
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = str(exc)
    # one line: drivers add hints on lines of their own (SQLAlchemy's "Background on this
    # error at: …"), which a log line would break apart
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _reset_lock(ref: weakref.ReferenceType[StoreHealth]) -> None:
    health = ref()
    if health is not None:  # the parent's lock may have been held by a thread gone here
        health._lock = threading.Lock()


def store_probe(store: Store, me: str) -> Callable[[], object]:
    """One round trip that tells a worker's start whether ``store`` answers: set up
    (:meth:`~taskonce.stores.base.Store.check_ready`, a :class:`ConfigError` otherwise) and
    reading the liveness record of ``me``."""

    def probe() -> object:
        store.check_ready()
        return store.seen(me)

    return probe


def wait_for_store(
    probe: Callable[[], object],
    describe: str,
    timeout: float = START_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Call ``probe`` (one round trip to the store) until it answers or ``timeout`` seconds
    have passed.

    :raises StoreUnavailable: the store did not answer in time; its message names the store,
        the wait and the last error, and says the URL is the likely cause.
    :raises ConfigError: ``timeout`` is not a number of seconds, 0 or more.
    """
    timeout = check_seconds("wait_for_store(timeout=…)", timeout, zero=True, note="0: one try")
    deadline = clock() + timeout
    told = False
    while True:
        try:
            probe()
            return
        except StoreUnavailable as exc:
            last = exc
        left = deadline - clock()
        if left <= 0:
            break
        if not told:
            told = True
            logger.info(
                "store %s does not answer yet; waiting up to %.0f s before giving up (%s)",
                describe,
                timeout,
                reason(last),
            )
        sleep(min(_START_POLL, left))
    raise StoreUnavailable(
        f"store {describe} could not be reached within {timeout:g} s ({reason(last)}): check "
        "its URL and that the server runs"
    )


__all__ = ["REMIND_EVERY", "START_TIMEOUT", "StoreHealth", "store_probe", "wait_for_store"]
