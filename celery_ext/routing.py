"""Which queue a Celery delivery belongs to.

Celery's request has no queue field: ``delivery_info`` carries the exchange and the routing
key, and the routing key names the queue only when the exchange is ``''``. taskonce therefore
stamps the destination queue into a message header when the message is published
(:data:`QUEUE_HEADER`, set by a ``before_task_publish`` receiver) and reads it in the worker.

**The queue-name rule** (what :func:`delivery_queue` returns):

1. the :data:`QUEUE_HEADER` header stamped at publish time;
2. else the routing key of ``delivery_info`` (messages published by a producer without the
   receiver, e.g. another language's client or a raw kombu producer);
3. else the queue the task is routed to by default (``task_routes``, then
   ``task_default_queue``) — this is what eager runs (``apply()``, ``task_always_eager``) use
   unless ``queue=`` or ``routing_key=`` was given.

At publish time the header is the name of the queue Celery declares for the message; when the
message is published to an exchange without a queue (a retry re-published to the
``delivery_info`` it came from), the queue bound to that exchange and routing key in
``app.amqp.queues``; for the anonymous exchange ``''``, the routing key.

Where a refused message ends (:func:`record_refusal`): rejected without requeue, so a broker
dead-letter exchange catches it where one is configured; that stores no state in the result
backend, so one refused because its key is quarantined (``Policy.crash_limit``) gets
``FAILURE`` with its :class:`~taskonce.errors.Quarantined` error, and whoever waits for its
result learns why it never ran. Other refusals leave the state alone: a payload mismatch's task
id may hold the first run's result, which a duplicate never overwrites.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from celery import current_app
from celery.signals import before_task_publish

from taskonce.errors import Quarantined

logger = logging.getLogger("taskonce.celery")

#: The message header holding the destination queue, stamped at publish time.
QUEUE_HEADER = "taskonce_queue"

#: While :func:`stamped_queues` runs: the queues stamped in this context, in publish order.
_STAMPED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "taskonce_stamped_queues", default=None
)


@contextlib.contextmanager
def stamped_queues() -> Iterator[list[str]]:
    """The queues the messages published inside the block went to (as stamped): the hand-off's
    publisher learns where a send went, to know its receiver's key."""
    seen: list[str] = []
    token = _STAMPED.set(seen)
    try:
        yield seen
    finally:
        _STAMPED.reset(token)


def publish_queue(
    exchange: Any, routing_key: Any, declare: Sequence[Any] | None, app: Any = None
) -> str | None:
    """The queue a message published with these ``before_task_publish`` arguments goes to."""
    queues = [q for q in (declare or ()) if _is_queue(q)]
    if len(queues) == 1:
        return str(queues[0].name)
    exchange_name = getattr(exchange, "name", exchange) or ""
    if len(queues) > 1:
        for queue in queues:
            if _binds(queue, exchange_name, routing_key):
                return str(queue.name)
    if exchange_name == "" and isinstance(routing_key, str) and routing_key:
        return routing_key
    try:
        known = (app or current_app).amqp.queues
    except Exception:  # no app configured in this process: fall back to the routing key
        known = {}
    for queue in known.values():
        if _binds(queue, exchange_name, routing_key):
            return str(queue.name)
    if isinstance(routing_key, str) and routing_key:
        return routing_key
    return None


def _is_queue(candidate: Any) -> bool:
    # kombu Queue (Broadcast queues are fanout: no single destination).
    return (
        hasattr(candidate, "name")
        and hasattr(candidate, "routing_key")
        and bool(candidate.name)
        and type(candidate).__name__ != "Broadcast"
    )


def _binds(queue: Any, exchange_name: str, routing_key: Any) -> bool:
    exchange = getattr(queue, "exchange", None)
    name = getattr(exchange, "name", exchange) or ""
    return bool(name == exchange_name and queue.routing_key == routing_key)


def stamp_queue(
    sender: Any = None,
    headers: dict[str, Any] | None = None,
    exchange: Any = None,
    routing_key: Any = None,
    declare: Sequence[Any] | None = None,
    **_: Any,
) -> None:
    """``before_task_publish`` receiver: write the destination queue into the headers.

    Connected once when :mod:`taskonce.celery_ext` is imported; it stamps every task message
    (a few bytes), so tasks sent by name with ``send_task`` are stamped too.
    """
    if headers is None:
        return
    try:
        queue = publish_queue(exchange, routing_key, declare)
    except Exception:  # stamping must never stop a publish
        logger.debug("could not work out the queue of %s", sender, exc_info=True)
        return
    if queue:
        headers[QUEUE_HEADER] = queue
        seen = _STAMPED.get()
        if seen is not None:
            seen.append(queue)


before_task_publish.connect(stamp_queue, weak=False, dispatch_uid="taskonce.celery_ext.stamp")


def default_queue(task: Any) -> str:
    """The queue ``task`` is routed to when no queue is named (task_routes, then default)."""
    app = task.app
    try:
        options = dict(task._get_exec_options())  # the task's own queue/routing attributes
        route = app.amqp.router.route(options, task.name)
        queue = route.get("queue")
        name = getattr(queue, "name", queue)
        if isinstance(name, str) and name:
            return name
    except Exception:  # a router that needs arguments: use the configured default
        logger.debug("could not route %s without arguments", task.name, exc_info=True)
    return str(app.conf.task_default_queue or "celery")


def delivery_queue(task: Any, request: Any) -> str:
    """The canonical queue of the delivery ``request`` of ``task`` (see the module's rule)."""
    stamped = getattr(request, QUEUE_HEADER, None)
    if not (isinstance(stamped, str) and stamped):
        headers = request.headers
        stamped = headers.get(QUEUE_HEADER) if isinstance(headers, Mapping) else None
    if isinstance(stamped, str) and stamped:
        return stamped
    info = request.delivery_info
    routing_key = info.get("routing_key") if isinstance(info, Mapping) else None
    if isinstance(routing_key, str) and routing_key:
        return routing_key
    return default_queue(task)


def record_refusal(task: Any, task_id: str, exc: BaseException) -> None:
    """Store ``FAILURE`` with ``exc`` for ``task_id`` when ``exc`` is :class:`Quarantined` and
    the task keeps results; a backend that fails is logged, never raised (the message is
    dead-lettered all the same)."""
    if not isinstance(exc, Quarantined) or task.ignore_result:
        return
    try:
        task.backend.mark_as_failure(task_id, exc)
    except Exception:
        logger.warning(
            "taskonce: could not store FAILURE of %s[%s]", task.name, task_id, exc_info=True
        )
