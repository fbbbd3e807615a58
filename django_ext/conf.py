"""``settings.TASKONCE``, read in one place: the guard a Django project's workers and views
share.

::

    TASKONCE = {
        "STORE": "django://default",     # default; or any store URL (redis://…, postgresql://…)
        "DEFAULT": {"mode": "eager", "transactional": True},   # Policy fields
        "QUEUES": {"emails": {"mode": "lazy", "transactional": False}},
        "EVENTS": [],                    # extra event sinks (taskonce.JsonlEvents(…), …)
        "SEND_LIMIT": 1048576,           # Guard(send_limit=…)
        "DISPATCH_LEASE": 30.0,          # Guard(dispatch_lease=…)
        "RELAY_EVERY": 30.0,             # the Dramatiq middleware's relay_every (seconds)
        "START_TIMEOUT": 30.0,           # … its start_timeout (seconds)
        "STORE_RETRY_DELAY": 1.0,        # … the first back-off after a store error (seconds)
    }

Every key is optional. :func:`guard` builds the guard once per process (again after
``override_settings(TASKONCE=…)`` in a test).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from taskonce.errors import ConfigError
from taskonce.guard import Guard
from taskonce.stores.base import Store
from taskonce.worker_options import WorkerOptions

#: The keys of ``settings.TASKONCE`` and their defaults.
DEFAULTS: dict[str, Any] = {
    "STORE": "django://default",
    "DEFAULT": {},
    "QUEUES": {},
    "EVENTS": [],
    "SEND_LIMIT": None,
    "DISPATCH_LEASE": None,
    "RELAY_EVERY": None,
    "START_TIMEOUT": None,
    "STORE_RETRY_DELAY": None,
}
#: The keys of ``settings.TASKONCE`` that are worker options, and their fields.
WORKER_OPTIONS = {
    "RELAY_EVERY": "relay_every",
    "START_TIMEOUT": "start_timeout",
    "STORE_RETRY_DELAY": "backoff_first",
}

_lock = threading.Lock()
_guard: Guard | None = None


def read_settings() -> dict[str, Any]:
    """``settings.TASKONCE`` over :data:`DEFAULTS`.

    :raises ConfigError: it is not a dict, or it has a key taskonce does not know (the message
        suggests the close one)."""
    from django.conf import settings

    given = getattr(settings, "TASKONCE", {})
    if not isinstance(given, Mapping):
        raise ConfigError(f"settings.TASKONCE must be a dict, not {type(given).__name__}")
    for name in given:
        if name not in DEFAULTS:
            close = difflib.get_close_matches(str(name).upper(), DEFAULTS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"settings.TASKONCE has no setting {name!r}{hint}; known: {', '.join(DEFAULTS)}"
            )
    return {**DEFAULTS, **given}


def store_url() -> str:
    """The store URL of ``settings.TASKONCE["STORE"]``."""
    url = read_settings()["STORE"]
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f'settings.TASKONCE["STORE"] must be a store URL such as "django://default" or '
            f'"redis://localhost:6379/0", not {url!r}'
        )
    return url


def open_configured_store() -> Store:
    """The store ``settings.TASKONCE["STORE"]`` names."""
    from taskonce.stores import open_store

    return open_store(store_url())


def worker_options() -> WorkerOptions:
    """The worker options of ``settings.TASKONCE`` (``RELAY_EVERY``, ``START_TIMEOUT``,
    ``STORE_RETRY_DELAY``), the defaults for the ones it leaves out.

    :raises ConfigError: a bad value, naming it: ``settings.TASKONCE["RELAY_EVERY"]=-1 must be
        a number of seconds, 0 or more``."""
    values = read_settings()
    given = {field: values[key] for key, field in WORKER_OPTIONS.items() if values[key] is not None}
    names = {field: f'settings.TASKONCE["{key}"]' for key, field in WORKER_OPTIONS.items()}
    return WorkerOptions(**given, names=names)


def middleware_options() -> WorkerOptions:
    """:func:`worker_options` for the Dramatiq middleware, which django_dramatiq makes while
    Django sets up: a bad value refuses a worker's start (exit status 78), like :func:`guard`;
    in another process still setting up (``manage.py check``, which names the mistake) the
    defaults stand in, beside the stand-in guard that refuses every use."""
    try:
        return worker_options()
    except ConfigError as exc:
        _refuse_if_worker(exc)
        if not _django_setting_up():
            raise
        logging.getLogger("taskonce.django_ext").warning(
            "taskonce: %s; the Dramatiq middleware takes the default worker options", exc
        )
        return WorkerOptions()


def build_guard() -> Guard:
    """A new guard from ``settings.TASKONCE``.

    :raises ConfigError: a bad setting or policy, naming it."""
    values = read_settings()
    options: dict[str, Any] = {}
    if values["SEND_LIMIT"] is not None:
        options["send_limit"] = values["SEND_LIMIT"]
    if values["DISPATCH_LEASE"] is not None:
        options["dispatch_lease"] = values["DISPATCH_LEASE"]
    for name in ("DEFAULT", "QUEUES"):
        if not isinstance(values[name], Mapping):
            raise ConfigError(
                f'settings.TASKONCE["{name}"] must be a dict, not {type(values[name]).__name__}'
            )
    store = open_configured_store()
    try:
        return Guard(store, values["DEFAULT"], values["QUEUES"], list(values["EVENTS"]), **options)
    except BaseException:
        store.close()
        raise


def guard() -> Guard:
    """The project's guard, built from ``settings.TASKONCE`` on first use and shared by every
    caller in the process (Celery's ``setup(app, guard())``, the Dramatiq middleware,
    :func:`~taskonce.django_ext.send_on_commit`, the management commands).

    :raises ConfigError: a bad setting or policy, naming it. Called while a worker command
        (``celery worker``, ``dramatiq``) imports the project, the worker refuses to start
        instead: one line, exit status 78.
    """
    global _guard
    if _guard is not None:
        return _guard
    with _lock:
        if _guard is None:
            try:
                _guard = build_guard()
            except ConfigError as exc:
                _refuse_if_worker(exc)
                if _django_setting_up():
                    return _stand_in(exc)
                raise
        return _guard


def _django_setting_up() -> bool:
    """Whether Django is still loading the settings or the apps: ``guard()`` then runs from
    the import of the project's package (``proj/__init__.py`` importing ``proj/celery.py``,
    Celery's Django layout), before any management command, check or request."""
    from django.apps import apps

    return not apps.ready


def _stand_in(exc: ConfigError) -> Guard:
    """The guard that stands in for one ``settings.TASKONCE`` cannot build, while Django sets
    up a process that is no worker: raising there would kill every ``manage.py`` command
    (``check`` included, which says what is wrong, as ``taskonce.E0…``) with a traceback."""
    logging.getLogger("taskonce.django_ext").warning(
        "taskonce: %s; the project's guard refuses every use (manage.py check says more)", exc
    )
    return UnconfiguredGuard(exc)


#: What :class:`UnconfiguredGuard` lets through: what Celery's ``setup(app, guard)`` does at
#: import (registering the app's publisher) and closing.
_INERT = frozenset({"register_publisher", "close", "error"})


class UnconfiguredGuard(Guard):
    """A guard for settings that cannot make one: any use but registering a publisher or
    closing raises the :class:`~taskonce.ConfigError` that building it raised, so nothing
    runs or sends on a guard the settings do not describe.

    :func:`guard` returns it only while Django sets up a process that is no worker (a worker
    refuses to start instead); afterwards :func:`guard` raises the error itself."""

    def __init__(self, error: ConfigError) -> None:  # builds nothing: there is nothing valid
        object.__setattr__(self, "error", error)

    def register_publisher(self, framework: str, publish: Any) -> None:
        """Nothing: the error is raised at the guard's first use."""

    def close(self) -> None:
        """Nothing to close."""

    def __getattribute__(self, name: str) -> Any:
        if name in _INERT or (name.startswith("__") and name.endswith("__")):
            return object.__getattribute__(self, name)
        raise object.__getattribute__(self, "error")

    def __setattr__(self, name: str, value: Any) -> None:
        raise object.__getattribute__(self, "error")

    def __repr__(self) -> str:
        return f"<UnconfiguredGuard: {object.__getattribute__(self, 'error')}>"


def reset() -> None:
    """Forget the process's guard (closing it): the next :func:`guard` reads the settings
    again. Connected to Django's ``setting_changed`` for ``TASKONCE``."""
    global _guard
    with _lock:
        old, _guard = _guard, None
    if old is not None:
        old.close()


def _refuse_if_worker(exc: ConfigError) -> None:
    from taskonce.exits import refuse_start

    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    celery = program == "celery" or sys.argv[0].endswith(os.path.join("celery", "__main__.py"))
    celery_worker = celery and "worker" in sys.argv[1:]
    if celery_worker or program in ("dramatiq", "rundramatiq") or "rundramatiq" in sys.argv[1:2]:
        refuse_start(exc, logging.getLogger("taskonce.django_ext"))


__all__ = [
    "DEFAULTS",
    "UnconfiguredGuard",
    "build_guard",
    "guard",
    "middleware_options",
    "open_configured_store",
    "read_settings",
    "reset",
    "worker_options",
]
