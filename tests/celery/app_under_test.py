"""The Celery app the worker subprocesses of the Celery tests run, configured by environment.

``TO_BROKER``, ``TO_BACKEND``: broker and result backend URLs. ``TO_PREFIX``: this run's
prefix (queue names ``{prefix}.eager``, ``.lazy``, ``.tx``, ``.off``, ``.plain`` and the Redis
``global_keyprefix``). ``TO_STORE`` / ``TO_STORE_NS``: the taskonce store and its prefix (Redis)
or table (SQL). ``TO_EVENTS``: JSONL events file. ``TO_PG``: the PostgreSQL URL of the run-count
tables. ``TO_LEASE``: lease of the guarded queues. ``TO_VISIBILITY``: Redis visibility timeout.
``TO_STORE_RETRY_DELAY``: ``taskonce_store_retry_delay``. ``TO_READY``: file written when the
worker is ready.

Every task counts its runs in the PostgreSQL table whose name it is given (one row per run,
committed before the body goes on), so a test reads run counts from the database, not memory.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals

import taskonce
from taskonce.celery_ext import IdempotentTask, setup

ENV = os.environ
PREFIX = ENV.get("TO_PREFIX", "tc")
BROKER = ENV.get("TO_BROKER", "memory://")
STORE = ENV.get("TO_STORE", "memory://")
STORE_NS = ENV.get("TO_STORE_NS", PREFIX)
LEASE = float(ENV.get("TO_LEASE", "3"))
PG = ENV.get("TO_PG", "postgresql://postgres@127.0.0.1:5432/test").replace(
    "postgresql+psycopg://", "postgresql://"
)

EAGER_Q, LAZY_Q, TX_Q, OFF_Q, PLAIN_Q = (
    f"{PREFIX}.{name}" for name in ("eager", "lazy", "tx", "off", "plain")
)
SQL_STORE = STORE.startswith(("postgresql", "sqlite", "mysql"))

app = Celery("app_under_test", broker=BROKER, backend=ENV.get("TO_BACKEND") or None)
transport: dict[str, Any] = {}
if BROKER.startswith("redis"):
    transport["global_keyprefix"] = f"{PREFIX}:"
    if ENV.get("TO_VISIBILITY"):
        transport.update(
            visibility_timeout=float(ENV["TO_VISIBILITY"]),
            unacked_restore_interval=1,
            unacked_restore_throttle=1,
        )
app.conf.update(
    broker_transport_options=transport,
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:"},
    result_expires=3600,
    task_default_queue=EAGER_Q,
    worker_prefetch_multiplier=1,
    worker_lost_wait=1.0,  # report a killed pool process's job promptly (default 10 s)
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    taskonce_store_retry_delay=float(ENV.get("TO_STORE_RETRY_DELAY", "1")),
)

queues: dict[str, Any] = {
    LAZY_Q: {"mode": "lazy"},
    OFF_Q: {"enabled": False},
}
if SQL_STORE:
    queues[TX_Q] = {"transactional": True}
store_options = {"table": STORE_NS} if SQL_STORE else {"prefix": STORE_NS}
if STORE.startswith("memory"):
    store_options = {}
GUARD = taskonce.Guard(
    taskonce.open_store(STORE, **store_options),
    default=taskonce.Policy(mode="eager", lease=LEASE),
    queues=queues,
    events=[taskonce.JsonlEvents(ENV["TO_EVENTS"])] if ENV.get("TO_EVENTS") else [],
)
setup(app, GUARD)

# -- run counting (one autocommit psycopg connection per process, opened after the fork) -------

_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_conn: dict[int, Any] = {}


def _db() -> Any:
    import psycopg

    pid = os.getpid()
    conn = _conn.get(pid)
    if conn is None or conn.closed:
        conn = psycopg.connect(PG, autocommit=True)
        _conn.clear()
        _conn[pid] = conn
    return conn


def count_run(table: str, task: Any, label: str) -> int:
    """Record one run of ``label``; return how many runs of it there have been."""
    if not _TABLE.match(table):
        raise ValueError(f"bad table name {table!r}")
    request = task.request
    with _db().cursor() as cur:
        cur.execute(
            f"INSERT INTO {table} (label, task_id, retries, pid) VALUES (%s, %s, %s, %s)",
            (label, request.id, request.retries or 0, os.getpid()),
        )
        cur.execute(f"SELECT count(*) FROM {table} WHERE label = %s", (label,))
        row = cur.fetchone()
    return int(row[0])


# -- tasks ------------------------------------------------------------------------------------


@app.task(
    base=IdempotentTask, bind=True, acks_late=True, reject_on_worker_lost=True, name="t.record"
)
def record(self: Any, table: str, label: str, sleep: float = 0.0, hang_first: bool = False) -> str:
    runs = count_run(table, self, label)
    if hang_first and runs == 1:
        time.sleep(120)  # the test SIGKILLs this child
    if sleep:
        time.sleep(sleep)
    return label


@app.task(base=IdempotentTask, bind=True, acks_late=True, max_retries=5, name="t.flaky")
def flaky(self: Any, table: str, label: str, fails: int) -> dict[str, Any]:
    count_run(table, self, label)
    if self.request.retries < fails:
        raise self.retry(countdown=0)
    return {"label": label, "attempts": self.request.retries + 1}


@app.task(
    base=IdempotentTask,
    bind=True,
    acks_late=True,
    autoretry_for=(ValueError,),
    retry_kwargs={"countdown": 0, "max_retries": 5},
    name="t.auto",
)
def auto(self: Any, table: str, label: str, fails: int) -> dict[str, Any]:
    count_run(table, self, label)
    if self.request.retries < fails:
        raise ValueError(f"attempt {self.request.retries} fails on purpose")
    return {"label": label, "attempts": self.request.retries + 1}


@app.task(base=IdempotentTask, bind=True, acks_late=True, name="t.chain_a")
def chain_a(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return f"{label}-a"


@app.task(bind=True, acks_late=True, name="t.chain_b")
def chain_b(self: Any, value: str, table: str) -> str:
    count_run(table, self, value)
    return f"{value}-b"


@app.task(
    base=IdempotentTask, bind=True, acks_late=True, reject_on_worker_lost=True, name="t.effect"
)
def effect(
    self: Any,
    table: str,
    effects: str,
    label: str,
    hang_first: bool = False,
    fail_first: bool = False,
) -> str:
    """Write one row into ``effects`` through the guard's transaction."""
    from sqlalchemy import text

    if not _TABLE.match(effects):
        raise ValueError(f"bad table name {effects!r}")
    runs = count_run(table, self, label)
    session = taskonce.current_session()
    session.execute(text(f"INSERT INTO {effects} (label) VALUES (:label)"), {"label": label})
    if hang_first and runs == 1:
        time.sleep(120)  # the test SIGKILLs this child: the insert above never commits
    if fail_first and runs == 1:
        raise self.retry(countdown=0)  # rolls the insert back, releases the claim
    return label


@app.task(
    base=IdempotentTask, bind=True, acks_late=True, idempotency={"mode": "eager"}, name="t.override"
)
def override(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return label


@app.task(base=IdempotentTask, bind=True, name="t.noack")
def noack(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return label


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = ENV.get("TO_READY")
    if path:
        Path(path).write_text(str(os.getpid()))
