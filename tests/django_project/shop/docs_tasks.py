"""docs/django.md's Celery task, as the page has it (tests/test_docs.py checks the lines are the
same): found by the project's workers through ``shop/tasks.py``, run by
tests/django/test_docs_examples.py on a real worker."""

from celery import shared_task

from taskonce.celery_ext import IdempotentTask

from .models import Order, Payment


@shared_task(base=IdempotentTask)
def charge(order_id):
    Order.objects.filter(pk=order_id).update(paid=True)
    Payment.objects.create(order_id=order_id, cents=500)
