"""The Celery app of ``taskonce demo``: one guarded ``charge`` task, configured by environment.

The demo (:mod:`taskonce.demo.celery_demo`) starts ``celery -A taskonce.demo.celery_app
worker`` with these variables:

- ``TASKONCE_DEMO_BROKER``, ``TASKONCE_DEMO_QUEUE``: broker URL and the queue to consume.
- ``TASKONCE_DEMO_STORE``, ``TASKONCE_DEMO_NS``: store URL and its table (SQL) or prefix (Redis).
- ``TASKONCE_DEMO_LEDGER``: ``sql:<table>`` — the charge is written through
  :func:`taskonce.current_session` into this table of the store's database (transactional
  mode: the ledger row and the mark commit together); or ``sqlite:<path>`` — a local SQLite
  ledger written after the work (Redis store).
- ``TASKONCE_DEMO_DIR``: where the events file and the victim's pid file go.
- ``TASKONCE_DEMO_LEASE``: the claim lease in seconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery, signals

import taskonce
from taskonce.celery_ext.config import setup
from taskonce.celery_ext.task import IdempotentTask
from taskonce.demo import common as _demo
from taskonce.demo.celery_demo import broker_options

ENV = os.environ
BROKER = ENV.get("TASKONCE_DEMO_BROKER", "memory://")
QUEUE = ENV.get("TASKONCE_DEMO_QUEUE", "taskonce-demo")
STORE = ENV.get("TASKONCE_DEMO_STORE", "memory://")
NAMESPACE = ENV.get("TASKONCE_DEMO_NS", "taskonce_demo")
LEDGER = ENV.get("TASKONCE_DEMO_LEDGER", "")
WORKDIR = Path(ENV.get("TASKONCE_DEMO_DIR", "."))
LEASE = float(ENV.get("TASKONCE_DEMO_LEASE", "4"))
#: the pid file the victim charge writes before it stalls (the demo SIGKILLs that process)
VICTIM_FILE = "victim.pid"
SQL_STORE = not STORE.startswith(("redis", "rediss", "unix", "memory"))

logger = logging.getLogger("taskonce.demo")


app = Celery("taskonce_demo", broker=BROKER)
app.conf.update(
    broker_transport_options=broker_options(BROKER, NAMESPACE),
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=2,
    worker_lost_wait=1.0,  # report a killed pool process's job at once (default 10 s)
    taskonce_store_retry_delay=1.0,
)

if STORE != "memory://":  # the worker; importing the module elsewhere opens nothing
    store_options = {"table": NAMESPACE} if SQL_STORE else {"prefix": NAMESPACE}
    setup(
        app,
        taskonce.Guard(
            taskonce.open_store(STORE, **store_options),
            default=taskonce.Policy(mode="eager", lease=LEASE, transactional=SQL_STORE),
            events=[taskonce.JsonlEvents(WORKDIR / "events.jsonl")],
        ),
    )


def charge(order_id: str, cents: int, stall: bool = False) -> int:
    """Charge an order: a little work, then one ledger row. ``stall`` makes the first run
    write its pid and hang, so the demo can SIGKILL the process mid-charge."""
    time.sleep(0.01)
    victim = WORKDIR / VICTIM_FILE
    if stall and not victim.exists():
        victim.write_text(str(os.getpid()))
        time.sleep(60)
    _demo.write_ledger(LEDGER, order_id, cents)
    return cents


charge_task: Any = app.task(
    base=IdempotentTask,
    name="taskonce_demo.charge",
    acks_late=True,
    reject_on_worker_lost=True,
    shared=False,
)(charge)


# -- kombu's SQLAlchemy transport (the embedded broker) in a prefork worker -------------------
#
# Three things make it unsafe as it comes, all about one SQLite file shared by processes that
# fork: (1) its Channel shares one ORM session between the consumer (main thread) and
# billiard's result thread, which requeues a killed pool process's message
# (reject_on_worker_lost): two threads in one session fail ("session is in 'prepared' state")
# and the message is lost; (2) it caches its engine at class level, so a pool process forked
# after the main process connected (the killed one's replacement) shares the parent's SQLite
# connections; (3) a fork taken while another thread is inside an SQLite transaction leaves
# the child believing a lock is held in-process, so its own transactions wait forever. The
# demo serialises the channel's database calls per process, forks only between them, and gives
# each new process its own engine. (Redis and RabbitMQ need none of this.)

_SQLA_LOCK = threading.RLock()
_SQLA_METHODS = ("_get", "_put", "_purge", "_size", "_get_or_create", "_new_queue")
#: inherited engines (with their SQLite connections) kept alive, never closed, in a child:
#: closing a connection a parent opened would disturb the parent's SQLite locks
_INHERITED: list[Any] = []


def _serialise_sqla_channel() -> None:
    from kombu.transport import sqlalchemy as kombu_sqla

    for name in _SQLA_METHODS:
        original = getattr(kombu_sqla.Channel, name)
        if getattr(original, "_taskonce_serialised", False):
            continue

        def serialised(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with _SQLA_LOCK:
                return _original(self, *args, **kwargs)

        serialised._taskonce_serialised = True  # type: ignore[attr-defined]
        setattr(kombu_sqla.Channel, name, serialised)


def _before_fork() -> None:
    _SQLA_LOCK.acquire()  # no thread of this process is inside an SQLite call while it forks


def _after_fork_in_parent() -> None:
    _SQLA_LOCK.release()


def _after_fork_in_child() -> None:
    global _SQLA_LOCK
    from kombu.transport import sqlalchemy as kombu_sqla

    _SQLA_LOCK = threading.RLock()
    kombu_sqla._MUTEX = threading.RLock()
    _INHERITED.append(dict(kombu_sqla.Channel._engines))
    kombu_sqla.Channel._engines.clear()


if BROKER.startswith("sqla+"):
    _serialise_sqla_channel()
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _ready(**_: Any) -> None:
    (WORKDIR / "ready").write_text(str(os.getpid()))


signals.worker_ready.connect(_ready, weak=False)
