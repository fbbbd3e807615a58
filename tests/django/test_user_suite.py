"""A Django user's own test suite, with pytest-django and taskonce's testing helpers, run by
pytest in a subprocess (pytester) on the test project and PostgreSQL: the project's guard on
the test database, a task delivered twice and skipped the second time, and a view's sends
captured — the examples of docs/django.md#testing, for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.django_project import databases
from tests.helpers import require_service

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[2]

USER_TESTS = """
import pytest
from django.db import transaction

from taskonce.celery_ext import IdempotentTask
from taskonce.django_ext import DjangoStore, send_on_commit
from taskonce.testing import assert_runs_once, captured_sends, celery_app, make_guard
from tests.django_project.shop.models import Order, Payment


@pytest.fixture
def app():
    guard = make_guard(DjangoStore("default"), default={"transactional": True})
    app = celery_app(guard)

    @app.task(base=IdempotentTask, acks_late=True, name="shop.charge")
    def charge(order_id):
        Order.objects.filter(pk=order_id).update(paid=True)
        Payment.objects.create(order_id=order_id, cents=500, message_id="m")

    yield app
    guard.close()


@pytest.mark.django_db
def test_charge_runs_once(app):
    order = Order.objects.create(ref="o-1")
    assert_runs_once(app.tasks["shop.charge"], (order.pk,))
    assert Payment.objects.filter(order=order).count() == 1


@pytest.mark.django_db
def test_a_charge_that_is_not_guarded_is_reported(app):
    @app.task(name="shop.plain")
    def plain(order_id):
        pass

    with pytest.raises(AssertionError, match="expected 'shop.plain' to run once"):
        assert_runs_once(plain, (1,))


@pytest.mark.django_db
def test_the_view_sends_the_charge(app):
    charge = app.tasks["shop.charge"]
    with captured_sends() as sent:
        with transaction.atomic():
            order = Order.objects.create(ref="o-2")
            charge.delay(order.pk)
    assert [(s.name, s.args) for s in sent] == [("shop.charge", (order.pk,))]
    assert Payment.objects.count() == 0  # captured, not run
"""


def test_a_django_users_suite_uses_the_helpers(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_service("postgresql")
    databases.setup_django()
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the project, as a user's checkout has it
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess(
        "-p",
        "django",
        "--ds",
        databases.SETTINGS_MODULE,
        "-p",
        "no:cacheprovider",
        "-q",
    )
    result.assert_outcomes(passed=3)
