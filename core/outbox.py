"""The producer outbox: send from a web request (or any code outside a guarded handler) exactly
when its database transaction commits.

``with taskonce.send_on_commit(session): charge.delay(order.id)`` captures what the block sends
with the hand-off's capture (:mod:`taskonce.handoff`): each send gets its message id at once and
is written, as a record ``outbox:<uuid>`` with the send pending, in the store's table *through
the caller's transaction*. The business rows and the sends commit together or not at all. After
the commit the guard publishes them and marks them dispatched; a rollback discards them. A
process that dies between the commit and the publish leaves committed records that the relay
(:meth:`taskonce.Guard.relay`, ``taskonce relay``) publishes, under the same ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from taskonce import handoff
from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.events import Event, Sinks, make_event
from taskonce.handoff import Capture, Send
from taskonce.stores.transactional import TransactionalStore

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    from taskonce.dispatch import Dispatcher
    from taskonce.guard import Guard

logger = logging.getLogger("taskonce")

#: The guards that frameworks registered publishers with, in this process: where
#: :func:`taskonce.send_on_commit` finds its guard when none is named.
_PUBLISHING: weakref.WeakSet[Guard] = weakref.WeakSet()


def publishing_guards() -> list[Guard]:
    """The live guards of this process that a framework registered a publisher with."""
    return list(_PUBLISHING)


def add_publishing_guard(guard: Guard) -> None:
    """Count ``guard`` among :func:`publishing_guards` (held weakly: a dropped guard leaves)."""
    _PUBLISHING.add(guard)


#: Keys of the producer outbox's records (:func:`taskonce.send_on_commit`) start with this.
OUTBOX_PREFIX = "outbox:"


@dataclasses.dataclass(frozen=True)
class OutboxRow:
    """One send of the producer outbox, written in an application's transaction.

    :param key: its record's key (``outbox:<uuid>``).
    :param token: the dispatch token it was written with (holding its dispatch lease).
    :param text: the send's JSON text.
    :param verify: read the record back before publishing (it was written inside a savepoint
        that may have been rolled back).
    """

    key: str
    token: str
    text: str
    verify: bool = False


def outbox_event(
    sinks: Sinks,
    name: Event,
    key: str,
    texts: Sequence[str],
    lease_s: float,
    keep_for_s: float,
    reason: str | None = None,
) -> None:
    """A producer's event: no incoming message, so ``key`` is None; ``message_id`` names the
    outbox record, ``framework`` the sends' framework (one event per framework)."""
    if sinks.quiet(name):
        return
    counts: dict[str, int] = {}
    for text in texts:
        framework = Send.from_json(text).framework
        counts[framework] = counts.get(framework, 0) + 1
    for framework, count in counts.items():
        sinks.send(
            make_event(
                name,
                message_id=key,
                framework=framework,
                lease_s=lease_s,
                keep_for_s=keep_for_s,
                count=count,
                reason=reason,
            )
        )


def dispatch_committed(dispatcher: Dispatcher, rows: Sequence[OutboxRow]) -> int:
    """Publish the sends of outbox records whose transaction just committed, in order, and
    mark each dispatched; the number published. Never raises: a send that could not be
    published (broker down, store blip) stays pending for the relay, whose lease on it is let
    go at once."""
    for row in rows:
        dispatcher.outbox_event(Event.SENDS_DEFERRED, row.key, (row.text,))
    published = 0
    for index, row in enumerate(rows):
        try:
            if (
                row.verify
                and not dispatcher.store.take_sends(row.key, row.token, dispatcher.lease).sends
            ):
                dispatcher.outbox_event(Event.SENDS_DISCARDED, row.key, (row.text,))
                continue  # rolled back with its savepoint
        except StoreUnavailable:
            logger.warning("could not read outbox record %s back; the relay will", row.key)
            dispatcher.let_go((row.key, row.token) for row in rows[index + 1 :])
            break
        if not dispatcher.dispatch(row.key, row.token, (row.text,)):
            dispatcher.let_go((row.key, row.token) for row in rows[index + 1 :])
            break
        published += 1
        dispatcher.outbox_event(Event.SENDS_DISPATCHED, row.key, (row.text,))
    return published


def discard_uncommitted(dispatcher: Dispatcher, rows: Sequence[OutboxRow]) -> None:
    """Forget outbox records whose transaction rolled back (nothing of them was stored)."""
    for row in rows:
        dispatcher.outbox_event(Event.SENDS_DISCARDED, row.key, (row.text,))


#: Where a Session keeps its outbox state (``Session.info``).
_INFO_KEY = "taskonce_outbox"

B = TypeVar("B")


class _Outbox:
    """The sends written in one Session's (or one block's Connection's) current transaction,
    waiting for its commit."""

    __slots__ = ("guard", "rows", "store")

    def __init__(self, guard: Guard, store: TransactionalStore) -> None:
        self.guard = guard
        self.store = store
        self.rows: list[OutboxRow] = []

    def write(self, connection: Connection, text: str, nested: bool) -> None:
        # A savepoint may still be rolled back: such a row is read back before publishing.
        self.rows.append(write_row(self.guard, self.store, connection, text, verify=nested))

    def committed(self) -> None:
        rows, self.rows = self.rows, []
        if rows:
            self.guard.dispatch_committed(rows)

    def discarded(self) -> None:
        rows, self.rows = self.rows, []
        if rows:
            self.guard.discard_uncommitted(rows)


def write_row(
    guard: Guard, store: TransactionalStore, connection: Any, text: str, *, verify: bool = False
) -> OutboxRow:
    """Write one send (its JSON ``text``) as a new outbox record through ``connection``'s
    transaction, not committed here; the row to publish after the commit."""
    row = OutboxRow(
        key=f"{OUTBOX_PREFIX}{uuid.uuid4().hex}",
        token=secrets.token_hex(16),
        text=text,
        verify=verify,
    )
    store.record_sends_in(
        connection, row.key, (text,), row.token, guard.default.keep_for, guard.recorder_lease
    )
    return row


@contextlib.contextmanager
def capturing_sends(guard: Guard, write: Callable[[str], None]) -> Iterator[None]:
    """Capture what the block sends (the hand-off's capture) and hand each send's JSON text to
    ``write`` as it is made; a send ``write`` refuses is not captured."""
    with handoff.capturing(_OutboxCapture(guard, write)):
        yield


class _OutboxCapture(Capture):
    """The hand-off's capture, writing each send into the caller's transaction as it is made."""

    __slots__ = ("_test", "_write")

    def __init__(self, guard: Guard, write: Any) -> None:
        super().__init__(
            f"{OUTBOX_PREFIX}{uuid.uuid4().hex}",
            "",
            guard.send_limit,
            guard.default.confirm_within,
        )
        self._write = write
        # Inside a test's captured_sends(): its capture takes the sends (nothing is written, so
        # nothing is published at the commit).
        outer = handoff.current()
        self._test = outer if outer is not None and outer.for_test else None

    def add(
        self,
        framework: str,
        body: dict[str, Any],
        message_id: str | None = None,
        *,
        name: str | None = None,
        size: int | None = None,
    ) -> str:
        if self._test is not None:
            return self._test.add(framework, body, message_id, name=name, size=size)
        before = self.size
        send_id = super().add(framework, body, message_id, name=name, size=size)
        try:
            self._write(self.texts[-1])
        except BaseException:
            self.sends.pop()
            self.texts.pop()
            self.size = before
            raise
        return send_id

    def _sender(self) -> str:
        return "taskonce.send_on_commit()"


@contextlib.contextmanager
def send_on_commit(
    bind: B,
    *,
    guard: Guard | None = None,
    on_commit: Callable[[Callable[[], None]], Any] | None = None,
) -> Iterator[B]:
    """``with taskonce.send_on_commit(session): charge.delay(order.id)`` — what the block sends
    (Celery ``delay``/``apply_async``/``send_task``, Dramatiq ``send``) is published when
    ``session``'s transaction commits, and never if it rolls back.

    Each send is written, when it is made, as a row in the store's table through ``bind``'s
    transaction: it commits or rolls back with your own rows. After the commit the guard
    publishes the sends (in order, under the ids they got when made) and marks them dispatched;
    if the process dies first, or the broker is down, the relay (``taskonce relay``,
    :meth:`Guard.start_relay`, or a worker's own relay) publishes them later under the same ids,
    so guard the receiving tasks (a second copy is then dropped).

    :param bind: a SQLAlchemy ``Session`` (or ``scoped_session``, e.g. Flask-SQLAlchemy's
        ``db.session``), committed by you inside or after the block; or a ``Connection`` not
        yet in a transaction, in which case the block is the transaction: it begins it, commits
        it at the end (rolls it back on an exception), then publishes.
    :param guard: the guard whose store, publishers and events to use; default: the one guard
        of this process that a framework registered (``setup(app, guard)`` for Celery,
        ``IdempotencyMiddleware(guard)`` for Dramatiq).
    :param on_commit: for a ``Connection`` whose transaction someone else commits (Django's
        ``transaction.on_commit``): the block writes the sends in that transaction and hands
        ``on_commit`` the function that publishes them, to call after the commit (and to drop
        on a rollback); if it is never called, the relay publishes what committed.
    :raises ConfigError: no session, a store without SQL transactions (Redis, memory), a
        session on another database than the store's, no guard, or no framework registered.
    :raises SendRefused: (from the send itself) arguments JSON cannot store; nothing is written.
    """
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session, scoped_session

    target: Any = bind() if isinstance(bind, scoped_session) else bind
    if isinstance(target, Session):
        with _in_session(target, guard, on_commit):
            yield bind
        return
    if isinstance(target, Connection):
        with _on_connection(target, guard, on_commit):
            yield bind
        return
    raise ConfigError(
        "send_on_commit() needs the SQLAlchemy Session or Connection whose transaction the sends "
        f"share, not {type(bind).__name__}"
    )


@contextlib.contextmanager
def _in_session(
    target: Session, guard: Guard | None, on_commit: Callable[[Callable[[], None]], Any] | None
) -> Iterator[None]:
    """:func:`send_on_commit` on a Session: the rows go out at its commit (``_listen``)."""
    if on_commit is not None:
        raise ConfigError(
            "send_on_commit(session, on_commit=…): a Session's commit is seen by taskonce "
            "itself; on_commit= is for a Connection whose transaction someone else commits"
        )
    chosen = publishing_guard(guard)
    store = _sql_store(chosen)
    _check_bind(store, target)
    _listen()
    state = target.info.get(_INFO_KEY)
    if not isinstance(state, _Outbox) or (not state.rows and state.guard is not chosen):
        state = target.info[_INFO_KEY] = _Outbox(chosen, store)
    elif state.guard is not chosen:
        raise ConfigError(
            "send_on_commit: this session's transaction already holds sends of another guard"
        )
    session = target
    outbox = state

    def write(text: str) -> None:
        outbox.write(session.connection(), text, session.in_nested_transaction())

    with handoff.capturing(_OutboxCapture(chosen, write)):
        yield


@contextlib.contextmanager
def _on_connection(
    target: Connection, guard: Guard | None, on_commit: Callable[[Callable[[], None]], Any] | None
) -> Iterator[None]:
    """:func:`send_on_commit` on a Connection: the block is the transaction, or (``on_commit``)
    someone else's transaction commits it."""
    chosen = publishing_guard(guard)
    store = _sql_store(chosen)
    _check_bind(store, target)
    if on_commit is not None:
        if not callable(on_commit):
            raise ConfigError(f"send_on_commit(on_commit={on_commit!r}) must be callable")
        hooked = _Outbox(chosen, store)
        joined = target

        def write_joined(text: str) -> None:
            hooked.write(joined, text, joined.in_nested_transaction())

        with handoff.capturing(_OutboxCapture(chosen, write_joined)):
            yield
        if hooked.rows:
            on_commit(hooked.committed)
        return
    if target.in_transaction():
        raise ConfigError(
            "send_on_commit(connection): the connection is already in a transaction, whose "
            "commit taskonce cannot see; enter the block before the connection's first "
            "statement (the block then begins and commits the transaction), or pass a Session"
        )
    connection = target
    outbox = _Outbox(chosen, store)

    def write_through(text: str) -> None:
        outbox.write(connection, text, connection.in_nested_transaction())

    transaction = connection.begin()
    try:
        with handoff.capturing(_OutboxCapture(chosen, write_through)):
            yield
        if transaction.is_active:
            transaction.commit()
        else:  # committed or rolled back inside the block: publish only what is there
            outbox.rows = [dataclasses.replace(row, verify=True) for row in outbox.rows]
    except BaseException:
        try:
            if transaction.is_active:
                transaction.rollback()
        finally:
            outbox.discarded()
        raise
    outbox.committed()


def publishing_guard(guard: Guard | None) -> Guard:
    """``guard`` (checked), or the one guard of this process a framework registered.

    :raises ConfigError: not a guard, none or several registered, or no framework registered
        with it (nothing could publish)."""
    from taskonce.guard import Guard  # the guard imports this module

    if guard is not None:
        if not isinstance(guard, Guard):
            raise ConfigError(
                f"send_on_commit(guard=…) must be a taskonce.Guard, not {type(guard).__name__}"
            )
        chosen = guard
    else:
        found = publishing_guards()
        if len(found) != 1:
            raise ConfigError(
                "send_on_commit() found "
                + ("no guard" if not found else f"{len(found)} guards")
                + " with a framework registered in this process: pass guard=…, or register "
                "one (Celery: setup(app, guard); Dramatiq: IdempotencyMiddleware(guard))"
            )
        chosen = found[0]
    if not chosen.frameworks():
        raise ConfigError(
            "send_on_commit(): no framework is registered with this guard, so nothing could "
            "publish the sends (Celery: setup(app, guard); Dramatiq: "
            "broker.add_middleware(IdempotencyMiddleware(guard)))"
        )
    return chosen


def _sql_store(guard: Guard) -> TransactionalStore:
    store = guard.store
    if not isinstance(store, TransactionalStore):
        raise ConfigError(
            f"send_on_commit() needs an SQL store; {store.describe()} has no database "
            "transaction to share with your rows"
        )
    return store


def _check_bind(store: TransactionalStore, target: Session | Connection) -> None:
    from sqlalchemy.engine import Connection
    from sqlalchemy.exc import UnboundExecutionError

    if isinstance(target, Connection):
        store.check_shared(target, target.in_transaction())
        return
    try:
        bind = target.get_bind()
    except UnboundExecutionError:
        raise ConfigError(
            "send_on_commit(session): the session is bound to no engine or connection"
        ) from None
    store.check_shared(bind, target.in_transaction())


_LISTENING = threading.Lock()
_listening = False


def _listen() -> None:
    """Follow every Session's transactions (once per process): a commit publishes the outbox
    state's rows, a rollback or close without commit discards them."""
    global _listening
    if _listening:
        return
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    with _LISTENING:
        if not _listening:
            event.listen(Session, "after_commit", _after_commit)
            event.listen(Session, "after_rollback", _after_rollback)
            event.listen(Session, "after_transaction_end", _after_transaction_end)
            _listening = True


def _after_commit(session: Session) -> None:
    state = session.info.get(_INFO_KEY)
    if state is None or not state.rows or session.in_nested_transaction():
        return  # a released savepoint: its rows commit (or not) with the enclosing transaction
    try:
        state.committed()
    except Exception:  # never turn a done commit into an error; the relay has the rows
        logger.exception("publishing the sends of a committed transaction failed")


def _after_rollback(session: Session) -> None:
    state = session.info.get(_INFO_KEY)
    if state is not None and state.rows:
        # A savepoint's rollback removes the rows written inside it only: read every row back
        # before publishing it. The outermost rollback discards them all (transaction end).
        state.rows = [dataclasses.replace(row, verify=True) for row in state.rows]


def _after_transaction_end(session: Session, transaction: Any) -> None:
    if transaction.parent is not None:
        return
    state = session.info.get(_INFO_KEY)
    if state is not None and state.rows:
        state.discarded()  # ended without its commit: rolled back or closed


__all__ = [
    "OUTBOX_PREFIX",
    "OutboxRow",
    "add_publishing_guard",
    "capturing_sends",
    "publishing_guard",
    "send_on_commit",
    "write_row",
]
