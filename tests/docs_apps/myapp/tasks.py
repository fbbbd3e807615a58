"""``myapp.tasks``: the Celery app and the guarded ``charge(order_id, cents)`` of docs/celery.md
(and the task docs/audit.md's ``send_rows`` names).

Configured by environment, with defaults that work where none is given (a Spark executor):
``MYAPP_BROKER`` (default Redis db 15), ``MYAPP_PREFIX`` (the broker's and the store's key
prefix: one run's own; default ``myapp-docs``), ``MYAPP_EVENTS`` (a JSONL events file). Each
run of ``charge`` adds one to the Redis counter ``{prefix}:runs:{order_id}`` (the store's Redis).
"""

from __future__ import annotations

import os

import redis
from celery import Celery

import taskonce
from taskonce.celery_ext import IdempotentTask, setup

ENV = os.environ
PREFIX = ENV.get("MYAPP_PREFIX", "myapp-docs")
STORE_URL = ENV.get("MYAPP_STORE", "redis://127.0.0.1:6379/15")

app = Celery("myapp", broker=ENV.get("MYAPP_BROKER", "redis://127.0.0.1:6379/15"))
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
)
setup(
    app,
    taskonce.Guard(
        taskonce.open_store(STORE_URL, prefix=PREFIX),
        events=[taskonce.JsonlEvents(ENV["MYAPP_EVENTS"])] if ENV.get("MYAPP_EVENTS") else [],
    ),
)
_runs = redis.Redis.from_url(STORE_URL)


@app.task(base=IdempotentTask)
def charge(order_id: str, cents: int) -> None:
    _runs.incr(f"{PREFIX}:runs:{order_id}")
