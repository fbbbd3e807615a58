"""The soak's Dramatiq worker app (``dramatiq tools.soak.dramatiq_app``), configured by
``CHAOS_CONFIG`` (see :mod:`tools.soak.common`).

``pay(key)`` and ``child(key)`` as in :mod:`tools.soak.celery_app`; Retries with a short
backoff and many retries, so no message is given up while faults pass. The Redis broker
requeues a silent worker's messages after 10 s (``heartbeat_timeout``), with maintenance on
every tenth fetch so that happens promptly.
"""

from __future__ import annotations

from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware
from tools.soak.common import Config, Ledger

CONFIG = Config.from_env()

broker = RedisBroker(
    url=CONFIG.broker,
    namespace=f"{CONFIG.namespace}-dq",
    heartbeat_timeout=10_000,
    maintenance_chance=100_000,
)
broker.add_middleware(CurrentMessage())
redis_store = CONFIG.store.startswith("redis")
store_options = {"prefix": CONFIG.namespace} if redis_store else {"table": CONFIG.namespace}
GUARD = taskonce.Guard(
    taskonce.open_store(CONFIG.store, **store_options),
    default=CONFIG.policy(),
    events=[taskonce.JsonlEvents(CONFIG.events)],
)
broker.add_middleware(
    IdempotencyMiddleware(
        GUARD,
        store_error_min_backoff=200,
        store_error_max_backoff=2000,
        relay_every=CONFIG.relay_every,
    )
)
dramatiq.set_broker(broker)
LEDGER = Ledger(CONFIG)
RETRY: dict[str, Any] = {"max_retries": 200, "min_backoff": 200, "max_backoff": 1000}


def _message_id() -> str:
    message = CurrentMessage.get_current_message()
    return message.message_id if message is not None else "?"


@dramatiq.actor(queue_name=CONFIG.namespace, actor_name="pay", **RETRY)
def pay(key: str) -> str:
    LEDGER.body(key, "parent", _message_id())
    if CONFIG.handoff:
        child.send(key)
    return key


@dramatiq.actor(queue_name=CONFIG.child_queue, actor_name="child", **RETRY)
def child(key: str) -> str:
    LEDGER.body(key, "child", _message_id())
    return key
