"""``taskonce.current_key()``: the delivery's key inside a guarded handler, ``None`` outside.

In process: ``Guard.run``, a Celery task run eagerly, a Dramatiq actor on the StubBroker with a
real ``dramatiq.Worker``. Real workers killed mid-task: tests/celery/test_outside_api.py and
tests/dramatiq/test_outside_api.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from celery import Celery
from dramatiq.brokers.stub import StubBroker

import taskonce
from taskonce.celery_ext import IdempotentTask, setup
from taskonce.dramatiq_ext import IdempotencyMiddleware
from taskonce.errors import StoreUnavailable
from taskonce.stores import MemoryStore


class DownStore(MemoryStore):
    """A memory store whose claims and look-ups fail as if it were unreachable."""

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("store down (test)")

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("store down (test)")


def test_outside_a_handler_there_is_no_key() -> None:
    assert taskonce.current_key() is None


def test_guard_run_gives_the_key_the_guard_claims_and_resets_it() -> None:
    guard = taskonce.Guard(MemoryStore())
    outcome = guard.run("m1", "payments", taskonce.current_key)
    assert outcome.status == "ran"
    assert outcome.value == outcome.key == "payments:m1"
    assert taskonce.current_key() is None


def test_the_key_is_the_same_on_a_retry_after_a_failure() -> None:
    guard = taskonce.Guard(MemoryStore())
    seen: list[str | None] = []

    def charge(fail: bool) -> None:
        seen.append(taskonce.current_key())
        if fail:
            raise RuntimeError("the first attempt fails")

    with pytest.raises(RuntimeError):
        guard.run("m1", "payments", charge, True)
    assert taskonce.current_key() is None  # reset after a raising handler too
    guard.run("m1", "payments", charge, False)
    assert seen == ["payments:m1", "payments:m1"]


def test_identity_id_keys_on_the_message_id_alone() -> None:
    guard = taskonce.Guard(MemoryStore(), default={"identity": "id"})
    assert guard.run("m1", "payments", taskonce.current_key).value == "m1"


def test_a_guarded_run_inside_a_handler_has_its_own_key_then_the_outer_one_again() -> None:
    guard = taskonce.Guard(MemoryStore())
    seen: list[str | None] = []

    def outer() -> None:
        seen.append(taskonce.current_key())
        guard.run("inner", "emails", lambda: seen.append(taskonce.current_key()))
        seen.append(taskonce.current_key())

    guard.run("outer", "payments", outer)
    assert seen == ["payments:outer", "emails:inner", "payments:outer"]


def test_unguarded_runs_fail_open_keeps_the_key_disabled_has_none() -> None:
    opened = taskonce.Guard(DownStore(), default={"on_store_error": "fail_open"})
    outcome = opened.run("m1", "payments", taskonce.current_key)
    assert (outcome.status, outcome.value) == ("unguarded", "payments:m1")
    disabled = taskonce.Guard(MemoryStore(), default={"enabled": False})
    outcome = disabled.run("m1", "payments", taskonce.current_key)
    assert (outcome.status, outcome.value) == ("unguarded", None)
    assert taskonce.current_key() is None


# -- Celery, eagerly (the real worker: tests/celery/test_outside_api.py) ----------------------


@pytest.fixture
def celery_app() -> Iterator[Celery]:
    app = Celery(f"key-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="work")
    setup(app, taskonce.Guard(MemoryStore(), queues={"off": {"enabled": False}}))
    yield app
    app.close()


def test_celery_task_body_sees_its_key_on_every_retry(celery_app: Celery) -> None:
    seen: list[tuple[int, str | None]] = []

    @celery_app.task(base=IdempotentTask, shared=False, bind=True, name="charge", max_retries=3)
    def charge(self: Any, fails: int) -> str | None:
        seen.append((self.request.retries, taskonce.current_key()))
        if self.request.retries < fails:
            raise self.retry(countdown=0)
        return taskonce.current_key()

    result = charge.apply((2,), task_id="t-1")
    assert result.get() == "work:t-1"
    assert seen == [(0, "work:t-1"), (1, "work:t-1"), (2, "work:t-1")]
    assert taskonce.current_key() is None
    # not guarded: a direct call, and a queue whose policy is enabled=False
    assert charge(0) is None
    assert charge.apply((0,), task_id="t-2", queue="off").get() is None


# -- Dramatiq, a real dramatiq.Worker on the StubBroker ---------------------------------------


def test_dramatiq_actor_sees_its_key_and_the_next_message_none() -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")
    guard = taskonce.Guard(MemoryStore())
    broker.add_middleware(IdempotencyMiddleware(guard))
    seen: list[tuple[str, str | None]] = []

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=0)
    def charge(order: str) -> None:
        seen.append((order, taskonce.current_key()))

    @dramatiq.actor(broker=broker, queue_name="payments", idempotency=False, max_retries=0)
    def plain(order: str) -> None:
        seen.append((order, taskonce.current_key()))

    # one worker thread: both messages run in the same thread, one after the other
    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        first = charge.send("a")
        broker.join("payments")
        worker.join()
        plain.send("b")
        broker.join("payments")
        worker.join()
        broker.enqueue(first)  # the same message again: a duplicate, not run
        broker.join("payments")
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert seen == [("a", f"payments:{first.message_id}"), ("b", None)]
    assert taskonce.current_key() is None


def test_dramatiq_async_actor_sees_its_key() -> None:
    """An ``async def`` actor runs on the AsyncIO middleware's event-loop thread, started with a
    copy of the worker thread's context: the key is there too."""
    from dramatiq.middleware.asyncio import AsyncIO

    broker = StubBroker()
    broker.emit_after("process_boot")
    broker.add_middleware(AsyncIO())
    broker.add_middleware(IdempotencyMiddleware(taskonce.Guard(MemoryStore())))
    seen: list[str | None] = []

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=0)
    async def charge(order: str) -> None:
        seen.append(taskonce.current_key())

    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        message = charge.send("a")
        broker.join("payments")
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert seen == [f"payments:{message.message_id}"]
