"""The outcome's one write: after a handler ran, :meth:`taskonce.Guard.finish` records it here.

The writer is chosen once — the store, or (transactional mode) the store inside the handler's
session, a :class:`~taskonce.stores.base.TransactionalStore` — then one write: complete the
claim (eager) or write the mark (lazy), with the sends the handler made; a store blip is
retried (:func:`final_write`); the transaction is committed after a mark that wrote.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from taskonce.errors import InvalidInput, LeaseLost, StoreUnavailable
from taskonce.events import Event
from taskonce.stores.base import Record, Status, Store, TransactionalStore
from taskonce.ticket import Ticket

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


def write_outcome(
    store: Store,
    ticket: Ticket,
    result: str | None,
    sends: tuple[str, ...],
    token: str,
    hold: float,
    emit: Emit,
) -> bool:
    """Complete the claim (eager) or write the mark (lazy) of ``ticket``, with ``sends``
    pending under the dispatch ``token`` (held ``hold`` seconds), through ``store`` or
    (transactional) the handler's session, then commit. True when it recorded the outcome;
    False when a lazy mark met a live record (a concurrent duplicate; transactional: this
    run's transaction is then rolled back, and the guard decides what it was)."""
    assert ticket.key is not None
    key, policy, session = ticket.key, ticket.policy, ticket.session
    complete: Callable[..., None] = store.complete
    mark: Callable[..., bool] = store.mark
    if session is not None:  # the writer: the store inside the handler's transaction
        assert isinstance(store, TransactionalStore)
        complete, mark = partial(store.complete_in, session), partial(store.mark_in, session)
    if policy.mode == "eager":
        assert ticket.owner is not None
        # A task that sends nothing calls exactly what it did before the hand-off.
        more: tuple[Any, ...] = (sends, hold) if sends else ()
        args = (key, ticket.owner, policy.keep_for, result, *more)
        final_write(store, ticket, lambda: complete(*args))
        wrote = True
    else:
        more = (sends, token, hold) if sends else ()
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
