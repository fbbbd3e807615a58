"""The producer outbox (``taskonce.send_on_commit``) against real PostgreSQL, MariaDB and SQLite,
with a recording publisher standing in for a broker (tests/test_outbox_workers.py runs real
Celery and Dramatiq workers)."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session, sessionmaker

import taskonce
from taskonce import handoff
from taskonce.guard import OutboxRow
from taskonce.handoff import Send
from taskonce.stores.sql import SQLStore
from tests.helpers import drop_store, make_store, wait_for

FRAMEWORK = "python"


class Broker:
    """A recording publisher; ``down`` makes every publish fail like an unreachable broker.
    ``seen`` is asked, at publish time, whether the order the send names is visible to
    another connection (it must be: sends leave after the commit)."""

    def __init__(self) -> None:
        self.sent: list[Send] = []
        self.down = False
        self.lock = threading.Lock()
        self.visible: list[bool] = []
        self.seen: Any = None

    def __call__(self, send: Send) -> None:
        if self.down:
            raise ConnectionError("broker unreachable")
        if self.seen is not None:
            self.visible.append(self.seen(send.body["args"][0]))
        with self.lock:
            self.sent.append(send)


def charge(order_id: Any) -> str:
    """What an adapter does with ``charge.delay(order_id)``: capture it, or publish at once."""
    body = {"task": "charge", "args": [order_id]}
    capture = handoff.current()
    if capture is None:
        raise AssertionError("sent outside a capture")
    return capture.add(FRAMEWORK, body)


class World:
    def __init__(self, store: SQLStore, url: str, tmp_path: Any) -> None:
        self.store = store
        self.broker = Broker()
        self.events: list[dict[str, Any]] = []
        store.create_tables()  # as an application does at start-up (taskonce init-db)
        self.guard = taskonce.Guard(store, events=[self], dispatch_lease=1.0)
        self.guard.register_publisher(FRAMEWORK, self.broker)
        self.engine = sa.create_engine(url)
        self.orders = sa.Table(
            f"orders_{uuid.uuid4().hex[:8]}",
            sa.MetaData(),
            sa.Column("id", sa.Integer, primary_key=True),
        )
        self.orders.create(self.engine)
        self.broker.seen = self.order_visible

    def emit(self, event: Any) -> None:
        self.events.append(dict(event))

    def session(self) -> Session:
        return Session(self.engine)

    def order_visible(self, order_id: int) -> bool:
        with self.engine.connect() as connection:
            found = connection.execute(
                sa.select(self.orders.c.id).where(self.orders.c.id == order_id)
            ).first()
        return found is not None

    def outbox(self) -> list[taskonce.Record]:
        return list(self.store.records("outbox:"))

    def close(self) -> None:
        self.orders.drop(self.engine)
        self.engine.dispose()


def _url_of(store: SQLStore) -> str:
    return store._url.render_as_string(hide_password=False)


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def world(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[World]:
    store = make_store(request.param, tmp_path)
    assert isinstance(store, SQLStore)
    w = World(store, _url_of(store), tmp_path)
    try:
        yield w
    finally:
        w.close()
        drop_store(store)


def test_commit_after_the_block_publishes_once_after_the_row_is_visible(world: World) -> None:
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            send_id = charge(1)
        assert world.broker.sent == []  # not before the commit
        assert [r.sends_pending for r in world.outbox()] == []  # not visible outside either
        session.commit()
    assert [s.id for s in world.broker.sent] == [send_id]
    assert world.broker.visible == [True]
    [record] = world.outbox()
    assert not record.sends_pending and record.status is taskonce.Status.COMPLETED
    names = [(e["event"], e["key"], e["framework"], e["count"]) for e in world.events]
    assert names == [
        ("sends_deferred", None, FRAMEWORK, 1),
        ("sends_dispatched", None, FRAMEWORK, 1),
    ]
    assert {e["message_id"] for e in world.events} == {record.key}
    assert record.key.startswith("outbox:")


def test_commit_inside_the_block_and_several_transactions(world: World) -> None:
    with world.session() as session, taskonce.send_on_commit(session, guard=world.guard):
        session.execute(world.orders.insert().values(id=1))
        first = charge(1)
        second = charge(1)
        session.commit()
        assert [s.id for s in world.broker.sent] == [first, second]
        session.execute(world.orders.insert().values(id=2))
        third = charge(2)
        session.rollback()
        session.execute(world.orders.insert().values(id=3))
        fourth = charge(3)
        session.commit()
    assert [s.id for s in world.broker.sent] == [first, second, fourth]
    assert third not in {s.id for s in world.broker.sent}
    assert len({first, second, third, fourth}) == 4
    assert world.broker.visible == [True, True, True]


def test_rollback_and_close_without_commit_send_nothing(world: World) -> None:
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            charge(1)
        session.rollback()
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=2))
            charge(2)
    # the session closed without a commit; a later commit of another session sends only its own
    with world.session() as session:
        session.execute(world.orders.insert().values(id=3))
        session.commit()
    assert world.broker.sent == []
    assert world.outbox() == []
    assert [e["event"] for e in world.events] == ["sends_discarded", "sends_discarded"]


def test_an_exception_in_the_block_rolls_back_with_the_transaction(world: World) -> None:
    with world.session() as session:
        with pytest.raises(KeyError), taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            charge(1)
            raise KeyError("boom")
        session.rollback()
    assert world.broker.sent == [] and world.outbox() == []


def test_a_rolled_back_savepoint_takes_its_sends_with_it(world: World) -> None:
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            kept = charge(1)
            savepoint = session.begin_nested()
            session.execute(world.orders.insert().values(id=2))
            charge(2)
            savepoint.rollback()
            with session.begin_nested():
                session.execute(world.orders.insert().values(id=3))
                kept_too = charge(3)
        session.commit()
    assert [s.id for s in world.broker.sent] == [kept, kept_too]
    assert len(world.outbox()) == 2


def test_a_connection_block_is_its_transaction(world: World) -> None:
    with world.engine.connect() as connection:
        with taskonce.send_on_commit(connection, guard=world.guard):
            connection.execute(world.orders.insert().values(id=1))
            sent = charge(1)
        assert [s.id for s in world.broker.sent] == [sent]
        with pytest.raises(ValueError), taskonce.send_on_commit(connection, guard=world.guard):
            connection.execute(world.orders.insert().values(id=2))
            charge(2)
            raise ValueError("no")
        assert len(world.broker.sent) == 1 and not world.order_visible(2)
        connection.execute(sa.select(1))  # autobegins a transaction the block cannot see
        with (
            pytest.raises(taskonce.ConfigError, match="already in a transaction"),
            taskonce.send_on_commit(connection, guard=world.guard),
        ):
            pass
    assert world.broker.visible == [True]
    assert len(world.outbox()) == 1


def test_a_connection_in_someone_elses_transaction_hands_the_publish_to_on_commit(
    world: World,
) -> None:
    callbacks: list[Any] = []
    with world.engine.begin() as connection:
        connection.execute(world.orders.insert().values(id=1))
        with taskonce.send_on_commit(connection, guard=world.guard, on_commit=callbacks.append):
            sent = charge(1)
        assert len(callbacks) == 1 and world.broker.sent == []
    callbacks.pop()()  # what the owner of the transaction does after its commit
    assert [s.id for s in world.broker.sent] == [sent] and world.broker.visible == [True]
    with pytest.raises(taskonce.ConfigError, match="must be callable"):
        with world.engine.connect() as connection:
            with taskonce.send_on_commit(connection, guard=world.guard, on_commit=1):  # type: ignore[arg-type]
                pass
    with pytest.raises(taskonce.ConfigError, match="on_commit= is for a Connection"):
        with taskonce.send_on_commit(world.session(), guard=world.guard, on_commit=print):
            pass


class _NoLiveness:
    """A guard's liveness writer that writes nothing: the real one creates the store's tables
    from its thread as soon as the guard exists, which would race the missing-table check."""

    def __init__(self, store: Any, health: Any = None) -> None:
        pass

    def ensure(self) -> None:
        pass

    def silence_wait(self) -> float:
        return 0.0

    def stop(self) -> None:
        pass


def test_sqlite_without_the_table_inside_a_transaction_is_a_clear_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(taskonce.guard, "Liveness", _NoLiveness)
    store = taskonce.open_store(f"sqlite:///{tmp_path}/fresh.db")
    guard = taskonce.Guard(store)
    guard.register_publisher(FRAMEWORK, Broker())
    engine = sa.create_engine(f"sqlite:///{tmp_path}/fresh.db")
    try:
        with engine.begin() as connection:
            connection.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            with pytest.raises(taskonce.ConfigError, match="create it first"):
                with taskonce.send_on_commit(connection, guard=guard, on_commit=print):
                    pass
        with Session(engine) as session, taskonce.send_on_commit(session, guard=guard):
            pass  # outside a transaction the block creates the table itself
        assert store.stats()["keys"] == 0
    finally:
        engine.dispose()
        store.close()


def test_a_scoped_session_works_like_its_session(world: World) -> None:
    scoped = scoped_session(sessionmaker(world.engine))
    try:
        with taskonce.send_on_commit(scoped, guard=world.guard):
            scoped.execute(world.orders.insert().values(id=1))
            charge(1)
        scoped.commit()
    finally:
        scoped.remove()
    assert len(world.broker.sent) == 1 and world.broker.visible == [True]


def test_broker_down_at_commit_the_send_waits_and_the_relay_sends_it(world: World) -> None:
    world.broker.down = True
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            sent = charge(1)
        session.commit()  # no error reaches the request
    assert world.broker.sent == []
    [record] = world.outbox()
    assert record.sends_pending
    assert world.guard.relay(older_than=0) == 0  # still down: it stays
    assert [r.sends_pending for r in world.outbox()] == [True]
    world.broker.down = False
    assert world.guard.relay(older_than=0) == 1
    assert [s.id for s in world.broker.sent] == [sent]
    assert world.guard.relay(older_than=0) == 0
    assert [r.sends_pending for r in world.outbox()] == [False]
    dispatched = [e for e in world.events if e["event"] == "sends_dispatched"]
    assert [(e["key"], e["message_id"], e["framework"]) for e in dispatched] == [
        (None, record.key, FRAMEWORK)
    ]


def test_died_after_commit_the_relay_sends_it_once_after_the_lease(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(world.guard, "dispatch_committed", lambda rows: 0)  # "killed" here
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            sent = charge(1)
        session.commit()
    assert world.broker.sent == []
    # The dead producer's dispatch lease (1 s here) holds the relay off, then it publishes.
    from tests.helpers import wait_for

    wait_for(lambda: world.guard.relay(older_than=0), timeout=30, what="the relay")
    assert [s.id for s in world.broker.sent] == [sent]
    assert world.guard.relay(older_than=0) == 0


def test_refused_arguments_name_the_argument_and_write_nothing(world: World) -> None:
    with world.session() as session:
        with taskonce.send_on_commit(session, guard=world.guard):
            session.execute(world.orders.insert().values(id=1))
            with pytest.raises(taskonce.SendRefused, match=r"argument args\[0\] of type object"):
                charge(object())
            kept = charge(1)
        session.commit()
    assert [s.id for s in world.broker.sent] == [kept]
    assert len(world.outbox()) == 1


def test_a_session_on_another_database_is_refused(world: World, tmp_path: Any) -> None:
    other = sa.create_engine(f"sqlite:///{tmp_path}/other.db")
    with Session(other) as session, pytest.raises(taskonce.ConfigError, match="is not the store"):
        with taskonce.send_on_commit(session, guard=world.guard):
            pass
    other.dispose()


def test_bad_targets_are_config_errors(world: World, tmp_path: Any) -> None:
    for target, text in [
        (None, "needs the SQLAlchemy Session or Connection"),
        ("postgresql://", "not str"),
        (world.engine, "not Engine"),
        (Session(), "bound to no engine"),
    ]:
        with (
            pytest.raises(taskonce.ConfigError, match=text),
            taskonce.send_on_commit(target, guard=world.guard),
        ):
            pass
    with pytest.raises(taskonce.ConfigError, match="must be a taskonce.Guard"):
        with taskonce.send_on_commit(world.session(), guard="g"):  # type: ignore[arg-type]
            pass
    bare = taskonce.Guard(world.store)
    with pytest.raises(taskonce.ConfigError, match="no framework is registered"):
        with taskonce.send_on_commit(world.session(), guard=bare):
            pass
    assert world.outbox() == [] and world.broker.sent == []


@pytest.mark.parametrize("kind", ["redis", "memory"])
def test_stores_without_transactions_are_refused(kind: str, tmp_path: Any) -> None:
    store = make_store(kind, tmp_path)
    try:
        guard = taskonce.Guard(store)
        guard.register_publisher(FRAMEWORK, Broker())
        engine = sa.create_engine(f"sqlite:///{tmp_path}/app.db")
        with pytest.raises(taskonce.ConfigError, match="needs an SQL store"):
            with taskonce.send_on_commit(Session(engine), guard=guard):
                pass
        engine.dispose()
    finally:
        drop_store(store)


def test_the_guard_is_found_when_there_is_exactly_one(world: World) -> None:
    import gc

    from taskonce import outbox as outbox_module

    gc.collect()
    others = [g for g in outbox_module.publishing_guards() if g is not world.guard]
    for g in others:
        outbox_module._PUBLISHING.discard(g)
    try:
        with world.session() as session:
            with taskonce.send_on_commit(session):
                session.execute(world.orders.insert().values(id=1))
                charge(1)
            session.commit()
        assert len(world.broker.sent) == 1
        second = taskonce.Guard(world.store)
        second.register_publisher(FRAMEWORK, Broker())
        with pytest.raises(taskonce.ConfigError, match="found 2 guards"):
            with taskonce.send_on_commit(world.session()):
                pass
        outbox_module._PUBLISHING.discard(second)
    finally:
        for g in others:
            outbox_module._PUBLISHING.add(g)


class DyingGuard(taskonce.Guard):
    """A guard whose process "dies" between a commit and its publish in threads that say so."""

    dying = threading.local()

    def dispatch_committed(self, rows: Any) -> int:
        if getattr(self.dying, "now", False):
            return 0
        return super().dispatch_committed(rows)


def test_1000_requests_from_8_threads_sent_equals_committed(tmp_path: Any) -> None:
    store = make_store("postgresql", tmp_path)
    assert isinstance(store, SQLStore)
    broker = Broker()
    guard = DyingGuard(store, dispatch_lease=1.0)
    guard.register_publisher(FRAMEWORK, broker)
    engine = sa.create_engine(_url_of(store), pool_size=8)
    orders = sa.Table(
        f"orders_{uuid.uuid4().hex[:8]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
    )
    orders.create(engine)
    committed: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def requests(thread: int) -> None:
        rng = random.Random(thread)
        try:
            for n in range(125):
                order_id = thread * 1000 + n
                fate = rng.random()
                DyingGuard.dying.now = 0.8 <= fate
                with Session(engine) as session:
                    with taskonce.send_on_commit(session, guard=guard):
                        session.execute(orders.insert().values(id=order_id))
                        charge(order_id)
                    if fate < 0.2:
                        session.rollback()
                        continue
                    session.commit()
                with lock:
                    committed.append(order_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=requests, args=(t,)) for t in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []

        def relayed() -> bool:
            guard.relay(older_than=0, batch=500)
            return store.stats()["sends_pending"] == 0

        wait_for(relayed, timeout=60, interval=0.2, what="the relay to empty the outbox")
        sent = sorted(s.body["args"][0] for s in broker.sent)
        assert sent == sorted(committed)  # each committed order once, nothing else
        assert 600 < len(committed) < 1000
        with engine.connect() as connection:
            rows = sorted(connection.execute(sa.select(orders.c.id)).scalars())
        assert rows == sorted(committed)
    finally:
        orders.drop(engine)
        engine.dispose()
        drop_store(store)


def test_outbox_rows_are_a_relay_candidate_like_any_record(world: World) -> None:
    row = OutboxRow(
        "outbox:x", "t" * 32, Send("i", FRAMEWORK, {"task": "t", "args": [1]}).to_json()
    )
    with world.engine.begin() as connection:
        world.store.record_sends_in(connection, row.key, (row.text,), row.token, 60.0, 0.0)
    assert world.store.due_for_relay(0.0).sends == ["outbox:x"]
    assert world.guard.relay(older_than=0) == 1
    assert [s.id for s in world.broker.sent] == ["i"]
