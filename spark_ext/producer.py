"""Spark as a producer: one Celery task or Dramatiq message per DataFrame row, with a
deterministic id.

Spark re-runs failed tasks (``spark.task.maxFailures``) and speculative copies of slow ones, and
each re-run sends its partition's rows again. With ``uuid5(namespace, key columns)`` as the
message id, every re-send of a row carries the id of the first send, so the consumer's guard
(keyed on queue + message id) treats it as a duplicate and the handler runs once per row.
"""

from __future__ import annotations

import importlib
import json
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taskonce.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row

logger = logging.getLogger("taskonce.spark_ext")


def namespace_uuid(namespace: uuid.UUID | str) -> uuid.UUID:
    """The UUID namespace of ``namespace``: a UUID (or its text) as it is; any other text
    ``uuid5(NAMESPACE_URL, "taskonce:" + text)``, so ``"orders-export"`` is a fine namespace."""
    if isinstance(namespace, uuid.UUID):
        return namespace
    try:
        return uuid.UUID(namespace)
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"taskonce:{namespace}")


def row_id(namespace: uuid.UUID | str, values: Sequence[Any]) -> str:
    """The message id of a row whose key columns hold ``values``:
    ``uuid5(namespace, JSON array of the values)``. The JSON array keeps ``("a|b", "c")`` and
    ``("a", "b|c")`` apart; values JSON cannot hold (dates, decimals) are written as text."""
    name = json.dumps(list(values), default=str, separators=(",", ":"), ensure_ascii=False)
    return str(uuid.uuid5(namespace_uuid(namespace), name))


def target_path(task_or_actor: Any) -> str:
    """``"module:attribute"`` of a Celery task or Dramatiq actor defined at module level (what
    executors import); a string is taken as such a path."""
    if isinstance(task_or_actor, str):
        if ":" not in task_or_actor:
            raise ConfigError(
                f"send_rows: {task_or_actor!r} is not a 'package.module:attribute' path"
            )
        return task_or_actor
    # a Dramatiq actor keeps its function as .fn, a Celery task as .__wrapped__
    fn = getattr(task_or_actor, "fn", None) or getattr(task_or_actor, "__wrapped__", None)
    module = getattr(fn, "__module__", None) or getattr(task_or_actor, "__module__", None)
    name = getattr(fn, "__name__", None) or getattr(task_or_actor, "__name__", None)
    if not module or not name or module == "__main__":
        raise ConfigError(
            f"send_rows: cannot find {task_or_actor!r} by import path (executors import it); "
            "define it at module level in an importable module, or pass 'module:attribute'"
        )
    path = f"{module}:{name}"
    try:
        found = _resolve(path)
    except (ImportError, AttributeError):
        found = None
    if found is not task_or_actor:
        raise ConfigError(
            f"send_rows: {path} is not {task_or_actor!r}; pass its 'module:attribute' path"
        )
    return path


def _resolve(path: str) -> Any:
    module, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _send(target: Any, message_id: str, kwargs: dict[str, Any], options: Mapping[str, Any]) -> None:
    if hasattr(target, "message_with_options") and hasattr(target, "broker"):  # Dramatiq
        extra = dict(options)
        delay = extra.pop("delay", None)
        message = target.message_with_options(kwargs=kwargs, **extra).copy(message_id=message_id)
        target.broker.enqueue(message, delay=delay)
    elif hasattr(target, "apply_async"):  # Celery
        target.apply_async(kwargs=kwargs, task_id=message_id, **options)
    else:
        raise ConfigError(f"send_rows: {target!r} is neither a Celery task nor a Dramatiq actor")


def _partition_sender(
    path: str,
    key_cols: Sequence[str],
    namespace: uuid.UUID,
    columns: Sequence[str] | None,
    options: Mapping[str, Any],
) -> Any:
    def send_partition(rows: Iterator[Row]) -> Iterator[int]:
        target = _resolve(path)
        sent = 0
        for row in rows:
            values = row.asDict(recursive=True)
            message_id = row_id(namespace, [values[column] for column in key_cols])
            payload = values if columns is None else {c: values[c] for c in columns}
            _send(target, message_id, payload, options)
            sent += 1
        yield sent

    return send_partition


def send_rows(
    df: DataFrame,
    task_or_actor: Any,
    key_cols: Sequence[str],
    namespace: uuid.UUID | str,
    *,
    columns: Sequence[str] | None = None,
    options: Mapping[str, Any] | None = None,
) -> int:
    """Enqueue one message per row of ``df``: the row's columns as keyword arguments, the id
    ``uuid5(namespace, key columns)`` (:func:`row_id`) as the Celery task id or Dramatiq
    ``message_id``. Runs on the executors, partition by partition; nothing is collected.

    A Spark task that fails after sending part of its partition, or a speculative copy, sends
    those rows again under the same ids: the consumer's taskonce guard skips them, so each
    row's handler runs once. (Without a guard at the consumer they would run twice.)

    :param df: the rows to send.
    :param task_or_actor: a Celery task or Dramatiq actor defined at module level in a module
        the executors can import, or its ``"package.module:attribute"`` path (any object there
        with Celery's ``apply_async`` or Dramatiq's ``message_with_options`` and ``broker``).
        The executors' Python must have the framework installed (with a local master,
        :func:`~taskonce.spark_ext.build_session` points ``PYSPARK_PYTHON`` at this
        interpreter).
    :param key_cols: the columns that identify a row (its natural key); must not be empty.
    :param namespace: a UUID, or any text naming this export (see :func:`namespace_uuid`).
        Keep it stable across re-runs of the job, and distinct between unrelated exports.
    :param columns: the columns sent as keyword arguments (default all); values must be
        serialisable by the broker's serializer (JSON by default).
    :param options: passed on per message: ``apply_async`` options for Celery (``queue``,
        ``countdown``, …) or ``message_with_options`` options for Dramatiq (``delay``, …).
    :returns: the number of rows sent (each counted once, however often Spark re-ran its task).
    """
    if not key_cols:
        raise ConfigError("send_rows: key_cols must name at least one column")
    missing = [c for c in [*key_cols, *(columns or [])] if c not in df.columns]
    if missing:
        raise ConfigError(f"send_rows: no such column(s) {missing} in {df.columns}")
    path = target_path(task_or_actor)
    space = namespace_uuid(namespace)
    sender = _partition_sender(
        path, list(key_cols), space, list(columns) if columns else None, dict(options or {})
    )
    total = int(df.rdd.mapPartitions(sender).sum())
    logger.info("send_rows: sent %d row(s) to %s (namespace %s)", total, path, space)
    return total
