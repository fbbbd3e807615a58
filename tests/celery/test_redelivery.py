"""Broker redelivery while the first delivery still runs, and a store that goes down.

Each test runs its own worker: a Redis broker with ``visibility_timeout=2`` (which redelivers a
message whose acknowledgement is 2 s late, i.e. while a 6-second task still runs), and a worker
whose store is a throwaway redis-server this test stops and starts again.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.celery.conftest import (
    REDIS_BROKER,
    STORE_DOWN_DB,
    VISIBILITY_DB,
    Stack,
    Table,
    start_stack,
    stop_stack,
)
from tests.helpers import RedisServer, event_time, wait_for


@pytest.fixture(params=["redis", "postgresql"], ids=["redis-store", "pg-store"])
def visibility_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    stack = start_stack(
        tmp_path,
        "redis",
        request.param,
        db=VISIBILITY_DB,
        extra_env={"TO_VISIBILITY": "2"},
        transport={"visibility_timeout": 2},
    )
    try:
        yield stack
    finally:
        stop_stack(stack)


def test_visibility_timeout_redelivery_is_deferred_then_skipped(
    visibility_stack: Stack, runs: Table
) -> None:
    """Redis broker, visibility_timeout=2, a 6-second task with acks_late: the broker hands
    the unacknowledged message out again while it runs. The copy is deferred (the claim's
    lease is alive), then skipped once the first run completed: one run."""
    stack = visibility_stack
    task_id = str(uuid.uuid4())
    stack.send("t.record", (runs.name, "slow"), "eager", task_id=task_id, kwargs={"sleep": 6})

    wait_for(
        lambda: stack.count(task_id, "in_progress_deferred") >= 1, timeout=15, what="a deferral"
    )
    assert stack.app.AsyncResult(task_id).get(timeout=20) == "slow"
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") >= 1, timeout=20, what="a skip")

    # Wait until the broker holds nothing more of this run: no queued or unacknowledged copy.
    client = redis.Redis.from_url(REDIS_BROKER.format(db=VISIBILITY_DB))
    try:

        def drained() -> bool:
            queued = client.llen(f"{stack.prefix}:{stack.q('eager')}")
            unacked = client.zcard(f"{stack.prefix}:unacked_index")
            return queued == 0 and unacked == 0

        wait_for(drained, timeout=30, interval=0.2, what="the broker to hold no copy")
    finally:
        client.close()

    assert runs.count("slow") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "completed") == 1
    assert stack.count(task_id, "lease_taken_over") == 0
    redelivered = [e for e in stack.events(task_id) if e["event"] == "in_progress_deferred"]
    assert any(e["redelivered"] for e in redelivered)  # the broker marked its copy redelivered
    assert stack.app.AsyncResult(task_id).get(timeout=5) == "slow"


def test_store_down_fail_closed_not_run_then_run_once_when_back(
    tmp_path: Path, runs: Table
) -> None:
    """fail_closed with the store unreachable: the task is not run, it is delivered again
    later (store_error events, no runs), each time a little later (the core's one back-off
    rule, ``taskonce_store_retry_delay`` the first: 0.5 s here), never counted as a retry;
    when the store is back it runs exactly once."""
    server = RedisServer().start()
    stack = start_stack(
        tmp_path,
        "redis",
        "redis",
        db=STORE_DOWN_DB,
        store_pair=(server.url, f"tc{uuid.uuid4().hex[:8]}"),
        extra_env={"TO_STORE_RETRY_DELAY": "0.5"},
    )
    try:
        server.stop()  # only this test's redis-server, by its pid
        task_id = str(uuid.uuid4())
        stack.send("t.record", (runs.name, "store-down"), "eager", task_id=task_id)

        wait_for(lambda: stack.count(task_id, "store_error") >= 5, timeout=30, what="store errors")
        assert runs.count("store-down") == 0
        assert stack.count(task_id, "claimed") == 0
        errors = [e for e in stack.events(task_id) if e["event"] == "store_error"]
        assert {e["attempt"] for e in errors} == {0}  # Celery's retries untouched
        gaps = [event_time(b) - event_time(a) for a, b in itertools.pairwise(errors)]
        # The n-th back-off in a row waits between half of and 0.5 × 2**n s (Backoff): a fixed
        # delay would leave ~0.5 s between every two deliveries.
        assert gaps[2] >= 1.0 and gaps[3] >= 2.0, gaps

        server.start()  # same port
        wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=30, what="the run")
        assert runs.count("store-down") == 1
        assert stack.app.AsyncResult(task_id).get(timeout=10) == "store-down"

        stack.send("t.record", (runs.name, "store-down"), "eager", task_id=task_id)
        wait_for(
            lambda: stack.count(task_id, "duplicate_skipped") == 1, timeout=20, what="the skip"
        )
        assert runs.count("store-down") == 1
    finally:
        stop_stack(stack, drop=False)
        server.stop()
