"""Crash-loop quarantine: a message whose handler kills its worker every time (an OOM kill, a
segfaulting C extension) would otherwise be taken over and run again for ever.

Each take-over of a key from a dead, silent or expired owner is counted in the key's record
(:attr:`~taskonce.stores.base.Record.crashes`, by the store's take-over itself). A take-over
that brings the count past ``Policy.crash_limit`` does not run the handler: :func:`check`
turns the claim into a quarantined record (fenced by the new owner token, kept ``keep_for``),
emits ``quarantined`` and raises :class:`~taskonce.errors.Quarantined`, which every adapter
dead-letters (:mod:`taskonce.action`: ``REJECT``). Later copies of the key are skipped
(``duplicate_skipped``, reason ``quarantined``) until ``taskonce release KEY`` deletes the
record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from taskonce.errors import LeaseLost, Quarantined
from taskonce.events import Event
from taskonce.stores.base import Record, Status, Store
from taskonce.ticket import Ticket

logger = logging.getLogger("taskonce")


def check(
    store: Store, ticket: Ticket, owner: str, emit: Callable[..., None], reason: str | None
) -> None:
    """After ``owner`` claimed ``ticket``'s key or took it over (the take-over's count is
    ``ticket.crashes``, 0 for a claim): nothing when the count is within ``crash_limit`` (or
    the limit is 0); else quarantine the key and raise :class:`Quarantined`. A store outage on
    the way raises :class:`~taskonce.errors.StoreUnavailable` (the claim stays ours until its
    lease ends, and the next delivery counts one take-over more)."""
    limit, crashes = ticket.policy.crash_limit, ticket.crashes
    if not limit or crashes <= limit:
        return
    assert ticket.key is not None
    try:
        store.quarantine(ticket.key, owner, ticket.policy.keep_for)
    except LeaseLost:
        # Taken over from us in between: that delivery counts one crash more and quarantines.
        logger.debug("quarantine of %s: the claim changed hands first", ticket.key)
    ticket.owner = None
    # Logged as a warning by the events' logging; the adapters log the refusal (the error
    # names the release command).
    emit(Event.QUARANTINED, ticket, reason=reason, count=crashes)
    raise Quarantined(ticket.key, crashes)


def skip_reason(record: Record) -> str | None:
    """The ``reason`` of the ``duplicate_skipped`` of a delivery that found ``record``:
    ``quarantined`` for a quarantined key (skipped until released), else none."""
    return "quarantined" if record.status is Status.QUARANTINED else None


__all__ = ["check", "skip_reason"]
