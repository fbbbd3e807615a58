"""Loaded at start by every Python process of an upstream run (``tools/upstream`` puts this
folder first on ``PYTHONPATH``), so the patches below reach the processes the frameworks'
tests start themselves (Dramatiq's CLI tests run ``python -m dramatiq``) as well as pytest.

Environment, set by :mod:`tools.upstream.common` for one variant:

- ``TASKONCE_UPSTREAM_REDIS_PORT``: the variant's own redis-server. A Redis client built for
  the default address (``localhost:6379``, as Dramatiq's fixtures build theirs, and they run
  ``FLUSHALL``) connects there instead: the shared Redis on 6379 is never touched.
- ``TASKONCE_UPSTREAM_DRAMATIQ_STORE``: a taskonce store URL. Every Dramatiq broker built
  (stub, Redis, RabbitMQ) gets an ``IdempotencyMiddleware`` on a guard of that store, appended
  as a user adds it (after ``Retries``); closing the broker closes the guard.

Python runs one ``sitecustomize``: the one this shadows (the distribution's, if any) is run
after these patches.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import logging
import os
import sys
from typing import Any

logger = logging.getLogger("taskonce.upstream")

REDIS_PORT_ENV = "TASKONCE_UPSTREAM_REDIS_PORT"
DRAMATIQ_STORE_ENV = "TASKONCE_UPSTREAM_DRAMATIQ_STORE"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def redirect_redis(target: int) -> None:
    """Make redis-py clients of the default address connect to port ``target``."""
    import redis.connection

    original: Any = redis.connection.Connection.__init__

    @functools.wraps(original)
    def __init__(
        self: Any, host: str = "localhost", port: int = 6379, *args: Any, **kw: Any
    ) -> None:
        if str(port) == "6379" and host in DEFAULT_HOSTS:
            port = target
        original(self, host, port, *args, **kw)

    redis.connection.Connection.__init__ = __init__  # type: ignore[method-assign]


def add_idempotency_middleware(store_url: str) -> None:
    """Append an ``IdempotencyMiddleware`` to every Dramatiq broker built from now on."""
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.brokers.stub import StubBroker

    from taskonce import Guard, open_store
    from taskonce.dramatiq_ext import IdempotencyMiddleware

    def attach(broker: Any) -> None:
        if any(isinstance(m, IdempotencyMiddleware) for m in broker.middleware):
            return  # a subclass's __init__ ran the patched one of its base already
        # A user opens the store once, before building the broker; here it is opened inside
        # the broker's constructor, so its "opened ..." debug line would land in the tests'
        # captured logs (tests/middleware/test_shutdown.py counts every record): quiet it.
        stores = logging.getLogger("taskonce.stores")
        level = stores.level
        stores.setLevel(logging.WARNING)
        try:
            store = open_store(store_url)
        finally:
            stores.setLevel(level)
        guard = Guard(store)
        broker._taskonce_upstream_guard = guard
        broker.add_middleware(IdempotencyMiddleware(guard))

    for cls in (StubBroker, RedisBroker, RabbitmqBroker):
        init, close = cls.__init__, cls.close

        @functools.wraps(init)
        def patched_init(self: Any, *args: Any, _init: Any = init, **kw: Any) -> None:
            _init(self, *args, **kw)
            attach(self)

        @functools.wraps(close)
        def patched_close(self: Any, _close: Any = close) -> None:
            try:
                _close(self)
            finally:
                guard = self.__dict__.pop("_taskonce_upstream_guard", None)
                if guard is not None:
                    guard.close()

        cls.__init__ = patched_init  # type: ignore[method-assign]
        cls.close = patched_close  # type: ignore[method-assign]


def run_shadowed() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this module shadows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:  # the shadowed hook is optional (e.g. apport's): never stop a process
        logger.debug("the shadowed sitecustomize failed", exc_info=True)


if os.environ.get(REDIS_PORT_ENV):
    redirect_redis(int(os.environ[REDIS_PORT_ENV]))
if os.environ.get(DRAMATIQ_STORE_ENV):
    add_idempotency_middleware(os.environ[DRAMATIQ_STORE_ENV])
run_shadowed()
