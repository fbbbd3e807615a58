"""The shop's own rows: what a charge writes, counted by the tests."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """An order; ``paid`` set by the charge task."""

    ref = models.CharField(max_length=64, unique=True)
    cents = models.IntegerField(default=0)
    paid = models.BooleanField(default=False)

    def get_absolute_url(self) -> str:
        """Where ``redirect(order)`` goes (the docs' checkout view): no page of its own."""
        return f"/shop/orders/{self.pk}/"


class Payment(models.Model):
    """One per charge run: two rows for one order is a double charge."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    cents = models.IntegerField()
    message_id = models.CharField(max_length=255)
