"""A send published to a broker that lives in one process (Celery's ``memory://``, as a shell
may override it; Dramatiq's StubBroker) while the store is shared with other processes awaits
no receipt: a relay of another process, on another broker, never publishes it again there.
With a real broker (the control) the receipt is awaited as usual."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce.handoff import Send
from tests.helpers import require_service


def _parent_sends_a_child(tmp_path: Path, broker_url: str) -> tuple[taskonce.Guard, Any, str]:
    """A guard on a shared (SQLite file) store, a Celery app on ``broker_url`` whose guarded
    task ``parent`` sends the guarded ``child`` to a queue of its own; ``parent`` run once."""
    from celery import Celery

    from taskonce.celery_ext import IdempotentTask, setup

    store = taskonce.open_store(f"sqlite:///{tmp_path / 'store.db'}")
    guard = taskonce.Guard(store, default={"confirm_within": 60})
    app = Celery(f"local-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(broker_url=broker_url)
    setup(app, guard)
    queue = f"local-{uuid.uuid4().hex[:8]}"

    @app.task(base=IdempotentTask, name="t.child", shared=False)
    def child() -> None: ...

    def parent() -> None:
        child.apply_async(queue=queue)

    assert guard.run(f"m-{uuid.uuid4().hex[:6]}", "parents", parent).status == "ran"
    return guard, app, queue


def test_a_send_to_celerys_memory_broker_awaits_no_receipt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="taskonce")
    guard, app, _ = _parent_sends_a_child(tmp_path, "memory://")
    try:
        stats = guard.store.stats()
        assert stats["sends_pending"] == 0  # published (into memory://)
        assert stats["receipts_awaited"] == 0  # nothing for a relay elsewhere to publish again
        assert guard.relay(older_than=0) == 0
    finally:
        guard.close()
        app.close()


def test_the_control_a_real_broker_awaits_the_receipt(tmp_path: Path) -> None:
    require_service("redis")
    import redis

    guard, app, queue = _parent_sends_a_child(tmp_path, "redis://127.0.0.1:6379/14")
    client: Any = redis.Redis.from_url("redis://127.0.0.1:6379/14")
    try:
        assert client.llen(queue) == 1
        assert guard.store.stats()["receipts_awaited"] == 1
    finally:
        client.delete(queue)
        client.close()
        guard.close()
        app.close()


def test_dramatiqs_stub_broker_with_a_shared_store_awaits_no_receipt(tmp_path: Path) -> None:
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from taskonce.dramatiq_ext import IdempotencyMiddleware

    send = Send(
        "child-1",
        "dramatiq",
        {"queue_name": "mail", "actor_name": "child", "message_timestamp": 0},
        60.0,
    )
    receipts = []
    for store in (taskonce.open_store(f"sqlite:///{tmp_path / 's.db'}"), taskonce.MemoryStore()):
        guard = taskonce.Guard(store, default={"confirm_within": 60})
        broker = StubBroker()
        broker.add_middleware(IdempotencyMiddleware(guard, relay_every=0))
        dramatiq.actor(lambda: None, actor_name="child", queue_name="mail", broker=broker)
        try:
            receipts.append(guard.dispatcher.publishers["dramatiq"](send))
            assert broker.queues["mail"].qsize() == 1  # published either way
        finally:
            broker.close()
            guard.close()
    shared, in_process = receipts
    assert shared is None  # the store outlives the StubBroker's process: nothing awaited
    assert in_process is not None and in_process.key == "mail:child-1"  # as before
