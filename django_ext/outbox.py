"""``send_on_commit()`` for Django: what a block sends leaves when Django commits.

Each send is written, as it is made, as an outbox row in the store's table through Django's
connection — inside whatever ``atomic()`` block is open, so it commits or rolls back with the
view's own rows — and its publishing is handed to ``transaction.on_commit``, registered in the
same (possibly nested) block: Django drops it with a rolled-back savepoint or transaction, and
runs it after the outermost commit. Rows that committed but were not published (the process
died first, the broker was down) are published by the relay under the same ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

from taskonce.errors import ConfigError
from taskonce.guard import Guard
from taskonce.outbox import OutboxRow, capturing_sends, publishing_guard, write_row

from . import conf
from .store import DjangoStore


def _publish(guard: Guard, row: OutboxRow) -> None:
    guard.dispatch_committed((row,))  # never raises: what fails stays for the relay


@contextlib.contextmanager
def send_on_commit(*, using: str | None = None, guard: Guard | None = None) -> Iterator[None]:
    """``with transaction.atomic(), send_on_commit(): charge.delay(order.pk)`` — what the
    block sends (Celery ``delay``/``apply_async``/``delay_on_commit``, Dramatiq ``send``) is
    published when Django commits the transaction, and never if it rolls back (a rolled-back
    savepoint takes the sends made inside it along). Outside ``atomic()`` (autocommit) each
    send is published as soon as its row is written. Works the same with
    ``ATOMIC_REQUESTS = True``.

    :param using: the database alias; default, and the only one allowed: the store's
        (``settings.TASKONCE["STORE"]`` = ``django://ALIAS``), where the relay finds the rows.
    :param guard: default :func:`taskonce.django_ext.guard`.
    :raises ConfigError: the store is not a ``django://`` store, ``using`` names another
        database, or no framework registered a publisher with the guard (Celery:
        ``setup(app, guard())``; Dramatiq: the middleware).
    """
    from django.db import transaction

    chosen = publishing_guard(guard if guard is not None else conf.guard())
    store = chosen.store
    if not isinstance(store, DjangoStore):
        raise ConfigError(
            f"taskonce.django_ext.send_on_commit() writes its rows in a Django database, but "
            f'the store is {store.describe()}: set TASKONCE["STORE"] = "django://default" (or '
            "use taskonce.send_on_commit(session) with a SQLAlchemy session)"
        )
    alias = store.alias if using is None else using
    if alias != store.alias:
        raise ConfigError(
            f"send_on_commit(using={using!r}): the store's rows live in database "
            f"{store.alias!r}; the sends can share only that database's transaction"
        )

    def write(text: str) -> None:
        row = write_row(chosen, store, store.connection(), text)
        transaction.on_commit(partial(_publish, chosen, row), using=alias)

    with capturing_sends(chosen, write):
        yield


__all__ = ["send_on_commit"]
