"""A real Celery prefork worker whose store is the session's Redis Cluster
(``redis+cluster://``): a task id published five times runs once, and its record lives in the
cluster."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import taskonce
from taskonce.stores import Status
from tests import redis_topologies
from tests.celery.conftest import Stack, Table, start_stack, stop_stack
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def cluster_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("celery-cluster-store")
    pair = (redis_topologies.cluster().url, f"tc{uuid.uuid4().hex[:10]}")
    running = start_stack(tmp, "redis", "redis-cluster", store_pair=pair)
    try:
        yield running
    finally:
        stop_stack(running)


def test_duplicates_on_a_cluster_store_are_skipped(cluster_stack: Stack, runs: Table) -> None:
    task_id = str(uuid.uuid4())
    for _ in range(5):
        cluster_stack.send("t.record", (runs.name, "dup-cluster"), "eager", task_id=task_id)
    wait_for(
        lambda: cluster_stack.count(task_id, "duplicate_skipped") >= 4,
        timeout=60,
        what="four duplicate_skipped events",
    )
    assert runs.count("dup-cluster") == 1
    assert cluster_stack.count(task_id, "claimed") == 1
    assert cluster_stack.count(task_id, "completed") == 1
    assert cluster_stack.app.AsyncResult(task_id).get(timeout=30) == "dup-cluster"
    store = taskonce.open_store(cluster_stack.store_url, prefix=cluster_stack.store_ns)
    try:
        record = store.get(f"{cluster_stack.q('eager')}:{task_id}")
        assert record is not None and record.status is Status.COMPLETED
    finally:
        store.close()
