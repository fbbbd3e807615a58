"""The SQL store's schema: its two tables, their creation and migration, the limits of their
columns, and the one translation of a row into a :class:`~taskonce.stores.base.Record`.

The keys table::

    key          VARCHAR(255) PRIMARY KEY    -- binary (case- and space-exact) on MariaDB/MySQL
    status       VARCHAR(16)  NOT NULL       -- 'in_progress' | 'completed' | 'sending'
                                             -- | 'quarantined'
    owner        VARCHAR(64)  NULL           -- the claim's owner token, NULL for marks
    fingerprint  VARCHAR(64)  NULL
    result       TEXT         NULL           -- LONGTEXT on MariaDB/MySQL
    created_at   DOUBLE       NOT NULL       -- seconds since the epoch, database clock
    lease_until  DOUBLE       NOT NULL       -- kept by a completion; 0 for lazy marks
    expires_at   DOUBLE       NOT NULL       -- indexed: purge deletes by it
    worker       VARCHAR(255) NULL           -- the claim owner's worker identity
    sends        TEXT         NULL           -- the hand-off: a JSON array of the sends' texts
    sends_token  VARCHAR(64)  NULL           -- their dispatch token
    sends_at     DOUBLE       NULL           -- the relay's due time (indexed): when pending
                                             -- sends were recorded, or when awaited receipts
                                             -- are looked for; NULL otherwise
    sends_lease  DOUBLE       NULL           -- a dispatcher's (or a relay's) lease runs until
    receipts     TEXT         NULL           -- published sends awaiting their receipts (JSON),
                                             -- or given up on (sends_at NULL: kept for inspect)
    crashes      INTEGER      NULL           -- take-overs from dead owners (claims, quarantined)

and, next to it, the worker processes' liveness records (``<table>_live``)::

    worker       VARCHAR(255) PRIMARY KEY
    seen_at      DOUBLE       NOT NULL       -- last liveness write, database clock
    alive_until  DOUBLE       NOT NULL       -- seen_at + the liveness window

A record has sends pending or awaits receipts (:mod:`taskonce.receipts`), never both, so the
two share the dispatch token, due time and lease columns, and one index serves both halves of
the relay's work. ``status`` tells them apart: ``'sending'`` with ``sends_at`` set means sends
pending; ``'completed'`` with ``sends_at`` set means receipts awaited (``receipts`` set). A
record replacing an expired one starts with all of them NULL. A keys table created before the
``worker`` column (or the hand-off's, the receipts', ``crashes``) existed gains it on first use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.engine import Connection

from taskonce.errors import ConfigError
from taskonce.stores.base import (
    MAX_KEY_LENGTH,
    MAX_TOKEN_LENGTH,
    MAX_WORKER_LENGTH,
    Record,
    Status,
    StrEnum,
)

logger = logging.getLogger("taskonce.stores.sql")

#: The table name used when none is given.
DEFAULT_TABLE = "taskonce_keys"


_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
_TABLE_RE = re.compile(rf"^(?:(?P<schema>{_IDENT})\.)?(?P<name>{_IDENT})$")


class Stored(StrEnum):
    """The ``status`` column of a record."""

    #: a claim (in progress)
    IN_PROGRESS = Status.IN_PROGRESS.value
    #: completed: an eager claim's completion or a lazy mark
    COMPLETED = Status.COMPLETED.value
    #: completed, its deferred sends not all published yet (the hand-off)
    SENDING = "sending"
    #: quarantined: its owners died too often (``Policy.crash_limit``)
    QUARANTINED = Status.QUARANTINED.value

    @property
    def status(self) -> Status:
        """The :class:`~taskonce.stores.base.Status` a record with this column has."""
        if self is Stored.SENDING:
            return Status.COMPLETED
        return Status(self.value)


_STORED: dict[str, Stored] = {stored.value: stored for stored in Stored}


def parse_table(table: str) -> tuple[str | None, str]:
    """``(schema, name)`` of a table name; :class:`ConfigError` unless it is a plain identifier
    (letters, digits, underscore, at most 63 characters) with at most one schema prefix."""
    match = _TABLE_RE.match(table) if isinstance(table, str) else None
    if match is None:
        raise ConfigError(
            f"table {table!r} is not a valid table name: use letters, digits and underscores "
            "(at most 63, not starting with a digit), optionally 'schema.table'"
        )
    return match.group("schema"), match.group("name")


def index_name(name: str) -> str:
    """The name of keys table ``name``'s index on ``expires_at`` (at most 63 characters)."""
    candidate = f"ix_{name}_expires_at"
    if len(candidate) <= 63:
        return candidate
    digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"ix_{name[:40]}_{digest}_expires_at"


def live_name(name: str) -> str:
    """The liveness table's name next to keys table ``name`` (at most 63 characters)."""
    candidate = f"{name}_live"
    if len(candidate) <= 63:
        return candidate
    digest = hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{name[:45]}_{digest}_live"


def make_live_table(
    metadata: sa.MetaData, name: str, schema: str | None, **dialect_kw: Any
) -> sa.Table:
    """The liveness table of keys table ``name``."""
    return sa.Table(
        live_name(name),
        metadata,
        sa.Column("worker", sa.String(MAX_WORKER_LENGTH), primary_key=True),
        sa.Column("seen_at", sa.Double(), nullable=False),
        sa.Column("alive_until", sa.Double(), nullable=False),
        schema=schema,
        **dialect_kw,
    )


def make_table(metadata: sa.MetaData, name: str, schema: str | None, **dialect_kw: Any) -> sa.Table:
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
        # Receipts (taskonce.receipts): published sends awaiting them (their due time is
        # sends_at, free once the sends were published). NULL on every other record, so it
        # costs a row a bit of its null bitmap and no index entry.
        sa.Column("receipts", result_type, nullable=True),
        # Take-overs from dead, silent or expired owners (crash-loop quarantine): NULL (none)
        # on almost every row.
        sa.Column("crashes", sa.Integer(), nullable=True),
        schema=schema,
        **dialect_kw,
    )
    sa.Index(index_name(name), table.c.expires_at)
    # Only records with sends pending or receipts awaited have a sends_at (the relay's index,
    # both halves): PostgreSQL and SQLite index just those; MariaDB/MySQL have no partial
    # indexes and index every row (one index, not two: issue 31's bytes per row).
    relayed = table.c.sends_at.isnot(None)
    sa.Index(
        index_name(name).replace("expires_at", "sends_at"),
        table.c.sends_at,
        postgresql_where=relayed,
        sqlite_where=relayed,
    )
    return table


def _mysql_collation(connection: Connection) -> str:
    """A binary collation that compares keys exactly (no case folding, no space padding)."""
    dialect = connection.dialect
    version = tuple(dialect.server_version_info or ())
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
    return "utf8mb4_0900_bin" if version >= (8, 0) else "utf8mb4_bin"


def create_table(
    connection: Connection,
    make: Callable[..., sa.Table],
    name: str,
    schema: str | None,
    *,
    family: str,
    backend: str,
    where: str,
) -> bool:
    """Create the table ``make`` builds for keys table ``name`` unless it exists (safe to run
    concurrently from several processes); True when this call created it. ``backend`` is the
    URL's (``mysql``/``mariadb``: the DDL options' prefix), ``where`` the redacted URL."""
    for attempt in range(4):
        metadata = sa.MetaData()
        dialect_kw: dict[str, Any] = {}
        if family == "mysql":
            dialect_kw = {
                f"{backend}_engine": "InnoDB",
                f"{backend}_charset": "utf8mb4",
                f"{backend}_collate": _mysql_collation(connection),
            }
        table = make(metadata, name, schema, **dialect_kw)
        if sa.inspect(connection).has_table(table.name, schema=schema):
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
        logger.info("created table %s in %s", table.name, where)
        return True
    return False


def add_missing_columns(connection: Connection, table: sa.Table, label: str) -> None:
    """A keys table created by an earlier version gets its newer columns (the owner's
    worker identity, the hand-off's) and their indexes added. ``label``: the table's name as
    the user gave it, for messages."""
    inspector = sa.inspect(connection)
    present = {c["name"] for c in inspector.get_columns(table.name, schema=table.schema)}
    missing = [c for c in table.columns if c.name not in present]
    if not missing:
        return
    preparer = connection.dialect.identifier_preparer
    table_sql = preparer.format_table(table)
    for column in missing:
        if not column.nullable:  # only the newer, nullable columns can be added in place
            raise ConfigError(
                f"table {label} has no column {column.name!r}; it was not made by taskonce"
            )
        ddl = column.type.compile(dialect=connection.dialect)
        try:
            connection.exec_driver_sql(
                f"ALTER TABLE {table_sql} ADD COLUMN {preparer.quote(column.name)} {ddl}"
            )
        except sa_exc.DBAPIError:
            # another process added it meanwhile (it is there now) or the ALTER failed
            fresh = sa.inspect(connection).get_columns(table.name, schema=table.schema)
            if column.name not in {c["name"] for c in fresh}:
                raise
    for index in table.indexes:
        if any(c in missing for c in index.columns):
            index.create(connection, checkfirst=True)
    logger.info("added the column(s) %s to %s", ", ".join(c.name for c in missing), label)


# -- a row as a Record -----------------------------------------------------------------------


def to_record(row: Any) -> Record:
    """The one translation of a stored row into a :class:`~taskonce.stores.base.Record`: a
    row of the store's reads, which start with ``key, status, owner, fingerprint, result,
    created_at, expires_at`` and name ``lease_remaining``, ``worker``, ``lease_until``,
    ``crashes`` and (in full reads) ``sends`` and ``receipts``."""
    key, status, owner, fingerprint, result, created_at, expires_at = row[:7]
    stored = _STORED[status]
    pending = stored is Stored.SENDING
    sends = row._mapping.get("sends") if pending else None
    return Record(
        key=key,
        status=stored.status,
        owner=owner,
        fingerprint=fingerprint,
        result=result,
        created_at=float(created_at),
        expires_at=float(expires_at),
        lease_remaining=float(row.lease_remaining),
        worker=row.worker,
        # a completion keeps its claim's lease_until; a lazy mark has none
        marked=stored.status is Status.COMPLETED and not float(row.lease_until),
        sends_pending=pending,
        sends=tuple(json.loads(sends)) if sends else (),
        receipts=row._mapping.get("receipts"),
        # due some time (sends_at): given up on, the entries stay without it
        receipts_awaited=stored is Stored.COMPLETED
        and row._mapping.get("receipts") is not None
        and row._mapping.get("sends_at") is not None,
        crashes=int(row.crashes or 0),
    )


__all__ = [
    "DEFAULT_TABLE",
    "Stored",
    "add_missing_columns",
    "create_table",
    "index_name",
    "live_name",
    "make_live_table",
    "make_table",
    "parse_table",
    "to_record",
]
