"""The application of tests/test_outbox_workers.py: one guard on a PostgreSQL store, a Celery
app and a Dramatiq broker on the test's own redis-server, a guarded task and actor that record
whether they saw the order row, a Flask app, and a script — both writing an order and sending
to both frameworks inside ``taskonce.send_on_commit``.

Configured by environment: ``OB_BROKER`` (redis URL without a db), ``OB_STORE_TABLE``,
``OB_ORDERS``, ``OB_RUNS`` (table names), ``OB_QUEUE``, ``OB_EVENTS`` (JSONL), ``OB_READY``
(a file a worker creates once it consumes).

``python -m tests.outbox_app serve PORT`` runs the Flask app; ``python -m tests.outbox_app
order ID commit|rollback|die`` is the script (``die``: SIGKILLed right after the commit, before
publishing).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import dramatiq
import sqlalchemy as sa
from celery import Celery
from celery.signals import worker_ready
from dramatiq.brokers.redis import RedisBroker
from sqlalchemy.orm import Session

import taskonce
from taskonce.celery_ext import IdempotentTask, setup
from taskonce.dramatiq_ext import IdempotencyMiddleware
from tests.helpers import POSTGRES_URL

BROKER = os.environ.get("OB_BROKER", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("OB_QUEUE", "outbox-test")
metadata = sa.MetaData()
orders = sa.Table(
    os.environ.get("OB_ORDERS", "ob_orders"),
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
)
runs = sa.Table(
    os.environ.get("OB_RUNS", "ob_runs"),
    metadata,
    sa.Column("n", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer, nullable=False),
    sa.Column("framework", sa.String(16), nullable=False),
    sa.Column("saw_order", sa.Boolean, nullable=False),
)
engine = sa.create_engine(POSTGRES_URL, pool_size=4)

store = taskonce.open_store(POSTGRES_URL, table=os.environ.get("OB_STORE_TABLE", "ob_store"))
events = [taskonce.JsonlEvents(os.environ["OB_EVENTS"])] if "OB_EVENTS" in os.environ else []
guard = taskonce.Guard(store, events=events, dispatch_lease=3.0)

celery_app = Celery("outbox_app", broker=f"{BROKER}/0", set_as_current=False)
celery_app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    taskonce_relay_every=0,  # the test runs `taskonce relay` itself
)
setup(celery_app, guard)

broker = RedisBroker(url=f"{BROKER}/1")
broker.add_middleware(IdempotencyMiddleware(guard, relay_every=0))
dramatiq.set_broker(broker)


def _record(order_id: int, framework: str) -> None:
    with engine.begin() as connection:
        seen = connection.execute(sa.select(orders.c.id).where(orders.c.id == order_id)).first()
        connection.execute(
            runs.insert().values(order_id=order_id, framework=framework, saw_order=seen is not None)
        )


@celery_app.task(base=IdempotentTask, acks_late=True, name="outbox.charge")
def charge(order_id: int) -> None:
    _record(order_id, "celery")


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def charge_dq(order_id: int) -> None:
    _record(order_id, "dramatiq")


class _Ready(dramatiq.Middleware):
    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        _ready()


broker.add_middleware(_Ready())


def _ready(**_: Any) -> None:
    path = os.environ.get("OB_READY")
    if path:
        Path(path).touch()


worker_ready.connect(_ready, weak=False)


def _die(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def place_order(order_id: int, fate: str) -> list[str]:
    """What a request does: write the order, send to both frameworks, then commit or not.
    Returns the two message ids (printed at once by the script, before it may die)."""
    if fate == "die":  # SIGKILLed after the commit, before anything is published
        guard.dispatch_committed = _die  # type: ignore[method-assign]
    elif fate == "die_after_publish":  # ... after publishing, before marking them sent
        store.dispatched = _die  # type: ignore[method-assign]
    with Session(engine) as session:
        with taskonce.send_on_commit(session):
            session.execute(orders.insert().values(id=order_id))
            ids = [charge.delay(order_id).id, charge_dq.send(order_id).message_id]
        if __name__ == "__main__":
            print(" ".join(ids), flush=True)
        if fate == "rollback":
            session.rollback()
        else:
            session.commit()
    return ids


def flask_app() -> Any:
    from flask import Flask, request

    app = Flask(__name__)

    @app.post("/orders/<int:order_id>")
    def order(order_id: int) -> tuple[str, int]:
        return " ".join(place_order(order_id, request.args.get("fate", "commit"))), 200

    return app


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        from werkzeug.serving import make_server

        server = make_server("127.0.0.1", int(argv[1]), flask_app(), threaded=True)
        _ready()
        server.serve_forever()
    elif argv[0] == "order":
        place_order(int(argv[1]), argv[2])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
