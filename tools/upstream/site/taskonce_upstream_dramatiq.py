"""pytest plugin for Dramatiq's own tests (``-p taskonce_upstream_dramatiq``).

The middleware itself is added by this folder's ``sitecustomize`` (every broker built, in
pytest and in the ``dramatiq`` processes the CLI tests start). This plugin only lets the suite
run where its optional extras are absent:

- ``tests/conftest.py`` imports ``pylibmc`` (memcached) at the top. Where it is not installed,
  a stand-in module whose every client call raises ``pylibmc.SomeErrors`` is put in its place:
  the conftest's own ``check_memcached`` then skips the memcached-parametrized tests ("No
  connection to memcached server"), as it does on a machine without memcached.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

STORE_ENV = "TASKONCE_UPSTREAM_DRAMATIQ_STORE"


class SomeErrors(Exception):
    """pylibmc's base error (the stand-in raises it for every call)."""


class NotFound(SomeErrors):
    """pylibmc's missing-key error."""


class _Client:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise SomeErrors("pylibmc is not installed (taskonce upstream stand-in)")

        return unavailable


class _ClientPool:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def fill(self, *args: Any, **kwargs: Any) -> None:
        pass

    @contextlib.contextmanager
    def reserve(self, *args: Any, **kwargs: Any) -> Iterator[_Client]:
        yield _Client()


def _install_pylibmc_stand_in() -> None:
    if importlib.util.find_spec("pylibmc") is not None:
        return
    module = types.ModuleType("pylibmc")
    module.SomeErrors = SomeErrors  # type: ignore[attr-defined]
    module.Error = SomeErrors  # type: ignore[attr-defined]
    module.NotFound = NotFound  # type: ignore[attr-defined]
    module.Client = _Client  # type: ignore[attr-defined]
    module.ClientPool = _ClientPool  # type: ignore[attr-defined]
    module.__taskonce_stand_in__ = True  # type: ignore[attr-defined]
    sys.modules["pylibmc"] = module


_install_pylibmc_stand_in()


def pytest_report_header() -> str:
    """Say which variant runs, at the top of the log."""
    store = os.environ.get(STORE_ENV)
    if store:
        return f"taskonce upstream: IdempotencyMiddleware on every broker, store {store}"
    return "taskonce upstream: plain Dramatiq"
