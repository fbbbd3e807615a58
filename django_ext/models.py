"""The store's tables as Django models, for the admin and for queries of your own: read them,
never write them (the store's statements do, judged by the database's clock). The migration
creates the tables with the same DDL as ``taskonce init-db``."""

from __future__ import annotations

import time

from django.db import models


class Record(models.Model):
    """One key's record: a claim, a mark, or an outbox row (``outbox:<uuid>``).

    Times are seconds since the epoch by the database's clock."""

    key = models.CharField(max_length=255, primary_key=True)
    status = models.CharField(max_length=16)  # in_progress | completed | sending | quarantined
    owner = models.CharField(max_length=64, null=True)
    fingerprint = models.CharField(max_length=64, null=True)
    result = models.TextField(null=True)
    created_at = models.FloatField()
    lease_until = models.FloatField()
    expires_at = models.FloatField()
    worker = models.CharField(max_length=255, null=True)
    sends = models.TextField(null=True)
    sends_token = models.CharField(max_length=64, null=True)
    # sends pending (status "sending"): when recorded; receipts awaited ("completed"): when the
    # relay looks for them next; NULL otherwise (given up on: receipts kept, sends_at NULL)
    sends_at = models.FloatField(null=True)
    sends_lease = models.FloatField(null=True)
    # published sends awaiting their receipts, or given up on (JSON)
    receipts = models.TextField(null=True)
    # take-overs of the key from dead owners; status "quarantined" once past crash_limit
    crashes = models.IntegerField(null=True)

    class Meta:
        db_table = "taskonce_keys"
        verbose_name = "record"
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return str(self.key)

    @property
    def queue(self) -> str:
        """The queue of a key ``queue:message-id`` (``""`` for identity ``id`` keys)."""
        queue, sep, _ = self.key.partition(":")
        return queue if sep else ""

    @property
    def state(self) -> str:
        """``in progress``, ``handled``, ``sends pending``, ``quarantined`` or ``expired``, by
        this process's clock (for display)."""
        if self.expires_at <= time.time():
            return "expired"
        return {
            "in_progress": "in progress",
            "sending": "sends pending",
            "quarantined": "quarantined",
        }.get(self.status, "handled")


class WorkerSeen(models.Model):
    """A worker process's liveness record: it wrote ``seen_at`` and counts as alive until
    ``alive_until`` (a claim of a worker that is not alive is taken over at once)."""

    worker = models.CharField(max_length=255, primary_key=True)
    seen_at = models.FloatField()
    alive_until = models.FloatField()

    class Meta:
        db_table = "taskonce_keys_live"
        verbose_name = "worker seen"
        verbose_name_plural = "workers seen"

    def __str__(self) -> str:
        return str(self.worker)
