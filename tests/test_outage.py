"""A store that does not answer: one log line per change (not per message or beat), a short
wait at a worker's start, and no liveness thread left behind by a guard no longer used.

The real workers' refusal to start is in tests/celery/test_config_errors.py and
tests/dramatiq/test_store_down.py.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest

import taskonce
from taskonce import Delivery, Guard
from taskonce.errors import StoreUnavailable
from taskonce.outage import StoreHealth, wait_for_store
from taskonce.stores import MemoryStore
from tests.helpers import free_port, require_service, wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def down(detail: str = "Connection refused") -> StoreUnavailable:
    try:
        raise ConnectionError(detail)
    except ConnectionError as cause:
        try:
            raise StoreUnavailable(f"store did not answer claim of key 'q:1': {cause}") from cause
        except StoreUnavailable as exc:
            return exc


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_outage_is_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    health = StoreHealth("redis://db:6390/0", clock=clock)
    with caplog.at_level(logging.DEBUG, logger="taskonce"):
        health.answered()  # nothing to say while all is well
        for _ in range(50):  # deliveries and beats during the first minute
            health.failed(down())
            clock.now += 1
        clock.now += 15  # 65 s into the outage
        health.failed(down())
        health.failed(down())
        clock.now += 2.5
        for _ in range(3):
            health.answered()
    lines = warnings_of(caplog)
    assert len(lines) == 3, lines
    assert lines[0] == (
        "store redis://db:6390/0 stopped answering (ConnectionError: Connection refused); "
        "guarded deliveries follow on_store_error until it answers"
    )
    assert lines[1] == (
        "store redis://db:6390/0 still unreachable after 65 s (ConnectionError: Connection refused)"
    )
    assert lines[2] == "store redis://db:6390/0 answers again after 67.5 s"


def test_a_store_that_never_answered_is_not_reached_yet_until_a_minute_has_passed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong URL, most likely: no outage warning (a worker's start check speaks for it in
    one line), an INFO line; a minute later it is an outage like any other."""
    clock = Clock()
    health = StoreHealth("redis://db:6390/0", clock=clock)
    with caplog.at_level(logging.INFO, logger="taskonce"):
        for _ in range(10):
            health.failed(down("Error 111\n(Background on this error at: https://…)"))
        assert warnings_of(caplog) == []
        assert [r.getMessage() for r in caplog.records] == [
            "store redis://db:6390/0 does not answer yet (ConnectionError: Error 111)"
        ]
        clock.now += 60
        health.failed(down())
        clock.now += 5
        health.answered()
    assert warnings_of(caplog) == [
        "store redis://db:6390/0 still unreachable after 60 s (ConnectionError: Connection refused)"
    ]
    assert caplog.records[-1].getMessage() == "store redis://db:6390/0 answers now after 65.0 s"


def test_a_guard_logs_its_store_once_however_many_deliveries_meet_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_service("redis")
    store = taskonce.open_store(f"redis://127.0.0.1:{free_port()}/0")
    with caplog.at_level(logging.DEBUG):
        guard = Guard(store)
        try:
            for n in range(20):
                with pytest.raises(StoreUnavailable):
                    guard.begin(Delivery(f"m{n}", "q"))
        finally:
            guard.close()
    assert warnings_of(caplog) == []
    lines = [r.getMessage() for r in caplog.records if r.name == "taskonce"]
    assert len(lines) == 1, lines
    assert "does not answer yet" in lines[0] and "Connection refused" in lines[0]
    # every delivery still emitted its event, at DEBUG
    events = [r for r in caplog.records if r.name == "taskonce.events"]
    assert sum("store_error" in r.getMessage() for r in events) == 20
    assert all(r.levelno == logging.DEBUG for r in events if "store_error" in r.getMessage())


def test_waiting_for_the_store_at_start() -> None:
    clock = Clock()
    answers = iter([down(), down(), None])
    slept: list[float] = []

    def probe() -> None:
        failure = next(answers)
        if failure is not None:
            raise failure

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    wait_for_store(probe, "memory://", timeout=5, clock=clock, sleep=sleep)
    assert slept == [1.0, 1.0]

    def never() -> None:
        raise down("Error 111 connecting to 127.0.0.1:6390")

    with pytest.raises(StoreUnavailable) as info:
        wait_for_store(never, "redis://127.0.0.1:6390/0", timeout=2.5, clock=clock, sleep=sleep)
    assert str(info.value) == (
        "store redis://127.0.0.1:6390/0 could not be reached within 2.5 s (ConnectionError: "
        "Error 111 connecting to 127.0.0.1:6390): check its URL and that the server runs"
    )


def test_guard_wait_for_store_answers_at_once_on_a_live_store() -> None:
    with Guard(MemoryStore()) as guard:
        guard.wait_for_store(0)


def test_a_dropped_guard_stops_its_liveness_thread_even_while_the_store_is_down() -> None:
    """The failed write's traceback kept the Liveness alive after its guard was gone, and its
    thread logged a warning every 4 s for the rest of the process."""
    require_service("redis")
    gc.disable()  # the guard must go by reference counting, as in a worker
    try:
        before = set(threading.enumerate())
        guard = Guard(taskonce.open_store(f"redis://127.0.0.1:{free_port()}/0"))
        guard._liveness.start()  # as a worker's start check or first delivery starts it
        liveness = weakref.ref(guard._liveness)
        health = guard.health
        wait_for(lambda: health.down_since is not None, what="the first failed beat")
        (thread,) = [
            t for t in set(threading.enumerate()) - before if t.name == "taskonce-liveness"
        ]
        del guard
        assert liveness() is None or liveness()._stopped.is_set()  # type: ignore[union-attr]
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        gc.enable()


def test_a_guard_that_is_only_built_writes_no_liveness_record() -> None:
    """A web process (or Django loading its apps) builds the guard without delivering
    anything: no liveness thread, no write; the first delivery starts it."""
    from taskonce.worker import identity_text

    store = taskonce.MemoryStore()
    before = set(threading.enumerate())
    with Guard(store) as guard:
        assert not [t for t in set(threading.enumerate()) - before if t.name == "taskonce-liveness"]
        assert store.seen(identity_text()) is None
        guard.run("m1", "q", lambda: None)
        assert store.seen(identity_text()) is not None
