"""Guarded Celery tasks on RabbitMQ quorum queues (``x-queue-type: quorum``) through a real
prefork worker: a duplicate, a SIGKILL mid-body, and a delivery limit (``x-delivery-limit``)
meeting a task whose pool process dies on every delivery.

Worker and publisher declare ``{prefix}.eager`` alike (tests/celery/queues.py). A quorum queue
has no global QoS; Celery 5.5 and later see the queue type and use a per-consumer prefetch.
The store is PostgreSQL (the SQS tests use Redis).
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery
import pytest

from tests.celery.conftest import (
    Stack,
    Table,
    Worker,
    broker_url,
    clean_broker,
    drop_store,
    new_prefix,
    publisher,
    store_url,
    worker_env,
)
from tests.celery.queues import quorum_queue
from tests.helpers import require_service, wait_for

if tuple(int(part) for part in celery.__version__.split(".")[:2]) < (5, 5):
    pytest.skip(
        "quorum queues need Celery 5.5 (no global QoS); docs/brokers.md", allow_module_level=True
    )

#: Three deliveries in all: RabbitMQ dead-letters a message returned a third time.
DELIVERY_LIMIT = 2


def start(tmp: Path, delivery_limit: int = 0) -> Stack:
    require_service("postgresql")
    require_service("redis")
    prefix = new_prefix()
    broker = broker_url("rabbitmq", 0)
    surl, namespace = store_url("postgresql")
    events = tmp / "events.jsonl"
    extra = {"TO_QUORUM": "1", "TO_DELIVERY_LIMIT": str(delivery_limit)}
    env = worker_env(prefix, broker, surl, namespace, events, extra)
    app = publisher(broker, prefix)
    app.conf.task_queues = [quorum_queue(prefix, delivery_limit)]
    if delivery_limit:
        declare_dead_letter_queue(app, prefix)
    worker = Worker(tmp, env, [f"{prefix}.eager"])
    try:
        worker.start()
    except BaseException:
        stop(Stack("rabbitmq", "postgresql", prefix, events, worker, app, surl, namespace))
        raise
    return Stack("rabbitmq", "postgresql", prefix, events, worker, app, surl, namespace)


def stop(stack: Stack) -> None:
    try:
        stack.worker.stop()
    finally:
        try:
            clean_broker(
                stack.app, str(stack.app.conf.broker_url), stack.prefix,
                [stack.q("eager"), stack.q("dead")],
            )  # fmt: skip
        finally:
            stack.app.close()
            drop_store(stack.store_url, stack.store_ns)


def declare_dead_letter_queue(app: Any, prefix: str) -> None:
    from kombu import Queue

    with app.connection_for_write() as conn:
        Queue(f"{prefix}.dead", channel=conn.channel()).declare()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start(tmp_path_factory.mktemp("celery-quorum"))
    try:
        yield running
    finally:
        stop(running)


def new_id() -> str:
    return str(uuid.uuid4())


def test_queue_is_a_quorum_queue(stack: Stack) -> None:
    """The worker consumes a quorum queue: RabbitMQ refuses to declare it as a classic one."""
    from amqp.exceptions import PreconditionFailed
    from kombu import Queue

    with stack.app.connection_for_write() as conn:
        with pytest.raises(PreconditionFailed, match="x-queue-type"):
            Queue(stack.q("eager"), queue_arguments={"x-queue-type": "classic"}).bind(
                conn.channel()
            ).queue_declare()


def test_duplicate_on_the_wire_runs_once(stack: Stack, runs: Table) -> None:
    """The same task id published five times on a quorum queue: one run, four skipped."""
    task_id = new_id()
    for _ in range(5):
        stack.send("t.record", (runs.name, "dup5"), "eager", task_id=task_id)

    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") >= 4,
        timeout=30,
        what="four duplicate_skipped events",
    )
    assert runs.count("dup5") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "completed") == 1
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "dup5"


def test_pool_process_killed_mid_body_runs_once_more(stack: Stack, runs: Table) -> None:
    """SIGKILL the pool process running the task: the quorum queue delivers the requeued
    message again (delivery count 1), which takes the dead child's claim over and runs."""
    task_id = new_id()
    stack.send(
        "t.record", (runs.name, "crash"), "eager", task_id=task_id, kwargs={"hang_first": True}
    )
    first = wait_for(lambda: runs.rows("crash"), timeout=20, what="the first run to start")
    child = first[0][4]
    os.kill(child, signal.SIGKILL)

    wait_for(
        lambda: stack.count(task_id, "completed") == 1, timeout=30, what="the re-run to complete"
    )
    rows = runs.rows("crash")
    assert len(rows) == 2 and rows[1][4] != child
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "lease_taken_over") == 1
    assert stack.worker.alive()


def test_delivery_limit_dead_letters_a_task_that_kills_its_worker_every_time(
    tmp_path: Path, runs: Table
) -> None:
    """``x-delivery-limit: 2``: a task whose pool process dies on every delivery runs three
    times (each redelivery takes the dead child's claim over, as taskonce does for any
    crash), then RabbitMQ dead-letters the message (``x-death`` reason ``delivery_limit``).
    The broker's limit ends the crash loop; the record stays a claim of a dead worker, never
    completed, so nothing is marked done that did not finish (docs/brokers.md)."""
    stack = start(tmp_path, delivery_limit=DELIVERY_LIMIT)
    try:
        task_id = new_id()
        stack.send(
            "t.record", (runs.name, "doomed"), "eager", task_id=task_id, kwargs={"sleep": 120}
        )
        for attempt in range(1, DELIVERY_LIMIT + 2):
            rows = wait_for(
                lambda n=attempt: len(runs.rows("doomed")) >= n and runs.rows("doomed"),
                timeout=30,
                what=f"run {attempt} to start",
            )
            os.kill(rows[attempt - 1][4], signal.SIGKILL)

        with stack.app.connection_for_write() as conn:
            channel = conn.channel()
            dead = wait_for(
                lambda: channel.basic_get(stack.q("dead"), no_ack=True),
                timeout=30,
                interval=0.2,
                what="the message in the dead-letter queue",
            )
        assert dead.headers["id"] == task_id
        assert dead.headers["x-death"][0]["reason"] == "delivery_limit"
        assert runs.count("doomed") == DELIVERY_LIMIT + 1
        assert stack.count(task_id, "claimed") == 1
        assert stack.count(task_id, "lease_taken_over") == DELIVERY_LIMIT
        assert stack.count(task_id, "completed") == 0
        assert stack.worker.alive()
    finally:
        stop(stack)
