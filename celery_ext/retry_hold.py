"""The retry hold-back: :meth:`IdempotentTask.retry <taskonce.celery_ext.IdempotentTask.retry>`
holds the retry message back until the attempt's claim is released and its ``RETRY`` state is
stored; :func:`publish_held_retry` publishes it then (from ``on_retry``, else ``task_postrun``)."""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from celery.signals import task_postrun

from taskonce.celery_ext.request import reject
from taskonce.handoff import send_now

logger = logging.getLogger("taskonce.celery")

#: The task id whose retry publish is being held back (inside ``IdempotentTask.retry``).
HOLDING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "taskonce_celery_holding", default=None
)
#: Held retry publishes by task id: (signature, apply_async args, apply_async options).
HELD: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {}


def publish_held_retry(task_id: str) -> None:
    """Publish the retry message :meth:`IdempotentTask.retry` held back for ``task_id``.

    A failed publish raises ``Reject(requeue=True)``: the message goes back to the broker
    instead of being acknowledged with its retry lost.
    """
    held = HELD.pop(task_id, None)
    if held is None:
        return
    signature, publish_args, publish_options = held
    try:
        with send_now():  # the same message again, never a deferred send
            signature.apply_async(*publish_args, **publish_options)
    except Exception as exc:
        logger.error(
            "taskonce: the retry of %s could not be published (%r); rejecting the message "
            "back to the broker",
            task_id,
            exc,
        )
        raise reject(exc, requeue=True) from exc


def _publish_leftover_retry(sender: Any = None, task_id: Any = None, **_: Any) -> None:
    # task_postrun runs after the state is stored, whatever on_retry did.
    if isinstance(task_id, str) and task_id in HELD:
        logger.warning("taskonce: publishing the retry of %s from task_postrun", task_id)
        publish_held_retry(task_id)


task_postrun.connect(_publish_leftover_retry, weak=False, dispatch_uid="taskonce.celery_ext.retry")
