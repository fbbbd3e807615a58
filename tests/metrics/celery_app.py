"""The Celery app of the metrics tests: ``celery -A tests.metrics.celery_app worker``.

Configured by environment: ``MX_BROKER`` (Redis broker URL), ``MX_PREFIX`` (queue name
``{prefix}.q`` and the broker's key prefix), ``MX_STORE`` / ``MX_STORE_NS`` (Redis store and
its prefix), ``MX_READY`` (file written when the worker is ready). ``PROMETHEUS_MULTIPROC_DIR``
must be set too: every pool process writes its metrics there. The guard also has a sink that
raises on every event, which must change nothing. ``MX_SERVE=1``: the worker's main process
serves ``/metrics`` on port 9808, with docs/operations.md's lines (tests/test_docs.py checks they
are the same).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

import taskonce
from taskonce.celery_ext import IdempotentTask, setup
from tests.metrics.common import RaisingSink

ENV = os.environ
PREFIX = ENV["MX_PREFIX"]
QUEUE = f"{PREFIX}.q"

app = Celery("metrics_app", broker=ENV["MX_BROKER"])
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
metrics = taskonce.PrometheusEvents()
store = metrics.time_store(taskonce.open_store(ENV["MX_STORE"], prefix=ENV["MX_STORE_NS"]))
guard = taskonce.Guard(store, events=[RaisingSink(), metrics])
setup(app, guard)
_runs = redis.Redis.from_url(ENV["MX_STORE"])


@app.task(name="mx.work", base=IdempotentTask, acks_late=True, reject_on_worker_lost=True)
def work(n: int) -> int:
    _runs.incr(f"{PREFIX}:runs")
    return n


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    Path(ENV["MX_READY"]).write_text("ready")


if ENV.get("MX_SERVE"):
    from celery import signals

    from taskonce.prometheus_events import serve

    @signals.worker_init.connect
    def expose_metrics(**_):
        serve(9808, store=guard.store)
