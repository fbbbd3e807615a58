"""The hand-off in the guard, on every store: capture, record with the outcome, dispatch,
redispatch on redelivery, the relay, purge, events and bad input."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

import taskonce
from taskonce import handoff
from taskonce.events import FIELDS
from taskonce.handoff import Send, derive_id
from taskonce.stores import Store
from tests.helpers import POSTGRES_URL, drop_store, require_service, wait_for


class Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        self.seen.append(dict(event))

    def names(self) -> list[str]:
        return [e["event"] for e in self.seen]

    def count(self, name: str) -> list[int | None]:
        return [e["count"] for e in self.seen if e["event"] == name]


class Broker:
    """A publisher that records what it publishes and can be told to fail."""

    def __init__(self) -> None:
        self.sent: list[Send] = []
        self.failing = False

    def __call__(self, send: Send) -> None:
        if self.failing:
            raise ConnectionError("broker down")
        self.sent.append(send)


def make_guard(store: Store, **policy: Any) -> tuple[taskonce.Guard, Events, Broker]:
    events, broker = Events(), Broker()
    guard = taskonce.Guard(
        store, default=taskonce.Policy(**policy), events=[events], dispatch_lease=0.3
    )
    guard.register_publisher("python", broker)
    return guard, events, broker


def sender(*args: Any) -> Any:
    def body() -> str:
        capture = handoff.current()
        assert capture is not None
        for arg in args:
            capture.add("python", {"task": "child", "args": [arg]})
        return "done"

    return body


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_sends_leave_after_the_record_in_order(store: Store, mode: str) -> None:
    guard, events, broker = make_guard(store, mode=mode)
    outcome = guard.run("m1", "q", sender(1, 2, 3))
    assert outcome.status == "ran"
    assert [s.body["args"] for s in broker.sent] == [[1], [2], [3]]
    assert [s.id for s in broker.sent] == [derive_id("q:m1", i) for i in range(3)]
    recorded = "completed" if mode == "eager" else "marked"
    names = events.names()
    assert names.index(recorded) < names.index("sends_deferred") < names.index("sends_dispatched")
    assert events.count("sends_deferred") == [3] and events.count("sends_dispatched") == [3]
    record = store.get("q:m1")
    assert record is not None and not record.sends_pending and record.sends == ()
    assert store.due_for_relay(0.0).sends == []
    # a duplicate is skipped and sends nothing again
    assert guard.run("m1", "q", sender(1, 2, 3)).status == "skipped"
    assert len(broker.sent) == 3


def test_caller_chosen_ids_are_kept(store: Store) -> None:
    guard, _, broker = make_guard(store)

    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        assert capture.add("python", {"args": []}, message_id="mine") == "mine"
        assert capture.add("python", {"args": []}) == derive_id("q:m1", 1)

    guard.run("m1", "q", body)
    assert [s.id for s in broker.sent] == ["mine", derive_id("q:m1", 1)]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_failed_run_sends_nothing(store: Store, mode: str) -> None:
    guard, events, broker = make_guard(store, mode=mode)

    def body() -> None:
        sender(1, 2)()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        guard.run("m1", "q", body)
    assert broker.sent == []
    assert events.count("sends_discarded") == [2]
    assert store.due_for_relay(0.0).sends == []
    # the retry that succeeds sends its own captures once, under the same ids
    guard.run("m1", "q", sender(1, 2))
    assert [s.id for s in broker.sent] == [derive_id("q:m1", i) for i in range(2)]


def test_a_lost_lease_discards_the_sends() -> None:
    clock = [1000.0]
    store = taskonce.MemoryStore(clock=lambda: clock[0])
    guard, events, broker = make_guard(store, lease=10)

    def body() -> None:
        sender(1)()
        clock[0] += 11  # the lease runs out; another delivery takes the claim over
        store.claim("q:m1", "other", 10, 100, None)

    with pytest.raises(taskonce.LeaseLost):
        guard.run("m1", "q", body)
    assert broker.sent == [] and events.count("sends_discarded") == [1]


def test_defer_sends_off_and_send_now_publish_at_once() -> None:
    guard, _, _ = make_guard(taskonce.MemoryStore(), defer_sends=False)
    seen: list[Any] = []
    guard.run("m1", "q", lambda: seen.append(handoff.current()))
    assert seen == [None]

    guard, _, _ = make_guard(taskonce.MemoryStore())

    def body() -> None:
        assert handoff.current() is not None
        with taskonce.send_now():
            seen.append(handoff.current())
        assert handoff.current() is not None

    outer = handoff.current()
    guard.run("m1", "q", body)
    assert seen == [None, None]
    assert handoff.current() is outer  # nothing leaks out of the handler's context

    # a guarded handler inside a capturing one follows its own policy
    inner_guard, _, _ = make_guard(taskonce.MemoryStore(), defer_sends=False)
    guard.run("m2", "q", lambda: inner_guard.run("m3", "q", lambda: seen.append(handoff.current())))
    assert seen[-1] is None


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_redelivery_publishes_pending_sends_then_skips(store: Store, mode: str) -> None:
    guard, events, broker = make_guard(store, mode=mode)
    broker.failing = True
    delivery = taskonce.Delivery("m1", "q", task="t")
    assert guard.execute(delivery, sender(1, 2)).status == "ran"  # finish does not raise
    record = store.get("q:m1")
    assert record is not None and record.sends_pending
    assert [Send.from_json(t).body["args"] for t in record.sends] == [[1], [2]]
    assert store.stats()["sends_pending"] == 1
    broker.failing = False
    ran: list[int] = []
    assert guard.execute(delivery, lambda: ran.append(1)).status == "skipped"
    assert ran == []
    assert [s.id for s in broker.sent] == [derive_id("q:m1", i) for i in range(2)]
    assert events.count("sends_redispatched") == [2]
    assert events.names()[-2:] == ["sends_redispatched", "duplicate_skipped"]
    assert store.due_for_relay(0.0).sends == [] and store.stats()["sends_pending"] == 0


def test_redelivery_defers_while_another_dispatcher_holds_the_sends(store: Store) -> None:
    guard, _, broker = make_guard(store)
    broker.failing = True
    guard.run("m1", "q", sender(1))
    assert store.take_sends("q:m1", "relay-elsewhere", 30.0).sends  # someone else is on it
    broker.failing = False
    with pytest.raises(taskonce.InProgressElsewhere) as caught:
        guard.run("m1", "q", sender(1))
    assert 0 < caught.value.retry_after <= 30
    assert broker.sent == []


def test_relay_publishes_stranded_sends_once(store: Store) -> None:
    guard, events, broker = make_guard(store)
    broker.failing = True
    guard.run("m1", "q", sender(1, 2))
    guard.run("m2", "q", sender(3))
    broker.failing = False
    assert guard.relay(older_than=3600) == 0  # too recent: the worker may still be on it
    assert store.take_sends("q:m2", "another-relay", 30.0).sends
    assert guard.relay(older_than=0) == 1  # m2 is leased by the other relay
    assert [s.body["args"] for s in broker.sent] == [[1], [2]]
    assert events.count("sends_dispatched") == [2]
    assert guard.relay(older_than=0) == 0
    assert store.due_for_relay(0.0).sends == ["q:m2"]


def relay_threads() -> int:
    return [t.name for t in threading.enumerate()].count("taskonce-relay")


def test_background_relay(store: Store) -> None:
    guard, _, broker = make_guard(store)
    broker.failing = True
    guard.run("m1", "q", sender(1))
    broker.failing = False
    # Other guards of this test process (earlier tests' workers) may run sweeps of their own.
    before = relay_threads()
    guard.start_relay(every=0.05, older_than=0)
    guard.start_relay(every=0.05, older_than=0)  # one sweep per guard and process
    try:
        assert relay_threads() == before + 1
        wait_for(lambda: broker.sent, timeout=10, what="the relay to publish")
    finally:
        guard.stop_relay(timeout=5)
    assert relay_threads() == before
    assert [s.body["args"] for s in broker.sent] == [[1]]


@pytest.mark.parametrize(
    ("error", "level", "text", "traceback"),
    [
        (taskonce.StoreUnavailable("connection terminated"), logging.WARNING, "unavailable", False),
        (RuntimeError("a bug"), logging.ERROR, "sweep failed", True),
    ],
)
def test_a_failing_relay_sweep_logs_and_goes_on(
    caplog: pytest.LogCaptureFixture, error: Exception, level: int, text: str, traceback: bool
) -> None:
    """A store that is down is an outage: one warning line per sweep, no traceback (a
    PostgreSQL restart printed one per sweep); anything else is logged with its traceback.
    Either way the thread sweeps again."""
    from taskonce.relay import RelayThread

    sweeps: list[float] = []

    def sweep(older_than: float) -> int:
        sweeps.append(older_than)
        raise error

    relay = RelayThread()
    with caplog.at_level(logging.WARNING, logger="taskonce"):
        relay.start(sweep, every=0.01, older_than=5)
        try:
            wait_for(lambda: len(sweeps) >= 2, timeout=10, what="two sweeps")
        finally:
            relay.stop(timeout=5)
    records = [r for r in caplog.records if "relay sweep" in r.getMessage()]
    assert records and all(r.levelno == level and text in r.getMessage() for r in records)
    assert all((r.exc_info is not None) is traceback for r in records)


def test_purge_keeps_records_with_pending_sends(caplog: pytest.LogCaptureFixture) -> None:
    clock = [1000.0]
    store = taskonce.MemoryStore(clock=lambda: clock[0])
    guard, _, broker = make_guard(store, keep_for=10)
    broker.failing = True
    guard.run("m1", "q", sender(1))
    guard.run("m2", "q", lambda: None)
    clock[0] += 11
    with caplog.at_level(logging.WARNING, logger="taskonce"):
        assert guard.purge() == 1  # m2 only
    assert "1 record(s) still have deferred sends pending" in caplog.text
    broker.failing = False
    assert guard.relay(older_than=0) == 1 and len(broker.sent) == 1
    assert guard.purge() == 1


def test_sql_purge_keeps_records_with_pending_sends(tmp_path: Any) -> None:
    store = taskonce.open_store(f"sqlite:///{tmp_path}/p.db")
    guard, _, broker = make_guard(store, keep_for=0.01)
    broker.failing = True
    guard.run("m1", "q", sender(1))
    guard.run("m2", "q", lambda: None)
    wait_for(lambda: store.stats()["expired"] == 2, timeout=5, what="both records to expire")
    assert guard.purge() == 1
    assert store.due_for_relay(0.0).sends == ["q:m1"]


def test_a_send_json_cannot_store_is_refused_at_the_send() -> None:
    guard, _, broker = make_guard(taskonce.MemoryStore())
    caught: list[taskonce.SendRefused] = []

    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        capture.add("python", {"task": "child", "args": [1]})
        try:
            capture.add("python", {"task": "child", "args": [1], "kwargs": {"when": object()}})
        except taskonce.SendRefused as exc:
            caught.append(exc)
        assert len(capture) == 1  # the refused send is not captured, the earlier one stays

    guard.execute(taskonce.Delivery("m1", "q", task="shop.checkout"), body)
    text = str(caught[0])
    assert "task 'shop.checkout' sent 'child'" in text
    assert "argument kwargs['when'] of type object" in text and "JSON" in text
    assert isinstance(caught[0], taskonce.InvalidInput)
    assert [s.body["args"] for s in broker.sent] == [[1]]


def test_an_oversize_capture_is_refused() -> None:
    store = taskonce.MemoryStore()
    guard = taskonce.Guard(store, send_limit=1000)
    guard.register_publisher("python", lambda send: None)

    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        capture.add("python", {"task": "child", "args": ["x" * 500]})
        capture.add("python", {"task": "child", "args": ["x" * 500]})

    with pytest.raises(taskonce.SendRefused, match=r"over the limit of 1000 bytes per handler"):
        guard.execute(taskonce.Delivery("m1", "q", task="shop.checkout"), body)
    assert store.get("q:m1") is None  # the run failed: released, nothing recorded or sent


def test_config_errors() -> None:
    with pytest.raises(taskonce.ConfigError, match="Policy.defer_sends='yes'"):
        taskonce.Policy(defer_sends="yes")  # type: ignore[arg-type]
    with pytest.raises(taskonce.ConfigError, match="defer_sends"):
        taskonce.Guard(taskonce.MemoryStore(), queues={"q": {"defer_sends": 1}})
    with pytest.raises(taskonce.ConfigError, match="send_limit"):
        taskonce.Guard(taskonce.MemoryStore(), send_limit=0)
    with pytest.raises(taskonce.ConfigError, match="dispatch_lease"):
        taskonce.Guard(taskonce.MemoryStore(), dispatch_lease=float("nan"))
    guard = taskonce.Guard(taskonce.MemoryStore())
    with pytest.raises(taskonce.ConfigError, match="not callable"):
        guard.register_publisher("python", "nope")  # type: ignore[arg-type]


def test_events_carry_count_last() -> None:
    assert FIELDS[-1] == "count" and FIELDS[:3] == ("ts", "event", "key")
    guard, events, _ = make_guard(taskonce.MemoryStore())
    guard.run("m1", "q", sender(1))
    assert all(tuple(e) == FIELDS for e in events.seen)
    assert [e["count"] for e in events.seen if e["event"] == "completed"] == [None]


class Spy(taskonce.MemoryStore):
    """Records the arguments of complete/mark."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def complete(self, *args: Any) -> None:  # type: ignore[override]
        self.calls.append(("complete", args))
        super().complete(*args)

    def mark(self, *args: Any) -> bool:  # type: ignore[override]
        self.calls.append(("mark", args))
        return super().mark(*args)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_task_that_sends_nothing_calls_the_store_as_before(mode: str) -> None:
    store = Spy()
    guard = taskonce.Guard(store, default=taskonce.Policy(mode=mode))
    guard.run("m1", "q", lambda: None)
    assert [(name, len(args)) for name, args in store.calls] == [
        ("complete" if mode == "eager" else "mark", 4)
    ]


# -- transactional mode on PostgreSQL -----------------------------------------------------------


def _pg_store() -> Store:
    require_service("postgresql")
    return taskonce.open_store(POSTGRES_URL, table=f"t_{uuid.uuid4().hex[:10]}")


def _rows_table(store: Store) -> sa.Table:
    table = sa.Table(
        f"rows_{store._table_name}",  # type: ignore[attr-defined]
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
    )
    table.create(store._engine)  # type: ignore[attr-defined]
    return table


def _count(store: Store, table: sa.Table) -> int:
    with store._engine.connect() as connection:  # type: ignore[attr-defined]
        return int(connection.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def _die_before_commit(table_name: str, rows_name: str) -> None:
    """In a separate process: insert a row and send, then get SIGKILLed before the commit."""
    store = taskonce.open_store(POSTGRES_URL, table=table_name)
    guard = taskonce.Guard(store, default=taskonce.Policy(transactional=True, lease=1.0))
    guard.register_publisher("python", lambda send: None)
    rows = sa.Table(rows_name, sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))

    def body() -> None:
        taskonce.current_session().execute(sa.insert(rows).values(id=1))
        sender(1, 2)()
        taskonce.current_session().flush()
        os.kill(os.getpid(), signal.SIGKILL)

    guard.execute(taskonce.Delivery("m1", "q", task="t"), body)


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_transactional_rows_mark_and_sends_commit_together(mode: str) -> None:
    store = _pg_store()
    try:
        rows = _rows_table(store)
        guard, _, broker = make_guard(store, mode=mode, transactional=True)
        broker.failing = True

        def body(i: int) -> None:
            taskonce.current_session().execute(sa.insert(rows).values(id=i))
            sender(i)()

        def failing() -> None:
            body(2)
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            guard.run("m2", "q", failing)
        assert _count(store, rows) == 0 and store.get("q:m2") is None
        guard.run("m1", "q", body, 1)
        assert _count(store, rows) == 1
        record = store.get("q:m1")
        assert record is not None and len(record.sends) == 1  # committed with the row
        broker.failing = False
        assert guard.run("m1", "q", body, 1).status == "skipped"
        assert [s.body["args"] for s in broker.sent] == [[1]]
    finally:
        with store._engine.begin() as connection:  # type: ignore[attr-defined]
            connection.execute(sa.text(f'DROP TABLE IF EXISTS "rows_{store._table_name}"'))  # type: ignore[attr-defined]
        drop_store(store)


def test_transactional_killed_before_commit_leaves_nothing_and_reruns_once() -> None:
    store = _pg_store()
    try:
        rows = _rows_table(store)
        store.create_tables()  # type: ignore[attr-defined]
        process = multiprocessing.get_context("spawn").Process(
            target=_die_before_commit,
            args=(store._table_label, rows.name),  # type: ignore[attr-defined]
        )
        process.start()
        process.join(60)
        assert process.exitcode == -signal.SIGKILL
        # the row, the claim's completion and the sends: none of them exist
        assert _count(store, rows) == 0
        record = store.get("q:m1")
        assert record is None or not record.sends_pending
        assert store.due_for_relay(0.0).sends == []
        # the redelivery takes the dead worker's claim over once its lease ran out
        guard, events, broker = make_guard(store, transactional=True, lease=1.0)

        def body() -> None:
            taskonce.current_session().execute(sa.insert(rows).values(id=1))
            sender(1, 2)()

        def redeliver() -> bool:
            try:
                return guard.execute(taskonce.Delivery("m1", "q", task="t"), body).status == "ran"
            except taskonce.InProgressElsewhere:
                return False

        wait_for(redeliver, timeout=30, what="the re-run after the lease")
        assert "lease_taken_over" in events.names()
        assert _count(store, rows) == 1
        assert [s.id for s in broker.sent] == [derive_id("q:m1", i) for i in range(2)]
    finally:
        with store._engine.begin() as connection:  # type: ignore[attr-defined]
            connection.execute(sa.text(f'DROP TABLE IF EXISTS "rows_{store._table_name}"'))  # type: ignore[attr-defined]
        drop_store(store)


def test_background_relay_in_a_forked_child(tmp_path: Any) -> None:
    """A guard whose relay runs in the parent starts its own sweep in a forked child."""
    store = taskonce.open_store(f"sqlite:///{tmp_path}/fork.db")
    guard, _, broker = make_guard(store)
    broker.failing = True
    guard.run("m1", "q", sender(1))
    guard.start_relay(every=3600)  # the parent's sweep (sleeping)
    out = tmp_path / "child.txt"

    def child() -> None:
        broker.failing = False
        guard.register_publisher("python", lambda send: out.write_text(send.id))
        guard.start_relay(every=0.05, older_than=0)
        wait_for(lambda: not store.due_for_relay(0.0).sends, timeout=10, what="the child's relay")

    try:
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join(30)
        assert process.exitcode == 0
        assert out.read_text() == derive_id("q:m1", 0)
        assert store.due_for_relay(0.0).sends == []
    finally:
        guard.stop_relay(timeout=5)


def test_capturing_carries_the_capture_to_another_thread() -> None:
    """An adapter whose handler runs in another thread than ``begin`` (an event loop) makes the
    ticket's capture current there with ``handoff.capturing``; a bare thread is not captured."""
    guard, _, broker = make_guard(taskonce.MemoryStore())
    outer = handoff.current()
    ticket = guard.begin(taskonce.Delivery("m1", "q", task="t"))
    seen: list[Any] = []

    def handler() -> None:
        seen.append(handoff.current())
        with handoff.capturing(ticket.capture):
            handoff.current().add("python", {"args": [1]})  # type: ignore[union-attr]
        seen.append(handoff.current())

    thread = threading.Thread(target=handler)
    thread.start()
    thread.join()
    guard.finish(ticket)
    assert seen == [None, None]
    assert [s.id for s in broker.sent] == [derive_id("q:m1", 0)]
    assert handoff.current() is outer


class DownAtRecord(taskonce.MemoryStore):
    """A store that cannot record outcomes (every complete/mark times out)."""

    def complete(self, *args: Any) -> None:  # type: ignore[override]
        raise taskonce.StoreUnavailable("store timed out")

    def mark(self, *args: Any) -> bool:  # type: ignore[override]
        raise taskonce.StoreUnavailable("store timed out")


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_sends_of_a_run_that_cannot_be_recorded_leave_at_once(mode: str) -> None:
    """The handler's effects stand but its outcome cannot be recorded: its messages are
    published at once, as without the hand-off, instead of being lost."""
    guard, events, broker = make_guard(DownAtRecord(), mode=mode)
    with pytest.raises(taskonce.StoreUnavailable):
        guard.run("m1", "q", sender(1, 2))
    assert [s.id for s in broker.sent] == [derive_id("q:m1", i) for i in range(2)]
    assert events.count("sends_dispatched") == [2] and events.count("sends_discarded") == []


def test_capture_refuses_a_malformed_send() -> None:
    capture = handoff.Capture("q:k", "shop.checkout")
    with pytest.raises(taskonce.SendRefused, match="body must be a dict"):
        capture.add("python", ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(taskonce.SendRefused, match="message id 7 must be a non-empty str"):
        capture.add("python", {}, message_id=7)  # type: ignore[arg-type]
    with pytest.raises(taskonce.SendRefused, match=r"argument args\[0\] = nan"):
        capture.add("python", {"task": "x", "args": [float("nan")]})
    assert len(capture) == 0
