"""Celery 5.4's Django ``delay_on_commit`` / ``apply_async_on_commit`` on a guarded task
(:meth:`IdempotentTask.delay_on_commit <taskonce.celery_ext.IdempotentTask.delay_on_commit>`
calls :func:`publish_on_commit`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from taskonce import handoff


def publish_on_commit(publish: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``publish(*args, **kwargs)`` once the database transaction commits. Where taskonce
    already holds the sends until a commit — inside a guarded handler (the hand-off publishes
    them after its record) or a ``send_on_commit()`` block (an outbox row in the transaction)
    — it is published now, captured like any other send; elsewhere on Django's
    ``transaction.on_commit``."""
    if handoff.current() is not None:
        publish(*args, **kwargs)
        return
    from django.db import transaction

    transaction.on_commit(functools.partial(publish, *args, **kwargs))
