"""A ticket is settled once: after ``finish`` or ``fail``, another ``fail`` (or ``finish``) does
nothing, so a claim is released at most once and no ``lease_lost`` reports a lease nobody
lost. A transactional run whose commit the handler's own write refuses is settled by
:func:`taskonce.action.after` (claim released, ``RAISE``), the same for every adapter.

The real-worker proofs are ``tests/celery/test_refused_commit.py`` and
``tests/dramatiq/test_refused_commit.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from taskonce import Decision, Delivery, Guard, Policy, current_session
from taskonce.action import Do, after, before
from taskonce.errors import StoreUnavailable
from taskonce.stores import MemoryStore
from taskonce.stores.sql import SQLStore
from tests.helpers import POSTGRES_URL, require_service


class Names(list[str]):
    """An event sink that keeps the events' names."""

    def emit(self, event: Any) -> None:
        self.append(event["event"])


def test_fail_after_finish_does_nothing() -> None:
    events = Names()
    guard = Guard(MemoryStore(), events=[events])
    ticket = guard.begin(Delivery("m1", "q"))
    assert not ticket.settled
    guard.finish(ticket, "done")
    assert ticket.settled
    guard.fail(ticket, RuntimeError("late"))
    assert events == ["claimed", "completed"]
    record = guard.store.get("q:m1")
    assert record is not None and record.status.value == "completed"


def test_fail_twice_releases_once_and_finish_after_fail_records_nothing() -> None:
    events = Names()
    guard = Guard(MemoryStore(), events=[events])
    ticket = guard.begin(Delivery("m1", "q"))
    guard.fail(ticket, RuntimeError("first"))
    assert ticket.settled
    guard.fail(ticket, RuntimeError("second"))
    guard.finish(ticket, "too late")
    assert events == ["claimed", "released"]  # no lease_lost, nothing completed
    assert guard.store.get("q:m1") is None
    assert guard.run("m1", "q", lambda: "again").status == "ran"  # the retry claims anew


def test_a_ticket_that_did_not_run_is_never_settled_by_fail() -> None:
    """A skip, a deferral or an unguarded run holds no claim: fail leaves it as it is."""
    guard = Guard(MemoryStore())
    guard.execute(Delivery("m1", "q"), lambda: None)
    skipped = guard.begin(Delivery("m1", "q"))
    assert skipped.decision is Decision.SKIP
    guard.fail(skipped)
    assert not skipped.settled


@pytest.fixture
def pg() -> Iterator[tuple[SQLStore, str, sa.Engine]]:
    """A PostgreSQL store and an effects table with a unique key checked only at commit."""
    require_service("postgresql")
    suffix = uuid.uuid4().hex[:10]
    store = SQLStore(POSTGRES_URL, table=f"keys_{suffix}")
    effects = f"effects_{suffix}"
    engine = sa.create_engine(POSTGRES_URL)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                f"CREATE TABLE {effects} (ref VARCHAR(64) NOT NULL, "
                f"CONSTRAINT {effects}_once UNIQUE (ref) DEFERRABLE INITIALLY DEFERRED)"
            )
        )
    try:
        yield store, effects, engine
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {effects}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS keys_{suffix}"))
        engine.dispose()
        store.close()


def refs(engine: sa.Engine, effects: str) -> list[str]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text(f"SELECT ref FROM {effects} ORDER BY ref"))]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_refused_commit_is_the_handlers_failure_settled_once(
    pg: tuple[SQLStore, str, sa.Engine], mode: str
) -> None:
    """What the adapters do, step by step: before(), the handler writes a row that a deferred
    unique constraint refuses at COMMIT, after() answers RAISE with the claim released once;
    a later fail() (what the adapters used to call) changes nothing. Once the conflicting row
    is gone, the same message id runs and commits exactly once."""
    store, effects, engine = pg
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {effects} (ref) VALUES ('order-1')"))
    events = Names()
    guard = Guard(store, default=Policy(mode=mode, transactional=True), events=[events])

    action = before(guard, lambda: Delivery("m1", "pay"))
    assert action.do is Do.RUN and action.ticket is not None
    current_session().execute(sa.text(f"INSERT INTO {effects} (ref) VALUES ('order-1')"))
    done = after(guard, action.ticket, None)
    assert done.do is Do.RAISE and done.ran
    assert isinstance(done.error, sa.exc.IntegrityError)
    assert f"{effects}_once" in str(done.error)
    assert action.ticket.settled
    guard.fail(action.ticket, done.error)  # the second release the adapters used to make
    assert events == (["claimed", "released"] if mode == "eager" else [])
    assert refs(engine, effects) == ["order-1"]  # nothing of the run committed
    assert store.get("pay:m1") is None

    with engine.begin() as conn:  # the cause is gone
        conn.execute(sa.text(f"DELETE FROM {effects}"))
    again = before(guard, lambda: Delivery("m1", "pay"))
    assert again.do is Do.RUN and again.ticket is not None
    current_session().execute(sa.text(f"INSERT INTO {effects} (ref) VALUES ('order-1')"))
    assert after(guard, again.ticket, None).do is Do.ACK
    assert refs(engine, effects) == ["order-1"]
    record = store.get("pay:m1")
    assert record is not None and record.status.value == "completed"
    assert "lease_lost" not in events


def test_a_store_failing_at_the_commit_backs_off_released_once(
    pg: tuple[SQLStore, str, sa.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that fails on the store's account (not the handler's) backs off, not counted
    as the handler's failure; the guard releases the claim once, by itself."""
    store, effects, engine = pg
    events = Names()
    guard = Guard(store, default=Policy(transactional=True), events=[events])
    action = before(guard, lambda: Delivery("m1", "pay"))
    assert action.ticket is not None
    session = action.ticket.session
    assert session is not None
    current_session().execute(sa.text(f"INSERT INTO {effects} (ref) VALUES ('order-1')"))

    def commit() -> None:
        raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(session, "commit", commit)
    done = after(guard, action.ticket, None)
    assert done.do is Do.BACK_OFF and isinstance(done.error, StoreUnavailable)
    guard.fail(action.ticket, done.error)
    assert events == ["claimed", "store_error", "released"]
    assert refs(engine, effects) == []
    assert store.get("pay:m1") is None
