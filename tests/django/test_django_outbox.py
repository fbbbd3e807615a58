"""``taskonce.django_ext.send_on_commit()`` in-process on each backend: the sends are rows in
Django's transaction and leave from ``transaction.on_commit``; a rollback (a savepoint's too)
drops them; what committed but was not published is the relay's. The same through a real
web process and workers is in test_views.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from taskonce import ConfigError, Guard, MemoryStore
from taskonce.dramatiq_ext import IdempotencyMiddleware
from tests.django_project import databases
from tests.helpers import require_service


@pytest.fixture(params=["default", "mariadb", "sqlite"])
def shop(request: pytest.FixtureRequest) -> Iterator[tuple[str, Guard, StubBroker, Any]]:
    """A guard on the alias's store with a Dramatiq StubBroker publishing for it, and an actor."""
    alias = str(request.param)
    if alias != "sqlite":
        require_service("postgresql" if alias == "default" else "mariadb")
    databases.ready([alias])
    databases.empty(alias)
    from taskonce.django_ext import DjangoStore

    guard = Guard(DjangoStore(alias))
    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard, relay_every=0))
    actor = dramatiq.actor(
        lambda order_ref: None, actor_name="ship", queue_name="shop", broker=broker
    )
    try:
        yield alias, guard, broker, actor
    finally:
        guard.close()
        broker.close()


def orders(alias: str, ref: str) -> int:
    from tests.django_project.shop.models import Order

    return int(Order.objects.using(alias).filter(ref=ref).count())


def create_order(alias: str) -> str:
    from tests.django_project.shop.models import Order

    ref = uuid.uuid4().hex
    Order.objects.using(alias).create(ref=ref)
    return ref


def queued(broker: StubBroker) -> list[Any]:
    from dramatiq import Message

    return [tuple(Message.decode(data).args) for data in list(broker.queues["shop"].queue)]


def test_sends_leave_at_the_commit_with_the_rows(shop: Any) -> None:
    from django.db import transaction

    from taskonce.django_ext import send_on_commit

    alias, guard, broker, actor = shop
    with transaction.atomic(using=alias):
        with send_on_commit(guard=guard):
            ref = create_order(alias)
            actor.send(ref)
        assert queued(broker) == []  # not before the commit
        assert guard.store.stats()["sends_pending"] == 1  # the row, in the transaction
    assert queued(broker) == [(ref,)] and orders(alias, ref) == 1
    assert guard.store.stats()["sends_pending"] == 0  # published, marked dispatched


def test_a_rollback_drops_the_rows_and_the_sends(shop: Any) -> None:
    from django.db import transaction

    from taskonce.django_ext import send_on_commit

    alias, guard, broker, actor = shop
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        with send_on_commit(guard=guard):
            ref = create_order(alias)
            actor.send(ref)
        raise RuntimeError("the view fails")
    assert queued(broker) == [] and orders(alias, ref) == 0
    assert guard.store.stats() == {**guard.store.stats(), "keys": 0, "sends_pending": 0}


def test_a_rolled_back_savepoint_takes_its_sends_along(shop: Any) -> None:
    from django.db import transaction

    from taskonce.django_ext import send_on_commit

    alias, guard, broker, actor = shop
    with transaction.atomic(using=alias), send_on_commit(guard=guard):
        kept = create_order(alias)
        actor.send(kept)
        try:
            with transaction.atomic(using=alias):
                dropped = create_order(alias)
                actor.send(dropped)
                raise RuntimeError("the inner block fails")
        except RuntimeError:
            pass
    assert queued(broker) == [(kept,)]
    assert orders(alias, dropped) == 0 and guard.store.stats()["sends_pending"] == 0


def test_outside_atomic_each_send_leaves_when_its_row_is_written(shop: Any) -> None:
    from taskonce.django_ext import send_on_commit

    _, guard, broker, actor = shop
    with send_on_commit(guard=guard):
        actor.send("a")
        assert queued(broker) == [("a",)]


def test_a_broker_down_at_the_commit_leaves_the_row_for_the_relay(shop: Any) -> None:
    from django.db import transaction

    from taskonce.django_ext import send_on_commit

    alias, guard, broker, actor = shop
    publish = guard.dispatcher.publishers["dramatiq"]

    def down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    guard.dispatcher.publishers["dramatiq"] = down
    with transaction.atomic(using=alias), send_on_commit(guard=guard):
        ref = create_order(alias)
        actor.send(ref)
    assert queued(broker) == [] and orders(alias, ref) == 1
    assert guard.store.stats()["sends_pending"] == 1
    guard.dispatcher.publishers["dramatiq"] = publish
    assert guard.relay(older_than=0) == 1
    assert queued(broker) == [(ref,)]
    assert guard.relay(older_than=0) == 0  # once


def test_the_store_must_be_a_django_database(shop: Any) -> None:
    from taskonce.django_ext import send_on_commit

    _, _, broker, actor = shop
    other = Guard(MemoryStore())
    IdempotencyMiddleware(other, relay_every=0).before_worker_boot(broker, None)  # a publisher
    try:
        with pytest.raises(ConfigError, match='set TASKONCE\\["STORE"\\] = "django://default"'):
            with send_on_commit(guard=other):
                actor.send("x")
    finally:
        other.close()
    assert queued(broker) == []


def test_another_database_than_the_stores_is_refused(shop: Any) -> None:
    from taskonce.django_ext import send_on_commit

    _, guard, broker, actor = shop
    with pytest.raises(ConfigError, match="can share only that database's transaction"):
        with send_on_commit(guard=guard, using="elsewhere"):
            actor.send("x")
    assert queued(broker) == []
