"""``send_rows``: deterministic ids make Spark's re-runs harmless at a guarded consumer.

The consumer here is a loop that reads the Celery messages from the broker (Redis, DB 9, a
queue of its own) with kombu and runs each under a real :class:`taskonce.Guard` over the Redis
store (DB 15, a random prefix) — the framework-neutral guard, not a Celery worker.
"""

from __future__ import annotations

import collections
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce.errors import ConfigError
from taskonce.guard import Delivery
from taskonce.spark_ext import audit, row_id, send_rows
from taskonce.spark_ext.producer import namespace_uuid, target_path
from tests.helpers import REDIS_URL, drop_store, require_service
from tests.spark import sendapp


def _consume(queue: str, guard: taskonce.Guard, runs: collections.Counter[str]) -> list[str]:
    """Read every message of ``queue`` and run it under ``guard``; returns the outcomes."""
    from kombu import Connection

    outcomes = []
    with Connection(sendapp.BROKER_URL) as connection:
        inbox = connection.SimpleQueue(queue)
        try:
            while True:
                try:
                    message = inbox.get(timeout=2)
                except inbox.Empty:
                    break
                _args, kwargs, _embed = message.payload
                delivery = Delivery(
                    message.headers["id"], queue, task=message.headers["task"], framework="celery"
                )

                def handler(**row: Any) -> None:
                    runs[row["order_id"]] += 1

                outcomes.append(guard.execute(delivery, handler, (), kwargs).status)
                message.ack()
        finally:
            inbox.queue.delete()
            inbox.close()
    return outcomes


def test_task_failing_midway_runs_every_handler_once(spark: Any, tmp_path: Path) -> None:
    require_service("redis")
    from kombu import Connection

    queue = f"taskonce_spark_{uuid.uuid4().hex[:8]}"
    with Connection(sendapp.BROKER_URL) as connection:  # declare it, so messages are routed
        connection.SimpleQueue(queue).close()
    rows = [(f"order-{i:02d}", 100 * i, "EUR") for i in range(20)]
    frame = spark.createDataFrame(rows, ["order_id", "cents", "currency"]).repartition(2)
    assert frame.rdd.getNumPartitions() == 2

    sent = send_rows(
        frame,
        "tests.spark.sendapp:flaky_export",  # partition 0's first attempt fails after 3 rows
        ["order_id"],
        "orders-export",
        options={"queue": queue},
    )
    assert sent == 20  # each row counted once, though 23 messages went out

    store = taskonce.open_store(REDIS_URL, prefix=f"spark{uuid.uuid4().hex[:10]}")
    log = tmp_path / "consumer.jsonl"
    guard = taskonce.Guard(store, events=[taskonce.JsonlEvents(log)])
    runs: collections.Counter[str] = collections.Counter()
    try:
        outcomes = _consume(queue, guard, runs)
    finally:
        drop_store(store)
    assert len(outcomes) == 20 + sendapp.FAIL_AFTER  # the failed attempt's rows, sent again
    assert collections.Counter(outcomes) == {"ran": 20, "skipped": sendapp.FAIL_AFTER}
    assert runs == {f"order-{i:02d}": 1 for i in range(20)}  # every handler ran exactly once

    messages = [json.loads(line) for line in log.read_text().splitlines()]
    ids = {item["message_id"] for item in messages}
    assert ids == {row_id("orders-export", [f"order-{i:02d}"]) for i in range(20)}

    report = audit(spark, [str(log)], now=None).report
    assert report["overall"]["distinct_keys"] == 20
    assert report["overall"]["runs"] == 20
    assert report["overall"]["duplicates_skipped"] == sendapp.FAIL_AFTER
    assert report["overall"]["leaks"] == 0


def test_dramatiq_actor_gets_deterministic_message_ids(spark: Any) -> None:
    require_service("redis")
    import dramatiq
    import redis

    client = redis.Redis.from_url(sendapp.BROKER_URL)
    pattern = f"{sendapp.DRAMATIQ_NAMESPACE}:*"
    client.delete(*client.keys(pattern) or ["-"])
    frame = spark.createDataFrame([("a", 1, 10), ("b", 2, 20), ("a", 2, 30)], ["x", "y", "v"])
    space = uuid.UUID("6f0c2c55-8a4f-4a2b-9a53-0c1de5c0ffee")
    try:
        assert send_rows(frame, sendapp.export_row_actor, ["x", "y"], space) == 3
        stored = client.hvals(f"{sendapp.DRAMATIQ_NAMESPACE}:{sendapp.DRAMATIQ_QUEUE}.msgs")
        messages = {
            m.message_id: m.kwargs for m in (dramatiq.Message.decode(raw) for raw in stored)
        }
    finally:
        client.delete(*client.keys(pattern) or ["-"])
    assert messages == {
        row_id(space, ["a", 1]): {"x": "a", "y": 1, "v": 10},
        row_id(space, ["b", 2]): {"x": "b", "y": 2, "v": 20},
        row_id(space, ["a", 2]): {"x": "a", "y": 2, "v": 30},
    }


def test_ids_and_targets() -> None:
    assert row_id("orders", ["a|b", "c"]) != row_id("orders", ["a", "b|c"])
    assert row_id("orders", [1]) == row_id(namespace_uuid("orders"), [1])
    assert row_id("orders", [1]) == str(uuid.uuid5(namespace_uuid("orders"), "[1]"))
    space = uuid.uuid4()
    assert namespace_uuid(str(space)) == space
    assert target_path(sendapp.export_row) == "tests.spark.sendapp:export_row"
    assert target_path(sendapp.export_row_actor) == "tests.spark.sendapp:export_row_actor"
    with pytest.raises(ConfigError, match="module:attribute"):
        target_path(lambda **row: None)


def test_bad_arguments(spark: Any) -> None:
    frame = spark.createDataFrame([(1,)], ["a"])
    with pytest.raises(ConfigError, match="key_cols"):
        send_rows(frame, sendapp.export_row, [], "ns")
    with pytest.raises(ConfigError, match="no such column"):
        send_rows(frame, sendapp.export_row, ["b"], "ns")
