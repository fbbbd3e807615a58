"""The Dramatiq application of the audit's end-to-end test, run by the real worker CLI:
``python -m dramatiq tests.spark.dramatiq_app:broker``.

Configured by ``TASKONCE_SPARK_E2E`` (JSON): ``broker`` (Redis URL), ``namespace`` (the
broker's key namespace), ``queue``, ``store`` (Redis URL of the taskonce store), ``prefix``
(the store's key prefix, also used for the test's own keys) and ``events`` (the JSONL log).
Importing the module without it builds nothing.

The ``handle`` actor records each successful run (``RPUSH <prefix>:runs``); with
``fail_first`` its first attempt raises, and Dramatiq's ``Retries`` delivers it again.
"""

from __future__ import annotations

import json
import os
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware

CONFIG: dict[str, Any] = json.loads(os.environ.get("TASKONCE_SPARK_E2E", "null")) or {}


class Ready(dramatiq.Middleware):
    """Sets ``<prefix>:ready:<pid>`` once a worker process consumes."""

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        client = redis.Redis.from_url(CONFIG["store"])
        client.set(f"{CONFIG['prefix']}:ready:{os.getpid()}", "1", ex=600)


if CONFIG:
    broker = RedisBroker(url=CONFIG["broker"], namespace=CONFIG["namespace"])
    guard = taskonce.Guard(
        taskonce.open_store(CONFIG["store"], prefix=f"{CONFIG['prefix']}:store"),
        default=taskonce.Policy(mode="eager", lease=30, keep_for=3600),
        events=[taskonce.JsonlEvents(CONFIG["events"])],
    )
    broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(Ready())
    dramatiq.set_broker(broker)
    results = redis.Redis.from_url(CONFIG["store"])

    @dramatiq.actor(queue_name=CONFIG["queue"], max_retries=5, min_backoff=100, max_backoff=500)
    def handle(number: int, fail_first: bool) -> None:
        """Fails on its first attempt when asked; records each successful run."""
        attempts = results.incr(f"{CONFIG['prefix']}:attempts:{number}")
        if fail_first and attempts == 1:
            raise RuntimeError("the first attempt fails")
        results.rpush(f"{CONFIG['prefix']}:runs", number)
