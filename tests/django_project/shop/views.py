"""The shop's views: an order written and charged in one request.

``POST /shop/orders/`` with form fields

- ``ref`` (unique), ``cents``;
- ``framework``: ``celery`` (``shop.tasks.charge.delay``, default) or ``dramatiq``
  (``shop.actors.charge.send``);
- ``way``: ``outbox`` (``with send_on_commit(): charge.delay(…)``, default), ``on_commit``
  (Celery 5.4's ``charge.delay_on_commit(…)``) or ``outbox_on_commit`` (``delay_on_commit``
  inside ``send_on_commit()``);
- ``atomic``: ``1`` (the view's own ``transaction.atomic()``, default) or ``0`` (none: the
  request's, with ``ATOMIC_REQUESTS``, or autocommit);
- ``fate``: ``commit`` (default), ``rollback`` (``set_rollback(True)``: no order, no send),
  ``raise`` (an exception out of the view: a 500), ``die`` (the process exits with status 17
  in an ``on_commit`` hook registered before the send's: committed, never published).

Answers ``{"order": id, "sent": [message ids]}`` (the ids the sends got inside the block;
none for ``delay_on_commit``, which returns nothing).

``POST /checkout/``: docs/django.md's view, as the page has it (tests/test_docs.py checks the
lines are the same): an order and its charge sent on commit, then a redirect to the order.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import redirect

from taskonce.django_ext import send_on_commit

from .models import Order

#: The exit status of a ``die`` request's process.
DIED = 17


class Refused(Exception):
    """``fate=raise``: the view fails after its writes and sends."""


def _die() -> None:
    os._exit(DIED)  # after the commit, before the send's own on_commit hook publishes


def _send(framework: str, way: str, order_id: int) -> list[str]:
    if framework == "dramatiq":
        from .actors import charge as actor

        with send_on_commit():
            return [actor.send(order_id).message_id]
    from .tasks import charge

    if way == "on_commit":
        charge.delay_on_commit(order_id)
        return []
    with send_on_commit():
        if way == "outbox_on_commit":
            charge.delay_on_commit(order_id)
            return []
        return [charge.delay(order_id).id]


def place_order(request: HttpRequest) -> JsonResponse:
    form = request.POST
    fate = form.get("fate", "commit")
    own: Any = transaction.atomic() if form.get("atomic", "1") == "1" else contextlib.nullcontext()
    with own:
        order = Order.objects.create(ref=form["ref"], cents=int(form.get("cents", "100")))
        if fate == "die":
            transaction.on_commit(_die)
        sent = _send(form.get("framework", "celery"), form.get("way", "outbox"), order.pk)
        if fate == "raise":
            raise Refused(f"order {order.ref} refused after its writes")
        if fate == "rollback":
            transaction.set_rollback(True)
    return JsonResponse({"order": order.pk, "sent": sent})


def checkout(request):  # the page's lines, as a user writes them
    from .tasks import charge

    with transaction.atomic(), send_on_commit():
        order = Order.objects.create(ref=f"checkout-{uuid.uuid4().hex[:12]}", cents=500)
        charge.delay(order.pk)
    return redirect(order)
