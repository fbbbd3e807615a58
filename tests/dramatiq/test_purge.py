"""``PeriodicPurge`` deletes an SQL store's expired marks from inside a running worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware, PeriodicPurge
from tests.helpers import wait_for


class Events:
    def __init__(self) -> None:
        self.names: list[str] = []

    def emit(self, event: Any) -> None:
        self.names.append(event["event"])


def test_periodic_purge_deletes_expired_marks_while_the_worker_runs(tmp_path: Path) -> None:
    events = Events()
    store = taskonce.open_store(f"sqlite:///{tmp_path / 'store.db'}")
    guard = taskonce.Guard(store, default=taskonce.Policy(keep_for=0.2), events=[events])
    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard))
    purge = PeriodicPurge(guard, every=0.2, first_after=0.1)
    broker.add_middleware(purge)
    act = dramatiq.actor(lambda i: None, broker=broker, actor_name="a")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        for i in range(5):
            act.send(i)
        broker.join("default")
        worker.join()
        assert events.names.count("completed") == 5
        wait_for(lambda: store.stats()["keys"] == 0, timeout=10, what="the purge")
        assert "purged" in events.names
    finally:
        worker.stop()
        store.close()
    assert purge._thread is None  # stopped with the worker


def test_periodic_purge_validates_its_arguments() -> None:
    guard = taskonce.Guard(taskonce.MemoryStore())
    with pytest.raises(taskonce.ConfigError, match="every"):
        PeriodicPurge(guard, every=0)
    with pytest.raises(taskonce.ConfigError, match="batch"):
        PeriodicPurge(guard, batch=0)
    with pytest.raises(taskonce.ConfigError, match="Guard"):
        PeriodicPurge("sqlite:///x.db")  # type: ignore[arg-type]
