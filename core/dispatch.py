"""The hand-off's dispatch: publishing recorded sends through the frameworks' publishers.

A guarded handler's sends are recorded with its outcome (:meth:`taskonce.Guard.finish`); the
:class:`Dispatcher` publishes them in order and marks them dispatched, each record's sends
under a *dispatch lease* (:meth:`~taskonce.stores.base.Store.take_sends`) so that two
dispatchers never publish them at the same moment. It serves three callers: the recorder right
after its record, a redelivery of a handled message that finds them still pending, and the
relay sweep (:meth:`Dispatcher.relay`, run by :mod:`taskonce.relay`) for records whose message
never comes back. docs/handoff.md tells the whole story.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence

from taskonce import handoff, receipts
from taskonce.checks import check_seconds
from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.events import Event, Sinks, make_event
from taskonce.handoff import Publisher, Receipt, Send
from taskonce.outbox import OUTBOX_PREFIX, outbox_event
from taskonce.stores.base import Store

logger = logging.getLogger("taskonce")

#: Seconds of dispatch lease the recorder of a handler's sends takes as it records them, to
#: publish them itself (milliseconds, normally). Short, so that when its worker dies right
#: after the record a redelivery or the relay publishes them within seconds; a recorder still
#: publishing after this may see them published twice, under the same ids (a guarded child
#: drops the second).
RECORDER_LEASE = 10.0

#: A redelivery whose pending sends could not be published, or that found another dispatcher
#: publishing them, comes back after at most this many seconds.
REDISPATCH_RETRY = 5.0


def check_dispatch_lease(lease: object) -> float:
    """``Guard(dispatch_lease=…)`` as seconds: :class:`~taskonce.errors.ConfigError` unless
    a positive number (``manage.py check`` calls it too)."""
    return check_seconds("Guard(dispatch_lease=…)", lease)


class Dispatcher:
    """Publishes recorded sends and marks them dispatched.

    :param store: where the sends are recorded.
    :param sinks: the guard's event sinks.
    :param lease: seconds one dispatcher holds a record's pending sends.
    :param keep_for: the ``keep_for_s`` of the producer outbox's events.
    """

    def __init__(self, store: Store, sinks: Sinks, lease: float, keep_for: float) -> None:
        self.store = store
        self.sinks = sinks
        self.lease = check_dispatch_lease(lease)
        self.keep_for = keep_for
        #: the publisher of each framework's sends (``Guard.register_publisher``)
        self.publishers: dict[str, Publisher] = {}

    def register(self, framework: str, publish: Publisher) -> None:
        """Publish ``framework``'s sends with ``publish`` (replacing an earlier one)."""
        if not isinstance(framework, str) or not framework:
            raise ConfigError("register_publisher: framework must be a non-empty string")
        if not callable(publish):
            raise ConfigError(f"register_publisher: {publish!r} is not callable")
        self.publishers[framework] = publish

    def warn_pending(self, batch: int) -> None:
        """Log a warning when records still have sends pending (after a purge, which keeps
        them): is a relay running?"""
        pending = len(self.store.due_for_relay(0.0, batch).sends)
        if pending:
            logger.warning(
                "%s%d record(s) still have deferred sends pending and are kept, even past their "
                "keep_for, until they are published: is a relay running (taskonce relay)?",
                "at least " if pending >= batch else "",
                pending,
            )

    def dispatch(
        self,
        key: str,
        token: str,
        texts: Sequence[str],
        on_store_error: Callable[[], None] | None = None,
    ) -> bool:
        """Publish ``texts`` in order, then mark them dispatched (fenced by ``token``). False
        when a publish failed or the mark was refused: they stay pending for a redelivery or
        the relay (the children's ids are fixed, so their guard drops a second copy).
        ``on_store_error`` is called when the mark could not reach the store. Sends whose
        receivers are guarded on this store await their receipts (:mod:`taskonce.receipts`),
        written with the mark."""
        published = self.publish_all(key, texts)
        if published is None:
            self.let_go(((key, token),))
            return False
        try:
            return self.store.dispatched(key, token, receipts.awaiting(texts, published))
        except StoreUnavailable:
            logger.warning(
                "sends of %s were published but not marked dispatched; they may be published "
                "again (same ids)",
                key,
            )
            if on_store_error is not None:
                on_store_error()
            return False

    def publish_all(self, key: str, texts: Sequence[str]) -> list[Receipt | None] | None:
        """Publish ``texts`` in order through their frameworks' publishers: each one's
        :class:`~taskonce.handoff.Receipt` (None where nothing is awaited); None at the first
        one that fails (the rest are not tried: order is kept)."""
        found: list[Receipt | None] = []
        with handoff.send_now():  # a publisher must not be captured by an enclosing handler
            for text in texts:
                send = Send.from_json(text)
                publish = self.publishers.get(send.framework)
                if publish is None:
                    logger.error(
                        "no publisher registered for %r sends; %s keeps %d send(s) pending",
                        send.framework,
                        key,
                        len(texts),
                    )
                    return None
                try:
                    receipt = publish(send)
                    # a publisher that answers anything else awaits nothing (the default)
                    found.append(receipt if isinstance(receipt, Receipt) else None)
                except Exception as exc:
                    logger.warning(
                        "publishing deferred send %s of %s failed (%s: %s); it stays pending for "
                        "a redelivery or the relay",
                        send.id,
                        key,
                        type(exc).__name__,
                        exc,
                    )
                    return None
        return found

    def let_go(self, leases: Iterable[tuple[str, str]]) -> None:
        """Release these ``(key, token)`` dispatch leases of sends not published, so that the
        next dispatcher (a redelivery, the relay) may take them at once."""
        for key, token in leases:
            try:
                self.store.take_sends(key, token, 0.0)
            except StoreUnavailable:
                return  # their leases run out instead

    def redispatch(
        self, key: str, on_store_error: Callable[[], None] | None = None
    ) -> tuple[int, float]:
        """A handled message came back with sends pending: publish them. Returns ``(count
        published, 0)``; ``(0, 0)`` when they were published meanwhile; ``(0, seconds)`` when
        another dispatcher holds them or a publish failed: come back after that long.

        :raises StoreUnavailable: the lease could not be taken.
        """
        token = secrets.token_hex(16)
        lease = self.store.take_sends(key, token, self.lease)
        if lease.sends:
            if self.dispatch(key, token, lease.sends, on_store_error):
                return len(lease.sends), 0.0
            return 0, REDISPATCH_RETRY
        if lease.retry_after > 0:
            # Usually the recorder itself, publishing right now: look again soon rather than
            # at the end of its lease.
            return 0, min(lease.retry_after, REDISPATCH_RETRY)
        return 0, 0.0

    def outbox_event(
        self, name: Event, key: str, texts: Sequence[str], reason: str | None = None
    ) -> None:
        """An event of the producer outbox's record ``key``
        (:func:`~taskonce.outbox.outbox_event`)."""
        outbox_event(self.sinks, name, key, texts, self.lease, self.keep_for, reason)

    def relay(self, older_than: float = 10.0, batch: int = 100) -> int:
        """Publish the deferred sends left pending for at least ``older_than`` seconds, and look
        for the receipts that are due (:func:`taskonce.receipts.look`): one store round trip
        when there is nothing to do. How many records this call dispatched or re-sent from
        (:meth:`taskonce.Guard.relay`)."""
        due = self.store.due_for_relay(older_than, batch)
        dispatched = 0
        for key in due.receipts:
            if receipts.look(self, key):
                dispatched += 1
        for key in due.sends:
            token = secrets.token_hex(16)
            lease = self.store.take_sends(key, token, self.lease, older_than)
            if not lease.sends:
                continue  # published meanwhile, or another dispatcher holds it
            if self.dispatch(key, token, lease.sends):
                dispatched += 1
                if key.startswith(OUTBOX_PREFIX):
                    self.outbox_event(Event.SENDS_DISPATCHED, key, lease.sends)
                    continue
                self.sinks.send(
                    make_event(
                        Event.SENDS_DISPATCHED,
                        key=key,
                        lease_s=self.lease,
                        count=len(lease.sends),
                    )
                )
        return dispatched
