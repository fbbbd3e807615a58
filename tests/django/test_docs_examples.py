"""The examples of docs/django.md that name this file, their lines as the page has them
(tests/test_docs.py checks they are the same): the settings of *Five lines for Celery*, *Five
lines for Dramatiq* and *Settings*, each through the checks and the project's guard; the Celery
example's task (tests/django_project/shop/docs_tasks.py, with the example's ``proj/celery.py``:
tests/django_project/celery.py) on a real worker, a duplicate skipped; the Dramatiq example's
actor (shop/docs_actors.py) with the project's guard on a stub broker."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from tests.django.conftest import ProjectProcess, Run, celery_worker, new_order, payments
from tests.django.test_celery_workers import BROKER, _delete_queues
from tests.helpers import require_service, wait_for

pytestmark = pytest.mark.timeout(120)


def taskonce_checks(**settings: Any) -> list[str]:
    """The ids of taskonce's checks with ``settings`` overridden."""
    from django.core.checks import run_checks
    from django.test.utils import override_settings

    with override_settings(**settings):
        return sorted(m.id for m in run_checks(tags=["taskonce"]))


def policy(settings: dict[str, Any], queue: str) -> Any:
    """The policy the project's guard, built from ``settings``, gives ``queue``."""
    from django.test.utils import override_settings

    import taskonce.django_ext

    with override_settings(**settings):
        return taskonce.django_ext.guard().policy_for(queue)


def test_the_celery_examples_settings(django_project: str) -> None:
    TASKONCE = {"DEFAULT": {"mode": "eager", "transactional": True}}   # store: django://default
    # W003: the test project has other databases besides the store's (the page's has not)
    assert taskonce_checks(TASKONCE=TASKONCE) == ["taskonce.W003"]
    chosen = policy({"TASKONCE": TASKONCE}, "payments")
    assert (chosen.mode, chosen.transactional) == ("eager", True)


def test_the_dramatiq_examples_settings(django_project: str) -> None:
    from django.utils.module_loading import import_string

    from taskonce.django_ext import IdempotencyMiddleware

    TASKONCE = {"DEFAULT": {"mode": "eager", "transactional": True}}
    DRAMATIQ_BROKER = {
        "BROKER": "dramatiq.brokers.rabbitmq.RabbitmqBroker",
        "OPTIONS": {"url": "amqp://localhost:5672"},
        "MIDDLEWARE": [
            "dramatiq.middleware.AgeLimit", "dramatiq.middleware.TimeLimit",
            "dramatiq.middleware.Callbacks", "dramatiq.middleware.Retries",
            "django_dramatiq.middleware.DbConnectionsMiddleware",
            "taskonce.django_ext.IdempotencyMiddleware",     # by its dotted path, no arguments
        ],
    }  # fmt: skip
    assert taskonce_checks(TASKONCE=TASKONCE, DRAMATIQ_BROKER=DRAMATIQ_BROKER) == ["taskonce.W003"]
    built = [import_string(path)() for path in DRAMATIQ_BROKER["MIDDLEWARE"]]  # no arguments
    assert isinstance(built[-1], IdempotencyMiddleware)
    without = {**DRAMATIQ_BROKER, "MIDDLEWARE": DRAMATIQ_BROKER["MIDDLEWARE"][:-1]}  # control
    assert "taskonce.W002" in taskonce_checks(TASKONCE=TASKONCE, DRAMATIQ_BROKER=without)


def test_the_settings_example(django_project: str) -> None:
    TASKONCE = {
        "STORE": "django://default",
        "DEFAULT": {"mode": "eager", "transactional": True},
        "QUEUES": {"emails": {"mode": "lazy", "transactional": False}},
    }
    assert taskonce_checks(TASKONCE=TASKONCE) == ["taskonce.W003"]
    emails, other = policy({"TASKONCE": TASKONCE}, "emails"), policy({"TASKONCE": TASKONCE}, "x")
    assert (emails.mode, emails.transactional) == ("lazy", False)
    assert (other.mode, other.transactional) == ("eager", True)


# -- the Celery example's task on a real worker ----------------------------------------------------


@pytest.fixture(scope="module")
def run(django_project: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_service("redis")
    return Run(tmp_path_factory.mktemp("django-docs"), django_project)


@pytest.fixture(scope="module")
def worker(run: Run) -> Iterator[ProjectProcess]:
    started = celery_worker(run, concurrency=1)
    try:
        yield started
    finally:
        started.stop()
        _delete_queues(run)


def test_the_celery_examples_task_charges_once(run: Run, worker: ProjectProcess) -> None:
    """The page's ``charge`` (``@shared_task(base=IdempotentTask)``, found by the page's
    ``proj/celery.py``) sent twice under one id: one Payment, the second copy skipped."""
    order = new_order("docs", cents=500)
    task_id = str(uuid.uuid4())
    app = Celery("django-docs-publisher", broker=BROKER, set_as_current=False)
    try:
        for _ in range(2):
            app.send_task(
                "tests.django_project.shop.docs_tasks.charge", args=(order.pk,),
                queue=run.q(), task_id=task_id,
            )  # fmt: skip
    finally:
        app.close()
    wait_for(
        lambda: run.count(task_id, "duplicate_skipped") == 1,
        timeout=60,
        what=f"the second copy of {task_id} to be skipped: {run.names(task_id)}\n{worker.log()}",
    )
    assert run.count(task_id, "completed") == 1
    assert payments(order.ref) == 1


# -- the Dramatiq example's actor ---------------------------------------------------------------


def test_the_dramatiq_examples_actor_charges_once(django_project: str) -> None:
    """The page's actor, declared on a stub broker with the project's guard (its queue
    ``payments`` is the page's, so it does not go to the shared RabbitMQ): one Payment."""
    import taskonce.django_ext
    from taskonce.testing import assert_runs_once, stub_broker

    stub_broker(taskonce.django_ext.guard())
    sys.modules.pop("tests.django_project.shop.docs_actors", None)  # declared on this broker
    actors = importlib.import_module("tests.django_project.shop.docs_actors")
    order = new_order("docs", cents=500)
    assert_runs_once(actors.charge, (order.pk,))
    assert payments(order.ref) == 1


# -- docs/web-requests.md: the common bug, the control of send_on_commit() -------------------------


def test_the_common_bug_loses_the_charge_when_the_broker_is_down(django_project: str) -> None:
    """The page's second spelling of the common bug: sent from ``on_commit``, a broker that is
    down at the commit loses the charge — the order is committed, and nothing is left to send it
    (``send_on_commit()`` keeps it as a row for the relay: tests/django/test_views.py)."""
    from django.db import transaction
    from kombu.exceptions import OperationalError

    from tests.django.conftest import new_ref, order_exists
    from tests.django_project.shop.models import Order

    app = Celery("common-bug", broker="redis://127.0.0.1:1/0", set_as_current=False)  # nothing there
    app.conf.update(broker_connection_retry=False, task_publish_retry=False)

    @app.task(shared=False)
    def charge(order_id: int) -> None: ...

    ref = new_ref("bug")
    try:
        with pytest.raises(OperationalError), transaction.atomic():
            order = Order.objects.create(ref=ref)
            transaction.on_commit(lambda: charge.delay(order.id))
        assert order_exists(ref)  # committed; the charge is gone for good
    finally:
        app.close()
