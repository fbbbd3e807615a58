"""The Dramatiq app of the metrics tests: ``dramatiq tests.metrics.dramatiq_app:broker``.

Configured by environment: ``MX_BROKER`` (Redis broker URL), ``MX_PREFIX`` (the broker's
namespace and the queue name), ``MX_STORE`` / ``MX_STORE_NS`` (Redis store and its prefix).
``PROMETHEUS_MULTIPROC_DIR`` must be set too: every worker process writes its metrics there.
The guard also has a sink that raises on every event, which must change nothing.
"""

from __future__ import annotations

import os

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware
from tests.metrics.common import RaisingSink

ENV = os.environ
PREFIX = ENV["MX_PREFIX"]

broker = RedisBroker(url=ENV["MX_BROKER"], namespace=PREFIX)
metrics = taskonce.PrometheusEvents()
store = metrics.time_store(taskonce.open_store(ENV["MX_STORE"], prefix=ENV["MX_STORE_NS"]))
broker.add_middleware(IdempotencyMiddleware(taskonce.Guard(store, events=[RaisingSink(), metrics])))
dramatiq.set_broker(broker)
_runs = redis.Redis.from_url(ENV["MX_STORE"])


@dramatiq.actor(actor_name="mx_work", queue_name=PREFIX)
def work(n: int) -> None:
    _runs.incr(f"{PREFIX}:runs")
