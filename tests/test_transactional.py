"""Transactional mode on PostgreSQL and SQLite: the handler's rows and the mark commit together."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from taskonce import Decision, Delivery, Guard, Policy, TaskonceError, current_session
from taskonce.stores.sql import SQLStore
from tests.helpers import POSTGRES_URL, require_service


@pytest.fixture(params=["postgresql", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SQLStore, str]]:
    suffix = uuid.uuid4().hex[:10]
    if request.param == "postgresql":
        require_service("postgresql")
        url = POSTGRES_URL
    else:
        url = f"sqlite:///{tmp_path}/tx.db"
    store = SQLStore(url, table=f"keys_{suffix}")
    effects = f"effects_{suffix}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {effects} (key VARCHAR(255) NOT NULL, note TEXT)"))
    try:
        yield store, effects
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {effects}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS keys_{suffix}"))
        engine.dispose()
        store.close()


def rows(store: SQLStore, effects: str) -> list[tuple[Any, ...]]:
    with store._engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(f"SELECT key, note FROM {effects}"))]


class Names(list[str]):
    """An event sink that keeps the events' names."""

    def emit(self, event: Any) -> None:
        self.append(event["event"])


def write_effect(effects: str, key: str, note: str = "") -> None:
    current_session().execute(
        sa.text(f"INSERT INTO {effects} (key, note) VALUES (:k, :n)"), {"k": key, "n": note}
    )


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_success_commits_the_row_and_the_mark_together(db: tuple[SQLStore, str], mode: str) -> None:
    store, effects = db
    guard = Guard(store, default=Policy(mode=mode, transactional=True))
    assert guard.run("m1", "pay", write_effect, effects, "m1").status == "ran"
    assert guard.run("m1", "pay", write_effect, effects, "m1").status == "skipped"
    assert rows(store, effects) == [("m1", "")]
    record = store.get("pay:m1")
    assert record is not None and record.status.value == "completed"


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_handler_that_raises_leaves_neither_row_nor_mark(
    db: tuple[SQLStore, str], mode: str
) -> None:
    store, effects = db
    guard = Guard(store, default=Policy(mode=mode, transactional=True))

    def write_then_fail(key: str) -> None:
        write_effect(effects, key)
        raise RuntimeError("payment provider said no")

    with pytest.raises(RuntimeError, match="provider said no"):
        guard.run("m1", "pay", write_then_fail, "m1")
    assert rows(store, effects) == []
    assert store.get("pay:m1") is None
    # the retry is not blocked, and commits exactly once
    assert guard.run("m1", "pay", write_effect, effects, "m1").status == "ran"
    assert rows(store, effects) == [("m1", "")]


def test_two_lazy_deliveries_that_both_ran_leave_one_row_and_one_run(
    db: tuple[SQLStore, str],
) -> None:
    """Both copies pass the look-up and run; the one that marks second is rolled back and is
    then the duplicate it is (as with check_first=False): skipped, the first run's result
    kept, and no ``concurrent_duplicate`` (the audit's leak) for a run that left no effect."""
    store, effects = db
    events = Names()
    guard = Guard(store, default=Policy(mode="lazy", transactional=True), events=[events])
    first = guard.begin(Delivery("m1", "pay"))
    second = guard.begin(Delivery("m1", "pay"))
    assert first.decision is second.decision is Decision.RUN  # both passed the check
    write_effect(effects, "m1", "second")  # the current session is the second's
    guard.finish(second)
    # the first delivery's handler writes through its own session, then loses at the mark
    assert first.session is not None
    first.session.execute(sa.text(f"INSERT INTO {effects} (key, note) VALUES ('m1', 'first')"))
    guard.finish(first)
    assert rows(store, effects) == [("m1", "second")]
    assert events == ["marked", "duplicate_skipped"]
    assert first.decision is Decision.SKIP


# A deferred unique constraint (checked at commit) is PostgreSQL's; SQLite has none.
@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
@pytest.mark.parametrize("check_first", [True, False])
def test_a_handlers_own_constraint_failing_at_commit_is_its_failure(
    db: tuple[SQLStore, str], check_first: bool
) -> None:
    """The handler's writes break a constraint checked only at commit: the commit fails, the
    mark and the writes are rolled back, and the handler's error reaches the caller as if it
    had raised it (the framework's retry policy applies), not a duplicate and not a store
    outage."""
    store, effects = db
    with store._engine.begin() as conn:
        conn.execute(
            sa.text(
                f"ALTER TABLE {effects} ADD CONSTRAINT {effects}_once UNIQUE (key) "
                "DEFERRABLE INITIALLY DEFERRED"
            )
        )
    events = Names()
    policy = Policy(mode="lazy", transactional=True, check_first=check_first)
    guard = Guard(store, default=policy, events=[events])

    def twice(key: str) -> None:
        write_effect(effects, key, "a")
        write_effect(effects, key, "b")  # accepted now, refused at commit

    with pytest.raises(sa.exc.IntegrityError, match=f"{effects}_once"):
        guard.run("m1", "pay", twice, "m1")
    assert rows(store, effects) == []
    assert store.get("pay:m1") is None
    assert "duplicate_skipped" not in events and "concurrent_duplicate" not in events
    # the retry, with the handler mended, commits once
    assert guard.run("m1", "pay", write_effect, effects, "m1").status == "ran"
    assert rows(store, effects) == [("m1", "")]


# SQLite has one writer at a time: its transactions cannot interleave like this.
@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_two_interleaved_lazy_transactions_on_postgresql_leave_one_row(
    db: tuple[SQLStore, str],
) -> None:
    store, effects = db
    guard = Guard(store, default=Policy(mode="lazy", transactional=True))
    both_wrote = threading.Barrier(2, timeout=30)
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def deliver(note: str) -> None:
        def handler() -> None:
            write_effect(effects, "m1", note)
            both_wrote.wait()  # both transactions hold uncommitted rows now

        try:
            outcomes.append(guard.execute(Delivery("m1", "pay"), handler).status)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    # both bodies ran; the mark decided whose effect stays, and the other is a duplicate
    assert sorted(outcomes) == ["ran", "skipped"]
    assert len(rows(store, effects)) == 1


def test_eager_concurrent_delivery_is_deferred_and_leaves_one_row(
    db: tuple[SQLStore, str],
) -> None:
    store, effects = db
    guard = Guard(store, default=Policy(mode="eager", transactional=True))
    first = guard.begin(Delivery("m1", "pay"))
    write_effect(effects, "m1")
    decisions: list[Decision] = []
    second = threading.Thread(
        target=lambda: decisions.append(guard.begin(Delivery("m1", "pay")).decision)
    )
    second.start()
    if store._engine.dialect.name == "postgresql":
        second.join(30)
        assert decisions == [Decision.DEFER]  # the claim is live: deliver again later
        guard.finish(first)
    else:
        # SQLite has one writer at a time: the second claim waits for the first's commit
        second.join(0.5)
        assert second.is_alive() and decisions == []
        guard.finish(first)
        second.join(30)
        assert decisions == [Decision.SKIP]
    assert guard.begin(Delivery("m1", "pay")).decision is Decision.SKIP
    assert rows(store, effects) == [("m1", "")]


def test_current_session_outside_a_transactional_handler_is_an_error() -> None:
    with pytest.raises(TaskonceError, match="only available inside a handler guarded"):
        current_session()
