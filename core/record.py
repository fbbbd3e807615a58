"""A run's outcome: after a handler ran, :meth:`taskonce.Guard.finish` records it here
(:func:`record_run`), and :meth:`~taskonce.Guard.fail` undoes it (:func:`undo_run`).

The writer is chosen once — the store, or (transactional mode) the store inside the handler's
session, a :class:`~taskonce.stores.transactional.TransactionalStore` — then one write: complete the
claim (eager) or write the mark (lazy), with the sends the handler made; a store blip is
retried (:func:`final_write`); the transaction is committed after a mark that wrote. Then the
sends are published (:mod:`taskonce.dispatch`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from taskonce import receipts
from taskonce.errors import InvalidInput, LeaseLost, StoreUnavailable
from taskonce.events import Event
from taskonce.handoff import end_capture
from taskonce.session import close_session
from taskonce.stores.base import Record, Status, Store
from taskonce.stores.transactional import TransactionalStore
from taskonce.ticket import Ticket

if TYPE_CHECKING:
    from taskonce.dispatch import Dispatcher

logger = logging.getLogger("taskonce")

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: Attempts at the final write (complete/mark) when the store blips after the handler ran.
FINAL_WRITE_ATTEMPTS = 3

#: ``emit(event, ticket, duration=True)``: the guard's event of a recorded outcome.
Emit = Callable[..., None]

#: The attribute marking an error at a transactional commit as the handler's own.
_HANDLERS_OWN = "_taskonce_handlers_own"


def handlers_own(exc: E) -> E:
    """Mark ``exc``, raised while committing a handler's transaction, as the handler's own
    failure (its constraint checked at commit; Django's rollback-only transaction), not
    taskonce's: the framework's failure path applies, as if the handler had raised it."""
    setattr(exc, _HANDLERS_OWN, True)
    return exc


def is_handlers_own(exc: BaseException) -> bool:
    """Whether :func:`handlers_own` marked ``exc``."""
    return getattr(exc, _HANDLERS_OWN, False) is True


@dataclasses.dataclass(frozen=True)
class OutcomeWriter:
    """What recording a run's outcome needs of its guard."""

    store: Store
    dispatcher: Dispatcher
    #: seconds the recorder of sends holds their dispatch lease (``Guard.recorder_lease``)
    recorder_lease: float
    emit: Emit


def record_run(writer: OutcomeWriter, ticket: Ticket, result: Any) -> Record | None:
    """Record ``ticket``'s successful run (:meth:`taskonce.Guard.finish`), then publish what
    its handler sent.

    Returns None, or the live record a lazy transactional run's mark met: the run was rolled
    back, and the guard decides what it was, as a look-up would. Raises :class:`LeaseLost`,
    a commit's error (the run rolled back and its claim released), and :class:`InvalidInput`
    (after recording) for a result ``store_result`` cannot keep.
    """
    sends = end_capture(ticket)
    encoded, encode_error = (
        encode_result(result, ticket) if ticket.policy.store_result else (None, None)
    )
    # The sends' dispatch token: the claim's owner token (eager), a fresh one (lazy).
    token = ticket.owner or (secrets.token_hex(16) if sends else "")
    transactional = ticket.session is not None
    recorded = _write(writer, ticket, encoded, sends, token)
    if transactional and not recorded:
        try:
            return winning_record(writer.store, ticket, writer.emit)
        except StoreUnavailable:
            undo_run(writer.store, ticket, writer.emit)  # it cannot be decided: it must come again
            raise
    if sends:
        _dispatch(writer, ticket, token, sends)
    if encode_error is not None:
        raise encode_error
    return None


def _write(
    writer: OutcomeWriter,
    ticket: Ticket,
    encoded: str | None,
    sends: tuple[str, ...],
    token: str,
) -> bool:
    """:func:`write_outcome`, and what its failure leaves: the session closed, unpublished
    sends reported discarded, a rolled-back run's claim released."""
    emit = writer.emit
    recorded = rolled_back = False
    try:
        recorded = write_outcome(writer, ticket, encoded, sends, token)
    except LeaseLost:
        report_lost(ticket, emit)
        raise
    except BaseException as exc:
        if ticket.session is not None:
            # Rolled back, nothing of this run stands: its commit refused on the handler's
            # account (Guard.finish), the store failing, or taskonce failing. The claim is
            # released below, once: the run must be able to run again.
            rolled_back = True
            if isinstance(exc, StoreUnavailable):
                emit(Event.STORE_ERROR, ticket, duration=True)
            raise
        if not isinstance(exc, Exception):
            raise
        emit(Event.STORE_ERROR, ticket, duration=True)
        # Its effects stand, its outcome unrecorded: its messages leave now, best effort (a
        # redelivery that runs it again sends them under the same ids).
        recorded = bool(sends) and _publish_unrecorded(writer, ticket, sends)
        raise
    finally:
        close_session(ticket)
        if sends and not recorded:
            emit(Event.SENDS_DISCARDED, ticket, count=len(sends))
        if rolled_back:
            undo_run(writer.store, ticket, emit)
    return recorded


def _publish_unrecorded(writer: OutcomeWriter, ticket: Ticket, sends: tuple[str, ...]) -> bool:
    assert ticket.key is not None
    if writer.dispatcher.publish_all(ticket.key, sends) is None:
        return False
    writer.emit(Event.SENDS_DISPATCHED, ticket, count=len(sends))
    return True


def _dispatch(writer: OutcomeWriter, ticket: Ticket, token: str, sends: tuple[str, ...]) -> None:
    assert ticket.key is not None
    emit = writer.emit
    emit(Event.SENDS_DEFERRED, ticket, count=len(sends))
    if writer.dispatcher.dispatch(
        ticket.key, token, sends, lambda: emit(Event.STORE_ERROR, ticket)
    ):
        emit(Event.SENDS_DISPATCHED, ticket, count=len(sends))


def undo_run(store: Store, ticket: Ticket, emit: Emit) -> None:
    """The run failed (or was rolled back): release its claim so a retry can claim the key
    again, and note the failed delivery for its sender's receipt."""
    release_claim(store, ticket, emit)
    receipts.note_failure(store, ticket.key, ticket.policy.keep_for)


def release_claim(store: Store, ticket: Ticket, emit: Emit) -> None:
    """Release an eager run's claim so that a retry can claim the key again."""
    if ticket.policy.mode != "eager" or ticket.owner is None:
        return
    assert ticket.key is not None
    try:
        store.release(ticket.key, ticket.owner)
    except LeaseLost:
        report_lost(ticket, emit)
    except StoreUnavailable:
        logger.warning("could not release %s; its lease will run out instead", ticket.key)
        emit(Event.STORE_ERROR, ticket, duration=True)
    else:
        emit(Event.RELEASED, ticket, duration=True)


def report_lost(ticket: Ticket, emit: Emit) -> None:
    """Another delivery took ``ticket``'s claim over: say so once (``lease_lost``)."""
    if not ticket.lost:
        ticket.lost = True
        emit(Event.LEASE_LOST, ticket, duration=True)


def write_outcome(
    writer: OutcomeWriter,
    ticket: Ticket,
    result: str | None,
    sends: tuple[str, ...],
    token: str,
) -> bool:
    """Complete the claim (eager) or write the mark (lazy) of ``ticket``, with ``sends``
    pending under the dispatch ``token`` (its lease held ``writer.recorder_lease`` seconds),
    through the store or (transactional) the handler's session, then commit. True when it
    recorded the outcome; False when a lazy mark met a live record (a concurrent duplicate;
    transactional: this run's transaction is then rolled back, and the guard decides what it
    was)."""
    assert ticket.key is not None
    store, emit, lease = writer.store, writer.emit, writer.recorder_lease
    key, policy, session = ticket.key, ticket.policy, ticket.session
    complete: Callable[..., None] = store.complete
    mark: Callable[..., bool] = store.mark
    if session is not None:  # the writer: the store inside the handler's transaction
        assert isinstance(store, TransactionalStore)
        complete, mark = partial(store.complete_in, session), partial(store.mark_in, session)
    if policy.mode == "eager":
        assert ticket.owner is not None
        # A task that sends nothing calls exactly what it did before the hand-off.
        more: tuple[Any, ...] = (sends, lease) if sends else ()
        args = (key, ticket.owner, policy.keep_for, result, *more)
        final_write(store, ticket, lambda: complete(*args))
        wrote = True
    else:
        more = (sends, token, lease) if sends else ()
        args = (key, policy.keep_for, ticket.fingerprint, result, *more)
        wrote = bool(final_write(store, ticket, lambda: mark(*args)))
    if session is not None and wrote:
        commit(ticket)
    if policy.mode == "eager":
        emit(Event.COMPLETED, ticket, duration=True)
    elif session is None or wrote:
        # A transactional run that loses at its mark left no effect: it is decided like the
        # duplicate it is. Outside a transaction both runs stand.
        emit(Event.MARKED if wrote else Event.CONCURRENT_DUPLICATE, ticket, duration=True)
    return wrote


def winning_record(store: Store, ticket: Ticket, emit: Emit) -> Record:
    """The record that rolled ``ticket``'s transactional run back: its mark met a live record
    of the key (``check_first=False``, or a concurrent copy that passed the look-up too).

    :raises StoreUnavailable: it cannot be read, or it is gone (released or purged since):
        nothing of this run was committed, so the message must come again.
    """
    assert ticket.key is not None
    try:
        record = store.get(ticket.key)
    except StoreUnavailable:
        emit(Event.STORE_ERROR, ticket, duration=True)
        raise
    if record is None:
        emit(Event.STORE_ERROR, ticket, duration=True)
        raise StoreUnavailable(
            f"the record of {ticket.key!r} that rolled this run back is gone; run it again"
        )
    return record


def final_write(store: Store, ticket: Ticket, write: Callable[[], T]) -> T:
    """``write()``, tried again after a store blip. The handler has run: a passing blip must
    not turn success into a re-run. A retry after a timed-out write cannot tell "my first
    write landed" from "someone else's did" by the write's answer alone, so it asks the store
    what is recorded."""
    assert ticket.key is not None
    for attempt in range(FINAL_WRITE_ATTEMPTS):
        try:
            answer = write()
        except StoreUnavailable:
            if attempt == FINAL_WRITE_ATTEMPTS - 1 or ticket.session is not None:
                raise
            time.sleep(0.2 * (attempt + 1))
            continue
        except LeaseLost:
            if attempt == 0 or not _landed(store, ticket):
                raise
            return True  # type: ignore[return-value]
        if answer is False and attempt > 0 and _landed(store, ticket):
            return True  # type: ignore[return-value]
        return answer
    raise AssertionError("unreachable")


def _landed(store: Store, ticket: Ticket) -> bool:
    assert ticket.key is not None
    record = store.get(ticket.key)
    return (
        record is not None
        and record.status is Status.COMPLETED
        and record.fingerprint == ticket.fingerprint
    )


def commit(ticket: Ticket) -> None:
    """Commit the handler's transaction. A mark that meets the key shows at its insert
    (which inserts only when absent), never here: an integrity error at the commit is the
    handler's own (a constraint checked at commit) and is raised as its failure, after
    rolling back."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    assert ticket.session is not None
    try:
        ticket.session.commit()
    except IntegrityError as exc:
        ticket.session.rollback()
        handlers_own(exc)
        raise
    except OperationalError as exc:
        ticket.session.rollback()
        raise StoreUnavailable(f"commit of {ticket.key!r} failed: {exc.orig}") from exc


def encode_result(result: Any, ticket: Ticket) -> tuple[str | None, InvalidInput | None]:
    """``result`` as JSON text to store, or the error to raise after recording without it."""
    try:
        return json.dumps(result, separators=(",", ":"), allow_nan=False), None
    except (TypeError, ValueError) as exc:
        return None, InvalidInput(
            f"result of task {ticket.delivery.task!r} for key {ticket.key!r} is not "
            f"JSON-serialisable ({exc}); store_result=True keeps JSON only. The key was recorded "
            "as handled without a result."
        )


def decode_result(text: str | None) -> Any:
    """A stored result, decoded."""
    return None if text is None else json.loads(text)
