"""An ``idempotency`` option no policy can take stops the worker at boot; a configuration error
met while a message is processed dead-letters the message (failed, not acknowledged, not
retried) with the actor not run. In process (StubBroker) and with real worker processes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.brokers.stub import StubBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyConfigError, IdempotencyMiddleware
from taskonce.dramatiq_ext.middleware import EXIT_CONFIG
from taskonce.stores import MemoryStore
from tests.dramatiq.conftest import (
    RABBIT_REDIS,
    REDIS_REDIS,
    Harness,
    Stack,
    Worker,
    harness_for,
    make_config,
)
from tests.helpers import wait_for

WANTS_SQL = {"transactional": True}


@pytest.fixture
def stub() -> Iterator[tuple[StubBroker, IdempotencyMiddleware]]:
    broker = StubBroker()
    broker.emit_after("process_boot")
    middleware = IdempotencyMiddleware(taskonce.Guard(MemoryStore()))
    broker.add_middleware(middleware)
    yield broker, middleware
    broker.close()


def test_declaring_an_actor_that_needs_an_sql_store_is_refused(stub: Any) -> None:
    broker, _ = stub
    with pytest.raises(IdempotencyConfigError, match=r"actor 'ship'.*needs an SQL store"):
        dramatiq.actor(lambda: None, broker=broker, actor_name="ship", idempotency=WANTS_SQL)


def test_worker_boot_checks_every_actor_again(stub: Any) -> None:
    broker, middleware = stub
    ship = dramatiq.actor(lambda: None, broker=broker, actor_name="ship")
    ship.options["idempotency"] = WANTS_SQL  # changed after declaration
    middleware.policies.forget("ship")
    with pytest.raises(IdempotencyConfigError, match=r"actor 'ship'.*needs an SQL store"):
        dramatiq.Worker(broker, worker_timeout=20).start()


def test_config_error_while_processing_dead_letters_the_message(
    stub: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker, middleware = stub
    runs: list[int] = []
    ship = dramatiq.actor(lambda: runs.append(1), broker=broker, actor_name="ship")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        ship.options["idempotency"] = WANTS_SQL  # after the boot checks passed
        middleware.policies.forget("ship")
        with caplog.at_level(logging.ERROR, logger="taskonce.dramatiq"):
            message = ship.send()
            broker.join(ship.queue_name, fail_fast=False)
            worker.join()
    finally:
        worker.stop()
    assert runs == []
    assert [m.message_id for m in broker.dead_letters] == [message.message_id]
    assert f"message '{message.message_id}' dead-lettered, not run: configuration error" in (
        caplog.text
    )
    assert "needs an SQL store" in caplog.text


def test_dead_letter_log_line_shows_an_empty_id_quoted(
    stub: Any, caplog: pytest.LogCaptureFixture
) -> None:
    broker, _ = stub
    runs: list[int] = []
    ship = dramatiq.actor(lambda: runs.append(1), broker=broker, actor_name="ship")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        with caplog.at_level(logging.ERROR, logger="taskonce.dramatiq"):
            broker.enqueue(ship.message().copy(message_id=""))
            broker.join(ship.queue_name, fail_fast=False)
            worker.join()
    finally:
        worker.stop()
    assert runs == []
    assert "message '' dead-lettered, not run: message id '' is missing or empty" in caplog.text


# -- real workers ----------------------------------------------------------------------------


def test_real_worker_refuses_to_boot_with_an_actor_that_needs_an_sql_store(
    tmp_path: Path,
) -> None:
    config = make_config(REDIS_REDIS, tmp_path, "shared", bad_actor=True)
    worker = Worker(config, tmp_path / "worker.log").start()
    try:
        wait_for(lambda: not worker.alive, timeout=60, what="the worker to refuse to boot")
        output = worker.output()
        # one line and EX_CONFIG, from the worker process and the dramatiq command (before: a
        # traceback of IdempotencyConfigError out of the broker module's import, status 1)
        assert worker.proc is not None and worker.proc.returncode == EXIT_CONFIG, output
        assert "Traceback" not in output
        (line,) = [line for line in output.splitlines() if "does not start" in line]
        assert "actor 'wants_sql'" in line
        assert "needs an SQL store" in line
    finally:
        worker.kill()


@pytest.fixture(params=[REDIS_REDIS, RABBIT_REDIS], ids=lambda s: s.name)
def breaking(
    request: pytest.FixtureRequest, tmp_path: Path, pg_engine: sa.Engine
) -> Iterator[Harness]:
    stack: Stack = request.param
    with harness_for(stack, tmp_path, pg_engine, "shared", break_at_run=True) as harness:
        yield harness


def dead_lettered(h: Harness, message_id: str) -> bool:
    """Whether the broker holds ``message_id`` in the main queue's dead-letter queue."""
    xq = h.config.queue("main") + ".XQ"
    if h.config.broker.startswith("amqp"):
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(h.config.broker))
        try:
            channel = connection.channel()
            method, _, body = channel.basic_get(queue=xq, auto_ack=False)
            found = method is not None and message_id.encode() in body
            if method is not None:
                channel.basic_nack(method.delivery_tag, requeue=True)
            return found
        finally:
            connection.close()
    import redis

    client = redis.Redis.from_url(h.config.broker)
    try:
        # Keyed by the broker's own redis_message_id; the message (with its id) is the value.
        stored = client.hvals(f"{h.config.namespace}:{xq}.msgs")
        return any(message_id.encode() in body for body in stored)
    finally:
        client.close()


def test_real_worker_dead_letters_a_message_that_meets_a_config_error(
    breaking: Harness,
) -> None:
    h = breaking
    table = h.new_runs_table()
    try:
        message = h.send("misconfigured", table)
        h.wait(lambda: h.acks(message.message_id, "nack"), what="the message to be dead-lettered")
        assert h.acks(message.message_id, "ack") == []
        # The Redis broker sends its nacks in batches: wait for the dead letter to land.
        h.wait(lambda: dead_lettered(h, message.message_id), what="the dead letter on the broker")
        assert h.runs(table) == 0  # the actor never ran
        assert h.events(message.message_id) == []  # nothing claimed, nothing recorded
        output = h.workers[0].output()
        assert f"message '{message.message_id}' dead-lettered, not run: configuration error" in (
            output
        )
        assert "needs an SQL store" in output
        assert h.workers[0].alive
    finally:
        h.drop_table(table)
