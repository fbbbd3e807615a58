"""docs/web-requests.md's ``send_on_commit(session)`` lines, as the page has them
(tests/test_docs.py checks they are the same), with an ORM model on SQLite and a Celery app on
the in-memory broker: nothing is published before the commit, the message right after it, and
a rolled-back order sends nothing. "Published" is what reaches the broker's queue: Celery's
``before_task_publish`` fires when a send is made (the message is built then and kept as Celery
made it, docs/celery.md), not when the outbox publishes it."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import taskonce
from taskonce import outbox as outbox_module
from taskonce.celery_ext import IdempotentTask, setup


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)


@pytest.fixture(scope="module")
def shop(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, sa.Engine, Callable[[], list[Any]]]]:
    """One guard for the module, as an application has (``send_on_commit`` finds it): the
    guards other tests of this process left registered are set aside meanwhile."""
    url = f"sqlite:///{tmp_path_factory.mktemp('web') / 'shop.db'}"
    gc.collect()
    others = list(outbox_module.publishing_guards())
    for other in others:
        outbox_module._PUBLISHING.discard(other)
    guard = taskonce.Guard(taskonce.open_store(url))
    app = Celery("web-requests-doc", broker="memory://", set_as_current=False)
    queue = f"web-requests-doc-{id(app)}"  # kombu's memory transport is one per process
    app.conf.task_default_queue = queue
    setup(app, guard)

    @app.task(base=IdempotentTask, name="shop.charge", shared=False)
    def charge(order_id: int) -> None: ...

    published: list[Any] = []

    def taken() -> list[Any]:
        """The order ids of the messages that reached the queue since the last look."""
        with app.connection_for_read() as conn, conn.SimpleQueue(queue) as messages:
            while messages.qsize():
                message = messages.get(block=False)
                published.append(message.payload[0][0])
                message.ack()
        return published

    engine = sa.create_engine(url)
    Base.metadata.create_all(engine)
    try:
        yield charge, engine, taken
    finally:
        engine.dispose()
        guard.close()
        app.close()
        outbox_module._PUBLISHING.update(others)


def test_the_message_leaves_after_the_commit(
    shop: tuple[Any, sa.Engine, Callable[[], list[Any]]],
) -> None:
    charge, engine, published = shop
    published().clear()
    with Session(engine) as session:
        order = Order()
        with taskonce.send_on_commit(session):
            session.add(order)
            session.flush()
            charge.delay(order.id)  # Celery; charge.send(order.id) for Dramatiq
        assert published() == []  # nothing before the commit
        session.commit()
        assert published() == [order.id]  # right after it


def test_a_rolled_back_order_sends_nothing(
    shop: tuple[Any, sa.Engine, Callable[[], list[Any]]],
) -> None:
    charge, engine, published = shop
    published().clear()
    with Session(engine) as session:
        order = Order()
        with taskonce.send_on_commit(session):
            session.add(order)
            session.flush()
            charge.delay(order.id)
        session.rollback()
    assert published() == []
