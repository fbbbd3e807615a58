"""The Celery settings a guarded task needs to get its messages back, and the warnings when
they are missing.

- :func:`warn_unsafe_acks`, at worker start: a guarded task whose effective ``acks_late`` or
  ``reject_on_worker_lost`` is off (its own option, a subclass, ``task_annotations``) loses the
  message of a run whose process dies; one warning line per such task.
- :func:`check_eta`, at publish: a guarded task sent with a countdown/ETA longer than the
  transport's ``visibility_timeout`` (Redis, SQS) is handed out again before it is due; one
  warning per task and setting.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger("taskonce.celery")

ACKS_EARLY_WARNING = (
    "taskonce: guarded task %s has acks_late=False%s: its message is acknowledged before the "
    "body runs, so a run whose worker dies mid-task (SIGKILL, out of memory, a restart) is "
    "lost and never runs again. Remove the option: IdempotentTask sets acks_late=True and "
    "reject_on_worker_lost=True, and the guard turns the redeliveries into skips."
)
REJECT_OFF_WARNING = (
    "taskonce: guarded task %s has reject_on_worker_lost=False: a pool process killed "
    "mid-task (SIGKILL, out of memory) has its message acknowledged as FAILURE "
    "(WorkerLostError), so that run is lost and never runs again. Remove the option: "
    "IdempotentTask sets it to True, and the guard takes the dead run's claim over."
)
ETA_WARNING = (
    "taskonce: task %s published with a countdown of %.0f s, longer than %s: the broker hands "
    "the message out again each time that timeout passes before the task is due. taskonce runs "
    "it once at its ETA (the early copies are deferred or skipped as duplicates), but each copy "
    "waits in a worker's memory until then; set broker_transport_options={'visibility_timeout': "
    "…} above your longest countdown or ETA, on the workers and the publishers."
)

#: Celery's transports that redeliver an unacknowledged message after ``visibility_timeout``
#: (kombu's defaults): a message with an ETA is held unacknowledged in a worker until it is due.
VISIBILITY_DEFAULTS = {"redis": ("Redis", 3600.0), "sqs": ("SQS", 1800.0)}
_TRANSPORT_KIND = {"redis": "redis", "rediss": "redis", "sentinel": "redis", "sqs": "sqs"}

_ETA_WARNED: set[tuple[str, str, float]] = set()
_ETA_LOCK = threading.Lock()


def unsafe_acks(task: Any) -> str | None:
    """The warning for ``task`` (a bound task) when its *effective* settings lose a message
    whose run dies, else None. ``reject_on_worker_lost=False`` is fine where Celery's
    ``retry_on_worker_lost`` sends the lost run again instead."""
    if not task.acks_late:
        both = "" if task.reject_on_worker_lost else " (and reject_on_worker_lost=False)"
        return ACKS_EARLY_WARNING % (task.name, both)
    if not task.reject_on_worker_lost and not getattr(task, "retry_on_worker_lost", False):
        return REJECT_OFF_WARNING % (task.name,)
    return None


def warn_unsafe_acks(tasks: Iterable[Any]) -> list[str]:
    """Log one warning line per task of ``tasks`` (the app's guarded tasks) that
    :func:`unsafe_acks` finds; return the names of those tasks."""
    named = []
    for task in sorted(tasks, key=lambda t: str(t.name)):
        warning = unsafe_acks(task)
        if warning is not None:
            logger.warning(warning)
            named.append(str(task.name))
    return named


def redelivery_bound(app: Any) -> tuple[str, float] | None:
    """``(what, seconds)``: the time after which ``app``'s broker transport hands an
    unacknowledged message out again, and a description naming its setting; None for a
    transport without one (RabbitMQ, memory) or a value that is not a number."""
    conf = app.conf
    url = conf.broker_write_url or conf.broker_url or ""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    url = str(url).split(";", 1)[0]
    scheme = str(conf.broker_transport or "") or (url.split("://", 1)[0] if "://" in url else "")
    kind = _TRANSPORT_KIND.get(scheme.split("+", 1)[0].lower())
    if kind is None:
        return None
    name, default = VISIBILITY_DEFAULTS[kind]
    options = conf.broker_transport_options
    value = options.get("visibility_timeout") if isinstance(options, Mapping) else None
    if value is None:
        return f"the {name} transport's visibility_timeout ({default:g} s by default)", default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    where = "broker_transport_options['visibility_timeout']"
    return f"the {name} transport's visibility_timeout ({where} = {seconds:g} s)", seconds


def seconds_ahead(app: Any, countdown: Any, eta: Any) -> float | None:
    """How far ahead a publish with ``countdown``/``eta`` (as ``apply_async`` takes them) is
    due; None when it is not delayed or the value is not one Celery takes. A countdown wins
    over an ETA, as in Celery."""
    if countdown and isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return float(countdown)
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            return None
    if not isinstance(eta, dt.datetime):
        return None
    if eta.tzinfo is None:  # Celery reads a naive ETA in UTC (enable_utc) or local time
        eta = eta.replace(tzinfo=dt.timezone.utc) if app.conf.enable_utc else eta.astimezone()
    ahead: float = (eta - dt.datetime.now(dt.timezone.utc)).total_seconds()
    return ahead


def check_eta(task: Any, options: Mapping[str, Any]) -> bool:
    """At publish: warn (once per task and setting) when ``options`` (``apply_async``'s)
    delay ``task`` beyond its transport's redelivery bound; True when this call warned."""
    app = task.app
    if app.conf.task_always_eager:
        return False  # run at once in this process: no broker holds it
    ahead = seconds_ahead(app, options.get("countdown"), options.get("eta"))
    if ahead is None:
        return False
    bound = redelivery_bound(app)
    if bound is None or ahead <= bound[1]:
        return False
    key = (str(task.name), bound[0], bound[1])
    with _ETA_LOCK:
        if key in _ETA_WARNED:
            return False
        _ETA_WARNED.add(key)
    logger.warning(ETA_WARNING, task.name, ahead, bound[0])
    return True
