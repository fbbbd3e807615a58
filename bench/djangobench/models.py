"""An order and its payments, as a Django shop writes them."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    ref = models.CharField(max_length=64)
    paid = models.BooleanField(default=False)

    class Meta:
        app_label = "djangobench"


class Payment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    cents = models.IntegerField()

    class Meta:
        app_label = "djangobench"
