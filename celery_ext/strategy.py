"""The worker-side message strategy of guarded tasks: refuse messages without a task id, and
note the digest of a body that has no canonical form (pickle) for the payload fingerprint.

Celery's default strategy builds its ``Request`` from the ``id`` header; a message without one
raises ``KeyError`` in the consumer, which Celery treats as a lost connection: it restores the
message, reconnects, receives it again, and stops the worker after five restarts a second. A
guarded task cannot be keyed without an id either, so such a message is rejected (without
requeue: dead-lettered where the broker has a dead-letter exchange) and logged, before the
default strategy sees it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from celery import signals
from celery.worker.strategy import default

from taskonce.celery_ext.message import BODY_DIGEST

logger = logging.getLogger("taskonce.celery")


def guarded(task: Any, app: Any, consumer: Any, **options: Any) -> Callable[..., Any]:
    """Celery's default strategy behind a check that the message has a usable task id."""
    handle = default(task, app, consumer, **options)
    connection_errors = consumer.connection_errors

    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any
    ) -> Any:
        headers = message.headers
        if isinstance(headers, dict) and "task" in headers:  # task protocol 2
            # A body with no canonical form (pickle) is fingerprinted as delivered: its digest
            # rides in the headers to the request (taskonce.celery_ext.message.BODY_DIGEST).
            if message.content_type == "application/json":
                headers.pop(BODY_DIGEST, None)
            else:
                raw = message.body
                raw = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
                headers[BODY_DIGEST] = hashlib.sha256(raw).hexdigest()
            task_id = headers.get("id")
            if not isinstance(task_id, str) or not task_id.strip():
                logger.error(
                    "taskonce: rejected a %s message without a task id (id=%r, "
                    "delivery_info=%r); it was not run. Publish tasks with apply_async/"
                    "send_task, which always set one.",
                    headers.get("task"),
                    task_id,
                    message.delivery_info,
                )
                message.reject_log_error(logger, connection_errors, requeue=False)
                signals.task_rejected.send(sender=consumer, message=message, exc=None)
                return None
        return handle(message, body, ack, reject, callbacks, **kwargs)

    return task_message_handler
