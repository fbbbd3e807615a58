"""SQLStore: claims and marks in one table of PostgreSQL, MariaDB/MySQL or SQLite.

Every decision about time (is a lease over, is a record expired) is taken by the database's own
clock inside the statement that acts on it, never by the worker's clock. Store operations run on
an ``AUTOCOMMIT`` engine, so a claim is one ``INSERT … ON CONFLICT DO NOTHING`` (``INSERT
IGNORE`` on MariaDB/MySQL) round trip when the key is new; a record that is in the way is read
and, when it is an expired record or a claim whose lease ran out, replaced by an optimistic
``UPDATE`` whose ``WHERE`` repeats what was read, so two racing workers can never both win.

Transactional mode (``Policy(transactional=True)``) uses a second engine with ordinary
transactions: :meth:`SQLStore.open_session` hands the guard a begun
:class:`~sqlalchemy.orm.Session`, the handler writes through it, and :meth:`SQLStore.mark_in` /
:meth:`SQLStore.complete_in` write the mark in the same transaction, which the guard commits or
rolls back.

The table::

    key          VARCHAR(255) PRIMARY KEY    -- binary (case- and space-exact) on MariaDB/MySQL
    status       VARCHAR(16)  NOT NULL       -- 'in_progress' | 'completed'
    owner        VARCHAR(64)  NULL           -- the claim's owner token, NULL for marks
    fingerprint  VARCHAR(64)  NULL
    result       TEXT         NULL           -- LONGTEXT on MariaDB/MySQL
    created_at   DOUBLE       NOT NULL       -- seconds since the epoch, database clock
    lease_until  DOUBLE       NOT NULL       -- kept by a completion; 0 for lazy marks
    expires_at   DOUBLE       NOT NULL       -- indexed: purge deletes by it
    worker       VARCHAR(255) NULL           -- the claim owner's worker identity

and, next to it, the worker processes' liveness records (``<table>_live``)::

    worker       VARCHAR(255) PRIMARY KEY
    seen_at      DOUBLE       NOT NULL       -- last liveness write, database clock
    alive_until  DOUBLE       NOT NULL       -- seen_at + the liveness window

A keys table created before the ``worker`` column existed gains it on first use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

try:
    import sqlalchemy as sa
    from sqlalchemy import event
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.dialects import mysql as mysql_dialect
    from sqlalchemy.dialects import postgresql as pg_dialect
    from sqlalchemy.dialects import sqlite as sqlite_dialect
    from sqlalchemy.engine import URL, Connection, Engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import StaticPool
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "the SQL store needs SQLAlchemy 2 and a driver: pip install 'taskonce[sql]'"
    ) from _exc

from ..errors import ConfigError, InvalidInput, LeaseLost, StoreUnavailable
from .base import (
    LIVENESS_RETENTION,
    MAX_KEY_LENGTH,
    MAX_WORKER_LENGTH,
    Claim,
    ClaimOutcome,
    Record,
    Seen,
    SendLease,
    Status,
    TransactionalStore,
)
from .options import check_names, own_value

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TABLE", "SQLStore", "init_db"]

#: The table name used when none is given.
DEFAULT_TABLE = "taskonce_keys"

#: Owner tokens and fingerprints longer than this do not fit their columns.
MAX_TOKEN_LENGTH = 64

#: How many times a claim or mark retries after losing a race to another writer.
_RACE_ATTEMPTS = 8

#: Seconds the driver waits for a TCP connection / SQLite waits for a lock.
_CONNECT_TIMEOUT = 5
_SQLITE_BUSY_TIMEOUT = 30.0
_MYSQL_IO_TIMEOUT = 60

_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
_TABLE_RE = re.compile(rf"^(?:(?P<schema>{_IDENT})\.)?(?P<name>{_IDENT})$")

#: The database's clock as seconds since the epoch (DOUBLE), per dialect family.
#: MariaDB/MySQL: ``UTC_TIMESTAMP(6)`` measured from the epoch is independent of the session
#: time zone (``UNIX_TIMESTAMP(NOW(6))`` is off by an hour in a DST fall-back hour).
_NOW_SQL = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1e6)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}

_FAMILIES = {
    "postgresql": "postgresql",
    "postgres": "postgresql",
    "mysql": "mysql",
    "mariadb": "mysql",
    "sqlite": "sqlite",
}

#: The driver used when a URL names none (``postgresql://`` → psycopg 3, ``mysql://`` → PyMySQL).
_DEFAULT_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}

#: The oldest SQLite with ``INSERT … ON CONFLICT DO NOTHING``; older ones use ``OR IGNORE``.
_SQLITE_UPSERT = (3, 24, 0)

_IN_PROGRESS = Status.IN_PROGRESS.value
_COMPLETED = Status.COMPLETED.value
#: the status column of a completed record whose deferred sends are not all published
_SENDING = "sending"


def _parse_url(url: str) -> URL:
    """``url`` as an SQLAlchemy URL, with the default driver filled in where none is named."""
    if not isinstance(url, str):
        raise ConfigError(f"store URL must be a string, got {type(url).__name__}")
    try:
        parsed = sa.engine.make_url(url)
    except sa_exc.ArgumentError as exc:
        raise ConfigError(f"store URL is not an SQLAlchemy URL: {exc}") from None
    backend = parsed.get_backend_name()
    if backend not in _FAMILIES:
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


def _parse_table(table: str) -> tuple[str | None, str]:
    """``(schema, name)`` of a table name; :class:`ConfigError` unless it is a plain identifier
    (letters, digits, underscore, at most 63 characters) with at most one schema prefix."""
    match = _TABLE_RE.match(table) if isinstance(table, str) else None
    if match is None:
        raise ConfigError(
            f"table {table!r} is not a valid table name: use letters, digits and underscores "
            "(at most 63, not starting with a digit), optionally 'schema.table'"
        )
    return match.group("schema"), match.group("name")


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


def _take_table(url: URL, family: str) -> tuple[URL, str | None]:
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


def _index_name(name: str) -> str:
    candidate = f"ix_{name}_expires_at"
    if len(candidate) <= 63:
        return candidate
    digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"ix_{name[:40]}_{digest}_expires_at"


def _live_name(name: str) -> str:
    """The liveness table's name next to keys table ``name`` (at most 63 characters)."""
    candidate = f"{name}_live"
    if len(candidate) <= 63:
        return candidate
    digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{name[:45]}_{digest}_live"


def _make_live_table(
    metadata: sa.MetaData, name: str, schema: str | None, **dialect_kw: Any
) -> sa.Table:
    """The liveness table of keys table ``name``."""
    return sa.Table(
        _live_name(name),
        metadata,
        sa.Column("worker", sa.String(MAX_WORKER_LENGTH), primary_key=True),
        sa.Column("seen_at", sa.Double(), nullable=False),
        sa.Column("alive_until", sa.Double(), nullable=False),
        schema=schema,
        **dialect_kw,
    )


def _make_table(
    metadata: sa.MetaData, name: str, schema: str | None, **dialect_kw: Any
) -> sa.Table:
    """The keys table; ``dialect_kw`` are DDL-only options (charset, collation)."""
    result_type = sa.Text().with_variant(mysql_dialect.LONGTEXT(), "mysql", "mariadb")
    table = sa.Table(
        name,
        metadata,
        sa.Column("key", sa.String(MAX_KEY_LENGTH), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(MAX_TOKEN_LENGTH), nullable=True),
        sa.Column("fingerprint", sa.String(MAX_TOKEN_LENGTH), nullable=True),
        sa.Column("result", result_type, nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("lease_until", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("worker", sa.String(MAX_WORKER_LENGTH), nullable=True),
        # The hand-off: sends recorded with the outcome (status "sending" until published).
        sa.Column("sends", result_type, nullable=True),  # JSON array of the sends' JSON texts
        sa.Column("sends_token", sa.String(MAX_TOKEN_LENGTH), nullable=True),
        sa.Column("sends_at", sa.Double(), nullable=True),
        sa.Column("sends_lease", sa.Double(), nullable=True),
        schema=schema,
        **dialect_kw,
    )
    sa.Index(_index_name(name), table.c.expires_at)
    sa.Index(_index_name(name).replace("expires_at", "sends_at"), table.c.sends_at)
    return table


def _mysql_collation(connection: Connection) -> str:
    """A binary collation that compares keys exactly (no case folding, no space padding)."""
    dialect = connection.dialect
    version = tuple(dialect.server_version_info or ())
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
    return "utf8mb4_0900_bin" if version >= (8, 0) else "utf8mb4_bin"


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"key {key!r} must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInput(
            f"key {key[:40]!r}… is {len(key)} characters; the limit is {MAX_KEY_LENGTH}"
        )


def _check_token(name: str, value: str | None) -> None:
    if value is not None and len(value) > MAX_TOKEN_LENGTH:
        raise InvalidInput(
            f"{name} {value[:20]!r}… is {len(value)} characters; the limit is {MAX_TOKEN_LENGTH}"
        )


def _rowcount(result: Any) -> int:
    count: int = result.rowcount
    return count


class _Statements:
    """The statements of one table on one dialect family, built once and cached by
    SQLAlchemy's compiled cache (every value is a bound parameter)."""

    def __init__(
        self, table: sa.Table, live_table: sa.Table, family: str, sqlite_upsert: bool
    ) -> None:
        c = table.c
        self.family = family
        now: sa.ColumnElement[float] = sa.literal_column(_NOW_SQL[family], type_=sa.Double())
        self.now = now
        dbl: sa.Double[float] = sa.Double()
        k = sa.bindparam("p_key", type_=sa.String())
        owner = sa.bindparam("p_owner", type_=sa.String())
        fp = sa.bindparam("p_fingerprint", type_=sa.String())
        result = sa.bindparam("p_result", type_=sa.Text())
        lease = sa.bindparam("p_lease", type_=dbl)
        keep = sa.bindparam("p_keep", type_=dbl)
        seen_owner = sa.bindparam("p_seen_owner", type_=sa.String())
        seen_status = sa.bindparam("p_seen_status", type_=sa.String())
        worker = sa.bindparam("p_worker", type_=sa.String())
        in_progress = sa.literal(_IN_PROGRESS, sa.String())
        completed = sa.literal(_COMPLETED, sa.String())
        sending = sa.literal(_SENDING, sa.String())
        zero = sa.literal(0.0, dbl)
        sends = sa.bindparam("p_sends", type_=sa.Text())
        token = sa.bindparam("p_token", type_=sa.String())
        age = sa.bindparam("p_age", type_=dbl)
        send_lease = sa.bindparam("p_send_lease", type_=dbl)
        with_sends = {
            "status": sending,
            "sends": sends,
            "sends_token": token,
            "sends_at": now,
            "sends_lease": now + send_lease,
        }

        self.lease_remaining = sa.case(
            (sa.and_(c.status == in_progress, c.lease_until > now), c.lease_until - now),
            else_=zero,
        )

        def insert_if_absent_into(into: sa.Table, values: Mapping[str, Any]) -> sa.Insert:
            # The cursor of an INSERT without RETURNING is closed at once; its rowcount (1 =
            # inserted, 0 = a record was in the way) must be kept explicitly.
            return _insert_if_absent(into, values).execution_options(preserve_rowcount=True)

        def insert_if_absent(values: Mapping[str, Any]) -> sa.Insert:
            return insert_if_absent_into(table, values)

        def _insert_if_absent(into: sa.Table, values: Mapping[str, Any]) -> sa.Insert:
            primary = list(into.primary_key.columns)
            if family == "postgresql":
                return (
                    pg_dialect.insert(into)
                    .values(values)
                    .on_conflict_do_nothing(index_elements=primary)
                )
            if family == "sqlite" and sqlite_upsert:
                return (
                    sqlite_dialect.insert(into)
                    .values(values)
                    .on_conflict_do_nothing(index_elements=primary)
                )
            if family == "sqlite":
                return sa.insert(into).values(values).prefix_with("OR IGNORE")
            return sa.insert(into).values(values).prefix_with("IGNORE")

        # -- claim --------------------------------------------------------------------------
        self.claim_insert = insert_if_absent(
            {
                "key": k,
                "status": in_progress,
                "owner": owner,
                "fingerprint": fp,
                "result": sa.null(),
                "created_at": now,
                "lease_until": now + lease,
                "expires_at": now + lease + keep,
                "worker": worker,
            }
        )
        self.read = sa.select(
            c.key,
            c.status,
            c.owner,
            c.fingerprint,
            c.result,
            c.created_at,
            c.expires_at,
            c.lease_until,
            self.lease_remaining.label("lease_remaining"),
            now.label("db_now"),
            c.worker,
        ).where(c.key == k)
        # An expired record (mark or claim) counts as absent: replace it wholesale, provided
        # it is still the record that was read and still expired.
        self.claim_replace_expired = (
            sa.update(table)
            .where(
                c.key == k,
                c.status == seen_status,
                c.owner.is_not_distinct_from(seen_owner),
                c.expires_at <= now,
            )
            .values(
                status=in_progress,
                owner=owner,
                fingerprint=fp,
                result=sa.null(),
                created_at=now,
                lease_until=now + lease,
                expires_at=now + lease + keep,
                worker=worker,
            )
        )
        # A live record whose claim's lease ran out: take it over (created_at is kept).
        self.claim_take_over = (
            sa.update(table)
            .where(
                c.key == k,
                c.status == in_progress,
                c.owner == seen_owner,
                c.lease_until <= now,
                c.expires_at > now,
            )
            .values(
                owner=owner,
                fingerprint=fp,
                result=sa.null(),
                lease_until=now + lease,
                expires_at=now + lease + keep,
                worker=worker,
            )
        )
        # A live claim whose owner is known dead: hand it on, fenced by the owner read.
        self.take_over = (
            sa.update(table)
            .where(
                c.key == k,
                c.status == in_progress,
                c.owner == seen_owner,
                c.expires_at > now,
            )
            .values(
                owner=owner,
                worker=worker,
                lease_until=now + lease,
                expires_at=now + lease + keep,
            )
        )

        # -- liveness -----------------------------------------------------------------------
        lc = live_table.c
        ttl = sa.bindparam("p_ttl", type_=dbl)
        self.beat_update = (
            sa.update(live_table)
            .where(lc.worker == worker)
            .values(seen_at=now, alive_until=now + ttl)
        )
        self.beat_insert = insert_if_absent_into(
            live_table, {"worker": worker, "seen_at": now, "alive_until": now + ttl}
        )
        self.seen = sa.select(
            (now - lc.seen_at).label("ago"), (lc.alive_until - now).label("remaining")
        ).where(lc.worker == worker)
        retention = sa.literal(LIVENESS_RETENTION, dbl)
        self.purge_live = sa.delete(live_table).where(lc.alive_until + retention <= now)

        # -- fenced writes ------------------------------------------------------------------
        fence = (
            c.key == k,
            c.owner == owner,
            c.status == in_progress,
            c.expires_at > now,
        )
        self.complete = (
            sa.update(table)
            .where(*fence)
            .values(
                # lease_until stays: it tells an eager completion from a lazy mark (0)
                status=completed,
                owner=sa.null(),
                worker=sa.null(),
                result=result,
                expires_at=now + keep,
            )
        )
        self.complete_sends = self.complete.values(with_sends)
        self.release = sa.delete(table).where(*fence)
        self.release_any = sa.delete(table).where(c.key == k)
        # MariaDB/MySQL evaluate SET assignments left to right, seeing earlier assignments:
        # expires_at must be computed from the old lease_until, so it comes first.
        extension = now + lease - c.lease_until
        self.renew = (
            sa.update(table)
            .where(*fence)
            .ordered_values(
                (c.expires_at, c.expires_at + sa.case((extension > 0, extension), else_=zero)),
                (c.lease_until, now + lease),
            )
        )

        # -- marks --------------------------------------------------------------------------
        self.mark_insert = insert_if_absent(
            {
                "key": k,
                "status": completed,
                "owner": sa.null(),
                "fingerprint": fp,
                "result": result,
                "created_at": now,
                "lease_until": zero,
                "expires_at": now + keep,
            }
        )
        self.mark_replace_expired = (
            sa.update(table)
            .where(c.key == k, c.expires_at <= now)
            .values(
                status=completed,
                owner=sa.null(),
                fingerprint=fp,
                result=result,
                created_at=now,
                lease_until=zero,
                expires_at=now + keep,
                worker=sa.null(),
            )
        )
        self.mark_insert_sends = insert_if_absent(
            {
                "key": k,
                "status": sending,
                "owner": sa.null(),
                "fingerprint": fp,
                "result": result,
                "created_at": now,
                "lease_until": zero,
                "expires_at": now + keep,
                "sends": sends,
                "sends_token": token,
                "sends_at": now,
                "sends_lease": now + send_lease,
            }
        )
        self.mark_replace_expired_sends = self.mark_replace_expired.values(with_sends)

        # -- the hand-off -------------------------------------------------------------------
        pending = sa.and_(c.key == k, c.status == sending, c.sends_at <= now - age)
        self.take_sends = (
            sa.update(table)
            .where(
                pending,
                sa.or_(c.sends_lease.is_(None), c.sends_lease <= now, c.sends_token == token),
            )
            .values(sends_token=token, sends_lease=now + lease)
        )
        self.read_sends = sa.select(
            c.sends, c.sends_token, sa.func.coalesce(c.sends_lease, zero) - now
        ).where(pending)
        self.dispatched = (
            sa.update(table)
            .where(c.key == k, c.status == sending, c.sends_token == token)
            .values(
                status=completed,
                sends=sa.null(),
                sends_token=sa.null(),
                sends_at=sa.null(),
                sends_lease=sa.null(),
            )
        )
        self.pending = (
            sa.select(c.key)
            .where(c.status == sending, c.sends_at <= now - age)
            .order_by(c.sends_at)
            .limit(sa.bindparam("p_limit", type_=sa.Integer()))
        )
        live = sa.case((c.expires_at > now, 1), else_=0).label("live")
        self.liveness = sa.select(live).where(c.key == k)
        # Inside a REPEATABLE READ transaction (InnoDB) a plain SELECT reads an old snapshot;
        # a locking read sees the latest committed row.
        self.liveness_locking = (
            self.liveness.with_for_update(read=True) if family == "mysql" else self.liveness
        )

        # -- reads --------------------------------------------------------------------------
        record_columns = (
            c.key,
            c.status,
            c.owner,
            c.fingerprint,
            c.result,
            c.created_at,
            c.expires_at,
            self.lease_remaining.label("lease_remaining"),
            c.worker,
            c.lease_until,
            c.sends,
        )
        self.get = sa.select(*record_columns).where(c.key == k, c.expires_at > now)
        # p_pattern: a LIKE pattern with "/" as its escape character (see SQLStore.records)
        pattern = sa.bindparam("p_pattern", type_=sa.String())
        self.records = sa.select(*record_columns).where(
            c.key.like(pattern, escape="/"), c.expires_at > now
        )

        def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
            return sa.func.coalesce(sa.func.sum(sa.case((condition, 1), else_=0)), 0)

        alive = c.expires_at > now
        self.stats = sa.select(
            count(alive).label("keys"),
            count(sa.and_(alive, c.status == in_progress)).label("in_progress"),
            count(sa.and_(alive, c.status != in_progress)).label("completed"),
            count(c.expires_at <= now).label("expired"),
            count(c.status == sending).label("sends_pending"),
        )
        self._table = table

    def purge(self, batch: int) -> sa.Executable:
        """Delete at most ``batch`` expired rows (the expiry is re-checked on the deleted rows,
        so a row re-claimed meanwhile survives)."""
        c = self._table.c
        # A record whose sends are pending is kept until the relay publishes them.
        expired = sa.and_(c.expires_at <= self.now, c.status != _SENDING)
        if self.family == "mysql":
            # MariaDB/MySQL refuse LIMIT inside IN (subquery) but allow DELETE … LIMIT, which
            # SQLAlchemy spells differently across 2.0.x/2.1; the identifiers are validated
            # and quoted, the limit is a bound parameter.
            preparer = mysql_dialect.dialect().identifier_preparer
            table_sql = preparer.format_table(self._table)  # validated by _TABLE_RE, quoted
            return (
                sa.text(
                    f"DELETE FROM {table_sql} "  # noqa: S608 - no value is interpolated
                    f"WHERE {preparer.quote('expires_at')} <= {_NOW_SQL['mysql']} "
                    f"AND {preparer.quote('status')} <> '{_SENDING}' LIMIT :p_batch"
                )
                .bindparams(sa.bindparam("p_batch", value=batch, type_=sa.Integer()))
                .execution_options(preserve_rowcount=True)
            )
        chosen = sa.select(c.key).where(expired).limit(batch)
        if self.family == "postgresql":
            chosen = chosen.with_for_update(skip_locked=True)
        return sa.delete(self._table).where(c.key.in_(chosen.scalar_subquery()), expired)


def _after_fork_in_child(ref: weakref.ReferenceType[SQLStore]) -> None:
    store = ref()
    if store is not None:
        store._after_fork()


#: Connections inherited by a forked child are kept referenced here so that garbage
#: collection never closes them in the child: closing an inherited SQLite handle can disturb
#: the parent's locks. (psycopg and PyMySQL close an inherited socket without telling the
#: server, so theirs may go.)
_INHERITED: list[Any] = []


class SQLStore(TransactionalStore):
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

    schemes = ("sqlite", "postgresql", "mysql", "mariadb")

    def __init__(
        self,
        url: str,
        *,
        table: str | None = None,
        create: bool = True,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        parsed = _parse_url(url)
        self._family = _FAMILIES[parsed.get_backend_name()]
        self._url, url_table = _take_table(parsed, self._family)
        table = own_value("SQLStore", "table", url_table, table, DEFAULT_TABLE)
        self._schema, self._table_name = _parse_table(table)
        self._table_label = table
        self._redacted = self._url.render_as_string(hide_password=True)
        self._password = self._url.password if isinstance(self._url.password, str) else None
        self._options = dict(engine_options or {})
        self._memory = self._family == "sqlite" and self._url.database in (None, "", ":memory:")
        self._lock = threading.Lock()
        self._ready = not create
        self._metadata = sa.MetaData()
        self._table = _make_table(self._metadata, self._table_name, self._schema)
        self._live_table = _make_live_table(self._metadata, self._table_name, self._schema)
        upsert = sqlite3.sqlite_version_info >= _SQLITE_UPSERT
        if self._family == "sqlite" and not upsert:
            logger.info(
                "SQLite %s predates ON CONFLICT; using INSERT OR IGNORE", sqlite3.sqlite_version
            )
        self._sql = _Statements(self._table, self._live_table, self._family, upsert)
        self._engine = self._make_engine(autocommit=True)
        self._tx_engine: Engine | None = None
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork_in_child(ref))

    # -- engines -----------------------------------------------------------------------------

    def _make_engine(self, *, autocommit: bool) -> Engine:
        options = dict(self._options)
        user_connect_args = dict(options.pop("connect_args", None) or {})
        user_isolation = options.pop("isolation_level", None)
        connect_args: dict[str, Any] = {}
        query = self._url.query
        if self._family == "postgresql" and "connect_timeout" not in query:
            connect_args["connect_timeout"] = _CONNECT_TIMEOUT
        elif self._family == "mysql":
            if "connect_timeout" not in query:
                connect_args["connect_timeout"] = _CONNECT_TIMEOUT
            if autocommit and self._url.get_driver_name() == "pymysql":
                # PyMySQL's connect_timeout covers the TCP connect only; the handshake and every
                # query wait up to read_timeout. The store's statements are short (row-lock waits
                # end at innodb_lock_wait_timeout, 50 s by default), so a silent server is
                # reported instead of hanging the worker.
                for name in ("read_timeout", "write_timeout"):
                    if name not in query:
                        connect_args[name] = _MYSQL_IO_TIMEOUT
        elif self._family == "sqlite":
            if "timeout" not in query:
                connect_args["timeout"] = _SQLITE_BUSY_TIMEOUT
            connect_args["check_same_thread"] = False
        connect_args.update(user_connect_args)
        if self._family != "sqlite":
            options.setdefault("pool_recycle", 1800)
        if self._memory:
            options.setdefault("poolclass", StaticPool)
        if autocommit:
            options["isolation_level"] = "AUTOCOMMIT"
            # The pool's reset-on-return ROLLBACK is a round trip on PyMySQL even in autocommit
            # mode, doubling every MariaDB store operation (bench/store_ops.py counts them).
            options.setdefault("skip_autocommit_rollback", True)
        elif user_isolation is not None:
            options["isolation_level"] = user_isolation
        try:
            engine = sa.create_engine(self._url, connect_args=connect_args, **options)
        except (
            sa_exc.ArgumentError,
            sa_exc.NoSuchModuleError,
            ImportError,
            TypeError,
            ValueError,  # a driver option's value of the wrong type (read_timeout=soon)
        ) as exc:
            raise ConfigError(
                f"store URL {self._redacted!r}: cannot build an engine: {exc}"
            ) from None
        if self._family == "sqlite":
            self._configure_sqlite(engine, transactional=not autocommit)
        return engine

    def _configure_sqlite(self, engine: Engine, *, transactional: bool) -> None:
        memory = self._memory

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
            if engine is None:
                continue
            if self._family == "sqlite":
                _INHERITED.extend(_pooled_dbapi_connections(engine))
            engine.dispose(close=False)

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
        with self._errors(operation), self._engine.connect() as connection:
            for make in (_make_table, _make_live_table):
                created = self._create_table(connection, make) or created
            self._add_missing_columns(connection)
        self._ready = True
        return created

    def _create_table(self, connection: Connection, make: Any) -> bool:
        """Create the table ``make`` builds unless it exists; True when this call created it."""
        for attempt in range(4):
            metadata = sa.MetaData()
            dialect_kw: dict[str, Any] = {}
            if self._family == "mysql":
                collation = _mysql_collation(connection)
                prefix = self._url.get_backend_name()
                dialect_kw = {
                    f"{prefix}_engine": "InnoDB",
                    f"{prefix}_charset": "utf8mb4",
                    f"{prefix}_collate": collation,
                }
            table = make(metadata, self._table_name, self._schema, **dialect_kw)
            if sa.inspect(connection).has_table(table.name, schema=self._schema):
                return False
            try:
                metadata.create_all(connection, tables=[table], checkfirst=True)
            except sa_exc.DBAPIError as exc:
                # Another process may have created it between the check and the CREATE.
                if exc.connection_invalidated or attempt == 3:
                    raise
                logger.debug("creating %s raced (%s); checking again", table.name, exc)
                time.sleep(0.05 * (attempt + 1))
                continue
            logger.info("created table %s in %s", table.name, self._redacted)
            return True
        return False

    def _add_missing_columns(self, connection: Connection) -> None:
        """A keys table created by an earlier version gets its newer columns (the owner's
        worker identity, the hand-off's) and their indexes added."""
        inspector = sa.inspect(connection)
        present = {c["name"] for c in inspector.get_columns(self._table_name, schema=self._schema)}
        missing = [c for c in self._table.columns if c.name not in present]
        if not missing:
            return
        preparer = connection.dialect.identifier_preparer
        table_sql = preparer.format_table(self._table)
        for column in missing:
            if not column.nullable:  # only the newer, nullable columns can be added in place
                raise ConfigError(
                    f"table {self._table_label} has no column {column.name!r}; it was not made "
                    "by taskonce"
                )
            ddl = column.type.compile(dialect=connection.dialect)
            try:
                connection.exec_driver_sql(
                    f"ALTER TABLE {table_sql} ADD COLUMN {preparer.quote(column.name)} {ddl}"
                )
            except sa_exc.DBAPIError:
                # another process added it meanwhile (it is there now) or the ALTER failed
                fresh = sa.inspect(connection).get_columns(self._table_name, schema=self._schema)
                if column.name not in {c["name"] for c in fresh}:
                    raise
        for index in self._table.indexes:
            if any(c in missing for c in index.columns):
                index.create(connection, checkfirst=True)
        logger.info(
            "added the column(s) %s to %s",
            ", ".join(c.name for c in missing),
            self._table_label,
        )

    # -- Store -------------------------------------------------------------------------------

    def claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None = None,
    ) -> Claim:
        _check_key(key)
        _check_token("owner", owner)
        _check_token("fingerprint", fingerprint)
        _check_worker(worker)
        params = {
            "p_key": key,
            "p_owner": owner,
            "p_fingerprint": fingerprint,
            "p_lease": float(lease),
            "p_keep": float(keep_for),
            "p_worker": worker,
        }
        sql = self._sql
        with self._connect("claim") as connection:
            for _ in range(_RACE_ATTEMPTS):
                if _rowcount(connection.execute(sql.claim_insert, params)) == 1:
                    return Claim(ClaimOutcome.CLAIMED)
                row = connection.execute(sql.read, {"p_key": key}).one_or_none()
                if row is None:  # released or purged in between: insert again
                    continue
                (_, status, seen_owner, seen_fp, _, _, expires_at, lease_until, _, now) = row[:10]
                if float(expires_at) <= float(now):
                    seen = {**params, "p_seen_owner": seen_owner, "p_seen_status": status}
                    if _rowcount(connection.execute(sql.claim_replace_expired, seen)) == 1:
                        return Claim(ClaimOutcome.CLAIMED)
                    continue
                expired_claim = status == _IN_PROGRESS and float(lease_until) <= float(now)
                same_payload = seen_fp is None or fingerprint is None or seen_fp == fingerprint
                if not (expired_claim and same_payload):
                    return Claim(ClaimOutcome.EXISTS, _record(row))
                seen = {**params, "p_seen_owner": seen_owner}
                if _rowcount(connection.execute(sql.claim_take_over, seen)) == 1:
                    logger.debug("key %s: took over the expired claim of %s", key, seen_owner)
                    return Claim(ClaimOutcome.TAKEN_OVER)
                logger.debug("key %s: lost a take-over race; reading again", key)
        raise StoreUnavailable(
            f"SQL store {self._redacted}: claim of {key!r} kept losing races with other "
            f"writers ({_RACE_ATTEMPTS} attempts)"
        )

    def take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> bool:
        _check_token("owner", owner)
        _check_worker(worker)
        params = {
            "p_key": key,
            "p_seen_owner": old_owner,
            "p_owner": owner,
            "p_lease": float(lease),
            "p_keep": float(keep_for),
            "p_worker": worker,
        }
        with self._connect("take_over") as connection:
            return _rowcount(connection.execute(self._sql.take_over, params)) == 1

    def beat(self, worker: str, ttl: float) -> None:
        """One UPDATE; the first beat of a worker also INSERTs its row."""
        _check_worker(worker)
        params = {"p_worker": worker, "p_ttl": float(ttl)}
        sql = self._sql
        with self._connect("beat") as connection:
            for _ in range(_RACE_ATTEMPTS):
                if _rowcount(connection.execute(sql.beat_update, params)) == 1:
                    return
                if _rowcount(connection.execute(sql.beat_insert, params)) == 1:
                    return
        raise StoreUnavailable(
            f"SQL store {self._redacted}: liveness write of {worker!r} kept losing races"
        )

    def seen(self, worker: str) -> Seen | None:
        with self._connect("seen") as connection:
            row = connection.execute(self._sql.seen, {"p_worker": worker}).one_or_none()
        if row is None:
            return None
        ago, remaining = float(row.ago), float(row.remaining)
        if remaining + LIVENESS_RETENTION <= 0:
            return None
        return Seen(ago=max(0.0, ago), remaining=max(0.0, remaining))

    def complete(
        self,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str] = (),
        dispatch_lease: float = 0.0,
    ) -> None:
        with self._connect("complete") as connection:
            self._complete(connection, key, owner, keep_for, result, sends, dispatch_lease)

    def _complete(
        self,
        connection: Connection,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str],
        dispatch_lease: float,
    ) -> None:
        params = {"p_key": key, "p_owner": owner, "p_keep": float(keep_for), "p_result": result}
        statement = self._sql.complete
        if sends:
            statement = self._sql.complete_sends
            params.update(
                p_sends=json.dumps(list(sends)), p_token=owner, p_send_lease=float(dispatch_lease)
            )
        if _rowcount(connection.execute(statement, params)) != 1:
            raise LeaseLost(key, "complete")

    def release(self, key: str, owner: str | None) -> None:
        with self._connect("release") as connection:
            if owner is None:
                connection.execute(self._sql.release_any, {"p_key": key})
                return
            count = _rowcount(
                connection.execute(self._sql.release, {"p_key": key, "p_owner": owner})
            )
        if count != 1:
            raise LeaseLost(key, "release")

    def renew(self, key: str, owner: str, lease: float) -> None:
        params = {"p_key": key, "p_owner": owner, "p_lease": float(lease)}
        with self._connect("renew") as connection:
            count = _rowcount(connection.execute(self._sql.renew, params))
        if count != 1:
            raise LeaseLost(key, "renew")

    def mark(
        self,
        key: str,
        keep_for: float,
        fingerprint: str | None,
        result: str | None,
        sends: Sequence[str] = (),
        token: str = "",
        dispatch_lease: float = 0.0,
    ) -> bool:
        _check_key(key)
        _check_token("fingerprint", fingerprint)
        with self._connect("mark") as connection:
            return self._mark(
                connection,
                key,
                keep_for,
                fingerprint,
                result,
                sends,
                token,
                dispatch_lease,
                locking=False,
            )

    def _mark(
        self,
        connection: Connection,
        key: str,
        keep_for: float,
        fingerprint: str | None,
        result: str | None,
        sends: Sequence[str],
        token: str,
        dispatch_lease: float,
        *,
        locking: bool,
    ) -> bool:
        sql = self._sql
        params = {
            "p_key": key,
            "p_fingerprint": fingerprint,
            "p_result": result,
            "p_keep": float(keep_for),
        }
        insert, replace = sql.mark_insert, sql.mark_replace_expired
        if sends:
            _check_token("token", token)
            insert, replace = sql.mark_insert_sends, sql.mark_replace_expired_sends
            params.update(
                p_sends=json.dumps(list(sends)), p_token=token, p_send_lease=float(dispatch_lease)
            )
        liveness = sql.liveness_locking if locking else sql.liveness
        for _ in range(_RACE_ATTEMPTS):
            if _rowcount(connection.execute(insert, params)) == 1:
                return True
            if _rowcount(connection.execute(replace, params)) == 1:
                return True
            live = connection.execute(liveness, {"p_key": key}).scalar_one_or_none()
            if live is not None and int(live) == 1:
                return False
            logger.debug("key %s: the record in the way of a mark changed; trying again", key)
        raise StoreUnavailable(
            f"SQL store {self._redacted}: mark of {key!r} kept losing races with other writers "
            f"({_RACE_ATTEMPTS} attempts)"
        )

    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        _check_token("token", token)
        params = {"p_key": key, "p_token": token, "p_lease": float(lease), "p_age": older_than}
        with self._connect("take_sends") as connection:
            taken = _rowcount(connection.execute(self._sql.take_sends, params)) == 1
            row = connection.execute(self._sql.read_sends, params).one_or_none()
        if row is None:
            return SendLease()  # none pending (published meanwhile), or recorded too recently
        sends, holder, remaining = row
        if taken and holder == token and sends:
            return SendLease(tuple(json.loads(sends)))
        return SendLease(retry_after=max(float(remaining or 0.0), 0.0))

    def dispatched(self, key: str, token: str) -> bool:
        with self._connect("dispatched") as connection:
            params = {"p_key": key, "p_token": token}
            return _rowcount(connection.execute(self._sql.dispatched, params)) == 1

    def pending_sends(self, older_than: float = 0.0, limit: int = 100) -> list[str]:
        with self._connect("pending_sends") as connection:
            rows = connection.execute(self._sql.pending, {"p_age": older_than, "p_limit": limit})
            return [row[0] for row in rows]

    def get(self, key: str) -> Record | None:
        with self._connect("get") as connection:
            row = connection.execute(self._sql.get, {"p_key": key}).one_or_none()
        return None if row is None else _record(row)

    def purge(self, batch: int = 1000) -> int:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigError(f"batch must be a positive integer, got {batch!r}")
        statement = self._sql.purge(batch)
        deleted = 0
        with self._connect("purge") as connection:
            while True:
                count = _rowcount(connection.execute(statement))
                deleted += count
                if count < batch:
                    break
            connection.execute(self._sql.purge_live)
        if deleted:
            logger.info("purged %d expired records from %s", deleted, self._table_label)
        return deleted

    def stats(self) -> Mapping[str, int]:
        with self._connect("stats") as connection:
            row = connection.execute(self._sql.stats).one()
        keys, in_progress, completed, expired, sends_pending = (int(v or 0) for v in row)
        return {
            "keys": keys,
            "in_progress": in_progress,
            "completed": completed,
            "expired": expired,
            "sends_pending": sends_pending,
        }

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        """The live records whose key starts with ``key_prefix``, read in one query."""
        escaped = key_prefix.replace("/", "//").replace("%", "/%").replace("_", "/_")
        with self._connect("records") as connection:
            result = connection.execute(self._sql.records, {"p_pattern": f"{escaped}%"})
            rows = [_record(row) for row in result]
        return iter(rows)

    def keys_ending(self, suffix: str, limit: int = 5) -> list[str]:
        """At most ``limit`` live keys ending with ``suffix``: one ``LIKE '%suffix'`` query
        (a scan of the table, for the CLI, not for hot paths)."""
        escaped = suffix.replace("/", "//").replace("%", "/%").replace("_", "/_")
        statement = self._sql.records.limit(limit)
        with self._connect("keys_ending") as connection:
            result = connection.execute(statement, {"p_pattern": f"%{escaped}"})
            return [str(row.key) for row in result]

    def close(self) -> None:
        self._engine.dispose()
        if self._tx_engine is not None:
            self._tx_engine.dispose()

    @property
    def engine(self) -> Any:
        """The store's SQLAlchemy engine (AUTOCOMMIT)."""
        return self._engine

    def describe(self) -> str:
        return f"SQLStore {self._redacted} (table {self._table_label})"

    # -- transactional mode ------------------------------------------------------------------

    def open_session(self) -> Session:
        """A :class:`~sqlalchemy.orm.Session` on the transactional engine, already begun.

        The handler writes through it; :meth:`complete_in` or :meth:`mark_in` add the mark to
        the same transaction, and the caller commits or rolls back. On PostgreSQL and
        MariaDB/MySQL the connection is taken at once (so an unreachable database shows up
        here as :class:`StoreUnavailable`); on SQLite it is taken, with ``BEGIN IMMEDIATE``,
        on the session's first statement so other writers are not held up meanwhile.
        """
        if self._memory:
            raise ConfigError(
                f"transactional mode needs a database file or server; {self._redacted} is an "
                "in-memory SQLite database private to one connection"
            )
        self._ensure_ready("open_session")
        engine = self._transactional_engine()
        session = Session(bind=engine)
        try:
            with self._errors("open_session"):
                session.begin()
                if self._family != "sqlite":
                    session.connection()
        except BaseException:
            session.close()
            raise
        return session

    def complete_in(
        self,
        session: Session,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str] = (),
        dispatch_lease: float = 0.0,
    ) -> None:
        """:meth:`complete`, written through ``session``'s transaction (not committed here),
        with ``sends``: the handler's rows, the mark and its sends commit together.

        :class:`LeaseLost` when the claim is no longer ``owner``'s.
        """
        with self._errors("complete_in"):
            self._complete(
                session.connection(), key, owner, keep_for, result, sends, dispatch_lease
            )

    def mark_in(
        self,
        session: Session,
        key: str,
        keep_for: float,
        fingerprint: str | None,
        result: str | None,
        sends: Sequence[str] = (),
        token: str = "",
        dispatch_lease: float = 0.0,
    ) -> bool:
        """:meth:`mark`, written through ``session``'s transaction (not committed here), with
        ``sends``.

        A concurrent transaction's uncommitted mark of the same key makes this wait for it
        (PostgreSQL, InnoDB; SQLite serialises write transactions anyway): when it commits this
        returns False — a concurrent duplicate, so the caller rolls back — and when it rolls
        back this writes the mark and returns True.
        """
        _check_key(key)
        _check_token("fingerprint", fingerprint)
        with self._errors("mark_in"):
            return self._mark(
                session.connection(),
                key,
                keep_for,
                fingerprint,
                result,
                sends,
                token,
                dispatch_lease,
                locking=True,
            )

    # -- the producer outbox -----------------------------------------------------------------

    def check_shared(self, bind: Engine | Connection, in_transaction: bool = False) -> None:
        """:class:`ConfigError` unless ``bind`` (an application's engine or connection) reaches
        the database this store's table lives in: the outbox's rows are written through the
        application's transaction, and the relay reads them through the store. Creates the
        store's tables if needed, which on SQLite cannot wait for a transaction that is already
        open (``in_transaction``) and may hold the database's only write lock."""
        url = bind.engine.url
        family = _FAMILIES.get(url.get_backend_name())
        theirs: tuple[Any, ...] = (family, url.host or None, url.port, url.database or None)
        ours: tuple[Any, ...] = (
            self._family,
            self._url.host or None,
            self._url.port,
            self._url.database or None,
        )
        if self._family == "sqlite":
            theirs, ours = (family, _sqlite_path(url)), (self._family, _sqlite_path(self._url))
        if theirs != ours:
            raise ConfigError(
                f"the session's database {url.render_as_string(hide_password=True)!r} is not "
                f"the store's ({self._redacted}): the outbox's rows must be written in the same "
                "database as your own rows, where the store's relay finds them"
            )
        if self._memory:
            raise ConfigError(
                f"the outbox needs a database file or server; {self._redacted} is an in-memory "
                "SQLite database private to one connection"
            )
        if self._family == "sqlite" and in_transaction and not self._ready:
            raise ConfigError(
                f"the store's table {self._table_label} may not exist yet and SQLite cannot "
                "create it while your transaction holds the write lock: create it first "
                "(taskonce init-db, or store.create_tables() at start-up)"
            )
        # Now, not inside the application's transaction (SQLite: it holds the write lock).
        self._ensure_ready("send_on_commit")

    def record_sends_in(
        self,
        connection: Connection,
        key: str,
        sends: Sequence[str],
        token: str,
        keep_for: float,
        dispatch_lease: float,
    ) -> None:
        """Write a record ``key`` holding ``sends`` (pending, dispatch lease held by ``token``
        for ``dispatch_lease`` seconds) through ``connection``'s transaction, not committed
        here: the application's rows and the sends commit or roll back together."""
        _check_key(key)
        _check_token("token", token)
        self._ensure_ready("record_sends_in")
        with self._errors("record_sends_in"):
            wrote = self._mark(
                connection, key, keep_for, None, None, sends, token, dispatch_lease, locking=True
            )
        if not wrote:
            raise InvalidInput(f"outbox record {key!r} exists already")


def _check_worker(worker: str | None) -> None:
    if worker is not None and len(worker) > MAX_WORKER_LENGTH:
        raise InvalidInput(
            f"worker identity {worker[:20]!r}… is {len(worker)} characters; the limit is "
            f"{MAX_WORKER_LENGTH}"
        )


def _record(row: Any) -> Record:
    key, status, owner, fingerprint, result, created_at, expires_at = row[:7]
    pending = status == _SENDING
    sends = row._mapping.get("sends") if pending else None
    return Record(
        key=key,
        status=Status.COMPLETED if pending else Status(status),
        owner=owner,
        fingerprint=fingerprint,
        result=result,
        created_at=float(created_at),
        expires_at=float(expires_at),
        lease_remaining=float(row.lease_remaining),
        worker=row.worker,
        marked=status in (_COMPLETED, _SENDING) and not float(row.lease_until),
        sends_pending=pending,
        sends=tuple(json.loads(sends)) if sends else (),
    )


def _sqlite_path(url: URL) -> str:
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
    return f"{verb} table {store._table_label} in {store._redacted}"
