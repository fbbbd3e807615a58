"""The relay thread: a guard's sweep of deferred sends left pending, every few seconds.

:meth:`taskonce.Guard.start_relay` starts it (workers do, every ``relay_every`` /
``taskonce_relay_every`` seconds), :meth:`taskonce.Guard.close` stops it. One per guard and
process: a forked child starts its own.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable

from taskonce.checks import check_seconds
from taskonce.errors import StoreUnavailable

logger = logging.getLogger("taskonce")

#: One sweep: ``sweep(older_than)`` (:meth:`taskonce.Guard.relay`).
Sweep = Callable[[float], object]


class RelayThread:
    """Runs a sweep every ``every`` seconds in a daemon thread until stopped."""

    def __init__(self) -> None:
        self._reset()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_in_child(ref))

    def _reset(self) -> None:
        # The parent's relay thread does not exist in a forked child, and it may have held the
        # lock at the fork.
        self._lock = threading.Lock()
        self._running: tuple[int, threading.Thread, threading.Event] | None = None

    def start(self, sweep: Sweep, every: float, older_than: float | None = None) -> None:
        """Sweep every ``every`` seconds, records older than ``older_than`` (default
        ``every``); nothing when this process's thread already runs, or for ``every`` 0."""
        every = check_seconds("start_relay(every=…)", every, zero=True, note="0: no relay")
        if older_than is not None:
            older_than = check_seconds("start_relay(older_than=…)", older_than, zero=True)
        if not every:
            return
        age = every if older_than is None else older_than
        with self._lock:
            running = self._running
            if running is not None and running[0] == os.getpid() and running[1].is_alive():
                return
            stop = threading.Event()
            thread = threading.Thread(
                target=_loop,
                args=(sweep, every, age, stop),
                name="taskonce-relay",
                daemon=True,
            )
            self._running = (os.getpid(), thread, stop)
            thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop this process's thread, waiting up to ``timeout`` seconds for it to end."""
        with self._lock:
            running, self._running = self._running, None
        if running is not None and running[0] == os.getpid():
            running[2].set()
            if running[1] is not threading.current_thread():
                running[1].join(timeout)


def _reset_in_child(ref: weakref.ReferenceType[RelayThread]) -> None:
    relay = ref()
    if relay is not None:
        relay._reset()


def _loop(sweep: Sweep, every: float, older_than: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        try:
            sweep(older_than)
        except StoreUnavailable as exc:  # an outage, not a fault: one line, no traceback
            logger.warning(
                "deferred-send relay sweep: the store is unavailable (%s); trying again in %ss",
                exc,
                every,
            )
        except Exception:  # a sweep that fails otherwise tries again next time, loudly
            logger.exception("deferred-send relay sweep failed; trying again in %ss", every)
