"""The Celery worker app of the comparison: the same order task under six guards (the sixth
is the yardstick :mod:`bench.handwritten`: SET NX PX before the body, SET PX after it), and
``one_trip.order``, plain Celery with one ``DEL`` after the body: the speed table's yardstick
for one round trip from the worker.

``PEERS_BROKER``: broker URL; ``PEERS_LOCKS``: the redis-server every guard keeps its records
in (the comparison's own, so its ``INFO commandstats`` counts only them); ``PEERS_PG``: the
PostgreSQL URL of the run table; ``PEERS_PREFIX``: queue and key prefix.

Each task is ``<peer>.order(table, label, mode)``: it records its run in ``table`` (one row per
run), then by ``mode``: ``""`` returns; ``"sleep"`` takes 1 s; ``"hang_first"`` hangs on its
first run (the comparison SIGKILLs it); ``"fail_first"`` fails its first run and retries;
``"send_then_die"`` sends ``plain.child`` and SIGKILLs itself on its first run. All tasks are
``acks_late`` with ``reject_on_worker_lost``, so a killed run is delivered again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery, Task, signals

import taskonce
from bench.handwritten import celery_base
from taskonce.celery_ext import IdempotentTask, setup

ENV = os.environ
PREFIX = ENV.get("PEERS_PREFIX", "peers")
LOCKS = ENV.get("PEERS_LOCKS", "redis://127.0.0.1:6379/0")
PG = ENV.get("PEERS_PG", "postgresql://postgres@127.0.0.1:5432/test")
PEERS = ("plain", "taskonce", "celery_once", "celery_singleton", "powertools", "handwritten")

app = Celery("peers", broker=ENV.get("PEERS_BROKER", "memory://"))
app.conf.update(
    task_default_queue=f"{PREFIX}.q",
    worker_prefetch_multiplier=1,
    worker_lost_wait=1.0,
    broker_connection_retry_on_startup=True,
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    task_ignore_result=True,
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": LOCKS}},
    singleton_backend_url=LOCKS,
    singleton_key_prefix=f"{PREFIX}-singleton:",
)
GUARD = taskonce.Guard(taskonce.open_store(LOCKS, prefix=f"{PREFIX}-taskonce"))
setup(app, GUARD)

_conn: dict[int, Any] = {}


def record_run(table: str, label: str) -> int:
    conn = _conn.get(os.getpid())
    if conn is None:
        conn = psycopg.connect(PG, autocommit=True)
        _conn.clear()
        _conn[os.getpid()] = conn
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} (label, pid) VALUES (%s, %s)", (label, os.getpid()))
        cur.execute(f"SELECT count(*) FROM {table} WHERE label = %s", (label,))
        row = cur.fetchone()
    return int(row[0]) if row else 0


_done: dict[int, redis.Redis] = {}


def body(task: Task, table: str, label: str, mode: str) -> str:
    if mode.startswith("noop"):  # the throughput rounds: count it on the broker, touch nothing else
        client = _done.get(os.getpid())
        if client is None:
            client = redis.Redis.from_url(ENV["PEERS_BROKER"])
            _done.clear()
            _done[os.getpid()] = client
        key = f"{PREFIX}:done:{table}"
        done = int(client.incr(key))
        # "noop:<total>": the first and the last completion stamp the round's clock, so the
        # worker's wake-up after add_consumer (its BRPOP on the old queues runs out its 1 s
        # timeout first) is not timed; two SETs a round, the same for every guard
        if done == 1 or done == int(mode.partition(":")[2] or 0):
            client.set(f"{key}:{'first' if done == 1 else 'last'}", repr(time.time()))
        return label
    if not table.replace("_", "").isalnum():
        raise ValueError(f"bad table name {table!r}")
    runs = record_run(table, label)
    if mode == "sleep":
        time.sleep(1.0)
    elif mode == "hang_first" and runs == 1:
        time.sleep(120)
    elif mode == "fail_first" and runs == 1:
        raise task.retry(countdown=0, max_retries=3)
    elif mode == "send_then_die":
        child.delay(table, f"{label}-child")
        if runs == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    return label


OPTIONS: dict[str, Any] = {"bind": True, "acks_late": True, "reject_on_worker_lost": True}


@app.task(name="plain.child", **OPTIONS)
def child(self: Task, table: str, label: str) -> str:
    return body(self, table, label, "")


@app.task(name="plain.order", **OPTIONS)
def plain_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return body(self, table, label, mode)


@app.task(name="taskonce.order", base=IdempotentTask, **OPTIONS)
def taskonce_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return body(self, table, label, mode)


class _OneTrip(Task):
    """The yardstick of one round trip: what celery-once and celery-singleton do in the worker
    (they lock in the producer and only delete the lock after the body), as a plain ``DEL``."""

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        client = _trip.get(os.getpid())
        if client is None:
            client = redis.Redis.from_url(LOCKS)
            _trip.clear()
            _trip[os.getpid()] = client
        client.delete(f"{PREFIX}-trip:{self.request.id}")


_trip: dict[int, redis.Redis] = {}


@app.task(name="one_trip.order", base=_OneTrip, **OPTIONS)
def one_trip_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return body(self, table, label, mode)


def _once_base() -> type[Task]:
    from celery_once import QueueOnce

    return QueueOnce


def _singleton_base() -> type[Task]:
    from celery_singleton import Singleton

    return Singleton


@app.task(name="celery_once.order", base=_once_base(), once={"graceful": True}, **OPTIONS)
def once_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return body(self, table, label, mode)


@app.task(name="celery_singleton.order", base=_singleton_base(), **OPTIONS)
def singleton_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return body(self, table, label, mode)


def _powertools() -> Any:
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
        RedisCachePersistenceLayer,
    )

    persistence = RedisCachePersistenceLayer(client=redis.Redis.from_url(LOCKS))
    config = IdempotencyConfig(expires_after_seconds=3600)

    @idempotent_function(
        data_keyword_argument="order", persistence_store=persistence, config=config
    )
    def guarded(order: dict[str, str], task: Task) -> str:
        return body(task, order["table"], order["label"], order["mode"])

    return guarded


_POWERTOOLS = _powertools()


@app.task(name="powertools.order", **OPTIONS)
def powertools_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return str(_POWERTOOLS(order={"table": table, "label": label, "mode": mode}, task=self))


@app.task(name="handwritten.order", base=celery_base(LOCKS, f"{PREFIX}-hand"), **OPTIONS)
def handwritten_order(self: Task, table: str, label: str, mode: str = "") -> str:
    return body(self, table, label, mode)


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = ENV.get("PEERS_READY")
    if path:
        Path(path).write_text(str(os.getpid()))
