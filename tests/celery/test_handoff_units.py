"""Fast in-process checks of the Celery hand-off wiring (eager runs, memory broker and store).

The guarantees themselves are shown through real workers in ``test_handoff.py``; these pin
down the adapter's translation: what is captured, what is not, and the settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kombu.messaging
import pytest
from celery import Celery
from celery.signals import before_task_publish

import taskonce
from taskonce.celery_ext import IdempotentTask, relay_guard, setup


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Names of the tasks published to the broker while the test runs (kombu's publish: a
    captured send is made when it is sent, and reaches the broker after the record)."""
    names: list[str] = []
    original = kombu.messaging.Producer.publish

    def record(producer: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(str((kwargs.get("headers") or {}).get("task")))
        return original(producer, body, *args, **kwargs)

    monkeypatch.setattr(kombu.messaging.Producer, "publish", record)
    yield names


def make_app(**policy: Any) -> tuple[Celery, taskonce.Guard, Any]:
    app = Celery("units", broker="memory://", set_as_current=False)
    guard = taskonce.Guard(taskonce.MemoryStore(), default=taskonce.Policy(**policy))
    setup(app, guard)

    @app.task(name="u.child", shared=False)
    def child(n: int) -> int:
        return n

    @app.task(base=IdempotentTask, bind=True, acks_late=True, name="u.parent", shared=False)
    def parent(self: Any, fail: bool = False) -> str:
        child.delay(1)
        with taskonce.send_now():
            child.delay(2)
        if fail:
            raise RuntimeError("parent fails")
        return "ok"

    return app, guard, parent


def test_sends_wait_for_the_record_except_send_now(published: list[str]) -> None:
    app, _, parent = make_app()
    parent.apply(task_id="p-1", kwargs={"fail": True})
    assert published == ["u.child"]  # the send_now one; the deferred one was discarded
    published.clear()
    assert parent.apply(task_id="p-2").get() == "ok"
    assert published == ["u.child", "u.child"]  # send_now at once, the deferred one after
    app.close()


def test_defer_sends_off_publishes_at_once(published: list[str]) -> None:
    app, _, parent = make_app(defer_sends=False)
    parent.apply(task_id="p-3", kwargs={"fail": True})
    assert published == ["u.child", "u.child"]
    app.close()


def test_the_id_of_a_deferred_send_is_fixed_and_returned(published: list[str]) -> None:
    app, _, _ = make_app()
    ids: list[str] = []

    @app.task(base=IdempotentTask, bind=True, acks_late=True, name="u.ids", shared=False)
    def ids_task(self: Any) -> None:
        ids.append(app.send_task("u.child", args=(1,)).id)
        ids.append(app.send_task("u.child", args=(2,), task_id="mine").id)

    ids_task.apply(task_id="p-4")
    assert ids == [taskonce.handoff.derive_id("celery:p-4", 0), "mine"]
    app.close()


@pytest.mark.parametrize("value", [-1, "30", float("nan"), True])
def test_relay_every_setting_is_checked(value: Any) -> None:
    app = Celery("units", broker="memory://", set_as_current=False)
    app.conf.taskonce_relay_every = value
    with pytest.raises(taskonce.ConfigError, match="taskonce_relay_every"):
        setup(app, taskonce.Guard(taskonce.MemoryStore()))
    app.close()


def test_relay_guard_is_the_apps_guard() -> None:
    app, guard, _ = make_app()
    assert relay_guard(app) is guard
    app.close()


def test_kombu_json_types_survive_the_capture(published: list[str]) -> None:
    """What Celery's JSON serializer sends (datetime, date, UUID, Decimal) is captured in kombu's
    tagged JSON and published as the same values; a set (which it cannot send) is refused."""
    import datetime
    import decimal
    import uuid

    app, _, _ = make_app()
    sent: list[tuple[Any, Any]] = []

    @before_task_publish.connect(weak=False)
    def keep(sender: Any = None, body: Any = None, **_: Any) -> None:
        if sender == "u.child":
            sent.append((body[0], body[1]))

    when = datetime.datetime(2026, 1, 31, 12, 0, tzinfo=datetime.timezone.utc)
    ident = uuid.UUID("9bd0fdf8-8c43-485e-8165-473e5bdb792d")
    values = [when, datetime.date(2026, 2, 1), ident, decimal.Decimal("1.50")]

    @app.task(base=IdempotentTask, bind=True, acks_late=True, name="u.typed", shared=False)
    def typed(self: Any) -> None:
        app.send_task("u.child", args=values, kwargs={"at": when})

    @app.task(base=IdempotentTask, bind=True, acks_late=True, name="u.odd", shared=False)
    def odd(self: Any) -> None:
        app.send_task("u.child", args=({"a", "set"},))

    try:
        typed.apply(task_id="p-typed").get()
        assert sent == [(values, {"at": when})]
        result = odd.apply(task_id="p-odd")
        assert isinstance(result.result, taskonce.SendRefused)
        assert "u.odd" in str(result.result) and "args[0] (set)" in str(result.result)
        assert published == ["u.child"]  # the refused one never reaches the broker
    finally:
        before_task_publish.disconnect(keep)
        app.close()
