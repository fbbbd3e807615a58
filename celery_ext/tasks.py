"""Tasks taskonce registers on every Celery app: ``taskonce.celery_ext.purge``.

Schedule it with Celery beat to keep an SQL store small (Redis stores expire their keys
themselves; there the task deletes nothing and returns 0)::

    app.conf.beat_schedule = {
        "taskonce-purge": {"task": "taskonce.celery_ext.purge", "schedule": 3600.0},
    }
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from taskonce.celery_ext.config import guard_for

logger = logging.getLogger("taskonce.celery")


def _purge(self: Any, batch: int = 1000) -> int:
    """Delete expired marks and dead claims from the app's store in batches of ``batch``;
    returns how many were deleted (one ``purged`` event)."""
    return guard_for(self.app).purge(batch)


#: The ``taskonce.celery_ext.purge`` task (a shared task: registered on every app).
purge: Any = shared_task(name="taskonce.celery_ext.purge", bind=True, ignore_result=False)(_purge)
