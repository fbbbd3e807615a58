"""The test project's Dramatiq actors through a real worker started the django_dramatiq way
(``python -m django rundramatiq``: the ``dramatiq`` command on ``django_dramatiq.setup`` and the
shop's actors module; the broker, RabbitMQ, and taskonce's middleware made from
``settings.DRAMATIQ_BROKER``), the store ``django://default`` on PostgreSQL, transactional:
each scenario ends with exactly one ``Payment`` for the order.

One worker for the module (the SIGKILL test replaces it); messages are published from here on
a plain ``RabbitmqBroker`` to the run's own queues: ``shop_charge`` on ``QUEUE`` (eager) and
``shop_charge_lazy`` on ``QUEUE-lazy`` (lazy).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from dramatiq import Message
from dramatiq.brokers.rabbitmq import RabbitmqBroker

from tests.django.conftest import (
    ProjectProcess,
    Run,
    WebServer,
    dramatiq_worker,
    new_order,
    new_ref,
    order_exists,
    order_paid,
    payments,
)
from tests.helpers import require_service, wait_for

AMQP = os.environ.get("TASKONCE_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672")
ACTORS = {"eager": ("shop_charge", ""), "lazy": ("shop_charge_lazy", "lazy")}
WON = {"completed", "marked"}
LOST = {"duplicate_skipped", "concurrent_duplicate"}

pytestmark = pytest.mark.timeout(120)


class Workers:
    """The module's worker, replaced when a test kills it."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.current: ProjectProcess = dramatiq_worker(run)

    def replace(self) -> ProjectProcess:
        self.current.kill()
        self.current = dramatiq_worker(self.run)
        return self.current

    def stop(self) -> None:
        self.current.stop()


@pytest.fixture(scope="module")
def run(django_project: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_service("rabbitmq")
    return Run(
        tmp_path_factory.mktemp("django-dramatiq"),
        django_project,
        TASKONCE_DJANGO_AMQP=AMQP,
        TASKONCE_DJANGO_DRAMATIQ="1",
    )


@pytest.fixture(scope="module")
def workers(run: Run) -> Iterator[Workers]:
    started = Workers(run)
    try:
        yield started
    finally:
        started.stop()
        _delete_queues(run)


@pytest.fixture(scope="module")
def broker(run: Run, workers: Workers) -> Iterator[RabbitmqBroker]:
    """A publisher on the run's queues (declared as the worker declared them)."""
    publisher = RabbitmqBroker(url=AMQP, middleware=[])
    for _, suffix in ACTORS.values():
        publisher.declare_queue(run.q(suffix))
    yield publisher
    publisher.close()


def _delete_queues(run: Run) -> None:
    import pika

    with contextlib.suppress(Exception):
        connection = pika.BlockingConnection(pika.URLParameters(AMQP))
        channel = connection.channel()
        for _, suffix in ACTORS.values():
            for tail in ("", ".DQ", ".XQ"):
                channel.queue_delete(queue=run.q(suffix) + tail)
        connection.close()


def message(run: Run, mode: str, order: Any, **test: Any) -> Message[Any]:
    actor, suffix = ACTORS[mode]
    return Message(
        queue_name=run.q(suffix), actor_name=actor, args=(order.pk,), kwargs=test, options={}
    )


def settled(run: Run, message_id: str, deliveries: int, timeout: float = 30) -> list[str]:
    """Wait until ``deliveries`` deliveries of the message ended; the names of its events."""

    def ended() -> int:
        return sum(name in WON | LOST for name in run.names(message_id))

    wait_for(
        lambda: ended() >= deliveries,
        timeout=timeout,
        what=f"{deliveries} deliveries of {message_id} to end: {run.names(message_id)}",
    )
    return run.names(message_id)


def one_payment(order: Any, message_id: str) -> None:
    from tests.django_project.shop.models import Payment

    assert payments(order.ref) == 1
    assert list(Payment.objects.filter(order=order).values_list("message_id", flat=True)) == [
        message_id
    ]
    assert order_paid(order.ref)


@pytest.mark.parametrize("mode", list(ACTORS))
def test_duplicate_on_the_wire_charges_once(
    run: Run, broker: RabbitmqBroker, workers: Workers, mode: str
) -> None:
    """The same message (same message id) enqueued three times: one payment."""
    order = new_order(f"dq-wire-{mode}")
    sent = message(run, mode, order)
    for _ in range(3):
        broker.enqueue(sent)

    names = settled(run, sent.message_id, 3)
    one_payment(order, sent.message_id)
    assert sum(name in WON for name in names) == 1, names
    assert sum(name in LOST for name in names) == 2, names
    events = run.events(sent.message_id)
    assert {e["framework"] for e in events} == {"dramatiq"}
    assert {e["key"] for e in events} == {f"{run.q(ACTORS[mode][1])}:{sent.message_id}"}
    assert {e["mode"] for e in events} == {mode}


@pytest.mark.parametrize("mode", list(ACTORS))
def test_failing_handler_leaves_no_row_and_the_retry_charges_once(
    run: Run, broker: RabbitmqBroker, workers: Workers, mode: str
) -> None:
    """The first run raises after its writes: they roll back; Dramatiq's Retries sends it
    again (100 ms later) and the retry writes the one payment."""
    order = new_order(f"dq-fail-{mode}")
    sent = broker.enqueue(message(run, mode, order, fail=True))

    names = settled(run, sent.message_id, 1)
    one_payment(order, sent.message_id)
    assert run.runs(sent.message_id) == 2
    if mode == "eager":
        assert names == ["claimed", "released", "claimed", "completed"], names
        assert [e["attempt"] for e in run.events(sent.message_id)] == [0, 0, 1, 1]
    else:
        assert names == ["marked"], names


def test_view_outbox_sends_with_the_commit(run: Run, workers: Workers) -> None:
    """``with transaction.atomic(), send_on_commit(): …; charge.send(order.pk)`` in a view of a
    web process of the project with django_dramatiq: the message leaves at the commit under
    the id it got in the block and is charged once; a rolled-back request sends nothing."""
    web = WebServer(run).start()
    try:
        ref = new_ref("dq-view")
        status, answer = web.post("/shop/orders/", ref=ref, framework="dramatiq")
        assert status == 200 and len(answer["sent"]) == 1
        (message_id,) = answer["sent"]
        settled(run, message_id, 1)
        assert run.names(message_id) == ["claimed", "completed"]
        from tests.django_project.shop.models import Order

        one_payment(Order.objects.get(ref=ref), message_id)

        rolled = new_ref("dq-view-rollback")
        status, answer = web.post(
            "/shop/orders/", ref=rolled, framework="dramatiq", fate="rollback"
        )
        assert status == 200 and len(answer["sent"]) == 1
        after = new_ref("dq-view-after")
        status, later = web.post("/shop/orders/", ref=after, framework="dramatiq")
        settled(run, later["sent"][0], 1)
        assert run.names(answer["sent"][0]) == []
        assert not order_exists(rolled)
    finally:
        web.stop()


def test_sigkill_mid_body_charges_once(run: Run, broker: RabbitmqBroker, workers: Workers) -> None:
    """The worker process is SIGKILLed after the actor wrote its payment (uncommitted); the
    dramatiq command exits, a new worker starts, RabbitMQ redelivers the unacknowledged
    message and the new worker takes the dead owner's claim over at once: one payment."""
    order = new_order("dq-kill")
    sent = broker.enqueue(message(run, "eager", order, hang=True))
    pid = run.hung_pid(sent.message_id)
    assert payments(order.ref) == 0 and not order_paid(order.ref)  # written, uncommitted
    os.kill(pid, signal.SIGKILL)
    first = workers.current
    wait_for(lambda: not first.alive(), timeout=15, what="the dramatiq command to exit")
    workers.replace()

    names = settled(run, sent.message_id, 1, timeout=60)
    one_payment(order, sent.message_id)
    assert run.runs(sent.message_id) == 2
    assert names.count("claimed") == 1 and names.count("completed") == 1, names
    taken = run.events(sent.message_id, "lease_taken_over")
    # The dead owner's claim is taken over at once (owner_dead) or, when the new worker took
    # longer than the 30 s lease to start (a loaded machine), as an expired lease.
    assert len(taken) == 1 and taken[0]["reason"] in ("owner_dead", "lease_expired"), names
    assert any(e["redelivered"] for e in run.events(sent.message_id))
