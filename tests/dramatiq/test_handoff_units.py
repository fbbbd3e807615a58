"""Fast in-process checks of the Dramatiq hand-off wiring (StubBroker, memory store).

The guarantees themselves are shown through real workers in ``test_handoff.py``; these pin
down the adapter's translation: what is captured, what is not, where the finisher sits, and
the ``relay_every`` option.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware, relay_guard
from taskonce.dramatiq_ext.handoff import Finisher


class Enqueued(dramatiq.Middleware):
    """Names of the actors whose messages reached the broker."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.names.append(message.actor_name)


def make(**policy: Any) -> tuple[StubBroker, taskonce.Guard, Enqueued]:
    broker = StubBroker()
    broker.emit_after("process_boot")
    enqueued = Enqueued()
    broker.add_middleware(enqueued)
    guard = taskonce.Guard(taskonce.MemoryStore(), default=taskonce.Policy(**policy))
    broker.add_middleware(IdempotencyMiddleware(guard))
    return broker, guard, enqueued


@pytest.fixture
def run() -> Iterator[Any]:
    workers: list[dramatiq.Worker] = []

    def run_all(broker: StubBroker) -> None:
        worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
        workers.append(worker)
        worker.start()
        broker.join("default", fail_fast=False)
        worker.join()

    yield run_all
    for worker in workers:
        worker.stop()


def declare(broker: StubBroker) -> dict[str, Any]:
    ran: list[Any] = []

    @dramatiq.actor(broker=broker, actor_name="child")
    def child(n: int) -> None:
        ran.append(n)

    @dramatiq.actor(broker=broker, actor_name="parent", max_retries=0)
    def parent(fail: bool) -> None:
        child.send(1)
        with taskonce.send_now():
            child.send(2)
        if fail:
            raise RuntimeError("parent fails")

    return {"child": child, "parent": parent, "ran": ran}


def test_the_finisher_comes_first(run: Any) -> None:
    broker, _, _ = make()
    declare(broker)
    assert isinstance(broker.middleware[0], Finisher)
    broker.close()


def test_failed_actor_sends_only_what_send_now_sent(run: Any) -> None:
    broker, _, enqueued = make()
    actors = declare(broker)
    actors["parent"].send(True)
    run(broker)
    assert actors["ran"] == [2]
    assert enqueued.names == ["parent", "child"]
    broker.close()


def test_successful_actor_sends_after_the_record(run: Any) -> None:
    broker, _, _ = make()
    actors = declare(broker)
    message = actors["parent"].send(False)
    run(broker)
    assert sorted(actors["ran"]) == [1, 2]
    key = f"default:{message.message_id}"
    record = broker_guard_record(broker, key)
    assert record is not None and not record.sends_pending
    broker.close()


def broker_guard_record(broker: StubBroker, key: str) -> Any:
    return relay_guard(broker).store.get(key)


def test_defer_sends_off_enqueues_at_once(run: Any) -> None:
    broker, _, _ = make(defer_sends=False)
    actors = declare(broker)
    actors["parent"].send(True)
    run(broker)
    assert sorted(actors["ran"]) == [1, 2]  # the failed actor's send left at once
    broker.close()


@pytest.mark.parametrize("value", [-1, "30", float("inf"), True])
def test_relay_every_is_checked(value: Any) -> None:
    with pytest.raises(taskonce.ConfigError, match="relay_every"):
        IdempotencyMiddleware(taskonce.Guard(taskonce.MemoryStore()), relay_every=value)


def test_relay_guard_needs_the_middleware() -> None:
    broker = StubBroker()
    with pytest.raises(taskonce.ConfigError, match="no IdempotencyMiddleware"):
        relay_guard(broker)
    broker.close()
