"""WorkerOptions: a worker's relay interval, start timeout and store-error back-off, checked once
(taskonce.worker_options), built by each adapter from its own words: Celery's ``taskonce_*``
settings and the Dramatiq middleware's keywords here, Django's ``TASKONCE`` in
tests/django/test_worker_options.py (with the three side by side)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

import taskonce
from taskonce.celery_ext import setup
from taskonce.celery_ext.config import app_state, worker_options
from taskonce.dramatiq_ext import IdempotencyMiddleware
from taskonce.dramatiq_ext.purge import PeriodicPurge
from taskonce.outage import Backoff
from taskonce.worker_options import WorkerOptions


def refused(build: Any) -> str:
    with pytest.raises(taskonce.ConfigError) as caught:
        build()
    return str(caught.value)


def test_defaults_and_the_one_back_off() -> None:
    options = WorkerOptions()
    assert (options.relay_every, options.start_timeout) == (30.0, 30.0)
    assert options.backoff == Backoff(1.0, 60.0, "WorkerOptions.backoff_first")
    # a first back-off above the cap is the cap: Celery's 90 s delay, Dramatiq's min > max
    assert (
        WorkerOptions(backoff_first=90).backoff.cap,
        WorkerOptions(backoff_cap=0.5).backoff.cap,
    ) == (
        90.0,
        1.0,
    )
    assert WorkerOptions(relay_every=0, start_timeout=0).relay_every == 0.0  # 0: off, one try


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("relay_every", -1, "must be a number of seconds, 0 or more (0 turns the relay off)"),
        ("relay_every", float("inf"), "must be a number of seconds, 0 or more (0 turns"),
        ("start_timeout", "30", "must be a number of seconds, 0 or more (0: one try)"),
        ("backoff_first", 0, "must be a positive number of seconds"),
        ("backoff_cap", True, "must be a positive number of seconds"),
    ],
)
def test_each_field_is_refused_by_the_name_the_user_wrote(
    field: str, value: Any, rule: str
) -> None:
    assert refused(lambda: WorkerOptions(**{field: value})).startswith(
        f"WorkerOptions.{field}={value!r} {rule}"
    )
    names = {field: f"setting taskonce_{field}"}
    assert refused(lambda: WorkerOptions(**{field: value}, names=names)).startswith(
        f"setting taskonce_{field}={value!r} {rule}"
    )


def celery_app(**conf: Any) -> Celery:
    app = Celery("options", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


@pytest.mark.parametrize(
    ("setting", "value", "text"),
    [
        (
            "taskonce_relay_every",
            -1,
            "setting taskonce_relay_every=-1 must be a number of seconds, 0 or more (0 turns the relay off)",
        ),
        (
            "taskonce_start_timeout",
            -1,
            "setting taskonce_start_timeout=-1 must be a number of seconds, 0 or more (0: one try)",
        ),
        (
            "taskonce_store_retry_delay",
            0,
            "setting taskonce_store_retry_delay=0 must be a positive number of seconds",
        ),
    ],
)
def test_a_bad_celery_setting_fails_at_setup(setting: str, value: Any, text: str) -> None:
    app = celery_app(**{setting: value})
    assert refused(lambda: setup(app, taskonce.Guard(taskonce.MemoryStore()))) == text
    app.close()


def test_celery_settings_become_the_apps_options() -> None:
    app = celery_app(
        taskonce_relay_every=0, taskonce_start_timeout=2, taskonce_store_retry_delay=0.5
    )
    setup(app, taskonce.Guard(taskonce.MemoryStore()))
    options = app_state(app).options
    assert (options.relay_every, options.start_timeout, options.backoff.first) == (0, 2, 0.5)
    assert app_state(app).backoff is options.backoff
    assert worker_options(celery_app().conf) == WorkerOptions()
    app.close()


@pytest.mark.parametrize(
    ("keyword", "value", "text"),
    [
        (
            "relay_every",
            -1,
            "IdempotencyMiddleware(relay_every=-1) must be a number of seconds, 0 or more (0 turns the relay off)",
        ),
        (
            "start_timeout",
            float("nan"),
            "IdempotencyMiddleware(start_timeout=nan) must be a number of seconds, 0 or more (0: one try)",
        ),
        (
            "store_error_min_backoff",
            0,
            "IdempotencyMiddleware(store_error_min_backoff=0) must be a whole number of milliseconds, 1 or more",
        ),
        (
            "store_error_max_backoff",
            2.5,
            "IdempotencyMiddleware(store_error_max_backoff=2.5) must be a whole number of milliseconds, 1 or more",
        ),
    ],
)
def test_a_bad_dramatiq_keyword_fails_when_the_middleware_is_made(
    keyword: str, value: Any, text: str
) -> None:
    guard = taskonce.Guard(taskonce.MemoryStore())
    assert refused(lambda: IdempotencyMiddleware(guard, **{keyword: value})) == text


def test_dramatiq_keywords_become_the_middlewares_options() -> None:
    guard = taskonce.Guard(taskonce.MemoryStore())
    middleware = IdempotencyMiddleware(
        guard, relay_every=0, start_timeout=2, store_error_min_backoff=250
    )
    options = middleware.options
    assert (options.relay_every, options.start_timeout) == (0, 2)
    assert (options.backoff.first, options.backoff.cap) == (0.25, 60.0)
    assert IdempotencyMiddleware(guard).options == WorkerOptions()


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ({"every": 0}, "PeriodicPurge(every=0) must be a positive number of seconds"),
        ({"first_after": -1}, "PeriodicPurge(first_after=-1) must be a positive number of seconds"),
        ({"batch": 0}, "PeriodicPurge(batch=0) must be a whole number, 1 or more"),
        ({"batch": 10.0}, "PeriodicPurge(batch=10.0) must be a whole number, 1 or more"),
    ],
)
def test_periodic_purge_arguments(arguments: dict[str, Any], text: str) -> None:
    guard = taskonce.Guard(taskonce.MemoryStore())
    assert refused(lambda: PeriodicPurge(guard, **arguments)) == text


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ({"dispatch_lease": 0}, "Guard(dispatch_lease=0) must be a positive number of seconds"),
        ({"send_limit": -1}, "Guard(send_limit=-1) must be a whole number of bytes, 1 or more"),
    ],
)
def test_guard_arguments(arguments: dict[str, Any], text: str) -> None:
    assert refused(lambda: taskonce.Guard(taskonce.MemoryStore(), **arguments)) == text


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        (
            {"every": -1},
            "start_relay(every=-1) must be a number of seconds, 0 or more (0: no relay)",
        ),
        ({"every": "30"}, "start_relay(every='30') must be a number of seconds, 0 or more (0: no"),
        (
            {"every": 5, "older_than": -1},
            "start_relay(older_than=-1) must be a number of seconds, 0",
        ),
    ],
)
def test_start_relay_arguments(arguments: dict[str, Any], text: str) -> None:
    with taskonce.Guard(taskonce.MemoryStore()) as guard:
        assert refused(lambda: guard.start_relay(**arguments)).startswith(text)
        guard.start_relay(every=0)  # off: no thread


def test_wait_for_store_timeout() -> None:
    with taskonce.Guard(taskonce.MemoryStore()) as guard:
        assert refused(lambda: guard.wait_for_store(float("nan"))) == (
            "wait_for_store(timeout=nan) must be a number of seconds, 0 or more (0: one try)"
        )
        guard.wait_for_store(0)  # one try: the memory store answers
