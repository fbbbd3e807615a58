"""Eager mode (``apply()``, ``task_always_eager``), settings, ``setup`` validation, the purge
task — everything that needs no worker process."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import taskonce
from taskonce.celery_ext import IdempotentTask, lease_beyond, setup
from tests.helpers import free_port, wait_for


class Events:
    """An in-memory event sink."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        self.items.append(dict(event))

    def names(self, message_id: str) -> list[str]:
        return [e["event"] for e in self.items if e["message_id"] == message_id]


def make_app(**conf: Any) -> Celery:
    app = Celery(f"eager-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="work", **conf)
    return app


@pytest.fixture
def sink() -> Events:
    return Events()


@pytest.fixture
def guarded(sink: Events) -> tuple[Celery, taskonce.Guard, list[Any]]:
    app = make_app()
    guard = taskonce.Guard(
        taskonce.MemoryStore(), queues={"payments": {"mode": "lazy"}}, events=[sink]
    )
    setup(app, guard)
    calls: list[Any] = []

    @app.task(
        base=IdempotentTask, shared=False, bind=True, acks_late=True, name="charge", max_retries=5
    )
    def charge(self: Any, order: str, fails: int = 0) -> dict[str, Any]:
        calls.append((order, self.request.retries))
        if self.request.retries < fails:
            raise self.retry(countdown=0)
        return {"order": order, "attempts": self.request.retries + 1}

    @app.task(
        base=IdempotentTask,
        shared=False,
        name="auto",
        autoretry_for=(ValueError,),
        retry_kwargs={"countdown": 0, "max_retries": 5},
    )
    def auto(order: str, fails: int) -> str:
        calls.append((order, "auto"))
        if sum(1 for c in calls if c == (order, "auto")) <= fails:
            raise ValueError("fails on purpose")
        return order

    return app, guard, calls


# -- eager mode ------------------------------------------------------------------------------


def test_eager_apply_is_guarded_under_the_default_queue(guarded: Any, sink: Events) -> None:
    app, _, calls = guarded
    task_id = str(uuid.uuid4())
    first = app.tasks["charge"].apply(("A-1",), task_id=task_id)
    again = app.tasks["charge"].apply(("A-1",), task_id=task_id)

    assert first.state == "SUCCESS" and first.result == {"order": "A-1", "attempts": 1}
    assert again.state == "IGNORED"  # a duplicate: Ignore, no result, no callbacks
    assert calls == [("A-1", 0)]
    assert sink.names(task_id) == ["claimed", "completed", "duplicate_skipped"]
    event = sink.items[0]
    assert event["queue"] == "work"  # eager runs: the task's default queue
    assert event["key"] == f"work:{task_id}"
    assert event["framework"] == "celery"
    assert event["redelivered"] is None


def test_eager_retry_and_autoretry_release_and_complete_once(guarded: Any, sink: Events) -> None:
    app, _, calls = guarded
    task_id = str(uuid.uuid4())
    result = app.tasks["charge"].apply(("B-2", 2), task_id=task_id)
    assert result.result == {"order": "B-2", "attempts": 3}
    assert calls == [("B-2", 0), ("B-2", 1), ("B-2", 2)]
    names = sink.names(task_id)
    assert names.count("claimed") == 3 and names.count("released") == 2
    assert names.count("completed") == 1

    auto_id = str(uuid.uuid4())
    assert app.tasks["auto"].apply(("C-3", 2), task_id=auto_id).result == "C-3"
    assert sink.names(auto_id).count("released") == 2
    assert sink.names(auto_id).count("completed") == 1


def test_always_eager_apply_async_uses_the_named_queue_policy(guarded: Any, sink: Events) -> None:
    app, _, _ = guarded
    app.conf.task_always_eager = True
    task_id = str(uuid.uuid4())
    app.tasks["charge"].apply_async(("D-4",), task_id=task_id, queue="payments")
    assert sink.names(task_id) == ["marked"]  # the lazy policy of "payments"
    assert sink.items[-1]["queue"] == "payments"


def test_eager_bypass_setting_runs_unguarded(sink: Events) -> None:
    app = make_app(taskonce_eager="bypass")
    setup(app, taskonce.Guard(taskonce.MemoryStore(), events=[sink]))
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, name="bypassed")
    def bypassed(x: int) -> int:
        runs.append(x)
        return x

    task_id = str(uuid.uuid4())
    bypassed.apply((1,), task_id=task_id)
    bypassed.apply((1,), task_id=task_id)
    assert runs == [1, 1]
    assert sink.items == []


def test_eager_run_of_a_key_in_progress_elsewhere_raises(guarded: Any) -> None:
    app, guard, calls = guarded
    task_id = str(uuid.uuid4())
    guard.store.claim(f"work:{task_id}", "another-owner", 60, 600, None)
    with pytest.raises(taskonce.InProgressElsewhere) as info:
        app.tasks["charge"].apply(("E-5",), task_id=task_id, throw=True)
    assert 0 < info.value.retry_after <= 60
    assert app.tasks["charge"].apply(("E-5",), task_id=task_id).state == "FAILURE"
    assert calls == []


def test_eager_payload_mismatch_and_store_down_raise(guarded: Any) -> None:
    app, _, calls = guarded
    task_id = str(uuid.uuid4())
    app.tasks["charge"].apply(("F-6",), task_id=task_id)
    with pytest.raises(taskonce.PayloadMismatch):
        app.tasks["charge"].apply(("F-7",), task_id=task_id, throw=True)
    assert calls == [("F-6", 0)]

    down = make_app()
    setup(down, taskonce.Guard(taskonce.open_store(f"redis://127.0.0.1:{free_port()}/0")))

    @down.task(base=IdempotentTask, shared=False, name="never")
    def never() -> None:
        raise AssertionError("must not run with the store down (fail_closed)")

    with pytest.raises(taskonce.StoreUnavailable):
        never.apply(throw=True)


def test_direct_call_is_a_plain_function_call(guarded: Any, sink: Events) -> None:
    app, _, calls = guarded
    assert app.tasks["charge"]("G-8") == {"order": "G-8", "attempts": 1}
    assert app.tasks["charge"]("G-8") == {"order": "G-8", "attempts": 1}
    assert len(calls) == 2
    assert sink.items == []


def test_lease_defaults_beyond_the_hard_time_limit(sink: Events, caplog: Any) -> None:
    app = make_app()
    setup(app, taskonce.Guard(taskonce.MemoryStore(), events=[sink]))

    @app.task(base=IdempotentTask, shared=False, name="limited", time_limit=600)
    def limited() -> None:
        return None

    @app.task(
        base=IdempotentTask, shared=False, name="short", time_limit=600, idempotency={"lease": 30}
    )
    def short() -> None:
        return None

    limited.apply(task_id="l1")
    assert sink.items[0]["lease_s"] == lease_beyond(600) == 660.0
    with caplog.at_level(logging.WARNING, logger="taskonce.celery"):
        short.apply(task_id="s1")
    assert next(e["lease_s"] for e in sink.items if e["message_id"] == "s1") == 30.0
    assert "a claim can run out while the body still runs" in caplog.text

    @app.task(base=IdempotentTask, shared=False, name="quick", time_limit=60)
    def quick() -> None:
        return None

    quick.apply(task_id="q1")  # a limit under the 300 s default lease changes nothing
    assert next(e["lease_s"] for e in sink.items if e["message_id"] == "q1") == 300.0


def test_store_result_duplicate_logs_the_first_result(sink: Events, caplog: Any) -> None:
    app = make_app()
    setup(app, taskonce.Guard(taskonce.MemoryStore(), default={"store_result": True}))

    @app.task(base=IdempotentTask, shared=False, name="priced")
    def priced(cents: int) -> dict[str, int]:
        return {"charged": cents}

    priced.apply((500,), task_id="p1")
    with caplog.at_level(logging.INFO, logger="taskonce.celery"):
        assert priced.apply((500,), task_id="p1").state == "IGNORED"
    assert "the first run returned {'charged': 500}" in caplog.text


def test_settings_alone_build_the_guard(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    app = make_app(
        taskonce_store="memory://",
        taskonce_default={"mode": "lazy"},
        taskonce_events=str(events),
    )

    @app.task(base=IdempotentTask, shared=False, name="configured")
    def configured() -> str:
        return "ok"

    assert configured.apply(task_id="c1").result == "ok"
    assert configured.apply(task_id="c1").state == "IGNORED"
    assert [e["event"] for e in taskonce.events.read_jsonl(events)] == [
        "marked",
        "duplicate_skipped",
    ]


def test_purge_task_deletes_expired_records(tmp_path: Path, sink: Events) -> None:
    app = make_app()
    store = taskonce.open_store(f"sqlite:///{tmp_path}/purge.db")
    setup(app, taskonce.Guard(store, events=[sink]))
    store.mark("work:old", 0.05, None, None)
    store.mark("work:new", 3600, None, None)
    wait_for(lambda: store.get("work:old") is None, timeout=5, what="the short mark to expire")

    assert app.tasks["taskonce.celery_ext.purge"].apply().result == 1
    assert [e["event"] for e in sink.items] == ["purged"]
    assert store.get("work:new") is not None
    store.close()


# -- setup-time validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "words"),
    [
        ({"taskonce_default": {"mode": "sometimes"}}, ["taskonce_default", "Policy.mode"]),
        (
            {"taskonce_queues": {"payments": {"lease": -1}}},
            ["taskonce_queues['payments']", "lease"],
        ),
        ({"taskonce_queues": {"payments": {"leese": 3}}}, ["payments", "leese"]),
        ({"taskonce_queues": ["payments"]}, ["taskonce_queues"]),
        ({"taskonce_eager": "maybe"}, ["taskonce_eager"]),
        ({"taskonce_store_retry_delay": 0}, ["taskonce_store_retry_delay"]),
        ({"taskonce_events": 42}, ["taskonce_events"]),
        ({"taskonce_default": {"transactional": True}}, ["transactional", "SQL store"]),
        (
            {"taskonce_queues": {"payments": {"mode": "lazy", "check_first": False}}},
            ["taskonce_queues['payments']", "check_first=False needs", "transactional=True"],
        ),
        ({"taskonce_store": "mongodb://x"}, ["unknown store URL scheme"]),
    ],
)
def test_misconfigured_settings_fail_at_setup(conf: dict[str, Any], words: list[str]) -> None:
    app = make_app(**{"taskonce_store": "memory://", **conf})
    with pytest.raises(taskonce.ConfigError) as info:
        setup(app)
    for word in words:
        assert word in str(info.value)


def test_optimistic_policy_from_the_settings(tmp_path: Any) -> None:
    """check_first travels through the settings like every Policy field."""
    app = make_app(
        taskonce_store=f"sqlite:///{tmp_path}/s.db",
        taskonce_queues={"payments": {"mode": "lazy", "transactional": True, "check_first": False}},
    )
    guard = setup(app)
    try:
        assert guard.policy_for("payments").check_first is False
        assert guard.policy_for("other").check_first is True
    finally:
        guard.close()


def test_setup_without_store_or_guard_names_the_setting() -> None:
    with pytest.raises(taskonce.ConfigError, match="taskonce_store"):
        setup(make_app())
    with pytest.raises(taskonce.ConfigError, match=r"taskonce\.Guard"):
        setup(make_app(), "redis://localhost")  # type: ignore[arg-type]


def test_misconfigured_task_option_fails_at_finalize_and_at_setup() -> None:
    app = make_app()

    @app.task(base=IdempotentTask, shared=False, name="typo", idempotency={"mode": "bogus"})
    def typo() -> None:
        return None

    with pytest.raises(taskonce.ConfigError, match=r"task 'typo'.*Policy\.mode='bogus'"):
        app.finalize()

    other = make_app()

    @other.task(
        base=IdempotentTask, shared=False, name="wants_sql", idempotency={"transactional": True}
    )
    def wants_sql() -> None:
        return None

    other.finalize()
    with pytest.raises(taskonce.ConfigError, match=r"task 'wants_sql'.*SQL store"):
        setup(other, taskonce.Guard(taskonce.MemoryStore()))


def test_queue_header_is_stamped_at_publish(guarded: Any) -> None:
    """The before_task_publish receiver writes the destination queue into the headers."""
    from celery.signals import before_task_publish

    from taskonce.celery_ext import QUEUE_HEADER
    from taskonce.celery_ext.routing import publish_queue

    app, _, _ = guarded
    seen: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    before_task_publish.connect(capture, weak=False)
    try:
        app.tasks["charge"].apply_async(("H-9",), queue="payments")
        app.tasks["charge"].apply_async(("H-9",))
    finally:
        before_task_publish.disconnect(capture)
    assert [h[QUEUE_HEADER] for h in seen] == ["payments", "work"]

    # Published to an exchange without a declared queue (how a retry goes back): the
    # anonymous exchange's routing key, else the queue bound to exchange + key, else the key.
    assert publish_queue("", "by-key", None, app) == "by-key"
    assert publish_queue("work", "work", None, app) == "work"
    assert publish_queue("topic", "a.b", None, app) == "a.b"
