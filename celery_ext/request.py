"""What a Celery request says about its delivery, read in one place: the counters the guard's
copies carry in their headers, whether the broker redelivered it, its hard time limit (and the
lease that outlives it), and the ``Reject`` that carries a reason across the prefork pool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery.exceptions import Reject

#: The header counting the guard's deferrals of a message (a copy published again because
#: another worker held its key): the audit counts a re-deferred copy as one duplicate.
DEFERRED_HEADER = "taskonce_deferred"
#: The header counting a message's back-offs in a row after a store error: each is longer
#: (:class:`taskonce.outage.Backoff`, the rule Dramatiq's middleware follows too).
STORE_ERRORS_HEADER = "taskonce_store_errors"


def lease_beyond(time_limit: float) -> float:
    """The default lease of a task with a hard ``time_limit``: longer than the limit.

    A hard time limit (like a ``WorkerLostError``) kills the child without running any task
    hook, so the claim can only end by its lease: it must not end while the body may still be
    running. ``time_limit + max(5 s, 10 %)``.
    """
    return time_limit + max(5.0, 0.1 * time_limit)


def reject(reason: BaseException, requeue: bool) -> Reject:
    """A ``Reject`` whose reason crosses process boundaries: the prefork pool pickles it back to
    the worker's main process, which stops with an unrecoverable error on a reason that does
    not unpickle. taskonce's own errors do (each has its ``__reduce__``), but a publish error
    from a broker's client need not (a constructor with arguments of its own), so the reason
    is carried as text, the same whatever raised it."""
    return Reject(f"{type(reason).__name__}: {reason}", requeue=requeue)


def hard_time_limit(task: Any, request: Any) -> float | None:
    limits = request.timelimit
    hard = limits[0] if isinstance(limits, (list, tuple)) and limits else None
    if hard is None:
        hard = task.time_limit
    if isinstance(hard, bool) or not isinstance(hard, (int, float)) or hard <= 0:
        return None
    return float(hard)


def count(request: Any, header: str) -> int:
    """A counter the guard's copies carry (:data:`DEFERRED_HEADER`, :data:`STORE_ERRORS_HEADER`)
    on this copy; 0 when absent: Celery puts a message's own headers on the request, or in
    ``request.headers``."""
    value = getattr(request, header, None)
    if value is None and isinstance(request.headers, Mapping):
        value = request.headers.get(header)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def redelivered(request: Any) -> bool | None:
    info = request.delivery_info
    if not isinstance(info, Mapping) or "redelivered" not in info:
        return None
    value = info.get("redelivered")
    return None if value is None else bool(value)
