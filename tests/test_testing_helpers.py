"""taskonce.testing and its pytest plugin: the helpers users run in their own test suites.

In process: Celery's eager ``apply`` and Dramatiq's StubBroker with an in-process worker, as the
helpers themselves use them. The last tests run a user's test file with ``pytester`` to show the
fixtures arrive through the ``pytest11`` entry point.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import kombu.messaging
import pytest
import sqlalchemy as sa
from celery import Celery
from dramatiq.brokers.stub import StubBroker
from sqlalchemy.orm import Session

import taskonce
from taskonce import handoff
from taskonce.celery_ext import IdempotentTask, setup
from taskonce.dramatiq_ext import IdempotencyMiddleware
from taskonce.stores.sql import SQLStore
from taskonce.testing import (
    CapturedSend,
    EventLog,
    assert_runs_once,
    captured_sends,
    celery_app,
    deliver_twice,
    drain_broker,
    events_of,
    make_guard,
    publish_pending,
    stub_broker,
)

pytest_plugins = ["pytester"]


# -- a guard for a test -----------------------------------------------------------------------


def test_make_guard_on_memory_with_policy_overrides_and_an_event_log() -> None:
    with make_guard(default={"lease": 7}, queues={"payments": {"mode": "lazy"}}) as guard:
        assert isinstance(guard.store, taskonce.MemoryStore)
        assert guard.policy_for("payments").mode == "lazy"
        assert guard.policy_for("other").lease == 7
        log = events_of(guard)
        assert isinstance(log, EventLog) and events_of(guard) is log  # found, not added twice
        guard.run("m-1", "payments", lambda: None)
        assert log.names("m-1") == ["marked"] and log.names() == ["marked"]
        log.clear()
        assert len(log) == 0


def test_make_guard_sqlite_in_a_directory_and_other_stores(tmp_path: Path) -> None:
    with make_guard("sqlite", path=tmp_path) as guard:
        assert isinstance(guard.store, SQLStore)
        assert (tmp_path / "taskonce.db").exists()
        assert guard.run("m-1", "q", lambda: 1).status == "ran"
    with make_guard("memory://") as guard:
        assert isinstance(guard.store, taskonce.MemoryStore)
    store = taskonce.MemoryStore()
    with make_guard(store) as guard:
        assert guard.store is store


def test_make_guard_refuses_what_it_cannot_open() -> None:
    with pytest.raises(taskonce.ConfigError, match="needs path="):
        make_guard("sqlite")
    with pytest.raises(taskonce.ConfigError, match="use 'memory', 'sqlite', a store URL"):
        make_guard("redis")
    with pytest.raises(taskonce.ConfigError, match="mode"):
        make_guard(default={"mode": "sometimes"})


def test_fixtures_guard_events_and_factory(
    taskonce_guard: taskonce.Guard,
    taskonce_events: EventLog,
    taskonce_make_guard: Any,
    tmp_path: Path,
) -> None:
    assert isinstance(taskonce_guard.store, taskonce.MemoryStore)
    taskonce_guard.run("m-1", "q", lambda: None)
    assert taskonce_events.names() == ["claimed", "completed"]
    other = taskonce_make_guard("sqlite", default={"mode": "lazy"})
    assert isinstance(other.store, SQLStore) and other.default.mode == "lazy"
    assert list(tmp_path.glob("taskonce-*.db"))


@pytest.mark.taskonce_guard("sqlite", default={"mode": "lazy"}, queues={"eager": {}})
def test_the_marker_configures_the_guard_fixture(taskonce_guard: taskonce.Guard) -> None:
    assert isinstance(taskonce_guard.store, SQLStore)
    assert taskonce_guard.default.mode == "lazy"


# -- Celery: deliver twice ----------------------------------------------------------------------


def _celery_tasks(app: Celery, runs: list[Any]) -> None:
    @app.task(base=IdempotentTask, shared=False, name="charge", acks_late=True)
    def charge(order: str, cents: int = 0) -> str:
        runs.append(order)
        return f"charged {order}"

    @app.task(shared=False, name="plain")
    def plain(order: str) -> None:
        runs.append(order)

    @app.task(base=IdempotentTask, shared=False, name="broken")
    def broken(order: str) -> None:
        runs.append(order)
        raise ValueError("card declined")


def test_celery_assert_runs_once_passes_and_reports_each_delivery(
    taskonce_celery_app: Celery,
) -> None:
    runs: list[Any] = []
    _celery_tasks(taskonce_celery_app, runs)
    twice = assert_runs_once(
        taskonce_celery_app.tasks["charge"], ("A-1",), {"cents": 5}, message_id="t-1"
    )
    assert runs == ["A-1"]
    first, second = twice
    assert (first.outcome, second.outcome) == ("ran", "skipped")
    assert first.names == ["claimed", "completed"] and second.names == ["duplicate_skipped"]
    assert first.result.result == "charged A-1" and second.result.state == "IGNORED"
    assert first.framework == "celery" and first.task == "charge" and first.message_id == "t-1"
    assert twice.ran_once and first.ran and second.skipped


@pytest.mark.taskonce_guard(queues={"payments": {"mode": "lazy"}})
def test_celery_deliver_twice_on_a_named_queue(taskonce_celery_app: Celery) -> None:
    runs: list[Any] = []
    _celery_tasks(taskonce_celery_app, runs)
    first, second = deliver_twice(taskonce_celery_app.tasks["charge"], ("B-2",), queue="payments")
    assert first.names == ["marked"] and first.events[0]["queue"] == "payments"
    assert second.skipped and runs == ["B-2"]


def test_celery_assert_runs_once_on_an_unguarded_task(taskonce_celery_app: Celery) -> None:
    runs: list[Any] = []
    _celery_tasks(taskonce_celery_app, runs)
    with pytest.raises(AssertionError) as info:
        assert_runs_once(taskonce_celery_app.tasks["plain"], ("C-3",), message_id="t-3")
    text = str(info.value)
    assert text.startswith(
        "expected 'plain' to run once and the second delivery of message 't-3' to be skipped"
    )
    assert "delivery 1: ran unguarded: the guard emitted no event for it; events: none" in text
    assert "delivery 2: ran unguarded" in text
    assert "'plain' is not guarded: declare it with @app.task(base=IdempotentTask, …)" in text
    assert runs == ["C-3", "C-3"]


def test_celery_assert_runs_once_without_setup_names_it() -> None:
    app = Celery(f"no-setup-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    runs: list[Any] = []
    _celery_tasks(app, runs)
    with pytest.raises(AssertionError) as info:
        assert_runs_once(app.tasks["charge"], ("D-4",))
    text = str(info.value)
    assert "delivery 1: failed (ConfigError: Celery app" in text
    assert "its Celery app has no guard: call taskonce.celery_ext.setup(app, guard)" in text
    assert runs == []


def test_celery_assert_runs_once_with_eager_bypass_names_the_setting() -> None:
    app = Celery(f"bypass-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.taskonce_eager = "bypass"
    with make_guard() as guard:
        setup(app, guard)
        runs: list[Any] = []
        _celery_tasks(app, runs)
        with pytest.raises(AssertionError, match="taskonce_eager='bypass'"):
            assert_runs_once(app.tasks["charge"], ("E-5",))
    assert runs == ["E-5", "E-5"]


def test_celery_a_failing_task_is_reported_failed_twice(taskonce_celery_app: Celery) -> None:
    taskonce_celery_app.conf.task_eager_propagates = True  # reported all the same, not raised
    runs: list[Any] = []
    _celery_tasks(taskonce_celery_app, runs)
    with pytest.raises(AssertionError) as info:
        assert_runs_once(taskonce_celery_app.tasks["broken"], ("F-6",))
    text = str(info.value)
    assert "delivery 1: failed (ValueError: card declined); events: claimed, released" in text
    assert "the first delivery failed, so the second ran again" in text
    assert runs == ["F-6", "F-6"]


# -- Dramatiq: deliver twice --------------------------------------------------------------------


def test_dramatiq_assert_runs_once_on_the_stub_broker(taskonce_stub_broker: StubBroker) -> None:
    runs: list[Any] = []

    @dramatiq.actor(queue_name="payments", actor_name="charge")
    def charge(order: str, cents: int = 0) -> None:
        runs.append((order, cents))

    assert charge.broker is taskonce_stub_broker
    first, second = assert_runs_once(charge, ("A-1",), {"cents": 5}, message_id="m-1")
    assert runs == [("A-1", 5)]
    assert first.names == ["claimed", "completed"] and second.names == ["duplicate_skipped"]
    assert first.events[0]["key"] == "payments:m-1" and first.framework == "dramatiq"


def test_dramatiq_a_failing_actor_is_not_retried_and_is_reported(
    taskonce_stub_broker: StubBroker,
) -> None:
    runs: list[Any] = []

    @dramatiq.actor(actor_name="broken")  # Dramatiq's default retries: 15 s and more
    def broken() -> None:
        runs.append(1)
        raise ValueError("card declined")

    first, second = deliver_twice(broken, timeout=5)
    assert (first.outcome, second.outcome) == ("failed", "failed")
    assert first.names == ["claimed", "released"]
    assert isinstance(first.error, ValueError) and runs == [1, 1]


def test_dramatiq_assert_runs_once_without_the_middleware_names_it() -> None:
    broker = StubBroker()
    runs: list[Any] = []
    actor = dramatiq.actor(lambda: runs.append(1), broker=broker, actor_name="bare")
    try:
        with pytest.raises(AssertionError) as info:
            assert_runs_once(actor)
    finally:
        broker.close()
    assert "its broker has no IdempotencyMiddleware: add broker.add_middleware(" in str(info.value)
    assert runs == [1, 1]


def test_dramatiq_assert_runs_once_on_an_actor_that_opted_out(
    taskonce_stub_broker: StubBroker,
) -> None:
    actor = dramatiq.actor(lambda: None, actor_name="opted_out", idempotency=False)
    with pytest.raises(AssertionError, match=r"idempotency=False"):
        assert_runs_once(actor)


def test_dramatiq_deliver_twice_needs_the_stub_broker() -> None:
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url="redis://127.0.0.1:1/0")  # never connected to
    actor = dramatiq.actor(lambda: None, broker=broker, actor_name="elsewhere")
    with pytest.raises(taskonce.ConfigError) as raised:
        deliver_twice(actor)
    assert str(raised.value) == (
        "deliver_twice needs Dramatiq's StubBroker; actor 'elsewhere' is on RedisBroker "
        "(taskonce.testing.stub_broker(guard) makes one; with django_dramatiq, test settings "
        "whose DRAMATIQ_BROKER is dramatiq.brokers.stub.StubBroker with taskonce's middleware: "
        "see docs/django.md, Testing)"
    )


# -- plain Python -------------------------------------------------------------------------------


def test_plain_function_with_a_guard(taskonce_guard: taskonce.Guard) -> None:
    runs: list[int] = []

    def charge(cents: int) -> int:
        runs.append(cents)
        return cents

    first, second = assert_runs_once(charge, (5,), guard=taskonce_guard)
    assert first.result == 5 and second.skipped and runs == [5]
    assert first.framework == "python" and first.task.endswith("charge")
    with pytest.raises(taskonce.ConfigError, match="needs guard="):
        deliver_twice(charge)
    with pytest.raises(taskonce.ConfigError, match="neither a Celery task"):
        deliver_twice(42, guard=taskonce_guard)


# -- the sends a block made ---------------------------------------------------------------------


def test_captured_sends_celery_nothing_is_published(
    taskonce_celery_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[Any] = []
    _celery_tasks(taskonce_celery_app, runs)
    published: list[Any] = []
    # what reaches the broker: kombu's publish (a captured send is made, not published)
    monkeypatch.setattr(kombu.messaging.Producer, "publish", lambda *a, **k: published.append(a))
    charge = taskonce_celery_app.tasks["charge"]
    with captured_sends() as sent:
        charge.delay("A-1", cents=500)
        charge.apply_async(("B-2",), task_id="chosen-id", queue="payments", countdown=5)
    assert published == [] and runs == []
    assert [(s.framework, s.name, s.args, s.kwargs) for s in sent] == [
        ("celery", "charge", ("A-1",), {"cents": 500}),
        ("celery", "charge", ("B-2",), {}),
    ]
    assert sent[1].message_id == "chosen-id" and sent[1].queue == "payments"
    assert sent[1].options["eta"]  # the countdown, as Celery sends it: an ETA
    assert str(sent[0]) == f"celery charge('A-1', cents=500) [id {sent[0].message_id}]"
    charge.delay("C-3")  # after the block: published as usual
    assert len(published) == 1


def test_captured_sends_dramatiq_nothing_is_enqueued(taskonce_stub_broker: StubBroker) -> None:
    @dramatiq.actor(queue_name="mail", actor_name="receipt")
    def receipt(order: str) -> None: ...

    with captured_sends() as sent:
        message = receipt.send("A-1")
        receipt.send_with_options(args=("B-2",), delay=1000)
    assert taskonce_stub_broker.queues["mail"].qsize() == 0
    assert taskonce_stub_broker.queues["mail.DQ"].qsize() == 0
    assert [(s.framework, s.name, s.args, s.queue) for s in sent] == [
        ("dramatiq", "receipt", ("A-1",), "mail"),
        ("dramatiq", "receipt", ("B-2",), "mail"),
    ]
    assert sent[0].message_id == message.message_id  # the id the caller got back
    assert sent[1].options["delay"] == 1000
    assert isinstance(sent[0], CapturedSend)


def test_captured_sends_refuses_what_json_cannot_store(taskonce_stub_broker: StubBroker) -> None:
    actor = dramatiq.actor(lambda items: None, actor_name="takes_a_set")
    with (
        captured_sends() as sent,
        pytest.raises(taskonce.SendRefused, match="takes_a_set.*JSONEncoder.*set"),
    ):
        actor.send({1, 2})
    assert sent == []


def test_captured_sends_ends_with_its_block() -> None:
    with captured_sends():
        assert handoff.current() is not None
    assert handoff.current() is None


# -- the relay, now -----------------------------------------------------------------------------


def test_publish_pending_publishes_handoff_sends_whatever_their_age(
    taskonce_guard: taskonce.Guard,
) -> None:
    broker_up = False
    outbox: list[str] = []

    def publish(send: taskonce.Send) -> None:
        if not broker_up:
            raise ConnectionError("broker down")
        outbox.append(send.id)

    taskonce_guard.register_publisher("python", publish)

    def handler() -> None:
        capture = handoff.current()
        assert capture is not None
        capture.add("python", {"task": "ship"})
        capture.add("python", {"task": "mail"})

    taskonce_guard.run("m-1", "jobs", handler)
    assert outbox == [] and taskonce_guard.relay() == 0  # the relay leaves recent sends
    with pytest.raises(AssertionError, match="1 record.s. still have sends pending"):
        publish_pending(taskonce_guard)
    assert publish_pending(taskonce_guard, strict=False) == 0
    broker_up = True
    assert publish_pending(taskonce_guard) == 2  # two messages, one record
    assert len(outbox) == 2 and publish_pending(taskonce_guard) == 0


@pytest.mark.taskonce_guard("sqlite")
def test_publish_pending_sends_outbox_rows_then_drain_broker_runs_them(
    taskonce_guard: taskonce.Guard, taskonce_stub_broker: StubBroker
) -> None:
    runs: list[int] = []

    @dramatiq.actor(queue_name="payments", actor_name="charge_order")
    def charge_order(order_id: int) -> None:
        runs.append(order_id)

    store = taskonce_guard.store
    assert isinstance(store, SQLStore)
    publisher = taskonce_guard.dispatcher.publishers["dramatiq"]

    def down(send: taskonce.Send) -> None:
        raise ConnectionError("broker down")

    taskonce_guard.dispatcher.publishers["dramatiq"] = down
    with Session(store.engine) as session:
        with taskonce.send_on_commit(session, guard=taskonce_guard):
            session.execute(sa.text("SELECT 1"))
            charge_order.send(7)
        session.commit()  # the publish fails: the row waits for the relay
    assert taskonce_stub_broker.queues["payments"].qsize() == 0
    taskonce_guard.dispatcher.publishers["dramatiq"] = publisher
    assert publish_pending(taskonce_guard) == 1
    assert taskonce_stub_broker.queues["payments"].qsize() == 1
    drain_broker(taskonce_stub_broker)
    assert runs == [7] and taskonce_stub_broker.queues["payments"].qsize() == 0


def test_drain_broker_follows_sends_across_queues(taskonce_stub_broker: StubBroker) -> None:
    runs: list[str] = []

    @dramatiq.actor(queue_name="z-last", actor_name="second")
    def second() -> None:
        runs.append("second")

    @dramatiq.actor(queue_name="a-first", actor_name="first")
    def first() -> None:
        runs.append("first")
        second.send_with_options(delay=50)

    first.send()
    drain_broker(taskonce_stub_broker)
    assert runs == ["first", "second"]


def test_drain_broker_fails_fast_and_times_out_with_reasons(
    taskonce_stub_broker: StubBroker,
) -> None:
    @dramatiq.actor(actor_name="fails", max_retries=0)
    def fails() -> None:
        raise ValueError("card declined")

    @dramatiq.actor(actor_name="retries")  # Dramatiq's backoff: 15 s and more
    def retries() -> None:
        raise ValueError("card declined")

    fails.send()
    with pytest.raises(ValueError, match="card declined"):
        drain_broker(taskonce_stub_broker)
    drain_broker(taskonce_stub_broker, fail_fast=False)
    taskonce_stub_broker.flush_all()
    retries.send()
    with pytest.raises(TimeoutError, match=r"max_retries=0"):
        drain_broker(taskonce_stub_broker, timeout=0.5)
    taskonce_stub_broker.flush_all()


def test_helpers_build_celery_apps_and_stub_brokers() -> None:
    with make_guard() as guard:
        app = celery_app(guard, task_default_queue="work")
        assert app.conf.task_default_queue == "work" and app.conf.broker_url == "memory://"
        previous = dramatiq.get_broker()
        broker = stub_broker(guard, set_global=False)
        assert dramatiq.get_broker() is previous
        assert any(isinstance(m, IdempotencyMiddleware) for m in broker.middleware)
        broker.close()
        app.close()


# -- the plugin ---------------------------------------------------------------------------------


def test_loading_the_plugin_imports_no_framework() -> None:
    code = (
        "import sys, taskonce.pytest_plugin, taskonce.testing\n"
        "heavy = ('celery', 'dramatiq', 'django', 'sqlalchemy', 'redis', 'kombu')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


USER_TESTS = """
import dramatiq
import pytest
from celery import Celery

import taskonce
from taskonce.celery_ext import IdempotentTask
from taskonce.testing import assert_runs_once, captured_sends, drain_broker

closed = []


def test_guard_and_events(taskonce_guard, taskonce_events):
    taskonce_guard.run("m-1", "q", lambda: None)
    assert taskonce_events.names() == ["claimed", "completed"]
    original = taskonce_guard.close
    taskonce_guard.close = lambda: (closed.append(1), original())


def test_the_guard_of_the_test_before_was_closed():
    assert closed == [1]


@pytest.mark.taskonce_guard("sqlite", default={"mode": "lazy"})
def test_sqlite_guard(taskonce_guard, tmp_path):
    assert taskonce_guard.default.mode == "lazy"
    assert list(tmp_path.glob("*.db"))


def test_celery(taskonce_celery_app):
    @taskonce_celery_app.task(base=IdempotentTask, shared=False)
    def charge(order):
        return order

    assert_runs_once(charge, ("A-1",))


def test_dramatiq(taskonce_stub_broker):
    @dramatiq.actor
    def charge(order):
        pass

    assert_runs_once(charge, ("A-1",))
    with captured_sends() as sent:
        charge.send("B-2")
    assert [s.args for s in sent] == [("B-2",)]
    drain_broker(taskonce_stub_broker)


def test_unguarded_fails_clearly(taskonce_celery_app):
    @taskonce_celery_app.task(shared=False)
    def plain(order):
        return order

    assert_runs_once(plain, ("A-1",))
"""


def test_a_users_test_file_gets_the_fixtures_through_the_entry_point(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    # -p no:cacheprovider keeps the run inside pytester's directory; the plugin is not named:
    # pytest loads it from the installed distribution's pytest11 entry point.
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*expected 'test_user.plain' to run once and the second delivery of message*",
            "*'test_user.plain' is not guarded: declare it with @app.task(base=IdempotentTask*",
        ]
    )
