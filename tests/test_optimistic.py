"""Optimistic transactional mode (``Policy(mode="lazy", transactional=True, check_first=False)``)
on PostgreSQL, MariaDB and SQLite: no look-up before the handler; a duplicate runs, its
transaction is rolled back at the key's unique constraint, and it is reported as a duplicate."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import taskonce
from taskonce import ConfigError, Decision, Delivery, Guard, Policy, current_session, handoff
from taskonce.handoff import Send
from taskonce.stores.sql import SQLStore
from tests.helpers import MARIADB_URL, POSTGRES_URL, require_service

OPTIMISTIC = {"mode": "lazy", "transactional": True, "check_first": False}


class Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def emit(self, event: Any) -> None:
        with self.lock:
            self.seen.append(dict(event))

    def names(self) -> list[str]:
        return [e["event"] for e in self.seen]


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SQLStore, str]]:
    """A store with its own table, and an effects table beside it in the same database."""
    suffix = uuid.uuid4().hex[:10]
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/opt.db"
    else:
        require_service(request.param)
        url = POSTGRES_URL if request.param == "postgresql" else MARIADB_URL
    store = SQLStore(url, table=f"opt_{suffix}")
    store.create_tables()
    effects = f"opt_fx_{suffix}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {effects} (k VARCHAR(100) NOT NULL, note TEXT)"))
    try:
        yield store, effects
    finally:
        store.close()
        with engine.begin() as conn:
            for table in (effects, f"opt_{suffix}", f"opt_{suffix}_live"):
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()


def rows(store: SQLStore, effects: str) -> list[tuple[Any, ...]]:
    with store._engine.connect() as conn:
        return sorted(tuple(r) for r in conn.execute(sa.text(f"SELECT k, note FROM {effects}")))


def write(effects: str, key: str, note: str) -> str:
    current_session().execute(
        sa.text(f"INSERT INTO {effects} (k, note) VALUES (:k, :n)"), {"k": key, "n": note}
    )
    return note


class Statements:
    """Counts the statements the store's two engines execute (round trips on PostgreSQL)."""

    def __init__(self, store: SQLStore) -> None:
        self.engines = [store._engine, store._transactional_engine()]
        self.texts: list[str] = []
        for engine in self.engines:
            sa.event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "_live" not in statement:  # worker liveness records, written by their own thread
            self.texts.append(" ".join(statement.split())[:60])

    def take(self) -> list[str]:
        taken, self.texts = self.texts, []
        return taken

    def close(self) -> None:
        for engine in self.engines:
            sa.event.remove(engine, "before_cursor_execute", self._seen)


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"check_first": False},  # eager, not transactional
        {"check_first": False, "mode": "lazy"},
        {"check_first": False, "transactional": True},  # eager
    ],
)
def test_check_first_false_needs_lazy_and_transactional(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="check_first=False needs mode='lazy' and transactional"):
        Policy(**fields)


def test_check_first_is_a_flag_and_a_dict_layer_is_checked() -> None:
    with pytest.raises(ConfigError, match="Policy.check_first=0 is not valid"):
        Policy(mode="lazy", transactional=True, check_first=0)  # type: ignore[arg-type]
    assert Policy().check_first is True
    assert Policy(**OPTIMISTIC).check_first is False
    # A per-task layer that turns the queue's optimistic policy eager is refused, not ignored.
    with pytest.raises(ConfigError, match="check_first"):
        Policy(**OPTIMISTIC).overridden_by({"mode": "eager"})


def test_optimistic_policy_needs_an_sql_store() -> None:
    with pytest.raises(ConfigError, match="transactional=True needs an SQL store"):
        Guard(taskonce.MemoryStore(), queues={"pay": OPTIMISTIC})


# -- one store round trip fewer ------------------------------------------------------------


def test_first_delivery_makes_no_store_call_before_the_handler(
    db: tuple[SQLStore, str],
) -> None:
    """Optimistic: begin() executes no statement; finish() adds exactly the mark's INSERT to
    the handler's transaction. With the check, begin() reads the key first."""
    store, effects = db
    optimistic = Guard(store, default=OPTIMISTIC)
    checking = Guard(store, default={"mode": "lazy", "transactional": True})
    seen = Statements(store)
    try:
        for guard, key, before in ((optimistic, "m1", 0), (checking, "m2", 1)):
            seen.take()
            ticket = guard.begin(Delivery(key, "pay"))
            assert ticket.decision is Decision.RUN
            assert len(seen.take()) == before  # the SELECT of the check, or nothing
            write(effects, key, "")
            seen.take()
            guard.finish(ticket)
            assert [t.split()[0] for t in seen.take()] == ["INSERT"]  # the mark, then COMMIT
    finally:
        seen.close()
    assert rows(store, effects) == [("m1", ""), ("m2", "")]
    record = store.get("pay:m1")
    assert record is not None and record.status.value == "completed"


# -- duplicates ---------------------------------------------------------------------------


def test_a_duplicate_runs_and_is_rolled_back_without_a_trace(db: tuple[SQLStore, str]) -> None:
    store, effects = db
    events = Events()
    guard = Guard(store, default={**OPTIMISTIC, "store_result": True}, events=[events])
    calls: list[str] = []

    def handler(key: str, note: str) -> str:
        calls.append(note)
        return write(effects, key, "first" if len(calls) == 1 else "again")

    first = guard.run("m1", "pay", handler, "m1", "x")
    assert (first.status, first.value) == ("ran", "first")
    for _ in range(2):
        again = guard.run("m1", "pay", handler, "m1", "x")
        # the body ran; its row was rolled back; the first run's stored result is returned
        assert (again.status, again.value) == ("skipped", "first")
    assert len(calls) == 3
    assert rows(store, effects) == [("m1", "first")]
    assert events.names() == ["marked", "duplicate_skipped", "duplicate_skipped"]
    skipped = events.seen[1]
    assert skipped["reason"] == "rolled_back"
    assert skipped["mode"] == "lazy" and skipped["key"] == "pay:m1"
    assert skipped["duration_ms"] is not None  # the body ran


def test_a_duplicates_sends_are_discarded_never_published(db: tuple[SQLStore, str]) -> None:
    store, effects = db
    events = Events()
    guard = Guard(store, default=OPTIMISTIC, events=[events])
    published: list[Send] = []
    guard.register_publisher("python", published.append)

    def handler(note: str) -> None:
        write(effects, "m1", note)
        capture = handoff.current()
        assert capture is not None
        capture.add("python", {"task": "child", "args": [note]})

    assert guard.run("m1", "pay", handler, "same").status == "ran"
    assert [s.body["args"] for s in published] == [["same"]]
    assert guard.run("m1", "pay", handler, "same").status == "skipped"
    assert [s.body["args"] for s in published] == [["same"]]  # nothing more
    assert rows(store, effects) == [("m1", "same")]
    assert events.names()[-2:] == ["sends_discarded", "duplicate_skipped"]
    record = store.get("pay:m1")
    assert record is not None and not record.sends_pending


def test_a_rolled_back_duplicate_publishes_the_first_runs_pending_sends(
    db: tuple[SQLStore, str],
) -> None:
    """What a pre-checked duplicate does for sends its first run left pending (its worker died
    before publishing them), the rolled-back one does too: publish them, under their ids."""
    store, effects = db
    guard = Guard(store, default=OPTIMISTIC, dispatch_lease=0.3)
    published: list[Send] = []
    down = [True]

    def publish(send: Send) -> None:
        if down[0]:
            raise ConnectionError("broker down")
        published.append(send)

    guard.register_publisher("python", publish)
    guard.recorder_lease = 0.0  # a redelivery may take the sends at once

    def handler() -> None:
        write(effects, "m1", "")
        capture = handoff.current()
        assert capture is not None
        capture.add("python", {"task": "child", "args": []})

    assert guard.run("m1", "pay", handler).status == "ran"  # recorded; the publish failed
    assert published == []
    down[0] = False
    assert guard.run("m1", "pay", handler).status == "skipped"
    assert len(published) == 1
    assert rows(store, effects) == [("m1", "")]


def test_other_arguments_under_the_key_are_a_payload_mismatch(db: tuple[SQLStore, str]) -> None:
    store, effects = db
    events = Events()
    guard = Guard(store, default=OPTIMISTIC, events=[events])

    def handler(amount: int) -> None:
        write(effects, "m1", str(amount))

    guard.run("m1", "pay", handler, 5)
    with pytest.raises(taskonce.PayloadMismatch):
        guard.run("m1", "pay", handler, 7)
    assert rows(store, effects) == [("m1", "5")]  # the mismatching run's row rolled back
    assert events.names() == ["marked", "payload_mismatch"]
    # without check_payload the same delivery is a plain duplicate
    lenient = Guard(store, default={**OPTIMISTIC, "check_payload": False})
    assert lenient.run("m2", "pay", handler, 5).status == "ran"
    assert lenient.run("m2", "pay", handler, 7).status == "skipped"


def test_concurrent_duplicates_both_run_and_exactly_one_commits(
    db: tuple[SQLStore, str],
) -> None:
    """Two threads deliver the same key at once: both bodies run (PostgreSQL and MariaDB: both
    transactions hold their uncommitted row at the same moment); one commits, the other's
    mark waits for it, meets the key and rolls back."""
    store, effects = db
    events = Events()
    guard = Guard(store, default=OPTIMISTIC, events=[events])
    serialised = store._engine.dialect.name == "sqlite"  # one writer at a time
    met = threading.Barrier(2, timeout=30)
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def deliver(note: str) -> None:
        def handler() -> None:
            if serialised:
                met.wait()  # both bodies started before either wrote
            write(effects, "m1", note)
            if not serialised:
                met.wait()  # both rows written, neither committed

        try:
            outcomes.append(guard.execute(Delivery("m1", "pay"), handler).status)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    assert sorted(outcomes) == ["ran", "skipped"]
    assert len(rows(store, effects)) == 1
    assert sorted(events.names()) == ["duplicate_skipped", "marked"]


def test_a_failing_body_leaves_nothing_and_the_retry_commits(db: tuple[SQLStore, str]) -> None:
    store, effects = db
    guard = Guard(store, default=OPTIMISTIC)

    def failing() -> None:
        write(effects, "m1", "failed")
        raise RuntimeError("provider said no")

    with pytest.raises(RuntimeError):
        guard.run("m1", "pay", failing)
    assert store.get("pay:m1") is None
    assert guard.run("m1", "pay", write, effects, "m1", "ok").status == "ran"
    assert rows(store, effects) == [("m1", "ok")]


def test_a_live_claim_of_the_key_defers_the_rolled_back_run(db: tuple[SQLStore, str]) -> None:
    """The key is held by another owner's live claim (an eager policy on the same key): the
    run is rolled back and deferred until the claim's lease is out, as a look-up would have."""
    store, effects = db
    guard = Guard(store, default=OPTIMISTIC)
    store.claim("pay:m1", "someone-else", 30, 100, None)
    with pytest.raises(taskonce.InProgressElsewhere) as caught:
        guard.run("m1", "pay", write, effects, "m1", "x")
    assert 0 < caught.value.retry_after <= 30
    assert rows(store, effects) == []
