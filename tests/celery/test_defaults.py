"""The defaults that keep a guarded task's messages, and the warnings where a setting loses one.

Unit tests of :mod:`taskonce.celery_ext.defaults` (no broker: ``send_task`` is replaced where a
publish would happen), and a real worker on a Redis broker whose ``visibility_timeout`` (3 s)
is shorter than a task's countdown (6 s). The worker-start warning and the SIGKILL of a bare
``@app.task(base=IdempotentTask)`` run on every stack in test_worker.py.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from taskonce.celery_ext import IdempotentTask
from taskonce.celery_ext import defaults as d
from tests.celery.conftest import REDIS_BROKER, VISIBILITY_DB, Stack, Table, start_stack, stop_stack
from tests.helpers import event_time, wait_for


def new_app(**conf: Any) -> Celery:
    app = Celery(f"defaults-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(**conf)
    return app


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "taskonce.celery" and r.levelno == logging.WARNING
    ]


@pytest.fixture(autouse=True)
def _fresh_eta_warnings() -> Iterator[None]:
    """Each test sees its own once-per-task-and-setting memory."""
    saved = set(d._ETA_WARNED)
    d._ETA_WARNED.clear()
    yield
    d._ETA_WARNED.clear()
    d._ETA_WARNED.update(saved)


# -- the defaults ------------------------------------------------------------------------------


def test_a_bare_guarded_task_acks_late_and_rejects_on_worker_lost() -> None:
    """Nothing but ``base=IdempotentTask``; the app's own settings turned both off do not win
    over the class (Celery fills a task attribute from a setting only where it is None)."""
    app = new_app(task_acks_late=False, task_reject_on_worker_lost=False)

    @app.task(base=IdempotentTask, shared=False, name="bare")
    def bare() -> None: ...

    @app.task(shared=False, name="plain")  # a plain task keeps Celery's settings
    def plain() -> None: ...

    assert (bare.acks_late, bare.reject_on_worker_lost) == (True, True)
    assert (plain.acks_late, plain.reject_on_worker_lost) == (False, False)
    assert d.unsafe_acks(bare) is None


def test_a_task_that_turns_acks_late_off_is_named_with_what_it_loses() -> None:
    app = new_app()

    @app.task(base=IdempotentTask, shared=False, acks_late=False, name="shop.charge")
    def charge() -> None: ...

    warning = d.unsafe_acks(charge)
    assert warning is not None
    assert warning.startswith("taskonce: guarded task shop.charge has acks_late=False:")
    assert "lost and never runs again" in warning
    assert "\n" not in warning  # one line


def test_a_task_that_turns_reject_on_worker_lost_off_is_named() -> None:
    app = new_app()

    @app.task(base=IdempotentTask, shared=False, reject_on_worker_lost=False, name="shop.ship")
    def ship() -> None: ...

    warning = d.unsafe_acks(ship)
    assert warning is not None
    assert "guarded task shop.ship has reject_on_worker_lost=False" in warning
    assert "acknowledged as FAILURE (WorkerLostError)" in warning


def test_both_off_is_one_line_and_annotations_count() -> None:
    """The effective value is judged: ``task_annotations`` and a subclass turn it off too."""
    app = new_app(task_annotations={"annotated": {"acks_late": False}})

    @app.task(
        base=IdempotentTask,
        shared=False,
        acks_late=False,
        reject_on_worker_lost=False,
        name="both",
    )
    def both() -> None: ...

    @app.task(base=IdempotentTask, shared=False, name="annotated")
    def annotated() -> None: ...

    class EarlyBase(IdempotentTask):
        acks_late = False

    @app.task(base=EarlyBase, shared=False, name="subclassed")
    def subclassed() -> None: ...

    warning = d.unsafe_acks(both)
    assert warning is not None and "acks_late=False (and reject_on_worker_lost=False)" in warning
    assert "has acks_late=False" in (d.unsafe_acks(annotated) or "")
    assert "has acks_late=False" in (d.unsafe_acks(subclassed) or "")


def test_retry_on_worker_lost_sends_the_run_again_so_it_is_not_named() -> None:
    app = new_app()
    options = {"reject_on_worker_lost": False, "retry_on_worker_lost": True}

    @app.task(base=IdempotentTask, shared=False, name="retried", **options)
    def retried() -> None: ...

    assert d.unsafe_acks(retried) is None


def test_warn_unsafe_acks_logs_one_line_per_named_task(caplog: pytest.LogCaptureFixture) -> None:
    app = new_app()

    @app.task(base=IdempotentTask, shared=False, acks_late=False, name="b.early")
    def early() -> None: ...

    @app.task(base=IdempotentTask, shared=False, reject_on_worker_lost=False, name="a.kept")
    def kept() -> None: ...

    @app.task(base=IdempotentTask, shared=False, name="c.safe")
    def safe() -> None: ...

    with caplog.at_level(logging.WARNING, logger="taskonce.celery"):
        named = d.warn_unsafe_acks([early, kept, safe])
    assert named == ["a.kept", "b.early"]
    lines = warnings_of(caplog)
    assert len(lines) == 2
    assert "a.kept has reject_on_worker_lost=False" in lines[0]
    assert "b.early has acks_late=False" in lines[1]


# -- the redelivery bound and the ETA warning --------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"broker_url": "redis://localhost:6379/0"}, 3600.0),
        ({"broker_url": "rediss://localhost:6380/0"}, 3600.0),
        ({"broker_url": "sentinel://localhost:26379"}, 3600.0),
        ({"broker_url": "redis+socket:///tmp/redis.sock"}, 3600.0),
        ({"broker_url": ["redis://a:6379/0", "redis://b:6379/0"]}, 3600.0),
        ({"broker_url": "sqs://"}, 1800.0),
        (
            {"broker_url": "redis://", "broker_transport_options": {"visibility_timeout": 43200}},
            43200.0,
        ),
        ({"broker_url": "sqs://", "broker_transport_options": {"visibility_timeout": "60"}}, 60.0),
        ({"broker_url": "amqp://guest@localhost//"}, None),
        ({"broker_url": "memory://"}, None),
        ({"broker_url": None}, None),  # Celery's default: amqp
        ({"broker_url": "redis://", "broker_transport_options": {"visibility_timeout": "x"}}, None),
    ],
)
def test_redelivery_bound_of_each_transport(conf: dict[str, Any], expected: float | None) -> None:
    bound = d.redelivery_bound(new_app(**conf))
    assert (bound[1] if bound else None) == expected
    if bound is not None:
        assert "visibility_timeout" in bound[0]


def test_seconds_ahead_reads_countdown_and_eta_as_celery_does() -> None:
    app = new_app()
    now = dt.datetime.now(dt.timezone.utc)
    assert d.seconds_ahead(app, 90, None) == 90.0
    assert d.seconds_ahead(app, None, None) is None
    assert d.seconds_ahead(app, 0, None) is None
    assert d.seconds_ahead(app, True, None) is None  # not a number of seconds
    assert 7195 < (d.seconds_ahead(app, None, now + dt.timedelta(hours=2)) or 0) <= 7200
    naive = (now + dt.timedelta(hours=2)).replace(tzinfo=None)  # UTC, as enable_utc reads it
    assert 7195 < (d.seconds_ahead(app, None, naive) or 0) <= 7200
    iso = (now + dt.timedelta(hours=2)).isoformat()
    assert 7195 < (d.seconds_ahead(app, None, iso) or 0) <= 7200
    assert d.seconds_ahead(app, None, "tomorrow") is None


def _guarded_on_redis(visibility: float | None = None, **conf: Any) -> tuple[Celery, Any, list]:
    """A guarded task on an app whose broker is Redis; its publishes are recorded, not sent."""
    options = {} if visibility is None else {"visibility_timeout": visibility}
    app = new_app(broker_url="redis://127.0.0.1:6379/0", broker_transport_options=options, **conf)
    sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(name: str, *args: Any, **kwargs: Any) -> None:
        sent.append((name, kwargs))

    app.send_task = send_task

    @app.task(base=IdempotentTask, shared=False, name="shop.remind")
    def remind(order_id: str) -> None: ...

    return app, remind, sent


def test_countdown_beyond_visibility_warns_once_per_task_and_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, remind, sent = _guarded_on_redis()
    with caplog.at_level(logging.WARNING, logger="taskonce.celery"):
        remind.apply_async(("A-1",), countdown=600)  # within the hour: nothing
        assert warnings_of(caplog) == []
        remind.apply_async(("A-1",), countdown=7200)
        remind.apply_async(("A-2",), countdown=9000)  # the same task and setting: once
        eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
        remind.apply_async(("A-3",), eta=eta)
        remind.s("A-4").apply_async(countdown=7200)  # a signature goes the same way
    lines = warnings_of(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("taskonce: task shop.remind published with a countdown of 7200 s")
    assert "the Redis transport's visibility_timeout (3600 s by default)" in lines[0]
    assert len(sent) == 5  # every publish went out

    caplog.clear()
    app.conf.broker_transport_options = {"visibility_timeout": 60}  # another setting: again
    with caplog.at_level(logging.WARNING, logger="taskonce.celery"):
        remind.apply_async(("A-5",), countdown=90)
        remind.apply_async(("A-6",), countdown=90)
    lines = warnings_of(caplog)
    assert len(lines) == 1
    assert "countdown of 90 s" in lines[0]
    assert "broker_transport_options['visibility_timeout'] = 60 s" in lines[0]


def test_no_eta_warning_on_rabbitmq_or_in_eager_mode(caplog: pytest.LogCaptureFixture) -> None:
    app, remind, sent = _guarded_on_redis(task_always_eager=True)
    with caplog.at_level(logging.WARNING, logger="taskonce.celery"):
        assert d.check_eta(remind, {"countdown": 7200}) is False
        app.conf.task_always_eager = False
        app.conf.broker_url = "amqp://guest@localhost//"
        remind.apply_async(("A-1",), countdown=7200)
    assert warnings_of(caplog) == []
    assert len(sent) == 1


# -- a real worker: the copies of a message waiting for its ETA --------------------------------


@pytest.fixture
def short_visibility(tmp_path: Path) -> Iterator[Stack]:
    """A worker on a Redis broker that hands an unacknowledged message out again after 3 s."""
    stack = start_stack(
        tmp_path,
        "redis",
        "redis",
        db=VISIBILITY_DB,
        extra_env={"TO_VISIBILITY": "3"},
        transport={"visibility_timeout": 3},
    )
    try:
        yield stack
    finally:
        stop_stack(stack)


def test_countdown_beyond_visibility_warns_and_runs_once_at_its_eta(
    short_visibility: Stack, runs: Table, caplog: pytest.LogCaptureFixture
) -> None:
    """``t.record`` sent with ``countdown=6`` through a broker whose ``visibility_timeout`` is
    3 s: one warning at publish naming the task, the countdown and the setting. The broker hands
    the waiting message out again before it is due; at the ETA the copies meet the first run's
    claim (deferred) or its record (skipped): one run, not before its ETA."""
    stack = short_visibility

    @stack.app.task(base=IdempotentTask, shared=False, bind=True, name="t.record")
    def record(self: Any, table: str, label: str, sleep: float = 0.0) -> str:
        raise AssertionError("runs in the worker, not here")

    task_id = str(uuid.uuid4())
    published = time.time()
    with caplog.at_level(logging.WARNING, logger="taskonce.celery"):
        record.apply_async(
            (runs.name, "eta"),
            {"sleep": 2.0},
            task_id=task_id,
            queue=stack.q("eager"),
            countdown=6,
        )
    lines = warnings_of(caplog)
    assert len(lines) == 1, lines
    assert "task t.record published with a countdown of 6 s" in lines[0]
    assert "broker_transport_options['visibility_timeout'] = 3 s" in lines[0]

    assert stack.app.AsyncResult(task_id).get(timeout=40) == "eta"
    wait_for(
        lambda: stack.count(task_id, "in_progress_deferred") >= 1,
        timeout=20,
        what="a copy handed out early to be deferred",
    )
    # Wait until the broker holds nothing more of it: no queued or unacknowledged copy.
    client = redis.Redis.from_url(REDIS_BROKER.format(db=VISIBILITY_DB))
    try:

        def drained() -> bool:
            queued = client.llen(f"{stack.prefix}:{stack.q('eager')}")
            unacked = client.zcard(f"{stack.prefix}:unacked_index")
            return queued == 0 and unacked == 0

        wait_for(drained, timeout=40, interval=0.2, what="the broker to hold no copy")
    finally:
        client.close()
    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") >= 1,
        timeout=20,
        what="a deferred copy to be skipped after the run",
    )

    assert runs.count("eta") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "completed") == 1
    assert stack.count(task_id, "lease_taken_over") == 0
    claimed = next(e for e in stack.events(task_id) if e["event"] == "claimed")
    assert event_time(claimed) >= published + 6 - 0.05  # at its ETA, not when handed out
