"""The soak's Celery worker app (``celery -A tools.soak.celery_app worker``), configured by
``CHAOS_CONFIG`` (see :mod:`tools.soak.common`).

``chaos.pay(key)`` writes a run row, sleeps, writes its ledger row and (hand-off variant) sends
``chaos.child(key)`` on a queue of its own, which writes a ledger row of kind ``child``. Both
are guarded (the hand-off's receipts look for each child ``confirm_within`` seconds after its
publish and publish it again if it never arrived), acks_late, requeued when their pool process
dies, and retried on any error (a terminated PostgreSQL backend, a store that cannot be reached
mid-body): a message is never given up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery, signals
from kombu import Queue

import taskonce
from taskonce.celery_ext import IdempotentTask, setup
from tools.soak.common import Config, Ledger

CONFIG = Config.from_env() if "CHAOS_CONFIG" in os.environ else None

app = Celery("chaos", broker=CONFIG.broker if CONFIG else "memory://")
app.conf.update(
    task_default_queue=CONFIG.namespace if CONFIG else "chaos",
    # The children on a queue of their own, served first: a child waiting behind a backlog of
    # parents for longer than confirm_within would be re-sent for being slow, and with the
    # queues taken in turn (kombu's default) each such copy takes a child's turn, so the
    # children's queue grows when the workers do not keep up with the parents.
    task_queues=[Queue(CONFIG.child_queue), Queue(CONFIG.namespace)] if CONFIG else None,
    task_routes={"chaos.child": {"queue": CONFIG.child_queue}} if CONFIG else None,
    worker_prefetch_multiplier=1,
    worker_lost_wait=1.0,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    # a killed worker's messages come back after 20 s (its unacknowledged ones), swept every
    # 1 s; a worker killed while it held the sweep's mutex blocks the others' sweeps only 10 s
    # (kombu's default: 300 s)
    broker_transport_options={
        "visibility_timeout": 20,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 10,
        # the queues in the order of task_queues, the children's first (below)
        "queue_order_strategy": "priority",
    },
    task_ignore_result=True,
    taskonce_store_retry_delay=0.5,
    taskonce_relay_every=CONFIG.relay_every if CONFIG else 5.0,
)
if CONFIG is not None:
    store_options = (
        {"prefix": CONFIG.namespace}
        if CONFIG.store.startswith("redis")
        else {"table": CONFIG.namespace}
    )
    GUARD = taskonce.Guard(
        taskonce.open_store(CONFIG.store, **store_options),
        default=CONFIG.policy(),
        events=[taskonce.JsonlEvents(CONFIG.events)],
    )
    setup(app, GUARD)
    LEDGER = Ledger(CONFIG)

RETRY: dict[str, Any] = {
    "autoretry_for": (Exception,),
    "retry_kwargs": {"countdown": 0.5, "max_retries": 200},
    "retry_backoff": False,
    "retry_jitter": False,
}


@app.task(
    base=IdempotentTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    name="chaos.pay",
    **RETRY,
)
def pay(self: Any, key: str) -> str:
    LEDGER.body(key, "parent", self.request.id)
    if CONFIG is not None and CONFIG.handoff:
        child.delay(key)
    return key


@app.task(
    base=IdempotentTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    name="chaos.child",
    **RETRY,
)
def child(self: Any, key: str) -> str:
    LEDGER.body(key, "child", self.request.id)
    return key


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = os.environ.get("CHAOS_READY")
    if path:
        Path(path).write_text(str(os.getpid()))
