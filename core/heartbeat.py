"""Lease renewal for handlers that outlive their lease.

One daemon thread per process renews every running eager claim a third of the way into its
lease, so a long handler keeps its claim while a dead worker's claim still runs out: the
:class:`Heartbeat` calls, the guard's :class:`Renewals` renew.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from taskonce.errors import LeaseLost, StoreUnavailable
from taskonce.events import Event
from taskonce.record import Emit, report_lost

if TYPE_CHECKING:
    from taskonce.stores.base import Store
    from taskonce.ticket import Ticket

logger = logging.getLogger(__name__)

#: ``renew()`` performs one renewal; it raises to stop watching (LeaseLost and friends).
Renew = Callable[[], None]


@dataclasses.dataclass(slots=True)
class _Watch:
    due: float  # time.monotonic() of the next renewal
    interval: float
    renew: Renew


class Heartbeat:
    """Calls each watched claim's ``renew`` every ``lease / 3`` seconds until unwatched.

    Watching and unwatching are a dict insert and delete under a lock: they run for every
    delivery, while renewals are rare (only handlers that run longer than a third of their
    lease need one).

    :param name: the thread's name.
    """

    def __init__(self, name: str = "taskonce-heartbeat") -> None:
        self._name = name
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # After a fork the parent's thread does not exist in the child: start afresh.
        self._cond = threading.Condition(threading.Lock())
        self._watched: dict[int, _Watch] = {}
        self._ids = itertools.count()
        self._wake_at = float("inf")
        # The shortest renewal interval watched so far. When the last watch goes, the thread
        # looks once more that long after (a watch made meanwhile is due no sooner, so it need
        # not wake the thread: waking it for every delivery cost a thread switch each), and
        # only then sleeps until a watch wakes it.
        self._shortest = float("inf")
        self._thread: threading.Thread | None = None

    def watch(self, lease: float, renew: Renew) -> int:
        """Start renewing; returns a handle for :meth:`unwatch`."""
        interval = lease / 3.0
        due = time.monotonic() + interval
        with self._cond:
            handle = next(self._ids)
            self._watched[handle] = _Watch(due, interval, renew)
            self._shortest = min(self._shortest, interval)
            if self._thread is None:  # the loop clears it if it ever ends (cheaper than is_alive)
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            elif due < self._wake_at:
                self._cond.notify()
        return handle

    def unwatch(self, handle: int) -> None:
        """Stop renewing."""
        with self._cond:
            self._watched.pop(handle, None)

    def stop(self, timeout: float | None = None) -> None:
        """Stop renewing every watched claim and end the thread, waiting up to ``timeout``
        seconds for it (the guard is closed; a later :meth:`watch` starts a thread again)."""
        with self._cond:
            self._watched.clear()
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        try:
            self._renew_due()
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None  # the next watch starts a new one

    def _renew_due(self) -> None:
        idle = False  # looked once more after the last watch went
        while True:
            with self._cond:
                while True:
                    if self._thread is not threading.current_thread():
                        return  # stopped
                    now = time.monotonic()
                    due = [(h, w) for h, w in self._watched.items() if w.due <= now]
                    if due:
                        break
                    if self._watched:
                        idle = False
                        self._wake_at = min(w.due for w in self._watched.values())
                    elif not idle:
                        idle = True
                        self._wake_at = now + self._shortest
                    else:
                        self._wake_at = float("inf")
                    timeout = None if self._wake_at == float("inf") else self._wake_at - now
                    self._cond.wait(timeout)
                self._wake_at = now
            for handle, watch in due:
                try:
                    watch.renew()
                except Exception:  # the guard's renew reports its own errors; stop on any
                    logger.debug("heartbeat stops renewing handle %s", handle, exc_info=True)
                    self.unwatch(handle)
                    continue
                with self._cond:
                    if handle in self._watched:
                        watch.due = time.monotonic() + watch.interval


class Renewals:
    """Keeps the lease of each running eager claim renewed, on a :class:`Heartbeat`, from
    :meth:`start` until its run settles (:meth:`stop`).

    :param store: where the claims live.
    :param emit: the guard's ``emit(event, ticket, **fields)``.
    """

    def __init__(self, store: Store, emit: Emit) -> None:
        self.store = store
        self.emit = emit
        self.heartbeat = Heartbeat()

    def start(self, ticket: Ticket) -> None:
        """Renew ``ticket``'s claim every third of its lease."""
        ticket.renewal = self.heartbeat.watch(ticket.policy.lease, lambda: self._renew(ticket))

    def stop(self, ticket: Ticket) -> None:
        """Renew ``ticket``'s claim no more (its run settled, or its process is as good as
        dead)."""
        if ticket.renewal is not None:
            self.heartbeat.unwatch(ticket.renewal)
            ticket.renewal = None

    def close(self, timeout: float | None = None) -> None:
        """Stop renewing every claim and end the thread (:meth:`Heartbeat.stop`)."""
        self.heartbeat.stop(timeout)

    def _renew(self, ticket: Ticket) -> None:
        assert ticket.key is not None and ticket.owner is not None
        try:
            self.store.renew(ticket.key, ticket.owner, ticket.policy.lease)
        except LeaseLost:
            if ticket.renewal is None:
                return  # finish/fail ran meanwhile: the claim is complete, not lost
            report_lost(ticket, self.emit)
            raise
        except StoreUnavailable:
            # Keep trying: the lease still has two thirds left when a renewal first fails.
            logger.warning("could not renew the lease of %s; will try again", ticket.key)
            return
        self.emit(Event.LEASE_RENEWED, ticket)
