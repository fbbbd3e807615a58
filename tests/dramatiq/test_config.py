"""Bad setups and the hook-level contract, in process (Dramatiq's StubBroker and a stub worker),
plus one real worker that refuses to boot with the middleware in the wrong place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError, Retries, SkipMessage
from dramatiq.results import Results
from dramatiq.results.backends import StubBackend

import taskonce
from taskonce.dramatiq_ext import (
    IdempotencyConfigError,
    IdempotencyMiddleware,
    MiddlewareOrderError,
    StoreDown,
)
from taskonce.dramatiq_ext.middleware import EXIT_CONFIG
from taskonce.dramatiq_ext.redelivery import DEFERRED_OPTION, STORE_ERRORS_OPTION
from taskonce.errors import StoreUnavailable
from taskonce.guard import FIRST_RECHECK
from taskonce.stores import MemoryStore
from tests.dramatiq.conftest import REDIS_REDIS, Worker, make_config
from tests.helpers import wait_for


class Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        self.seen.append(dict(event))

    def names(self) -> list[str]:
        return [e["event"] for e in self.seen]


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def guard(events: Events) -> taskonce.Guard:
    return taskonce.Guard(MemoryStore(), default=taskonce.Policy(lease=5), events=[events])


@pytest.fixture
def broker(guard: taskonce.Guard) -> Iterator[StubBroker]:
    broker = StubBroker()
    broker.emit_after("process_boot")
    broker.add_middleware(IdempotencyMiddleware(guard))
    yield broker
    broker.close()


@pytest.fixture
def worker(broker: StubBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=2)
    worker.start()
    yield worker
    worker.stop()


# -- the actor option ---------------------------------------------------------------------


def test_undeclared_option_spelling_is_refused(broker: StubBroker) -> None:
    with pytest.raises(ValueError, match="idempotence"):
        dramatiq.actor(lambda: None, broker=broker, actor_name="a", idempotence={"mode": "lazy"})


def test_misspelled_policy_field_names_the_actor_and_the_field(broker: StubBroker) -> None:
    with pytest.raises(IdempotencyConfigError, match=r"actor 'charge'.*mdoe") as info:
        dramatiq.actor(lambda: None, broker=broker, actor_name="charge", idempotency={"mdoe": 1})
    assert isinstance(info.value, taskonce.ConfigError)
    assert isinstance(info.value, MiddlewareError)  # so emit_before does not swallow it
    assert "charge" not in broker.actors


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("yes", "not valid"),
        ({"mode": "sometimes"}, "Policy.mode"),
        ({"lease": -1}, "Policy.lease"),
        ({"transactional": True}, "SQL store"),
        ({"mode": "lazy", "check_first": False}, "check_first=False needs"),
    ],
)
def test_bad_option_values_are_refused(broker: StubBroker, value: Any, match: str) -> None:
    with pytest.raises(IdempotencyConfigError, match=match):
        dramatiq.actor(lambda: None, broker=broker, actor_name="a", idempotency=value)


def test_middleware_needs_a_guard() -> None:
    with pytest.raises(taskonce.ConfigError, match="Guard"):
        IdempotencyMiddleware("redis://localhost")  # type: ignore[arg-type]
    with pytest.raises(taskonce.ConfigError, match="store_error_min_backoff"):
        IdempotencyMiddleware(taskonce.Guard(MemoryStore()), store_error_min_backoff=0)


# -- middleware order ---------------------------------------------------------------------


def test_wrong_order_is_refused_at_declaration_and_boot(guard: taskonce.Guard) -> None:
    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard), before=Retries)
    with pytest.raises(MiddlewareOrderError, match="must come after Retries"):
        dramatiq.actor(lambda: None, broker=broker, actor_name="a")
    with pytest.raises(MiddlewareOrderError):
        dramatiq.Worker(broker, worker_timeout=20).start()


def test_retries_added_after_the_middleware_is_refused(guard: taskonce.Guard) -> None:
    broker = StubBroker(middleware=[])
    broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(Retries())
    with pytest.raises(MiddlewareOrderError):
        dramatiq.actor(lambda: None, broker=broker, actor_name="a")


def test_added_twice_is_refused(guard: taskonce.Guard) -> None:
    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(IdempotencyMiddleware(guard))
    with pytest.raises(IdempotencyConfigError, match="2 times"):
        dramatiq.actor(lambda: None, broker=broker, actor_name="a")


def test_actor_declared_before_the_middleware_warns_and_is_guarded(
    guard: taskonce.Guard, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    broker = StubBroker()
    runs: list[int] = []
    early = dramatiq.actor(lambda: runs.append(1), broker=broker, actor_name="early")
    with caplog.at_level(logging.WARNING, logger="taskonce.dramatiq"):
        broker.add_middleware(IdempotencyMiddleware(guard))
    assert "declared before IdempotencyMiddleware" in caplog.text
    assert "'early'" in caplog.text
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        message = early.send()
        broker.join("default")
        broker.enqueue(message)
        broker.join("default")
        worker.join()
    finally:
        worker.stop()
    assert runs == [1]
    assert events.names() == ["claimed", "completed", "duplicate_skipped"]


def test_real_worker_with_wrong_order_refuses_to_boot(tmp_path: Path) -> None:
    config = make_config(REDIS_REDIS, tmp_path, "shared", wrong_order=True)
    worker = Worker(config, tmp_path / "worker.log").start()
    try:
        wait_for(lambda: not worker.alive, timeout=30, what="the worker to refuse to boot")
        output = worker.output()
        # one line and EX_CONFIG (before: a traceback of MiddlewareOrderError, status 1)
        assert worker.proc is not None and worker.proc.returncode == EXIT_CONFIG, output
        assert "Traceback" not in output
        (line,) = [line for line in output.splitlines() if "does not start" in line]
        assert "must come after Retries" in line
    finally:
        worker.kill()


# -- hook-level contract ------------------------------------------------------------------


class SkipAfter(dramatiq.Middleware):
    """A middleware after the guard that skips every message (a rate limiter, say)."""

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        raise SkipMessage("rate limited")


class FailBefore(dramatiq.Middleware):
    """A middleware before the guard that fails a message and skips it (like AgeLimit)."""

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        message.fail()
        raise SkipMessage("too old")


def test_claim_is_released_when_a_later_middleware_skips(
    guard: taskonce.Guard, events: Events
) -> None:
    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(SkipAfter())
    runs: list[int] = []
    act = dramatiq.actor(lambda: runs.append(1), broker=broker, actor_name="a")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        message = act.send()
        broker.join("default")
        worker.join()
    finally:
        worker.stop()
    assert runs == []
    assert events.names() == ["claimed", "released"]
    assert guard.store.get(f"default:{message.message_id}") is None


def test_message_failed_by_an_earlier_middleware_is_not_claimed(
    guard: taskonce.Guard, events: Events
) -> None:
    broker = StubBroker()
    broker.add_middleware(FailBefore(), before=Retries)
    broker.add_middleware(IdempotencyMiddleware(guard))
    act = dramatiq.actor(lambda: None, broker=broker, actor_name="a")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        act.send()
        broker.join("default", fail_fast=False)
        worker.join()
    finally:
        worker.stop()
    assert events.names() == []
    assert len(broker.dead_letters) == 1


def test_results_not_overwritten_by_a_skipped_duplicate(
    guard: taskonce.Guard, events: Events
) -> None:
    backend = StubBackend()
    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(Results(backend=backend))  # after the guard: its after_* runs first
    calls = iter(range(100))
    act = dramatiq.actor(lambda: next(calls) + 1, broker=broker, actor_name="a", store_results=True)
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        message = act.send()
        assert backend.get_result(message, block=True, timeout=5000) == 1
        broker.enqueue(message)
        broker.join("default")
        worker.join()
    finally:
        worker.stop()
    assert events.names() == ["claimed", "completed", "duplicate_skipped"]
    assert backend.get_result(message) == 1


class DownStore(MemoryStore):
    def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("store is down (test)")


def test_fail_closed_raises_a_middleware_error_and_puts_the_message_back() -> None:
    guard = taskonce.Guard(DownStore())
    middleware = IdempotencyMiddleware(guard, store_error_min_backoff=10)
    broker = StubBroker()
    broker.add_middleware(middleware)
    act = dramatiq.actor(lambda: None, broker=broker, actor_name="a")
    message = act.message_with_options(retries=2)
    proxy = dramatiq.broker.MessageProxy(message)
    with pytest.raises(StoreDown) as info:
        middleware.before_process_message(broker, proxy)
    assert isinstance(info.value, MiddlewareError)
    assert isinstance(info.value, SkipMessage)
    queued = broker.queues["default.DQ"].get_nowait()
    copy = dramatiq.Message.decode(queued)
    assert copy.message_id == message.message_id
    assert copy.options["retries"] == 2  # not counted against max_retries
    assert copy.options[STORE_ERRORS_OPTION] == 1
    assert copy.options["eta"] > time.time() * 1000


def test_deferred_duplicate_does_not_count_against_max_retries(
    guard: taskonce.Guard, events: Events
) -> None:
    middleware = IdempotencyMiddleware(guard)
    broker = StubBroker()
    broker.add_middleware(middleware)
    act = dramatiq.actor(lambda: None, broker=broker, actor_name="a", max_retries=0)
    message = act.message_with_options(retries=0)
    first = dramatiq.broker.MessageProxy(message)
    middleware.before_process_message(broker, first)  # claims; the "first run" is in flight
    second = dramatiq.broker.MessageProxy(message)
    with pytest.raises(SkipMessage):
        middleware.before_process_message(broker, second)
    copy = dramatiq.Message.decode(broker.queues["default.DQ"].get_nowait())
    assert copy.options["retries"] == 0
    # the claim has just begun: looked at again after FIRST_RECHECK, not the lease's 5 s
    assert 100 <= copy.options["eta"] - time.time() * 1000 <= FIRST_RECHECK * 1000 + 100
    assert copy.options[DEFERRED_OPTION] == 1  # a deferral of this copy is a re-check
    assert second.options["store_results"] is False  # this delivery never writes Results
    assert "store_results" not in copy.options
    middleware.after_skip_message(broker, second)  # not this middleware's claim: no-op
    middleware.after_process_message(broker, first, result=None)
    assert events.names() == ["claimed", "in_progress_deferred", "completed"]


def test_async_actor_sees_the_session_in_process(tmp_path: Path) -> None:
    from dramatiq.middleware import AsyncIO
    from sqlalchemy import text

    store = taskonce.open_store(f"sqlite:///{tmp_path / 'store.db'}")
    guard = taskonce.Guard(store, default=taskonce.Policy(transactional=True))
    broker = StubBroker()
    broker.add_middleware(AsyncIO())
    broker.add_middleware(IdempotencyMiddleware(guard))
    seen: list[bool] = []

    async def write(n: int) -> None:
        session = taskonce.current_session()  # raises if the context did not come along
        session.execute(text("CREATE TABLE IF NOT EXISTS effects (n INTEGER)"))
        session.execute(text("INSERT INTO effects (n) VALUES (:n)"), {"n": n})
        seen.append(True)

    act = dramatiq.actor(write, broker=broker, actor_name="write")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    worker.start()
    try:
        message = act.send(1)
        broker.join("default")
        broker.enqueue(message)
        broker.join("default")
        worker.join()
    finally:
        worker.stop()
    import sqlite3

    with sqlite3.connect(tmp_path / "store.db") as conn:
        assert conn.execute("SELECT count(*) FROM effects").fetchone() == (1,)
    assert seen == [True]
    store.close()
