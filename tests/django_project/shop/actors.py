"""The shop's Dramatiq actors (found by django_dramatiq: ``DRAMATIQ_AUTODISCOVER_MODULES``):
plain Django ORM, guarded by taskonce's middleware (``DRAMATIQ_BROKER["MIDDLEWARE"]``).

``shop_charge`` on the queue ``settings.QUEUE`` (the default policy: eager, transactional) and
``shop_charge_lazy`` on ``QUEUE-lazy``; the ``**test`` arguments are the tests' (see
``scenarios``).
"""

from __future__ import annotations

from typing import Any

import dramatiq
from django.conf import settings

from .models import Order, Payment
from .scenarios import rehearsal

RETRIES = {"max_retries": 3, "min_backoff": 100, "max_backoff": 500}


def _charge(order_id: int, **test: Any) -> None:
    message = dramatiq.middleware.CurrentMessage.get_current_message()
    message_id = message.message_id if message is not None else ""
    with rehearsal(message_id, **test):
        order = Order.objects.get(pk=order_id)
        Order.objects.filter(pk=order_id).update(paid=True)
        Payment.objects.create(order=order, cents=order.cents, message_id=message_id)


charge = dramatiq.actor(_charge, actor_name="shop_charge", queue_name=settings.QUEUE, **RETRIES)
charge_lazy = dramatiq.actor(
    _charge, actor_name="shop_charge_lazy", queue_name=f"{settings.QUEUE}-lazy", **RETRIES
)
