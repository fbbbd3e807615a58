"""``captured_sends()`` around ``send_on_commit()`` blocks (Django's, on PostgreSQL): the sends
are captured, no outbox row is written, nothing reaches the broker — Celery on a real Redis
broker, Dramatiq on its StubBroker. Each test's control (the same block without
``captured_sends()``) publishes, so the broker is looked at where the message would be."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from taskonce import Guard
from taskonce.dramatiq_ext import IdempotencyMiddleware
from taskonce.testing import captured_sends
from tests.django_project import databases
from tests.helpers import require_service

BROKER = "redis://127.0.0.1:6379/14"


@pytest.fixture
def guard() -> Iterator[Guard]:
    require_service("postgresql")
    databases.ready(["default"])
    databases.empty("default")
    from taskonce.django_ext import DjangoStore

    guard = Guard(DjangoStore("default"))
    try:
        yield guard
    finally:
        guard.close()
        databases.empty("default")


def outbox_rows() -> int:
    from taskonce.django_ext.models import Record

    return int(Record.objects.filter(key__startswith="outbox:").count())


def new_order() -> int:
    from tests.django_project.shop.models import Order

    return int(Order.objects.create(ref=uuid.uuid4().hex).pk)


def test_celery_sends_in_send_on_commit_are_captured_not_published(guard: Guard) -> None:
    require_service("redis")
    import redis
    from celery import Celery
    from django.db import transaction

    from taskonce.celery_ext import IdempotentTask, setup
    from taskonce.django_ext import send_on_commit

    app = Celery(f"captured-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(broker_url=BROKER)
    setup(app, guard)

    @app.task(base=IdempotentTask, name="shop.tasks.charge", shared=False)
    def charge(order_id: int) -> None:
        raise AssertionError("never run here")

    queue = f"captured-{uuid.uuid4().hex[:8]}"
    client: Any = redis.Redis.from_url(BROKER)
    try:
        with captured_sends() as sent:
            with transaction.atomic(), send_on_commit(guard=guard):
                order = new_order()
                result = charge.apply_async((order,), queue=queue)
        assert [(s.name, s.args, s.queue) for s in sent] == [("shop.tasks.charge", (order,), queue)]
        assert sent[0].message_id == result.id
        assert outbox_rows() == 0
        assert client.llen(queue) == 0  # nothing on the broker
        # the control: the same block outside captured_sends() publishes at the commit
        with transaction.atomic(), send_on_commit(guard=guard):
            charge.apply_async((new_order(),), queue=queue)
        assert client.llen(queue) == 1
    finally:
        client.delete(queue)
        client.close()
        app.close()


def test_dramatiq_sends_in_send_on_commit_are_captured_not_published(guard: Guard) -> None:
    from django.db import transaction

    from taskonce.django_ext import send_on_commit

    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard, relay_every=0))
    actor = dramatiq.actor(
        lambda order_id: None, actor_name="charge", queue_name="shop", broker=broker
    )
    try:
        with captured_sends() as sent:
            with transaction.atomic(), send_on_commit(guard=guard):
                order = new_order()
                message = actor.send(order)
        assert [(s.framework, s.name, s.args, s.message_id) for s in sent] == [
            ("dramatiq", "charge", (order,), message.message_id)
        ]
        assert outbox_rows() == 0
        assert broker.queues["shop"].qsize() == 0
        with transaction.atomic(), send_on_commit(guard=guard):  # the control
            actor.send(new_order())
        assert broker.queues["shop"].qsize() == 1
    finally:
        broker.close()
