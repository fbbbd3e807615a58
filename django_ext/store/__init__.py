"""``django://ALIAS``: the SQL store on the connection Django holds for a database alias.

:class:`DjangoStore` is :class:`~taskonce.stores.sql.SQLStore`'s sibling over the one SQL base
(:mod:`taskonce.stores.sql.base`) — the same tables, statements and decisions, judged by the
database's clock — without an engine of its own: every statement
runs on ``django.db.connections[ALIAS]`` in the calling thread, as Django runs the ORM's. So a
worker holds no second pool: each thread uses its own connection, opened and closed by Django
(``CONN_MAX_AGE``, ``close_old_connections`` between tasks, which Celery's Django fixup and
django_dramatiq's middleware call); the store's own threads (liveness, heartbeat, relay) close
theirs after each write as a request would. A store operation inside an ``atomic()`` block of
the same thread is part of that transaction, like any ORM statement.

Its tables come from the app's migration (``manage.py migrate``). In transactional mode the
handler runs inside ``transaction.atomic(using=ALIAS)`` (:class:`.DjangoTransaction`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.stores.sql.base import SQLBase
from taskonce.stores.sql.schema import DEFAULT_TABLE

from .statements import VENDORS, Compiler, DjangoConnection
from .transaction import DjangoTransaction

logger = logging.getLogger("taskonce.django_ext")

#: Store URLs that name a Django database alias.
SCHEME = "django"


def alias_of(url: str) -> str:
    """The alias ``django://ALIAS`` names (``django://`` alone: ``default``)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != SCHEME or "/" in rest.strip("/") or "?" in rest:
        raise ConfigError(
            f"store URL {url!r}: a Django database is named django://ALIAS, an alias of "
            "settings.DATABASES (e.g. django://default)"
        )
    return rest.strip("/") or "default"


def _own_thread() -> bool:
    """The store's own background threads (liveness, heartbeat, relay): no framework closes
    their Django connections, so the store does, after each write."""
    return threading.current_thread().name.startswith("taskonce-")


class DjangoStore(SQLBase):
    """Claims and marks in the ``taskonce_keys`` table of a Django database.

    :param alias: a key of ``settings.DATABASES`` (PostgreSQL, MariaDB/MySQL or SQLite).
    :raises ConfigError: Django is not set up, the alias is unknown, or its backend is not one
        of those three.
    """

    schemes = (SCHEME,)

    def __init__(self, alias: str = "default") -> None:  # no engine: Django's connections
        try:
            from django.conf import settings
            from django.db import connections

            databases = settings.DATABASES
        except Exception as exc:  # ImproperlyConfigured, or Django not installed
            raise ConfigError(
                f"django://{alias} needs Django's settings (DJANGO_SETTINGS_MODULE, "
                f"django.setup()): {exc}"
            ) from exc
        if alias not in databases:
            known = ", ".join(sorted(databases)) or "none"
            raise ConfigError(
                f"store django://{alias}: no database {alias!r} in settings.DATABASES "
                f"(there: {known})"
            )
        vendor = connections[alias].vendor
        if vendor not in VENDORS:
            raise ConfigError(
                f"store django://{alias}: the {vendor!r} backend is not supported; taskonce "
                "stores records in PostgreSQL, MariaDB/MySQL or SQLite"
            )
        self.alias = alias
        super().__init__(
            family=VENDORS[vendor],
            table=DEFAULT_TABLE,
            schema=None,
            label=DEFAULT_TABLE,
            where=f"django://{alias}",
        )
        fixed = [value for value in vars(self._sql).values() if isinstance(value, sa.Executable)]
        self._compiler = Compiler(self._family, fixed)

    @classmethod
    def from_url(cls, url: str) -> DjangoStore:
        """The store ``django://ALIAS`` names."""
        return cls(alias_of(url))

    # -- Django's connection for the alias, in this thread -----------------------------------

    def _wrapper(self) -> Any:
        from django.db import connections

        return connections[self.alias]

    @contextlib.contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        from django.db import Error, transaction

        try:
            yield
        except transaction.TransactionManagementError:
            raise  # the handler's transaction is broken: its failure, not the store's
        except Error as exc:
            wrapper = self._wrapper()
            if not wrapper.in_atomic_block:
                wrapper.close_if_unusable_or_obsolete()
            raise self._unavailable(operation, exc) from exc

    def _unavailable(self, operation: str, exc: BaseException) -> StoreUnavailable:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = ""
        if DEFAULT_TABLE in text and any(
            words in text.lower() for words in ("does not exist", "no such table", "doesn't exist")
        ):
            hint = f"; create it with: python manage.py migrate --database {self.alias}"
        return StoreUnavailable(
            f"store {self._redacted} failed during {operation}: {type(exc).__name__}: {text}{hint}"
        )

    @contextlib.contextmanager
    def _connect(self, operation: str) -> Iterator[Any]:
        wrapper = self._wrapper()
        try:
            with self._errors(operation):
                yield DjangoConnection(wrapper, self._compiler)
        finally:
            if _own_thread() and not wrapper.in_atomic_block:
                wrapper.close_if_unusable_or_obsolete()

    def create_tables(self) -> bool:
        """Create the tables (as the migration does) unless they exist; True when this call
        created the keys table. For tests and tools; projects run ``manage.py migrate``."""
        from .schema import create_tables

        with self._errors("create_tables"):
            return create_tables(self._wrapper())

    def check_ready(self) -> None:
        """:class:`ConfigError` when the store's table is missing or one of taskonce's
        migrations has not run on this database (at a worker's start: no wait mends that)."""
        from .schema import unapplied_migrations

        with self._errors("check_ready"):
            tables = self._wrapper().introspection.table_names()
            unapplied = unapplied_migrations(self.alias) if DEFAULT_TABLE in tables else []
        migrate = f"python manage.py migrate --database {self.alias}"
        if DEFAULT_TABLE not in tables:
            raise ConfigError(
                f"store {self._redacted}: the table {DEFAULT_TABLE} does not exist in database "
                f"{self.alias!r}; create it with: {migrate}"
            )
        if unapplied:
            raise ConfigError(
                f"store {self._redacted}: taskonce's migration(s) {', '.join(unapplied)} have "
                f"not run on database {self.alias!r}; apply them with: {migrate}"
            )

    # -- transactional mode and the outbox ----------------------------------------------------

    def open_session(self) -> Any:
        """The handler's transaction: ``transaction.atomic(using=alias)``, entered."""
        with self._errors("open_session"):
            return DjangoTransaction(self.alias, self._compiler)

    def connection(self) -> DjangoConnection:
        """The store's statements on this thread's connection for the alias (inside whatever
        ``atomic()`` block is open there): the producer outbox writes its rows through it."""
        return DjangoConnection(self._wrapper(), self._compiler)

    def check_shared(self, bind: Any, in_transaction: bool = False) -> None:
        raise ConfigError(
            f"{self._redacted} shares Django's transactions, not a SQLAlchemy session's: use "
            "taskonce.django_ext.send_on_commit() inside transaction.atomic()"
        )

    def _close(self) -> None:
        return  # Django owns the connections


__all__ = ["SCHEME", "DjangoStore", "alias_of"]
