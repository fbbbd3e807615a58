"""Lease renewal for handlers that outlive their lease.

One daemon thread per process renews every running eager claim a third of the way into its
lease, so a long handler keeps its claim while a dead worker's claim still runs out.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: ``renew()`` performs one renewal; it raises to stop watching (LeaseLost and friends).
Renew = Callable[[], None]


class Heartbeat:
    """Calls each watched claim's ``renew`` every ``lease / 3`` seconds until unwatched.

    :param name: the thread's name.
    """

    def __init__(self, name: str = "taskonce-heartbeat") -> None:
        self._name = name
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # After a fork the parent's thread does not exist in the child: start afresh.
        self._cond = threading.Condition(threading.Lock())
        self._due: list[tuple[float, int]] = []
        self._watched: dict[int, tuple[float, Renew]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, lease: float, renew: Renew) -> int:
        """Start renewing; returns a handle for :meth:`unwatch`."""
        interval = lease / 3.0
        with self._cond:
            handle = next(self._ids)
            self._watched[handle] = (interval, renew)
            heapq.heappush(self._due, (time.monotonic() + interval, handle))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            elif self._due[0][1] == handle:
                self._cond.notify()
        return handle

    def unwatch(self, handle: int) -> None:
        """Stop renewing (the heap entry is dropped lazily when it comes due)."""
        with self._cond:
            self._watched.pop(handle, None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._due and self._due[0][1] not in self._watched:
                        heapq.heappop(self._due)
                    timeout = self._due[0][0] - time.monotonic() if self._due else None
                    if timeout is not None and timeout <= 0:
                        break
                    self._cond.wait(timeout)
                _, handle = heapq.heappop(self._due)
                interval, renew = self._watched[handle]
            try:
                renew()
            except Exception:  # the guard's renew reports its own errors; stop on any
                logger.debug("heartbeat stops renewing handle %s", handle, exc_info=True)
                self.unwatch(handle)
                continue
            with self._cond:
                if handle in self._watched:
                    heapq.heappush(self._due, (time.monotonic() + interval, handle))
