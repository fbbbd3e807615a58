"""Sends made before a task replaces itself (Celery's ``self.replace(sig)``): recorded at the
replace, published once the replacement is out.

A replacement carries the replaced task's id, hence its key, so the replaced run cannot record
its outcome under that key: the replacement must be able to claim it. What the replaced run sent
before the replace is part of its effect all the same, so it is captured like any other send and
handed over in four steps:

1. :func:`hand_over` ends the run's capture and records its sends as a record of their own,
   ``replaced:<depth>:<key>`` (:func:`record_key`), written with the store's ``mark`` with the
   sends pending under a fresh dispatch token whose lease lasts ``Guard.recorder_lease`` seconds;
2. it releases the run's claim (eager mode), so the replacement can claim the key;
3. the adapter publishes the replacement;
4. :func:`dispatch` publishes the recorded sends, in order, and marks them dispatched; when the
   replacement could not be published, :func:`withdraw` marks them dispatched without publishing
   them instead: a replace that did not take effect sends nothing.

Ids: the sends keep the ids they got when they were made (the caller's, else derived from the key
and their ordinal). The replacement is delivered one level deeper (``Delivery.replaced``, from
Celery's ``replaced_task_nesting``), and its own sends derive from the key *and* that depth
(:func:`taskonce.handoff.id_base`): the two never collide.

The windows. A run that fails before the replace never reaches step 1: its sends are discarded
like any failed run's. A worker that dies before the record leaves nothing recorded and the claim
held: the message comes back, runs again and replaces again, its sends under the same ids. One
that dies after the record leaves it pending for the relay; a re-run of the same message that
replaces again finds the record (the mark does not write over it) and dispatches it itself after
publishing its replacement. The store unreachable at step 1 (eager or lazy mode): the sends are
published right after the replacement, unrecorded, as :meth:`~taskonce.Guard.finish` does.

In transactional mode the replaced run's database writes are rolled back at the replace, and its
sends with them: they would announce writes that never committed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
from typing import TYPE_CHECKING

from taskonce.errors import StoreUnavailable
from taskonce.events import Event
from taskonce.handoff import end_capture
from taskonce.stores.base import MAX_KEY_LENGTH
from taskonce.ticket import Decision, Ticket, emit_event

if TYPE_CHECKING:
    from taskonce.guard import Guard

logger = logging.getLogger("taskonce")

#: Keys of the records that hold the sends of replaced runs start with this.
REPLACED_PREFIX = "replaced:"


def record_key(key: str, replaced: int = 0) -> str:
    """The key of the record holding the sends a run of ``key`` made before it replaced itself,
    ``replaced`` levels deep (the same on every run of the same message); a key too long for the
    store is shortened to a digest."""
    text = f"{REPLACED_PREFIX}{replaced}:{key}"
    if len(text) <= MAX_KEY_LENGTH:
        return text
    return f"{REPLACED_PREFIX}{replaced}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"


@dataclasses.dataclass(frozen=True)
class Handover:
    """The sends of a replaced run, between :func:`hand_over` and :func:`dispatch`.

    :param ticket: the replaced run's ticket (its claim already released).
    :param key: the record that holds the sends (:func:`record_key`).
    :param texts: the sends' JSON texts, in send order.
    :param token: the dispatch token of the record this call wrote; "" when it wrote none.
    :param stood: a record of an earlier run of the same message already held them.
    """

    ticket: Ticket
    key: str
    texts: tuple[str, ...]
    token: str = ""
    stood: bool = False


def hand_over(guard: Guard, ticket: Ticket) -> Handover | None:
    """End ``ticket``'s run at a replace: record what it sent (step 1 of the module's story),
    then release its claim. None when there is nothing to publish after the replacement: the run
    sent nothing, or (transactional) its sends were rolled back with its writes. Never raises."""
    if ticket.decision is not Decision.RUN or ticket.key is None:
        return None
    capture = ticket.capture
    if capture is None or not capture.texts or ticket.session is not None:
        guard.fail(ticket)  # discards the sends (an event), rolls back, releases
        return None
    texts = end_capture(ticket)
    key = record_key(ticket.key, ticket.delivery.replaced)
    token = secrets.token_hex(16)
    handover = Handover(ticket, key, texts)
    try:
        if guard.store.mark(
            key, ticket.policy.keep_for, None, None, texts, token, guard.recorder_lease
        ):
            handover = Handover(ticket, key, texts, token=token)
            emit_event(guard.sinks, Event.SENDS_DEFERRED, ticket, count=len(texts))
        else:  # an earlier run of this message recorded the same sends (the same ids)
            handover = Handover(ticket, key, texts, stood=True)
            emit_event(guard.sinks, Event.SENDS_DISCARDED, ticket, count=len(texts))
    except StoreUnavailable:
        logger.warning(
            "could not record the sends %s made before it was replaced; they are published "
            "after the replacement, unrecorded",
            ticket.key,
        )
        emit_event(guard.sinks, Event.STORE_ERROR, ticket, duration=True)
    guard.fail(ticket)  # the capture has ended: only the claim is released
    return handover


def dispatch(guard: Guard, handover: Handover) -> None:
    """The replacement is out: publish the replaced run's sends and mark them dispatched
    (step 4). What cannot be published stays pending for the relay. Never raises."""
    ticket, key, texts = handover.ticket, handover.key, handover.texts

    def store_error() -> None:
        emit_event(guard.sinks, Event.STORE_ERROR, ticket)

    try:
        if handover.token:
            if guard.dispatcher.dispatch(key, handover.token, texts, store_error):
                emit_event(guard.sinks, Event.SENDS_DISPATCHED, ticket, count=len(texts))
        elif handover.stood:
            published, _ = guard.dispatcher.redispatch(key, store_error)
            if published:
                emit_event(guard.sinks, Event.SENDS_REDISPATCHED, ticket, count=published)
        elif guard.dispatcher.publish_all(key, texts) is not None:  # unrecorded: at once
            emit_event(guard.sinks, Event.SENDS_DISPATCHED, ticket, count=len(texts))
    except StoreUnavailable:
        logger.warning("sends of %s left pending for the relay (store unreachable)", key)
        store_error()


def withdraw(guard: Guard, handover: Handover) -> None:
    """The replacement could not be published: the replace did not take effect, so the
    replaced run's recorded sends are marked dispatched without being published. Never
    raises."""
    if not handover.token:
        return
    try:
        guard.store.dispatched(handover.key, handover.token)
    except StoreUnavailable:
        logger.error(
            "the replacement of %s was not published, and its earlier sends could not be "
            "withdrawn (store unreachable): the relay may publish them",
            handover.ticket.key,
        )
        emit_event(guard.sinks, Event.STORE_ERROR, handover.ticket)
        return
    emit_event(guard.sinks, Event.SENDS_DISCARDED, handover.ticket, count=len(handover.texts))


__all__ = ["REPLACED_PREFIX", "Handover", "dispatch", "hand_over", "record_key", "withdraw"]
