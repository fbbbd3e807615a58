"""8 processes × 500 keys, every key delivered to all 8 at once: each handler runs once (and
4 processes × 300 keys on a Redis Cluster, whose client and key layout differ; a
Sentinel-managed master runs the plain client's code).

The store is opened in the parent and used by forked children (the Celery prefork shape);
runs are counted in a PostgreSQL table, not in memory.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from taskonce import Guard, InProgressElsewhere, Policy
from taskonce.stores import Status
from tests.helpers import (
    POSTGRES_URL,
    drop_store,
    make_store,
    require_service,
    wait_for,
)

PROCESSES = 8
KEYS = 500


def _child(
    store: object, runs_table: str, barrier: object, out: Path, worker: int, keys: int
) -> None:
    engine = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    insert = sa.text(f"INSERT INTO {runs_table} (key, pid) VALUES (:key, :pid)")
    guard = Guard(store, default=Policy(lease=30))  # type: ignore[arg-type]
    counts = {"ran": 0, "skipped": 0, "deferred": 0}

    def charge(key: str) -> None:
        with engine.connect() as conn:
            conn.execute(insert, {"key": key, "pid": os.getpid()})

    for i in range(keys):
        key = f"k{i}"
        barrier.wait(timeout=120)  # type: ignore[attr-defined]
        try:
            counts[guard.run(key, "race", charge, key).status] += 1
        except InProgressElsewhere:
            counts["deferred"] += 1
            # a broker would deliver it again after the lease; here: once the owner is done
            wait_for(
                lambda key=key: (
                    (r := guard.store.get(f"race:{key}")) is not None
                    and r.status is Status.COMPLETED
                ),
                timeout=30,
            )
            assert guard.run(key, "race", charge, key).status == "skipped"
            counts["skipped"] += 1
    out.joinpath(f"{worker}.json").write_text(json.dumps(counts))
    engine.dispose()


@pytest.mark.parametrize("kind", ["redis", "postgresql"])
def test_every_key_runs_exactly_once_across_eight_processes(kind: str, tmp_path: Path) -> None:
    _race(kind, tmp_path, PROCESSES, KEYS)


def test_every_key_runs_exactly_once_on_a_redis_cluster(tmp_path: Path) -> None:
    _race("redis-cluster", tmp_path, 4, 300)


def _race(kind: str, tmp_path: Path, processes: int, keys: int) -> None:
    require_service("postgresql")
    store = make_store(kind, tmp_path)
    runs_table = f"runs_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE TABLE {runs_table} (key TEXT NOT NULL, pid INT NOT NULL)"))
    try:
        store.stats()  # the parent's pool holds a connection across the fork
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(processes)
        children = [
            ctx.Process(target=_child, args=(store, runs_table, barrier, tmp_path, n, keys))
            for n in range(processes)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join(timeout=240)
            assert child.exitcode == 0, f"worker exited with {child.exitcode}"

        with engine.connect() as conn:
            per_key = conn.execute(
                sa.text(f"SELECT key, count(*) FROM {runs_table} GROUP BY key")
            ).all()
            pids = conn.execute(sa.text(f"SELECT count(DISTINCT pid) FROM {runs_table}")).scalar()
        assert len(per_key) == keys, "some key never ran"
        assert {count for _, count in per_key} == {1}, "some key ran more than once"
        assert pids is not None and pids > 1, "one process did all the work: no race happened"

        totals = {"ran": 0, "skipped": 0, "deferred": 0}
        for n in range(processes):
            for name, value in json.loads(tmp_path.joinpath(f"{n}.json").read_text()).items():
                totals[name] += value
        assert totals["ran"] == keys
        assert totals["ran"] + totals["skipped"] == keys * processes
        assert store.stats()["completed"] == keys
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {runs_table}"))
        engine.dispose()
        drop_store(store)
