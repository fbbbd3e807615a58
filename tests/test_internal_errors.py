"""An unexpected error inside the guard or a store never loses a message (in process).

Before the handler it is a store outage (``fail_closed``: back off, not run; ``fail_open``: run
unguarded), after it an outcome the store could not record; the traceback of each distinct
error is logged once per process. Real workers: tests/celery/test_internal_error_workers.py and
tests/dramatiq/test_outside_api.py.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from celery import Celery
from dramatiq.brokers.stub import StubBroker

import taskonce
from taskonce import internal
from taskonce.action import Do, after, before
from taskonce.celery_ext import IdempotentTask, setup
from taskonce.dramatiq_ext import IdempotencyMiddleware
from taskonce.guard import Delivery
from taskonce.record import handlers_own, is_handlers_own
from taskonce.stores import MemoryStore, Status


class Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        self.seen.append(dict(event))

    def names(self) -> list[str]:
        return [e["event"] for e in self.seen]


class Broken(MemoryStore):
    """A memory store whose ``claim`` (or ``complete``/``mark``) raises ``TypeError`` the
    first ``times`` times, as an incompatible driver would."""

    def __init__(self, method: str = "claim", times: int = 1) -> None:
        super().__init__()
        self.method, self.left = method, times

    def _maybe_break(self, method: str) -> None:
        if method == self.method and self.left > 0:
            self.left -= 1
            raise TypeError(f"{method}() got an unexpected keyword argument 'ex'")

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_break("claim")
        return super().claim(*args, **kwargs)

    def complete(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_break("complete")
        return super().complete(*args, **kwargs)

    def mark(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_break("mark")
        return super().mark(*args, **kwargs)


@pytest.fixture(autouse=True)
def fresh_memory() -> Iterator[None]:
    internal.forget()
    yield
    internal.forget()


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info and "unexpected error" in r.getMessage()]


def one_liners(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if not r.exc_info and "unexpected error" in r.getMessage()]


# -- log once --------------------------------------------------------------------------------


def _fail(text: str) -> None:
    raise TypeError(text)


def _caught(text: str) -> TypeError:
    try:
        _fail(text)
    except TypeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_each_distinct_error_logs_its_traceback_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="taskonce")
    for _ in range(3):
        internal.report(_caught("bad argument"), "before running t[1]", "backing off")
    internal.report(_caught("another text"), "before running t[2]", "backing off")
    assert len(tracebacks(caplog)) == 2  # one per distinct (type, text, site)
    repeats = one_liners(caplog)
    assert len(repeats) == 2
    assert "seen 2 times" in repeats[0].getMessage()
    assert "seen 3 times" in repeats[1].getMessage()
    assert "TypeError: bad argument" in repeats[1].getMessage()
    assert "backing off" in repeats[1].getMessage()


def test_past_the_limit_new_errors_are_one_line_too(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(internal, "MAX_DISTINCT", 2)
    caplog.set_level(logging.ERROR, logger="taskonce")
    for i in range(4):
        internal.report(_caught(f"message {i}"), "here", "then")
    assert len(tracebacks(caplog)) == 2
    assert "over 2 distinct errors" in one_liners(caplog)[0].getMessage()


# -- before the handler ------------------------------------------------------------------------


def test_claim_raising_unexpectedly_backs_off_then_runs(caplog: pytest.LogCaptureFixture) -> None:
    events = Events()
    guard = taskonce.Guard(Broken("claim", times=2), events=[events])
    delivery = Delivery("m1", "payments", task="charge")
    caplog.set_level(logging.ERROR, logger="taskonce")
    for _ in range(2):
        action = before(guard, lambda: delivery)
        assert action.do is Do.BACK_OFF and isinstance(action.error, TypeError)
    assert guard.store.get("payments:m1") is None
    assert len(tracebacks(caplog)) == 1 and len(one_liners(caplog)) == 1
    assert "charge[m1]" in tracebacks(caplog)[0].getMessage()
    assert "goes back to the broker" in tracebacks(caplog)[0].getMessage()
    errors = [e for e in events.seen if e["event"] == "store_error"]
    assert [(e["key"], e["reason"]) for e in errors] == [("payments:m1", "internal_error")] * 2
    action = before(guard, lambda: delivery)  # the store works again
    assert action.do is Do.RUN
    assert after(guard, action.ticket, "done").do is Do.ACK  # type: ignore[arg-type]


def test_fail_open_runs_unguarded_with_the_key() -> None:
    guard = taskonce.Guard(Broken("claim"), default={"on_store_error": "fail_open"})
    action = before(guard, lambda: Delivery("m1", "payments"))
    assert action.do is Do.RUN_UNGUARDED
    assert action.ticket is not None and action.ticket.key == "payments:m1"


def test_an_error_building_the_delivery_backs_off() -> None:
    guard = taskonce.Guard(MemoryStore())

    def broken() -> Delivery:
        raise AttributeError("'NoneType' object has no attribute 'id'")

    action = before(guard, broken)
    assert action.do is Do.BACK_OFF and isinstance(action.error, AttributeError)


# -- after the handler ---------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "mode"), [("complete", "eager"), ("mark", "lazy")])
def test_recording_raising_unexpectedly_is_acknowledged_and_logged(
    method: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    events = Events()
    guard = taskonce.Guard(Broken(method), default={"mode": mode}, events=[events])
    caplog.set_level(logging.ERROR, logger="taskonce")
    action = before(guard, lambda: Delivery("m1", "payments", task="charge"))
    assert action.do is Do.RUN and action.ticket is not None
    done = after(guard, action.ticket, "done")
    # the handler's effects stand: acknowledged (not the task's failure), logged, an event
    assert done.do is Do.ACK and done.ran
    assert "store_error" in events.names()
    assert len(tracebacks(caplog)) == 1
    assert "outcome is not recorded" in tracebacks(caplog)[0].getMessage()


def test_recording_raising_unexpectedly_in_a_transaction_rolls_back_and_backs_off(
    tmp_path: Path,
) -> None:
    store = taskonce.open_store(f"sqlite:///{tmp_path / 'tx.db'}")
    policy = taskonce.Policy(mode="eager", transactional=True)
    guard = taskonce.Guard(store, default=policy)
    original = store.complete_in
    calls: list[int] = []

    def complete_in(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise TypeError("complete_in() got an unexpected keyword argument")
        return original(*args, **kwargs)

    store.complete_in = complete_in  # type: ignore[method-assign]
    action = before(guard, lambda: Delivery("m1", "payments"))
    assert action.do is Do.RUN and action.ticket is not None
    done = after(guard, action.ticket, None)
    assert done.do is Do.BACK_OFF and done.ran
    assert store.get("payments:m1") is None  # rolled back and released: the retry runs it
    action = before(guard, lambda: Delivery("m1", "payments"))
    assert action.do is Do.RUN and action.ticket is not None
    assert after(guard, action.ticket, None).do is Do.ACK
    record = store.get("payments:m1")
    assert record is not None and record.status is Status.COMPLETED
    guard.close()


def test_only_a_marked_commit_error_is_the_handlers_failure() -> None:
    assert not is_handlers_own(ValueError("x"))
    assert is_handlers_own(handlers_own(ValueError("x")))


# -- the adapters ----------------------------------------------------------------------------


def test_celery_eager_run_raises_the_error_and_the_next_try_runs() -> None:
    app = Celery(f"internal-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="work")
    setup(app, taskonce.Guard(Broken("claim")))
    runs: list[str] = []

    @app.task(base=IdempotentTask, shared=False, name="charge")
    def charge(order: str) -> str:
        runs.append(order)
        return order

    with pytest.raises(TypeError, match="unexpected keyword"):
        charge.apply(("a",), task_id="t-1", throw=True)
    assert runs == []
    assert charge.apply(("a",), task_id="t-1").get() == "a"
    assert runs == ["a"]
    app.close()


def test_dramatiq_claim_raising_once_runs_the_actor_once_later() -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")
    events = Events()
    guard = taskonce.Guard(Broken("claim"), events=[events])
    broker.add_middleware(
        IdempotencyMiddleware(guard, store_error_min_backoff=10, store_error_max_backoff=20)
    )
    runs: list[str] = []

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=0)
    def charge(order: str) -> None:
        runs.append(order)

    worker = dramatiq.Worker(broker, worker_timeout=50, worker_threads=1)
    worker.start()
    try:
        message = charge.send("a")
        broker.join("payments")  # the first delivery, and the copy enqueued after the backoff
        worker.join()
    finally:
        worker.stop()
        broker.close()
    assert runs == ["a"]
    assert [e["event"] for e in events.seen if e["message_id"] == message.message_id] == [
        "store_error",
        "claimed",
        "completed",
    ]
    assert broker.dead_letters == []
