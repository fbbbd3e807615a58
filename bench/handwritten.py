"""What a user would write by hand instead of taskonce: the benchmarks' yardstick, not a library.

A Celery base class that does one ``SET key running NX PX lease`` before the body (a duplicate
is skipped when the key exists) and one ``SET key done PX keep_for`` after it (``DEL`` when the
body raised, so a retry can run). No fencing token, no worker identity (a dead owner's key
blocks its redeliveries until the lease runs out), no payload check, no events, no hand-off:
the floor that the guard's extra promises are measured against (``bench/peers/compare.py``).
It keys on ``(queue, message id)`` like taskonce's default identity.
"""

from __future__ import annotations

import os
from typing import Any

import redis

LEASE_MS = 300_000
KEEP_MS = 7 * 86_400_000


class _Clients:
    """One redis client per process: a client must not cross a fork (Celery prefork)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pid = -1
        self._client: redis.Redis | None = None

    def get(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(self.url)
            self._pid = os.getpid()
        return self._client


def celery_base(url: str, prefix: str = "hand") -> type[Any]:
    """A Celery ``Task`` base class doing SET NX PX before the body, SET PX after it."""
    from celery import Task
    from celery.exceptions import Ignore

    clients = _Clients(url)

    class HandwrittenOnceTask(Task):  # type: ignore[misc]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            request = self.request
            if request.called_directly:
                return super().__call__(*args, **kwargs)
            queue = (request.delivery_info or {}).get("routing_key") or ""
            key = f"{prefix}:{queue}:{request.id}"
            client = clients.get()
            if not client.set(key, "running", nx=True, px=LEASE_MS):
                raise Ignore()  # a duplicate: acknowledged, not run
            try:
                result = super().__call__(*args, **kwargs)
            except BaseException:
                client.delete(key)
                raise
            client.set(key, "done", px=KEEP_MS)
            return result

    return HandwrittenOnceTask
