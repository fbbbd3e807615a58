"""The pytest plugin of taskonce (entry point ``pytest11``: loaded in every pytest session where
taskonce is installed): fixtures around :mod:`taskonce.testing`, all named ``taskonce_*``.

- ``taskonce_guard``: a guard on a memory store, closed after the test. The marker
  ``@pytest.mark.taskonce_guard(store="sqlite", default={...}, queues={...})`` changes it
  (the arguments of :func:`taskonce.testing.make_guard`; ``"sqlite"`` uses ``tmp_path``).
- ``taskonce_events``: the :class:`~taskonce.testing.EventLog` of ``taskonce_guard``.
- ``taskonce_make_guard``: a factory of more guards (same arguments), all closed after the test.
- ``taskonce_celery_app``: a Celery app (in-memory broker) set up with ``taskonce_guard``.
- ``taskonce_stub_broker``: a Dramatiq ``StubBroker`` with ``IdempotencyMiddleware``
  (``taskonce_guard``), the global broker during the test.

Loading it imports pytest and taskonce's core package only (no Celery, Dramatiq, SQLAlchemy,
Redis or Django): the fixtures import what they need when a test asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from taskonce.guard import Guard
    from taskonce.testing import EventLog

MARKER = "taskonce_guard"


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``taskonce_guard`` marker."""
    config.addinivalue_line(
        "markers",
        f"{MARKER}(store='memory', default=None, queues=None, **options): the guard of the "
        "taskonce_guard fixture (taskonce.testing.make_guard's arguments; 'sqlite' in tmp_path)",
    )


@pytest.fixture
def taskonce_make_guard(tmp_path: Path) -> Iterator[Callable[..., Guard]]:
    """``taskonce_make_guard(store="memory", default=…, queues=…, …)``: a new guard
    (:func:`taskonce.testing.make_guard`; ``store="sqlite"`` puts its file in ``tmp_path``),
    closed after the test."""
    from taskonce.testing import make_guard

    made: list[Guard] = []

    def make(store: Any = "memory", **kwargs: Any) -> Guard:
        if store == "sqlite" and kwargs.get("path") is None:
            kwargs["path"] = tmp_path / f"taskonce-{len(made)}.db"
        guard = make_guard(store, **kwargs)
        made.append(guard)
        return guard

    yield make
    for guard in reversed(made):
        guard.close()


@pytest.fixture
def taskonce_guard(
    request: pytest.FixtureRequest, taskonce_make_guard: Callable[..., Guard]
) -> Guard:
    """A guard for this test (memory store; see the ``taskonce_guard`` marker), closed after."""
    marker = request.node.get_closest_marker(MARKER)
    args: tuple[Any, ...] = marker.args if marker is not None else ()
    kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    return taskonce_make_guard(*args, **kwargs)


@pytest.fixture
def taskonce_events(taskonce_guard: Guard) -> EventLog:
    """Every event ``taskonce_guard`` emits in this test."""
    from taskonce.testing import events_of

    return events_of(taskonce_guard)


@pytest.fixture
def taskonce_celery_app(taskonce_guard: Guard) -> Iterator[Any]:
    """A Celery app with an in-memory broker whose tasks ``taskonce_guard`` guards (declare
    them with ``@taskonce_celery_app.task(base=IdempotentTask, shared=False)``)."""
    from taskonce.testing import celery_app

    app = celery_app(taskonce_guard)
    yield app
    app.close()


@pytest.fixture
def taskonce_stub_broker(taskonce_guard: Guard) -> Iterator[Any]:
    """A Dramatiq ``StubBroker`` with ``IdempotencyMiddleware(taskonce_guard)``, the global
    broker during the test (the one before it is put back after); actors declared in the test
    use it."""
    import dramatiq.broker

    from taskonce.testing import stub_broker

    previous = dramatiq.broker.global_broker
    broker = stub_broker(taskonce_guard)
    yield broker
    broker.close()
    if previous is not None:
        dramatiq.set_broker(previous)
    else:
        dramatiq.broker.global_broker = None
