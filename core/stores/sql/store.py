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
rolls back (:mod:`.transactional`).

The tables are described in :mod:`.schema`, the statements built in :mod:`.statements`; URLs,
drivers, engines and fork handling are in :mod:`.connecting`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from taskonce.errors import ConfigError, LeaseLost, StoreUnavailable
from taskonce.stores.base import (
    LIVENESS_RETENTION,
    Awaiting,
    Claim,
    ClaimOutcome,
    Record,
    Seen,
    SendLease,
)
from taskonce.stores.options import own_value
from taskonce.stores.sql.connecting import (
    FAMILIES,
    forget_after_fork,
    make_engine,
    missing_database,
    parse_url,
    take_table,
)
from taskonce.stores.sql.receipts import SQLReceipts, awaiting_params
from taskonce.stores.sql.schema import (
    DEFAULT_TABLE,
    Stored,
    add_missing_columns,
    check_key,
    check_token,
    check_worker,
    create_table,
    make_live_table,
    make_table,
    parse_table,
    to_record,
)
from taskonce.stores.sql.statements import SQLITE_UPSERT, Statements
from taskonce.stores.sql.transactional import SQLTransactions

logger = logging.getLogger("taskonce.stores.sql")

#: How many times a claim or mark retries after losing a race to another writer.
_RACE_ATTEMPTS = 8


def _rowcount(result: Any) -> int:
    count: int = result.rowcount
    return count


def _after_fork_in_child(ref: weakref.ReferenceType[SQLStore]) -> None:
    store = ref()
    if store is not None:
        store._after_fork()


class SQLStore(SQLTransactions, SQLReceipts):
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
        self._family = FAMILIES[parsed.get_backend_name()]
        self._url, url_table = take_table(parsed, self._family)
        table = own_value("SQLStore", "table", url_table, table, DEFAULT_TABLE)
        self._schema, self._table_name = parse_table(table)
        self._table_label = table
        self._redacted = self._url.render_as_string(hide_password=True)
        self._password = self._url.password if isinstance(self._url.password, str) else None
        self._options = dict(engine_options or {})
        self._memory = self._family == "sqlite" and self._url.database in (None, "", ":memory:")
        self._lock = threading.Lock()
        self._ready = not create
        self._metadata = sa.MetaData()
        self._table = make_table(self._metadata, self._table_name, self._schema)
        self._live_table = make_live_table(self._metadata, self._table_name, self._schema)
        upsert = sqlite3.sqlite_version_info >= SQLITE_UPSERT
        if self._family == "sqlite" and not upsert:
            logger.info(
                "SQLite %s predates ON CONFLICT; using INSERT OR IGNORE", sqlite3.sqlite_version
            )
        self._sql = Statements(self._table, self._live_table, self._family, upsert)
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
        check_key(key)
        check_token("owner", owner)
        check_token("fingerprint", fingerprint)
        check_worker(worker)
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
                expired_claim = status == Stored.IN_PROGRESS and float(lease_until) <= float(now)
                same_payload = seen_fp is None or fingerprint is None or seen_fp == fingerprint
                if not (expired_claim and same_payload):
                    return Claim(ClaimOutcome.EXISTS, to_record(row))
                seen = {**params, "p_seen_owner": seen_owner}
                if _rowcount(connection.execute(sql.claim_take_over, seen)) == 1:
                    logger.debug("key %s: took over the expired claim of %s", key, seen_owner)
                    # fenced by the owner read with this count: the update added one to it
                    return Claim(ClaimOutcome.TAKEN_OVER, crashes=int(row.crashes or 0) + 1)
                logger.debug("key %s: lost a take-over race; reading again", key)
        raise StoreUnavailable(
            f"SQL store {self._redacted}: claim of {key!r} kept losing races with other "
            f"writers ({_RACE_ATTEMPTS} attempts)"
        )

    def take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        check_token("owner", owner)
        check_worker(worker)
        params = {
            "p_key": key,
            "p_seen_owner": old_owner,
            "p_owner": owner,
            "p_lease": float(lease),
            "p_keep": float(keep_for),
            "p_worker": worker,
        }
        with self._connect("take_over") as connection:
            if _rowcount(connection.execute(self._sql.take_over, params)) != 1:
                return 0
            crashes = connection.execute(self._sql.crashes, params).scalar_one_or_none()
        return int(crashes or 1)  # gone again at once (released): this take-over was one

    def quarantine(self, key: str, owner: str, keep_for: float) -> None:
        params = {"p_key": key, "p_owner": owner, "p_keep": float(keep_for)}
        with self._connect("quarantine") as connection:
            count = _rowcount(connection.execute(self._sql.quarantine, params))
        if count != 1:
            raise LeaseLost(key, "quarantine")

    def beat(self, worker: str, ttl: float) -> None:
        """One UPDATE; the first beat of a worker also INSERTs its row."""
        check_worker(worker)
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
        check_key(key)
        check_token("fingerprint", fingerprint)
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
            check_token("token", token)
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
        check_token("token", token)
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

    def dispatched(self, key: str, token: str, awaiting: Awaiting | None = None) -> bool:
        """One fenced UPDATE; with ``awaiting`` the same one also writes the receipts."""
        params: dict[str, Any] = {"p_key": key, "p_token": token}
        statement = self._sql.dispatched
        if awaiting is not None:
            statement = self._sql.dispatched_awaiting
            params.update(awaiting_params(awaiting))
        with self._connect("dispatched") as connection:
            return _rowcount(connection.execute(statement, params)) == 1

    def pending_sends(self, older_than: float = 0.0, limit: int = 100) -> list[str]:
        with self._connect("pending_sends") as connection:
            rows = connection.execute(self._sql.pending, {"p_age": older_than, "p_limit": limit})
            return [row[0] for row in rows]

    def get(self, key: str) -> Record | None:
        with self._connect("get") as connection:
            row = connection.execute(self._sql.get, {"p_key": key}).one_or_none()
        return None if row is None else to_record(row)

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
        return {name: int(value or 0) for name, value in row._mapping.items()}

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        """The live records whose key starts with ``key_prefix``, read in one query."""
        escaped = key_prefix.replace("/", "//").replace("%", "/%").replace("_", "/_")
        with self._connect("records") as connection:
            result = connection.execute(self._sql.records, {"p_pattern": f"{escaped}%"})
            rows = [to_record(row) for row in result]
        return iter(rows)

    def keys_ending(self, suffix: str, limit: int = 5) -> list[str]:
        """At most ``limit`` live keys ending with ``suffix``: one ``LIKE '%suffix'`` query
        (a scan of the table, for the CLI, not for hot paths)."""
        escaped = suffix.replace("/", "//").replace("%", "/%").replace("_", "/_")
        statement = self._sql.records.limit(limit)
        with self._connect("keys_ending") as connection:
            result = connection.execute(statement, {"p_pattern": f"%{escaped}"})
            return [str(row.key) for row in result]

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

    def close(self) -> None:
        self._engine.dispose()
        if self._tx_engine is not None:
            self._tx_engine.dispose()

    def describe(self) -> str:
        return f"SQLStore {self._redacted} (table {self._table_label})"


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


__all__ = ["DEFAULT_TABLE", "SQLStore", "init_db"]
