"""End to end: real worker processes write a JSONL event log while duplicates are injected;
the audit of that log reports exactly the injected duplicates and no leak.

The workers are the framework-neutral :class:`taskonce.Guard` in four forked processes
(tests/spark/guard_workers.py) over the Redis store, popping messages from a Redis list that
stands in for the broker — not Celery or Dramatiq workers.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from taskonce.spark_ext import audit
from tests.helpers import REDIS_URL, require_service, wait_for
from tests.spark import guard_workers

REPO = Path(__file__).resolve().parents[2]
MESSAGES = 40
FAIL_FIRST = range(0, 5)  # the handler raises on attempt 0: released, retried — no duplicate
SLOW = (5, 6)  # a duplicate arrives while these run: deferred, later skipped
AFTER = (0, 1, 7, 8, 9, 10, 20, 30, 38, 39)  # delivered again after they completed: skipped


def _message(number: int) -> str:
    return json.dumps(
        {
            "id": f"m{number:03d}",
            "attempt": 0,
            "fail_first": number in FAIL_FIRST,
            "slow": number in SLOW,
        }
    )


@pytest.mark.slow
def test_workers_log_audits_to_the_injected_duplicates(spark: Any, tmp_path: Path) -> None:
    require_service("redis")
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"taskonce-e2e-{uuid.uuid4().hex[:10]}"
    inbox = f"{prefix}:broker"
    log = tmp_path / "events.jsonl"
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.spark.guard_workers",
            *("--redis", REDIS_URL, "--prefix", prefix, "--events", str(log)),
            *("--workers", "4"),
        ],
        cwd=REPO,
    )
    try:
        wait_for(lambda: client.get(f"{prefix}:ready"), timeout=30, what="the workers")
        for number in range(MESSAGES):
            client.lpush(inbox, _message(number))  # LPUSH + BRPOP: first in, first out
        for number in SLOW:  # a duplicate while the first delivery runs, at the queue's head
            wait_for(lambda n=number: client.get(f"{prefix}:started:m{n:03d}"), timeout=30)
            client.rpush(inbox, _message(number))
        wait_for(lambda: client.llen(f"{prefix}:runs") >= MESSAGES, timeout=60, what="runs")
        for number in AFTER:  # redelivered after completion (a visibility timeout, say)
            client.lpush(inbox, _message(number))
        final = MESSAGES + len(SLOW) + len(AFTER)
        wait_for(lambda: int(client.get(f"{prefix}:final") or 0) >= final, timeout=60)
        for _ in range(4):
            client.lpush(inbox, "stop")
        assert supervisor.wait(timeout=30) == 0
        runs = collections.Counter(r.decode() for r in client.lrange(f"{prefix}:runs", 0, -1))
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    assert runs == {f"m{n:03d}": 1 for n in range(MESSAGES)}  # each handler succeeded once

    result = audit(spark, [str(log)])
    overall = result.report["overall"]
    assert result.report["events"] == sum(1 for _ in log.open())
    assert overall["distinct_keys"] == MESSAGES
    assert overall["runs"] == MESSAGES + len(FAIL_FIRST)  # the failed first attempts ran too
    assert overall["releases"] == overall["failures"] == len(FAIL_FIRST)
    assert overall["duplicates_in_flight"] == len(SLOW)
    # every injected duplicate is skipped once; the in-flight ones after their deferral
    assert overall["duplicates_skipped"] == len(AFTER) + len(SLOW)
    assert overall["deliveries"] == overall["runs"] + len(AFTER) + 2 * len(SLOW)
    assert overall["leaks"] == 0
    assert overall["takeovers"] == overall["stuck_claims"] == overall["near_misses"] == 0
    assert 0 < overall["gap_max_s"] < 60
    assert result.report["queues"][guard_workers.QUEUE] == overall
    assert result.report["tasks"][guard_workers.TASK] == overall

    duplicates = result.tables["duplicates"].collect()
    per_key = collections.Counter((row["key"].split(":", 1)[1], row["kind"]) for row in duplicates)
    expected = collections.Counter({(f"m{n:03d}", "skipped"): 1 for n in AFTER})
    for number in SLOW:
        expected[(f"m{number:03d}", "in_flight")] += 1
        expected[(f"m{number:03d}", "skipped")] += 1
    assert per_key == expected
