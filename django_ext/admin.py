"""A read-only admin for the store's records (``django://ALIAS`` stores).

The records and the workers' liveness records can be listed, filtered (by queue, by state,
quarantined included), searched by key and looked at; nobody can add, change or delete them
here. The one write is
the **release** action (for users with the ``taskonce.change_record`` permission): after a
confirmation page it deletes each selected record through the project's store
(``taskonce.django_ext.guard().store.release(key, None)``), as ``manage.py taskonce release
KEY`` does, so that the next delivery of the key runs (a quarantined key is re-armed).

With a store that is not a Django database (``redis://…``, an SQL URL) its records are not in
the project's database, and the admin does not show them.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from taskonce.errors import ConfigError, TaskonceError
from taskonce.keys import queue_prefix
from taskonce.receipts import RECEIVED_SUFFIX

from .models import Record, WorkerSeen

logger = logging.getLogger("taskonce.django_ext")

_F = TypeVar("_F", bound=Callable[..., Any])


def _display(**options: Any) -> Callable[[_F], _F]:
    """``admin.display`` (typed for mypy: Django ships no types)."""
    return cast(Callable[[_F], _F], admin.display(**options))


def _action(**options: Any) -> Callable[[_F], _F]:
    """``admin.action`` (typed for mypy)."""
    return cast(Callable[[_F], _F], admin.action(**options))


#: How many keys the queue filter reads to find the queues in use (besides ``QUEUES``).
QUEUE_SAMPLE = 1000
#: How many keys the release confirmation page lists by name.
LISTED = 100


def store_alias() -> str | None:
    """The database alias of the project's store (``django://ALIAS``), None for a store that
    is not a Django database or a ``STORE`` setting that is not valid."""
    from taskonce.django_ext import conf

    from .store import SCHEME, alias_of

    try:
        url = conf.store_url()
        if url.split("://", 1)[0].lower() != SCHEME:
            return None
        return alias_of(url)
    except ConfigError:
        return None


def _when(seconds: float | None) -> datetime.datetime | None:
    """A store time (seconds since the epoch) as an aware datetime, shown in the admin's zone."""
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)


def queue_of(key: str) -> str:
    """The queue of a key ``queue:message-id``, unescaped (``""`` for identity ``id`` keys)."""
    head, separator, _ = key.partition(":")
    return head.replace("%3A", ":").replace("%25", "%") if separator else ""


class QueueFilter(admin.SimpleListFilter):
    """By queue: those of ``settings.TASKONCE["QUEUES"]`` and those of the first
    :data:`QUEUE_SAMPLE` keys read (keys are ``queue:message-id``)."""

    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from taskonce.django_ext import conf

        try:
            configured = conf.read_settings()["QUEUES"]
            queues = {str(name) for name in configured} if isinstance(configured, dict) else set()
        except ConfigError:
            queues = set()
        alias = store_alias()
        if alias is not None:
            sample = Record.objects.using(alias).order_by().values_list("key", flat=True)
            queues.update(queue_of(key) for key in sample[:QUEUE_SAMPLE])
        queues.discard("")
        return [(queue, queue) for queue in sorted(queues)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Record]) -> QuerySet[Record]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(key__startswith=queue_prefix(str(value)))


class StateFilter(admin.SimpleListFilter):
    """By state, as :attr:`Record.state` names it (by this process's clock)."""

    title = "state"
    parameter_name = "state"
    STATES = {
        "in_progress": "in progress",
        "handled": "handled",
        "sending": "sends pending",
        "quarantined": "quarantined",
    }
    STATUS = {
        "in_progress": "in_progress",
        "handled": "completed",
        "sending": "sending",
        "quarantined": "quarantined",
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [*self.STATES.items(), ("expired", "expired")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Record]) -> QuerySet[Record]:
        value, now = self.value(), time.time()
        if value == "expired":
            return queryset.filter(expires_at__lte=now)
        if value in self.STATUS:
            return queryset.filter(status=self.STATUS[value], expires_at__gt=now)
        return queryset


class _ReadOnly(admin.ModelAdmin):
    """Nothing added, changed or deleted; shown only when the store is a Django database
    (its queries on that alias)."""

    show_full_result_count = False  # no COUNT(*) of a large table on every page
    # nor one per filter choice (Django 5's facets; the attribute means nothing to 4.2)
    show_facets = getattr(getattr(admin, "ShowFacets", None), "NEVER", None)
    list_per_page = 100

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        alias = store_alias()
        queryset = super().get_queryset(request)
        return queryset.using(alias) if alias is not None else queryset.none()

    def has_module_permission(self, request: HttpRequest) -> bool:
        return store_alias() is not None and super().has_module_permission(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return store_alias() is not None and super().has_view_permission(request, obj)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@_action(permissions=["release"], description="Release the selected records")
def release_selected(
    modeladmin: RecordAdmin, request: HttpRequest, queryset: QuerySet[Record]
) -> HttpResponse | None:
    """Release the selected records: a confirmation page first (as Django's "delete selected"),
    then ``store.release(key, None)`` for each through the project's store, and a message with
    how many were released."""
    keys = list(queryset.values_list("key", flat=True))
    if request.POST.get("post"):
        modeladmin.release(request, keys)
        return None  # back to the list
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": "Release the selected records?",
        "subtitle": None,
        "keys": keys[:LISTED],
        "unlisted": max(0, len(keys) - LISTED),
        "count": len(keys),
        "queryset": queryset,
        "opts": opts,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media,
    }
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(
        request, "admin/taskonce/record/release_selected_confirmation.html", context
    )


def readable_worker(text: str | None) -> str:
    """A worker identity (``host/ns/pid/start``) as ``host pid 1234``; other text as it is."""
    from taskonce.worker import Identity

    identity = Identity.parse(text)
    if identity is None:
        return text or "-"
    return f"{identity.host} pid {identity.pid}"


@admin.register(Record)
class RecordAdmin(_ReadOnly):
    """The store's records: key, queue, state, worker, times; the release action."""

    list_display = ("key", "queue", "state", "worker_name", "created", "expires")
    list_filter = (QueueFilter, StateFilter)
    search_fields = ("key", "worker")  # a worker by its host name or pid, too
    actions: Sequence[Any] = (release_selected,)
    fields = readonly_fields = (
        "key",
        "queue",
        "state",
        "status",
        "worker",
        "owner",
        "created",
        "lease_until_time",
        "expires",
        "fingerprint",
        "result",
        "pending_sends",
        "awaited_receipts",
        "crashes",
    )

    @_display(description="queue")
    def queue(self, record: Record) -> str:
        return queue_of(record.key) or "-"

    @_display(description="state")
    def state(self, record: Record) -> str:
        return str(record.state)

    @_display(description="created", ordering="created_at")
    def created(self, record: Record) -> datetime.datetime | None:
        return _when(record.created_at)

    @_display(description="kept until", ordering="expires_at")
    def expires(self, record: Record) -> datetime.datetime | None:
        return _when(record.expires_at)

    @_display(description="lease until")
    def lease_until_time(self, record: Record) -> datetime.datetime | None:
        return _when(record.lease_until) if record.status == "in_progress" else None

    @_display(description="deferred sends")
    def pending_sends(self, record: Record) -> str:
        if record.status != "sending" or not record.sends:
            return "-"
        import json

        try:
            count = len(json.loads(record.sends))
        except (ValueError, TypeError):
            return "pending"
        return f"{count} pending"

    @_display(description="receipts")
    def awaited_receipts(self, record: Record) -> str:
        """How many published sends await their receipts (and when the relay looks next), and
        how many were given up on (``taskonce inspect`` shows them)."""
        if not record.receipts:
            return "-"
        import json

        try:
            entries = json.loads(record.receipts)
        except (ValueError, TypeError):
            return "awaited"
        given_up = sum(1 for entry in entries if entry.get("unconfirmed"))
        parts = []
        if len(entries) > given_up:
            awaited = f"{len(entries) - given_up} awaited"
            # a record with receipts has no sends pending: its sends_at is the receipts' due time
            looked = _when(record.sends_at)
            if looked is not None:
                awaited += f", next look at {looked.isoformat(timespec='seconds')}"
            parts.append(awaited)
        if given_up:
            parts.append(f"{given_up} never received")
        return "; ".join(parts) or "-"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # Not the receipts' markers (``<key>\x1freceived``, taskonce.receipts): bookkeeping of
        # the relay, not records of handled messages.
        return super().get_queryset(request).exclude(key__endswith=RECEIVED_SUFFIX)

    @_display(description="worker", ordering="worker")
    def worker_name(self, record: Record) -> str:
        """``HOST pid PID`` of the worker identity (``TASKONCE_WORKER_ID`` where set, else the
        host name, and the process): what Celery's node name (``celery@HOST``) and Dramatiq's
        process list show; an identity taskonce cannot read as it is."""
        return readable_worker(record.worker)

    def has_release_permission(self, request: HttpRequest) -> bool:
        """The release action's permission: ``taskonce.change_record``."""
        from django.contrib.auth import get_permission_codename

        user: Any = request.user
        codename = get_permission_codename("change", self.opts)
        return bool(user.has_perm(f"{self.opts.app_label}.{codename}"))

    def release(self, request: HttpRequest, keys: Sequence[str]) -> int:
        """``store.release(key, None)`` for each key through the project's store, and a message
        saying how many were released; the number. A store error stops there (its message says
        how many were released before it)."""
        from taskonce.django_ext import guard

        released = 0
        user = getattr(request.user, "get_username", lambda: "?")()
        try:
            store = guard().store
            for key in keys:
                store.release(key, None)
                released += 1
        except TaskonceError as exc:
            logger.warning(
                "admin user %s: release stopped after %d record(s): %s", user, released, exc
            )
            self.message_user(
                request,
                f"Released {released} of {len(keys)} record(s), then: {exc}",
                messages.ERROR,
            )
            return released
        logger.info("admin user %s released %d record(s) of the store", user, released)
        self.message_user(request, f"Released {released} record(s).", messages.SUCCESS)
        return released


@admin.register(WorkerSeen)
class WorkerSeenAdmin(_ReadOnly):
    """The workers' liveness records: who wrote one, when, and until when it counts."""

    list_display = ("worker", "seen", "alive_until_time", "alive")
    search_fields = ("worker",)
    fields = readonly_fields = ("worker", "seen", "alive_until_time", "alive")

    @_display(description="last seen", ordering="seen_at")
    def seen(self, record: WorkerSeen) -> datetime.datetime | None:
        return _when(record.seen_at)

    @_display(description="alive until", ordering="alive_until")
    def alive_until_time(self, record: WorkerSeen) -> datetime.datetime | None:
        return _when(record.alive_until)

    @_display(description="alive", boolean=True)
    def alive(self, record: WorkerSeen) -> bool:
        return bool(record.alive_until > time.time())


__all__ = ["QueueFilter", "RecordAdmin", "StateFilter", "WorkerSeenAdmin", "release_selected"]
