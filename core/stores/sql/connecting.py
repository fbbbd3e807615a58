"""How the SQL store connects: its URLs and their query options, the check that the driver is
installed, the engines it builds (``AUTOCOMMIT`` for its own statements, ordinary transactions
for the transactional mode) and what a forked child does with the parent's connections."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import StaticPool

from taskonce.errors import ConfigError
from taskonce.stores.options import check_names
from taskonce.stores.sql.compat import no_rollback_on_return

#: Seconds the driver waits for a TCP connection / SQLite waits for a lock.
_CONNECT_TIMEOUT = 5
_SQLITE_BUSY_TIMEOUT = 30.0
_MYSQL_IO_TIMEOUT = 60

#: The dialect family of each URL backend.
FAMILIES = {
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "mysql": "mysql",
    "mariadb": "mysql",
    "sqlite": "sqlite",
}

#: The driver used when a URL names none (``postgresql://`` → psycopg 3, ``mysql://`` → PyMySQL).
_DEFAULT_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}


def parse_url(url: str) -> URL:
    """``url`` as an SQLAlchemy URL, with the default driver filled in where none is named."""
    if not isinstance(url, str):
        raise ConfigError(f"store URL must be a string, got {type(url).__name__}")
    try:
        parsed = sa.engine.make_url(url)
    except sa_exc.ArgumentError as exc:
        raise ConfigError(f"store URL is not an SQLAlchemy URL: {exc}") from None
    backend = parsed.get_backend_name()
    if backend not in FAMILIES:
        raise ConfigError(
            f"store URL {parsed.render_as_string(hide_password=True)!r}: SQLStore supports "
            "sqlite, postgresql, mysql and mariadb"
        )
    if backend == "postgres":
        backend = "postgresql"
    driver = parsed.get_driver_name() if "+" in parsed.drivername else None
    if driver is None and backend in _DEFAULT_DRIVERS:
        driver = _DEFAULT_DRIVERS[backend]
    drivername = backend if driver is None else f"{backend}+{driver}"
    return parsed.set(drivername=drivername)


#: sqlite3's own ``connect()`` options that SQLAlchemy takes from the URL, and the options of an
#: SQLite URI filename (``sqlite:///file:path.db?mode=ro&uri=true``).
_SQLITE_OPTIONS = frozenset({"uri", "timeout", "detect_types", "cached_statements"})
_SQLITE_URI_OPTIONS = frozenset({"vfs", "mode", "cache", "psow", "nolock", "immutable"})

#: PyMySQL ``connect()`` parameters a URL's text cannot give (Python objects) and the TLS
#: options SQLAlchemy gathers into PyMySQL's ``ssl`` dict.
_PYMYSQL_OBJECTS = frozenset({"conv", "cursorclass", "auth_plugin_map", "ssl", "defer_connect"})
_SQLALCHEMY_MYSQL_TLS = frozenset({"ssl_capath", "ssl_cipher", "ssl_check_hostname"})

#: Options the store sets itself, and why a URL may not.
_MANAGED = {
    "sqlite": {
        "isolation_level": "the store runs its own statements in autocommit and opens "
        "transactions itself",
        "check_same_thread": "the store shares connections between threads",
    },
    "mysql": {"autocommit": "the store runs its own statements in autocommit"},
    "postgresql": {},
}


#: The driver the ``sql`` extra installs for each dialect family: (driver name, its package).
_EXTRA_DRIVERS = {"postgresql": ("psycopg", "psycopg 3"), "mysql": ("pymysql", "PyMySQL")}


def _require_driver(url: URL, family: str) -> None:
    """:class:`ConfigError` naming the extra to install (and, for a driver the extra does not
    install, the URL form that uses the one it does) when ``url``'s driver cannot be
    imported."""
    try:
        url.get_dialect().import_dbapi()
    except sa_exc.NoSuchModuleError:
        return  # an unknown driver name: building the engine says so
    except ImportError as exc:
        redacted = url.render_as_string(hide_password=True)
        driver = url.get_driver_name()
        backend = url.get_backend_name()
        if family not in _EXTRA_DRIVERS:
            raise ConfigError(
                f"store URL {redacted!r} needs the {driver} driver, which is not installed "
                f"({exc}): pip install 'taskonce[sql]'"
            ) from None
        supported, package = _EXTRA_DRIVERS[family]
        if driver == supported:  # named in the URL, or the default of postgresql:// / mysql://
            raise ConfigError(
                f"store URL {redacted!r} needs {package}, which is not installed ({exc}): "
                f"pip install 'taskonce[sql]' ({backend}:// means {backend}+{supported}://)"
            ) from None
        raise ConfigError(
            f"store URL {redacted!r} names the {driver} driver, which is not installed "
            f"({exc}); taskonce's sql extra installs {package}: pip install 'taskonce[sql]' "
            f"and write the URL as {backend}+{supported}://user:password@host/db"
        ) from None


def _driver_options(url: URL, family: str, query: Mapping[str, Any]) -> tuple[str, Any]:
    """Who takes ``url``'s driver options and their names (None when the driver is not one
    taskonce knows, so they pass through unchecked). Found without connecting: libpq's
    keywords from psycopg's ``PQconndefaults``, PyMySQL's ``connect()`` signature, sqlite3's
    ``connect()`` and URI options."""
    _require_driver(url, family)
    driver = url.get_driver_name()
    if family == "postgresql" and driver in ("psycopg", "psycopg2"):
        try:
            from psycopg import pq
        except ImportError:
            return f"libpq ({driver})", None
        return "libpq", frozenset(option.keyword.decode() for option in pq.Conninfo.get_defaults())
    if family == "mysql" and driver == "pymysql":
        import inspect

        import pymysql.connections

        parameters = inspect.signature(pymysql.connections.Connection.__init__).parameters
        names = set(parameters) - {"self"} - _PYMYSQL_OBJECTS
        return "PyMySQL", frozenset(names | _SQLALCHEMY_MYSQL_TLS)
    if family == "sqlite" and driver == "pysqlite":
        uri = str(query.get("uri", "")).lower() in ("1", "true", "yes", "on")
        return "sqlite3", _SQLITE_OPTIONS | (_SQLITE_URI_OPTIONS if uri else frozenset())
    return driver, None


def take_table(url: URL, family: str) -> tuple[URL, str | None]:
    """``url`` without its ``table`` query option, and that option's value; ConfigError for a
    query option that neither taskonce nor the driver takes, or one given twice."""
    redacted = url.render_as_string(hide_password=True)
    query = dict(url.query)
    for name, value in query.items():
        if isinstance(value, tuple):
            raise ConfigError(f"SQLStore url {redacted!r}: query option {name!r} is given twice")
    driver, accepted = _driver_options(url, family, query)
    if family == "sqlite" and accepted is not None:
        uri_only = sorted(set(query) & (_SQLITE_URI_OPTIONS - accepted))
        if uri_only:
            raise ConfigError(
                f"SQLStore url {redacted!r}: query option {uri_only[0]!r} is an SQLite URI "
                "option; it needs a URI filename: sqlite:///file:path.db?…&uri=true"
            )
    check_names(
        "SQLStore",
        redacted,
        query,
        own=("table",),
        driver=driver,
        accepted=accepted,
        managed=_MANAGED[family],
    )
    table = query.get("table")
    return url.difference_update_query(["table"]), None if table is None else str(table)


def missing_database(exc: BaseException) -> str:
    """What the server said when ``exc`` (a driver's error, or SQLAlchemy's around it) says the
    URL's database does not exist — PostgreSQL's ``database "x" does not exist``, MySQL's and
    MariaDB's error 1049 ``Unknown database 'x'`` —, else ``""``."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip()
    args = getattr(orig, "args", ())
    if args and args[0] == 1049:  # ER_BAD_DB_ERROR
        return str(args[1]) if len(args) > 1 else "unknown database"
    found = re.search(r'database "[^"]*" does not exist', text)
    return found.group(0) if found else ""


# -- engines -----------------------------------------------------------------------------------


def make_engine(
    url: URL,
    family: str,
    options: Mapping[str, Any],
    *,
    memory: bool,
    autocommit: bool,
) -> Engine:
    """The engine of a store: ``autocommit`` for the store's own statements, else with
    ordinary transactions (the transactional mode). ``options`` are the store's
    ``engine_options``; ``memory``: an in-memory SQLite database (one shared connection)."""
    options = dict(options)
    user_connect_args = dict(options.pop("connect_args", None) or {})
    user_isolation = options.pop("isolation_level", None)
    connect_args = _connect_args(url, family, autocommit)
    connect_args.update(user_connect_args)
    if family != "sqlite":
        options.setdefault("pool_recycle", 1800)
    if memory:
        options.setdefault("poolclass", StaticPool)
    if autocommit:
        options["isolation_level"] = "AUTOCOMMIT"
        # The pool's reset-on-return ROLLBACK is a round trip on PyMySQL even in autocommit
        # mode, doubling every MariaDB store operation (bench/store_ops.py counts them).
        no_rollback_on_return(options)
    elif user_isolation is not None:
        options["isolation_level"] = user_isolation
    try:
        engine = sa.create_engine(url, connect_args=connect_args, **options)
    except (
        sa_exc.ArgumentError,
        sa_exc.NoSuchModuleError,
        ImportError,
        TypeError,
        ValueError,  # a driver option's value of the wrong type (read_timeout=soon)
    ) as exc:
        redacted = url.render_as_string(hide_password=True)
        raise ConfigError(f"store URL {redacted!r}: cannot build an engine: {exc}") from None
    if family == "sqlite":
        _configure_sqlite(engine, memory=memory, transactional=not autocommit)
    return engine


def _connect_args(url: URL, family: str, autocommit: bool) -> dict[str, Any]:
    """The driver's connection arguments the store sets (timeouts), unless the URL sets them."""
    connect_args: dict[str, Any] = {}
    query = url.query
    if family == "postgresql" and "connect_timeout" not in query:
        connect_args["connect_timeout"] = _CONNECT_TIMEOUT
    elif family == "mysql":
        if "connect_timeout" not in query:
            connect_args["connect_timeout"] = _CONNECT_TIMEOUT
        if autocommit and url.get_driver_name() == "pymysql":
            # PyMySQL's connect_timeout covers the TCP connect only; the handshake and every
            # query wait up to read_timeout. The store's statements are short (row-lock waits
            # end at innodb_lock_wait_timeout, 50 s by default), so a silent server is
            # reported instead of hanging the worker.
            for name in ("read_timeout", "write_timeout"):
                if name not in query:
                    connect_args[name] = _MYSQL_IO_TIMEOUT
    elif family == "sqlite":
        if "timeout" not in query:
            connect_args["timeout"] = _SQLITE_BUSY_TIMEOUT
        connect_args["check_same_thread"] = False
    return connect_args


def _configure_sqlite(engine: Engine, *, memory: bool, transactional: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        if transactional:
            # Let SQLAlchemy's begin event issue BEGIN (below) instead of the driver's
            # implicit, deferred one.
            dbapi_connection.isolation_level = None
        if not memory:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
            finally:
                cursor.close()

    if transactional:

        @event.listens_for(engine, "begin")
        def _on_begin(connection: Connection) -> None:
            # IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so a
            # transaction that read first never fails to upgrade to a writer.
            connection.exec_driver_sql("BEGIN IMMEDIATE")


# -- fork safety and paths -----------------------------------------------------------------------

#: Connections inherited by a forked child are kept referenced here so that garbage
#: collection never closes them in the child: closing an inherited SQLite handle can disturb
#: the parent's locks. (psycopg and PyMySQL close an inherited socket without telling the
#: server, so theirs may go.)
_INHERITED: list[Any] = []


def forget_after_fork(engine: Engine, family: str) -> None:
    """In a forked child: forget (without closing) every pooled connection of the parent."""
    if family == "sqlite":
        _INHERITED.extend(_pooled_dbapi_connections(engine))
    engine.dispose(close=False)


def sqlite_path(url: URL) -> str:
    """The absolute path of an SQLite URL's database file ("" in memory)."""
    database = url.database or ""
    if database in ("", ":memory:"):
        return ""
    if database.startswith("file:"):
        database = database[5:].split("?", 1)[0]
    return os.path.realpath(database)


def _pooled_dbapi_connections(engine: Engine) -> list[Any]:
    """The driver connections idle in ``engine``'s pool (best effort, pool internals)."""
    found: list[Any] = []
    pool: Any = engine.pool
    records: list[Any] = []
    queue = getattr(getattr(pool, "_pool", None), "queue", None)
    if queue is not None:
        records.extend(list(queue))
    for attr in ("_conn", "connection"):  # StaticPool
        value = getattr(pool, attr, None)
        if value is not None and not callable(value):
            records.append(value)
    for record in records:
        dbapi_connection = getattr(record, "dbapi_connection", None)
        if dbapi_connection is not None:
            found.append(dbapi_connection)
    return found


__all__ = [
    "FAMILIES",
    "forget_after_fork",
    "make_engine",
    "missing_database",
    "parse_url",
    "sqlite_path",
    "take_table",
]
