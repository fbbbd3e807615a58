"""taskonce for Celery: the idempotent task base class and its settings.

::

    import taskonce
    from celery import Celery
    from taskonce.celery_ext import IdempotentTask, setup

    app = Celery("shop", broker="redis://localhost:6379/1")
    setup(app, taskonce.Guard(taskonce.open_store("redis://localhost:6379/0")))
    # or: app.conf.taskonce_store = "redis://…"; taskonce_default / taskonce_queues

    @app.task(base=IdempotentTask, idempotency={"mode": "eager"})  # acks_late: the class sets it
    def charge(order_id): ...

Importing this package connects a ``before_task_publish`` receiver that stamps each task
message with its destination queue (:data:`QUEUE_HEADER`) and registers the beat-friendly
``taskonce.celery_ext.purge`` task. What a guarded task sends (``.delay``, signatures, its
``link`` callbacks and next ``chain`` step) leaves only after its outcome is recorded: see
docs/handoff.md. See docs/celery.md.
"""

from __future__ import annotations

from taskonce.celery_ext.config import guard_for, relay_guard, setup
from taskonce.celery_ext.request import lease_beyond
from taskonce.celery_ext.routing import QUEUE_HEADER, delivery_queue
from taskonce.celery_ext.task import IdempotentTask
from taskonce.celery_ext.tasks import purge

__all__ = [
    "QUEUE_HEADER",
    "IdempotentTask",
    "delivery_queue",
    "guard_for",
    "lease_beyond",
    "purge",
    "relay_guard",
    "setup",
]
