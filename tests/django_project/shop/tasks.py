"""The shop's Celery tasks: plain Django ORM, guarded by ``IdempotentTask``.

``shop.charge`` marks the order paid and writes its payment; two payments for one order is a
double charge. ``shop.settle`` writes nothing of its own and charges with
``charge.delay_on_commit``. The ``**test`` arguments are the tests' (see ``scenarios``).
"""

from __future__ import annotations

from typing import Any

from taskonce.celery_ext import IdempotentTask
from tests.django_project.celery import app

from .models import Order, Payment
from .scenarios import Declined, rehearsal


@app.task(
    base=IdempotentTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(Declined,),
    retry_kwargs={"countdown": 0, "max_retries": 3},
    name="shop.charge",
)
def charge(self: Any, order_id: int, **test: Any) -> int:
    with rehearsal(self.request.id, **test):
        order = Order.objects.get(pk=order_id)
        Order.objects.filter(pk=order_id).update(paid=True)
        payment = Payment.objects.create(order=order, cents=order.cents, message_id=self.request.id)
    return int(payment.pk)


@app.task(
    base=IdempotentTask,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(Declined,),
    retry_kwargs={"countdown": 0, "max_retries": 3},
    name="shop.settle",
)
def settle(self: Any, order_id: int, **test: Any) -> None:
    """Charge the order once this run's transaction commits."""
    with rehearsal(self.request.id, **test):
        charge.delay_on_commit(order_id)


from . import docs_tasks  # noqa: E402, F401  (docs/django.md's task, for the workers)
