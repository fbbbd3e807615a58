"""The broker settings that keep a killed worker process's messages from coming back, said once
when a worker starts (:mod:`taskonce.dramatiq_ext.requeue`).

RabbitMQ needs nothing; Dramatiq's Redis broker moves a dead worker's messages back through its
maintenance, which ``maintenance_chance=0`` turns off, after ``heartbeat_timeout``, which must
stay shorter than the guard's ``keep_for``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import dramatiq
import pytest
import sqlalchemy as sa
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware
from taskonce.dramatiq_ext.requeue import requeue_warnings
from tests.dramatiq.conftest import REDIS_REDIS, harness_for

URL = "redis://127.0.0.1:6379/8"  # never connected to: the checks read settings only
WEEK = taskonce.Policy()


def test_redis_broker_defaults_need_no_warning() -> None:
    assert requeue_warnings(RedisBroker(url=URL), [("charge", WEEK)]) == []


def test_maintenance_off_loses_a_killed_process_s_messages() -> None:
    lines = requeue_warnings(RedisBroker(url=URL, maintenance_chance=0), [("charge", WEEK)])
    assert len(lines) == 1
    assert lines[0].startswith("taskonce: the Redis broker has maintenance_chance=0:")
    assert "never moved back to their queue" in lines[0]


def test_heartbeat_as_long_as_keep_for_names_the_actor() -> None:
    broker = RedisBroker(url=URL, heartbeat_timeout=3_600_000)  # an hour
    policies = [
        ("charge", WEEK),
        ("remind", taskonce.Policy(keep_for=1800)),  # the shortest: named
        ("ping", taskonce.Policy(keep_for=60, enabled=False)),  # not guarded: ignored
        ("plain", None),  # idempotency=False
    ]
    lines = requeue_warnings(broker, policies)
    assert len(lines) == 1
    assert (
        "heartbeat_timeout (3600 s) is not shorter than keep_for (1800 s) of actor remind"
        in (lines[0])
    )
    assert requeue_warnings(broker, [("charge", WEEK)]) == []


def test_rabbitmq_and_other_brokers_need_nothing() -> None:
    rabbit = RabbitmqBroker(url="amqp://guest:guest@127.0.0.1:5672/%2F")
    try:
        assert requeue_warnings(rabbit, [("charge", WEEK)]) == []
    finally:
        rabbit.close()
    assert requeue_warnings(StubBroker(), [("charge", WEEK)]) == []


@pytest.fixture
def guard() -> Iterator[taskonce.Guard]:
    with taskonce.Guard(taskonce.open_store("memory://")) as guard:
        yield guard


def test_the_middleware_says_it_once_per_worker(
    guard: taskonce.Guard, caplog: pytest.LogCaptureFixture
) -> None:
    broker = RedisBroker(url=URL, maintenance_chance=0)
    middleware = IdempotencyMiddleware(guard)
    broker.add_middleware(middleware)

    @dramatiq.actor(broker=broker, queue_name="payments")
    def charge(order_id: str) -> None: ...

    with caplog.at_level(logging.WARNING, logger="taskonce.dramatiq"):
        middleware._warn_requeue(broker)
        middleware._warn_requeue(broker)
    lines = [r.getMessage() for r in caplog.records if r.name == "taskonce.dramatiq"]
    assert len(lines) == 1 and "maintenance_chance=0" in lines[0]
    broker.close()


def test_real_worker_with_maintenance_off_says_it_once(
    pg_engine: sa.Engine, tmp_path: Path
) -> None:
    """Two worker processes of one ``dramatiq`` command on a Redis broker with
    ``maintenance_chance=0``: one warning line, from the first."""
    with harness_for(
        REDIS_REDIS, tmp_path, pg_engine, "crash", start=False, maintenance_chance=0
    ) as h:
        worker = h.start_worker(processes=2)
        h.wait(
            lambda: worker.output().count("Worker process is ready for action") == 2,
            what="both worker processes to boot",
        )
        output = worker.output()
        assert output.count("taskonce: the Redis broker has maintenance_chance=0") == 1, output
