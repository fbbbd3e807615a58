"""taskonce for Django: ``INSTALLED_APPS = [..., "taskonce.django_ext"]``.

- :func:`guard`: the project's guard, from ``settings.TASKONCE`` (``STORE``, ``DEFAULT``,
  ``QUEUES``, …), for Celery's ``setup(app, guard())``;
- ``django://ALIAS`` stores (:class:`DjangoStore`): records in a Django database, on Django's
  own connections, tables by ``manage.py migrate``; with ``transactional: True`` the handler
  runs in ``transaction.atomic(using=ALIAS)`` and its ORM writes commit with the mark;
- :func:`send_on_commit`: a view's sends leave when Django commits;
- :class:`IdempotencyMiddleware`: the Dramatiq middleware for django_dramatiq's settings;
- management command ``manage.py taskonce``, a read-only admin, and system checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .conf import guard

if TYPE_CHECKING:
    from .middleware import IdempotencyMiddleware
    from .outbox import send_on_commit
    from .store import DjangoStore

_LAZY = {
    "IdempotencyMiddleware": "middleware",  # imports dramatiq: only for Dramatiq projects
    "send_on_commit": "outbox",
    "DjangoStore": "store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'taskonce.django_ext' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)


__all__ = ["DjangoStore", "IdempotencyMiddleware", "guard", "send_on_commit"]
