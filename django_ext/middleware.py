"""The Dramatiq middleware with the project's guard, for django_dramatiq's settings::

DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.rabbitmq.RabbitmqBroker",
    "MIDDLEWARE": [..., "taskonce.django_ext.IdempotencyMiddleware"],
}
"""

from __future__ import annotations

from typing import Any

from taskonce.dramatiq_ext import IdempotencyMiddleware as _Middleware
from taskonce.guard import Guard
from taskonce.worker_options import WorkerOptions

from . import conf


class IdempotencyMiddleware(_Middleware):
    """:class:`taskonce.dramatiq_ext.IdempotencyMiddleware` on :func:`~taskonce.django_ext.guard`
    (``settings.TASKONCE``) when no guard is given, so django_dramatiq can make it from its
    dotted path. ``options`` are the Dramatiq middleware's (``relay_every``, …); those left out
    are ``settings.TASKONCE``'s (``RELAY_EVERY``, ``START_TIMEOUT``, ``STORE_RETRY_DELAY``)."""

    def __init__(self, guard: Guard | None = None, **options: Any) -> None:
        super().__init__(conf.guard() if guard is None else guard, **options)

    def default_options(self) -> WorkerOptions:
        """``settings.TASKONCE``'s worker options."""
        return conf.middleware_options()


__all__ = ["IdempotencyMiddleware"]
