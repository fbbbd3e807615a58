"""pytest plugin for Celery's integration tests (``-p taskonce_upstream_celery``).

Celery's ``t/integration/conftest.py`` builds its apps with ``celery.contrib.pytest``'s
``celery_app`` / ``celery_session_app`` fixtures, which pass the ``celery_parameters`` fixture
to ``Celery(...)`` and do not redefine it. This plugin redefines it, so with
``TASKONCE_UPSTREAM_CELERY_STORE`` set every app of the run is the one a user writes::

    Celery(..., task_cls="taskonce.celery_ext:IdempotentTask", taskonce_store=STORE)

(Celery keeps unknown keyword arguments as settings.) Without it the apps are plain Celery.
Nothing of Celery's tests is changed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest

STORE_ENV = "TASKONCE_UPSTREAM_CELERY_STORE"
TASK_CLS = "taskonce.celery_ext:IdempotentTask"


@pytest.fixture(scope="session")
def celery_parameters() -> Mapping[str, Any]:
    """The keyword arguments of every test app: taskonce's task class and store, or none."""
    store = os.environ.get(STORE_ENV)
    if not store:
        return {}
    return {"task_cls": TASK_CLS, "taskonce_store": store}


def pytest_report_header() -> str:
    """Say which variant runs, at the top of the log."""
    store = os.environ.get(STORE_ENV)
    if store:
        return f"taskonce upstream: task_cls={TASK_CLS}, taskonce_store={store}"
    return "taskonce upstream: plain Celery"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Show the guard was at work: how many keys taskonce's store holds at the end."""
    store = os.environ.get(STORE_ENV)
    if not store or not store.startswith("redis://"):
        return
    import redis

    try:
        with redis.Redis.from_url(store, socket_timeout=5) as client:
            size = client.dbsize()
    except redis.RedisError as exc:
        terminalreporter.write_line(f"taskonce upstream: store {store} unreachable: {exc}")
        return
    terminalreporter.write_line(f"taskonce upstream: the store {store} holds {size} keys")
