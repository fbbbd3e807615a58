"""SQLStore: claims and marks in one table of PostgreSQL, MariaDB/MySQL or SQLite.

Every decision about time (is a lease over, is a record expired) is taken by the database's own
clock inside the statement that acts on it, never by the worker's clock. The primitives are the
SQL base's (:mod:`.base`), shared with Django's store; this store runs them on an
``AUTOCOMMIT`` engine of its own.

Transactional mode (``Policy(transactional=True)``) uses a second engine with ordinary
transactions: :meth:`SQLStore.open_session` hands the guard a begun
:class:`~sqlalchemy.orm.Session`, the handler writes through it, and :meth:`SQLStore.mark_in` /
:meth:`SQLStore.complete_in` write the mark in the same transaction, which the guard commits or
rolls back (:mod:`.transactional`).

The tables are described in :mod:`.schema`, the statements built in :mod:`.statements`; URLs,
drivers, engines and fork handling are in :mod:`.connecting`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.stores.options import own_value
from taskonce.stores.sql.base import SQLBase
from taskonce.stores.sql.connecting import (
    FAMILIES,
    forget_after_fork,
    make_engine,
    missing_database,
    parse_url,
    take_table,
)
from taskonce.stores.sql.schema import (
    DEFAULT_TABLE,
    add_missing_columns,
    create_table,
    make_live_table,
    make_table,
    parse_table,
)
from taskonce.stores.sql.transactional import SQLTransactions

logger = logging.getLogger("taskonce.stores.sql")


def _after_fork_in_child(ref: weakref.ReferenceType[SQLStore]) -> None:
    store = ref()
    if store is not None:
        store._after_fork()


class SQLStore(SQLTransactions, SQLBase):
    """Claims and marks in one SQL table, judged by the database's clock.

    :param url: an SQLAlchemy URL: ``postgresql+psycopg://…``, ``mysql+pymysql://…``,
        ``mariadb+pymysql://…``, ``sqlite:///path.db``. ``postgresql://`` and ``postgres://``
        mean psycopg 3, ``mysql://`` and ``mariadb://`` mean PyMySQL.
        Query options: ``table`` (taskonce's own, as the argument below) and the driver's
        (libpq's ``sslmode``, ``connect_timeout``, …; PyMySQL's ``ssl_ca``, ``read_timeout``,
        …; sqlite3's ``timeout``, ``uri``), passed through; any other name is a
        :class:`~taskonce.errors.ConfigError`.
    :param table: the table's name, optionally ``schema.table``; also ``?table=`` in the URL.
        Default ``taskonce_keys``.
    :param create: create the table (and its index) if missing, on first use.
    :param engine_options: extra keyword arguments for :func:`sqlalchemy.create_engine`
        (``pool_size``, ``pool_pre_ping``, ``connect_args`` merged over the defaults, …). The
        store's own engine always runs in ``AUTOCOMMIT``; an ``isolation_level`` given here
        applies to the transactional engine only.
    """

    schemes: tuple[str, ...] = ("sqlite", "postgresql", "mysql", "mariadb")

    def __init__(
        self,
        url: str,
        *,
        table: str | None = None,
        create: bool = True,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        parsed = parse_url(url)
        family = FAMILIES[parsed.get_backend_name()]
        self._url, url_table = take_table(parsed, family)
        table = own_value("SQLStore", "table", url_table, table, DEFAULT_TABLE)
        schema, table_name = parse_table(table)
        super().__init__(
            family=family,
            table=table_name,
            schema=schema,
            label=table,
            where=self._url.render_as_string(hide_password=True),
        )
        self._password = self._url.password if isinstance(self._url.password, str) else None
        self._options = dict(engine_options or {})
        self._memory = family == "sqlite" and self._url.database in (None, "", ":memory:")
        self._lock = threading.Lock()
        self._ready = not create
        self._engine = self._make_engine(autocommit=True)
        self._tx_engine: Engine | None = None
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork_in_child(ref))

    # -- a public handle for tools and benchmarks -------------------------------------------

    @property
    def engine(self) -> Engine:
        """The store's own SQLAlchemy engine (``AUTOCOMMIT``): for tools and benchmarks that
        need the same database and connection pool."""
        return self._engine

    # -- engines -----------------------------------------------------------------------------

    def _make_engine(self, *, autocommit: bool) -> Engine:
        return make_engine(
            self._url, self._family, self._options, memory=self._memory, autocommit=autocommit
        )

    def _transactional_engine(self) -> Engine:
        engine = self._tx_engine
        if engine is None:
            with self._lock:
                if self._tx_engine is None:
                    self._tx_engine = self._make_engine(autocommit=False)
                engine = self._tx_engine
        return engine

    def _after_fork(self) -> None:
        """In a forked child: forget (without closing) every pooled connection of the parent."""
        self._lock = threading.Lock()
        for engine in (self._engine, self._tx_engine):
            if engine is not None:
                forget_after_fork(engine, self._family)

    # -- errors ------------------------------------------------------------------------------

    def _unavailable(self, operation: str, exc: BaseException) -> StoreUnavailable:
        detail = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
        text = str(detail).strip().splitlines()[0] if str(detail).strip() else type(detail).__name__
        if self._password:
            text = text.replace(self._password, "***")
        return StoreUnavailable(
            f"SQL store {self._redacted} failed during {operation}: {type(detail).__name__}: {text}"
        )

    @contextlib.contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except (sa_exc.DBAPIError, sa_exc.TimeoutError) as exc:
            # DBAPIError covers OperationalError, InterfaceError and invalidated connections;
            # anything the database refuses (a missing table, permissions) also means the
            # store cannot answer.
            raise self._unavailable(operation, exc) from exc

    @contextlib.contextmanager
    def _connect(self, operation: str) -> Iterator[Connection]:
        self._ensure_ready(operation)
        with self._errors(operation), self._engine.connect() as connection:
            yield connection

    # -- schema ------------------------------------------------------------------------------

    def _ensure_ready(self, operation: str) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            self._create_tables(operation)

    def create_tables(self) -> bool:
        """Create the table and its index unless they exist (safe to run concurrently from
        several processes). True when this call created the table."""
        with self._lock:
            return self._create_tables("create_tables")

    def _create_tables(self, operation: str) -> bool:
        created = False
        backend = self._url.get_backend_name()
        with self._errors(operation), self._engine.connect() as connection:
            for make in (make_table, make_live_table):
                created = (
                    create_table(
                        connection,
                        make,
                        self._table_name,
                        self._schema,
                        family=self._family,
                        backend=backend,
                        where=self._redacted,
                    )
                    or created
                )
            add_missing_columns(connection, self._table, self._table_label)
        self._ready = True
        return created

    def check_ready(self) -> None:
        """:class:`ConfigError` when the server answers that the URL's database does not exist
        (no wait mends that: a worker refuses to start at once); :class:`StoreUnavailable` when
        it does not answer."""
        try:
            with self._engine.connect():
                pass
        except sa_exc.DBAPIError as exc:
            missing = missing_database(exc)
            if missing:
                raise ConfigError(
                    f"store {self._redacted}: the server says {missing}; create that database "
                    "or correct the URL"
                ) from None
            raise self._unavailable("check_ready", exc) from exc
        except sa_exc.TimeoutError as exc:
            raise self._unavailable("check_ready", exc) from exc

    def _close(self) -> None:
        self._engine.dispose()
        if self._tx_engine is not None:
            self._tx_engine.dispose()


def init_db(url: str, table: str | None = None) -> str:
    """Create the keys table (and its index) at ``url`` unless it exists; a one-line summary.

    Used by ``taskonce init-db``. Raises :class:`ConfigError` for a bad URL or table name and
    :class:`StoreUnavailable` when the database cannot be reached.
    """
    store = SQLStore(url, table=table, create=False)
    try:
        created = store.create_tables()
    finally:
        store.close()
    verb = "created" if created else "already present:"
    return f"{verb} table {store.table_label} in {store.where}"


__all__ = ["DEFAULT_TABLE", "SQLStore", "init_db"]
