"""The example of docs/testing.md#the-fixtures, as a user's test file: collected by the suite with
taskonce's pytest plugin, the lines of the page (tests/test_docs.py checks they are the same)."""

import dramatiq
import pytest

from taskonce.celery_ext import IdempotentTask
from taskonce.testing import assert_runs_once


def test_charge_runs_once(taskonce_celery_app):
    @taskonce_celery_app.task(base=IdempotentTask, shared=False)
    def charge(order_id): ...

    assert_runs_once(charge, ("A-1",))


@pytest.mark.taskonce_guard("sqlite", default={"mode": "lazy"})
def test_receipt_runs_once(taskonce_stub_broker, taskonce_events):
    @dramatiq.actor(queue_name="mail")
    def receipt(order_id): ...

    assert_runs_once(receipt, ("A-1",))
    assert taskonce_events.names() == ["marked", "duplicate_skipped"]
