"""Django's ``TASKONCE`` worker options (``RELAY_EVERY``, ``START_TIMEOUT``,
``STORE_RETRY_DELAY``): the defaults of taskonce.django_ext.IdempotencyMiddleware, checked by
``manage.py check`` (E001), and refused in the same words as Celery's settings and the Dramatiq
middleware's keywords, but for the name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import taskonce
from taskonce.worker_options import WorkerOptions
from tests.django.ops_fixtures import project_store

RULE = "must be a number of seconds, 0 or more (0 turns the relay off)"


@pytest.fixture(autouse=True)
def store() -> Iterator[Any]:
    yield from project_store()


def refused(build: Any) -> str:
    with pytest.raises(taskonce.ConfigError) as caught:
        build()
    return str(caught.value)


def test_a_bad_relay_interval_reads_the_same_from_every_source() -> None:
    from celery import Celery
    from django.test.utils import override_settings

    from taskonce.celery_ext import setup
    from taskonce.django_ext import IdempotencyMiddleware, conf

    guard = taskonce.Guard(taskonce.MemoryStore())
    app = Celery("options", broker="memory://", set_as_current=False)
    app.conf.taskonce_relay_every = -1
    celery = refused(lambda: setup(app, guard))
    app.close()
    dramatiq = refused(lambda: IdempotencyMiddleware(guard, relay_every=-1))
    with override_settings(TASKONCE={"RELAY_EVERY": -1}):
        django = refused(conf.worker_options)
        middleware = refused(lambda: IdempotencyMiddleware(guard))
    assert [celery, dramatiq, django, middleware] == [
        f"setting taskonce_relay_every=-1 {RULE}",
        f"IdempotencyMiddleware(relay_every=-1) {RULE}",
        f'settings.TASKONCE["RELAY_EVERY"]=-1 {RULE}',
        f'settings.TASKONCE["RELAY_EVERY"]=-1 {RULE}',
    ]


def test_taskonce_gives_the_middlewares_defaults_and_a_keyword_wins() -> None:
    from django.test.utils import override_settings

    from taskonce.django_ext import IdempotencyMiddleware

    guard = taskonce.Guard(taskonce.MemoryStore())
    settings = {"RELAY_EVERY": 0, "START_TIMEOUT": 2, "STORE_RETRY_DELAY": 0.5}
    with override_settings(TASKONCE=settings):
        options = IdempotencyMiddleware(guard).options
        assert (options.relay_every, options.start_timeout, options.backoff.first) == (0, 2, 0.5)
        given = IdempotencyMiddleware(guard, relay_every=7, store_error_min_backoff=300).options
        assert (given.relay_every, given.start_timeout, given.backoff.first) == (7, 2, 0.3)
        # a keyword's mistake is named as the keyword, whatever TASKONCE says
        assert refused(lambda: IdempotencyMiddleware(guard, start_timeout=-1)).startswith(
            "IdempotencyMiddleware(start_timeout=-1) must be"
        )
    assert IdempotencyMiddleware(guard).options == WorkerOptions()


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("RELAY_EVERY", -1, f'settings.TASKONCE["RELAY_EVERY"]=-1 {RULE}'),
        (
            "START_TIMEOUT",
            "30",
            "settings.TASKONCE[\"START_TIMEOUT\"]='30' must be a number of seconds, 0 or more "
            "(0: one try)",
        ),
        (
            "STORE_RETRY_DELAY",
            0,
            'settings.TASKONCE["STORE_RETRY_DELAY"]=0 must be a positive number of seconds',
        ),
    ],
)
def test_manage_py_check_says_it_first(key: str, value: Any, text: str) -> None:
    from django.core.checks import run_checks
    from django.test.utils import override_settings

    project = {"STORE": "django://default", key: value}
    with override_settings(TASKONCE=project):
        errors = [m for m in run_checks(tags=["taskonce"]) if m.id == "taskonce.E001"]
    assert [m.msg for m in errors] == [f"settings.TASKONCE: {text}"]
    assert "RELAY_EVERY, START_TIMEOUT and STORE_RETRY_DELAY seconds" in errors[0].hint
