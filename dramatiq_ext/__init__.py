"""taskonce for Dramatiq: the idempotency middleware and its actor option.

::

    import dramatiq, taskonce
    from dramatiq.brokers.redis import RedisBroker
    from taskonce.dramatiq_ext import IdempotencyMiddleware

    guard = taskonce.Guard(taskonce.open_store("redis://localhost:6379/0"))
    broker = RedisBroker(url="redis://localhost:6379/1")
    broker.add_middleware(IdempotencyMiddleware(guard))   # after Retries, before any actor
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="payments", idempotency={"mode": "lazy"})
    def charge(order_id): ...

What a guarded actor sends (``send``, pipeline steps, ``on_success`` callbacks) is enqueued only
after its outcome is recorded: see docs/handoff.md. See docs/dramatiq.md.
"""

from __future__ import annotations

from taskonce.dramatiq_ext.errors import (
    DuplicateSkipped,
    GuardError,
    IdempotencyConfigError,
    InProgressDeferred,
    MiddlewareOrderError,
    NotRun,
    Rejected,
    StoreDown,
)
from taskonce.dramatiq_ext.middleware import IdempotencyMiddleware, relay_guard
from taskonce.dramatiq_ext.options import OPTION
from taskonce.dramatiq_ext.purge import PeriodicPurge

__all__ = [
    "OPTION",
    "DuplicateSkipped",
    "GuardError",
    "IdempotencyConfigError",
    "IdempotencyMiddleware",
    "InProgressDeferred",
    "MiddlewareOrderError",
    "NotRun",
    "PeriodicPurge",
    "Rejected",
    "StoreDown",
    "relay_guard",
]
