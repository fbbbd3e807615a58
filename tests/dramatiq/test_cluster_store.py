"""A real ``dramatiq`` worker whose store is the session's Redis Cluster (``redis+cluster://``):
a message delivered five times runs once, and its record lives in the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from dramatiq import Message

from taskonce.stores import Status
from tests import redis_topologies
from tests.dramatiq.conftest import REDIS_REDIS, Harness, harness_for, store_of


def done(h: Harness, message: Message[Any], deliveries: int) -> bool:
    deferred = len(h.events(message.message_id, "in_progress_deferred"))
    return len(h.acks(message.message_id)) >= deliveries + deferred


def test_duplicates_on_a_cluster_store_are_skipped(pg_engine: sa.Engine, tmp_path: Path) -> None:
    url = redis_topologies.cluster().url
    with harness_for(REDIS_REDIS, tmp_path, pg_engine, "shared", store=url) as h:
        runs_table = h.new_runs_table()
        try:
            message = h.send("record", runs_table)
            for _ in range(4):
                h.enqueue(message)
            h.wait(lambda: done(h, message, 5), timeout=60, what="5 deliveries acknowledged")
            assert h.runs(runs_table) == 1
            names = [e["event"] for e in h.events(message.message_id)]
            assert names.count("claimed") == 1
            assert names.count("completed") == 1
            assert names.count("duplicate_skipped") == 4
            store = store_of(h.config)
            try:
                record = store.get(f"{h.config.queue('main')}:{message.message_id}")
                assert record is not None and record.status is Status.COMPLETED
                assert store.describe().startswith("RedisStore redis+cluster://")
            finally:
                store.close()
        finally:
            h.drop_table(runs_table)
