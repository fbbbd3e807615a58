"""docs/django.md's Dramatiq actor, as the page has it (tests/test_docs.py checks the lines are
the same); tests/django/test_docs_examples.py runs it on a stub broker with the project's guard.
Not imported by the project's workers: the queue ``payments`` is the page's, not a test run's."""

import dramatiq

from .models import Order, Payment


@dramatiq.actor(queue_name="payments")
def charge(order_id):
    Order.objects.filter(pk=order_id).update(paid=True)
    Payment.objects.create(order_id=order_id, cents=500)
