"""End to end with a real Dramatiq worker: ``python -m dramatiq`` (2 processes × 2 threads)
with taskonce's ``IdempotencyMiddleware`` on a Redis broker (DB 9) and the Redis store (DB 15),
writing a JSONL event log; duplicates of finished messages are injected through the broker.
The audit of the log reports exactly the injected duplicates, the retries as retries (not
duplicates) and no leak."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from taskonce.spark_ext import audit
from tests.helpers import REDIS_URL, require_service, wait_for

REPO = Path(__file__).resolve().parents[2]
BROKER_URL = os.environ.get("TASKONCE_TEST_BROKER", "redis://127.0.0.1:6379/9")
MESSAGES = 30
FAIL_FIRST = (0, 1, 2, 3)  # raise once; Dramatiq's Retries delivers them again
AGAIN = (0, 4, 5, 10, 11, 12, 20, 29)  # delivered a second time after they finished


@pytest.mark.slow
def test_dramatiq_workers_log_audits_to_the_injected_duplicates(spark: Any, tmp_path: Path) -> None:
    require_service("redis")
    import dramatiq
    import redis
    from dramatiq.brokers.redis import RedisBroker

    prefix = f"taskonce-spark-e2e-{uuid.uuid4().hex[:10]}"
    config = {
        "broker": BROKER_URL,
        "namespace": prefix,
        "queue": "audit_e2e",
        "store": REDIS_URL,
        "prefix": prefix,
        "events": str(tmp_path / "events.jsonl"),
    }
    store_client = redis.Redis.from_url(REDIS_URL)
    broker_client = redis.Redis.from_url(BROKER_URL)
    worker = subprocess.Popen(
        [
            *(sys.executable, "-m", "dramatiq", "tests.spark.dramatiq_app:broker"),
            *("--processes", "2", "--threads", "2"),
        ],
        cwd=REPO,
        env={**os.environ, "TASKONCE_SPARK_E2E": json.dumps(config)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: stopped below by its id
    )
    publisher = RedisBroker(url=BROKER_URL, namespace=prefix)
    try:
        wait_for(
            lambda: len(list(store_client.scan_iter(match=f"{prefix}:ready:*"))) >= 2,
            timeout=60,
            what="two dramatiq worker processes",
        )
        messages = {
            number: dramatiq.Message(
                queue_name="audit_e2e",
                actor_name="handle",
                args=(number, number in FAIL_FIRST),
                kwargs={},
                options={},
            )
            for number in range(MESSAGES)
        }
        for message in messages.values():
            publisher.enqueue(message)
        wait_for(lambda: store_client.llen(f"{prefix}:runs") >= MESSAGES, timeout=60, what="runs")
        for number in AGAIN:  # the same message (same message_id) delivered again
            publisher.enqueue(messages[number])
        log = Path(config["events"])

        def skipped() -> int:
            if not log.exists():
                return 0
            return sum('"event":"duplicate_skipped"' in line for line in log.open())

        wait_for(lambda: skipped() >= len(AGAIN), timeout=60, what="the duplicates skipped")
        runs = collections.Counter(int(r) for r in store_client.lrange(f"{prefix}:runs", 0, -1))
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        for client in (store_client, broker_client):
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                client.delete(*keys)
    assert runs == {number: 1 for number in range(MESSAGES)}  # each handler succeeded once

    result = audit(spark, [config["events"]])
    overall = result.report["overall"]
    assert overall["distinct_keys"] == MESSAGES
    assert overall["runs"] == MESSAGES + len(FAIL_FIRST)  # failed first attempts ran too
    assert overall["releases"] == overall["failures"] == len(FAIL_FIRST)
    assert overall["duplicates_skipped"] == len(AGAIN)  # exactly the injected duplicates
    assert overall["duplicates_in_flight"] == 0
    assert overall["deliveries"] == MESSAGES + len(FAIL_FIRST) + len(AGAIN)
    assert overall["leaks"] == 0
    assert overall["takeovers"] == overall["stuck_claims"] == overall["near_misses"] == 0
    assert result.report["queues"] == {"audit_e2e": overall}
    assert result.report["tasks"] == {"handle": overall}
    skipped_ids = {
        row["key"] for row in result.tables["duplicates"].collect() if row["kind"] == "skipped"
    }
    assert skipped_ids == {f"audit_e2e:{messages[n].message_id}" for n in AGAIN}
