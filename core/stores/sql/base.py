"""The SQL stores' one base: the store contract's primitives on taskonce's tables, over a
connection each store provides. :class:`~taskonce.stores.sql.SQLStore` runs them on an
SQLAlchemy engine of its own; :class:`~taskonce.django_ext.DjangoStore` on the connection
Django holds for a database alias. Same tables, same statements (:mod:`.statements`), same
decisions, judged by the database's clock.

A claim is one ``INSERT … ON CONFLICT DO NOTHING`` (``INSERT IGNORE`` on MariaDB/MySQL) round
trip when the key is new; a record that is in the way is read and, when it is an expired record
or a claim whose lease ran out, replaced by an optimistic ``UPDATE`` whose ``WHERE`` repeats
what was read, so two racing workers can never both win: the primitive's one atomic step is
that ``UPDATE``, retried on a lost race.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import sqlite3
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from taskonce.errors import InvalidInput, StoreUnavailable
from taskonce.stores.base import Awaiting, Claim, ClaimOutcome, Completion, Marking, Record
from taskonce.stores.sql.receipts import SQLReceipts
from taskonce.stores.sql.schema import Stored, make_live_table, make_table, to_record
from taskonce.stores.sql.statements import SQLITE_UPSERT, Statements, rowcount

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

logger = logging.getLogger("taskonce.stores.sql")

#: How many times a claim or mark retries after losing a race to another writer.
RACE_ATTEMPTS = 8


def like_escaped(text: str) -> str:
    """``text`` inside a ``LIKE`` pattern whose escape character is ``/``."""
    return text.replace("/", "//").replace("%", "/%").replace("_", "/_")


class SQLBase(SQLReceipts):
    """The store contract's primitives on the keys and liveness tables.

    :param family: ``postgresql``, ``mysql`` or ``sqlite``.
    :param table: the keys table's name; :param schema: its schema (None: the default).
    :param label: the table in messages (``schema.table``).
    :param where: the database in messages (no password).
    """

    def __init__(
        self, *, family: str, table: str, schema: str | None, label: str, where: str
    ) -> None:
        self._family = family
        self._schema, self._table_name, self._table_label = schema, table, label
        self._redacted = where
        self._metadata = sa.MetaData()
        self._table = make_table(self._metadata, table, schema)
        self._live_table = make_live_table(self._metadata, table, schema)
        upsert = sqlite3.sqlite_version_info >= SQLITE_UPSERT
        if family == "sqlite" and not upsert:
            logger.info(
                "SQLite %s predates ON CONFLICT; using INSERT OR IGNORE", sqlite3.sqlite_version
            )
        self._sql = Statements(self._table, self._live_table, family, upsert)

    # -- what each SQL store provides ---------------------------------------------------------

    @abc.abstractmethod
    def _errors(self, operation: str) -> contextlib.AbstractContextManager[None]:
        """Database errors during ``operation`` raised as StoreUnavailable."""

    def _ensure_ready(self, operation: str) -> None:
        """Create the store's tables unless they are known to exist (by default they are:
        a migration made them)."""
        return

    def _lost_races(self, what: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"SQL store {self._redacted}: {what} kept losing races with other writers "
            f"({RACE_ATTEMPTS} attempts)"
        )

    # -- keys ----------------------------------------------------------------------------------

    def _claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None,
    ) -> Claim:
        params = {
            "p_key": key,
            "p_owner": owner,
            "p_fingerprint": fingerprint,
            "p_lease": lease,
            "p_keep": keep_for,
            "p_worker": worker,
        }
        with self._connect("claim") as connection:
            for _ in range(RACE_ATTEMPTS):
                if rowcount(connection.execute(self._sql.claim_insert, params)) == 1:
                    return Claim(ClaimOutcome.CLAIMED)
                claim = self._claim_in_the_way(connection, params)
                if claim is not None:
                    return claim
        raise self._lost_races(f"claim of {key!r}")

    def _claim_in_the_way(self, connection: Connection, params: Mapping[str, Any]) -> Claim | None:
        """The claim of a key whose insert found a record: the record read, then replaced when
        expired or taken over when its lease ran out (each fenced by what was read); None when
        a race changed the record meanwhile (the caller tries again)."""
        sql, key, fingerprint = self._sql, params["p_key"], params["p_fingerprint"]
        row = connection.execute(sql.read, {"p_key": key}).one_or_none()
        if row is None:  # released or purged in between: insert again
            return None
        (_, status, seen_owner, seen_fp, _, _, expires_at, lease_until, _, now) = row[:10]
        if float(expires_at) <= float(now):
            seen = {**params, "p_seen_owner": seen_owner, "p_seen_status": status}
            if rowcount(connection.execute(sql.claim_replace_expired, seen)) == 1:
                return Claim(ClaimOutcome.CLAIMED)
            return None
        expired_claim = status == Stored.IN_PROGRESS and float(lease_until) <= float(now)
        same_payload = seen_fp is None or fingerprint is None or seen_fp == fingerprint
        if not (expired_claim and same_payload):
            return Claim(ClaimOutcome.EXISTS, to_record(row))
        seen = {**params, "p_seen_owner": seen_owner}
        if rowcount(connection.execute(sql.claim_take_over, seen)) == 1:
            logger.debug("key %s: took over the expired claim of %s", key, seen_owner)
            # fenced by the owner read with this count: the update added one to it
            return Claim(ClaimOutcome.TAKEN_OVER, crashes=int(row.crashes or 0) + 1)
        logger.debug("key %s: lost a take-over race; reading again", key)
        return None

    def _take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        params = {
            "p_key": key,
            "p_seen_owner": old_owner,
            "p_owner": owner,
            "p_lease": lease,
            "p_keep": keep_for,
            "p_worker": worker,
        }
        with self._connect("take_over") as connection:
            if rowcount(connection.execute(self._sql.take_over, params)) != 1:
                return 0
            crashes = connection.execute(self._sql.crashes, params).scalar_one_or_none()
        return int(crashes or 1)  # gone again at once (released): this take-over was one

    def _quarantine(self, key: str, owner: str, keep_for: float) -> bool:
        params = {"p_key": key, "p_owner": owner, "p_keep": keep_for}
        with self._connect("quarantine") as connection:
            return rowcount(connection.execute(self._sql.quarantine, params)) == 1

    def _complete(self, done: Completion) -> bool:
        with self._connect("complete") as connection:
            return self._complete_on(connection, done)

    def _complete_on(self, connection: Connection, done: Completion) -> bool:
        """The fenced completion through ``connection``: one UPDATE."""
        params = {
            "p_key": done.key,
            "p_owner": done.owner,
            "p_keep": done.keep_for,
            "p_result": done.result,
        }
        statement = self._sql.complete
        if done.sends:
            statement = self._sql.complete_sends
            params.update(p_sends=done.sends, p_token=done.owner, p_send_lease=done.dispatch_lease)
        return rowcount(connection.execute(statement, params)) == 1

    def _release(self, key: str, owner: str) -> bool:
        with self._connect("release") as connection:
            params = {"p_key": key, "p_owner": owner}
            return rowcount(connection.execute(self._sql.release, params)) == 1

    def _forget(self, key: str) -> None:
        with self._connect("release") as connection:
            connection.execute(self._sql.release_any, {"p_key": key})

    def _renew(self, key: str, owner: str, lease: float) -> bool:
        params = {"p_key": key, "p_owner": owner, "p_lease": lease}
        with self._connect("renew") as connection:
            return rowcount(connection.execute(self._sql.renew, params)) == 1

    def _mark(self, mark: Marking) -> bool:
        with self._connect("mark") as connection:
            return self._mark_on(connection, mark, locking=False)

    def _mark_on(self, connection: Connection, mark: Marking, *, locking: bool) -> bool:
        """The mark through ``connection``: insert if absent, else replace an expired record,
        else (a live record) False."""
        sql = self._sql
        key = mark.key
        params = {
            "p_key": key,
            "p_fingerprint": mark.fingerprint,
            "p_result": mark.result,
            "p_keep": mark.keep_for,
        }
        insert, replace = sql.mark_insert, sql.mark_replace_expired
        if mark.sends:
            insert, replace = sql.mark_insert_sends, sql.mark_replace_expired_sends
            params.update(p_sends=mark.sends, p_token=mark.token, p_send_lease=mark.dispatch_lease)
        liveness = sql.liveness_locking if locking else sql.liveness
        for _ in range(RACE_ATTEMPTS):
            if rowcount(connection.execute(insert, params)) == 1:
                return True
            if rowcount(connection.execute(replace, params)) == 1:
                return True
            live = connection.execute(liveness, {"p_key": key}).scalar_one_or_none()
            if live is not None and int(live) == 1:
                return False
            logger.debug("key %s: the record in the way of a mark changed; trying again", key)
        raise self._lost_races(f"mark of {key!r}")

    def _get(self, key: str) -> Record | None:
        with self._connect("get") as connection:
            row = connection.execute(self._sql.get, {"p_key": key}).one_or_none()
        return None if row is None else to_record(row)

    # -- liveness ------------------------------------------------------------------------------

    def _beat(self, worker: str, ttl: float) -> None:
        """One UPDATE; the first beat of a worker also INSERTs its row."""
        params = {"p_worker": worker, "p_ttl": ttl}
        sql = self._sql
        with self._connect("beat") as connection:
            for _ in range(RACE_ATTEMPTS):
                if rowcount(connection.execute(sql.beat_update, params)) == 1:
                    return
                if rowcount(connection.execute(sql.beat_insert, params)) == 1:
                    return
        raise self._lost_races(f"liveness write of {worker!r}")

    def _seen(self, worker: str) -> tuple[float, float] | None:
        with self._connect("seen") as connection:
            row = connection.execute(self._sql.seen, {"p_worker": worker}).one_or_none()
        return None if row is None else (float(row.ago), float(row.remaining))

    # -- the hand-off --------------------------------------------------------------------------

    def _take_sends(
        self, key: str, token: str, lease: float, older_than: float
    ) -> tuple[str | None, float]:
        """Take the lease (UPDATE fenced by age and any other live lease), then read what was
        taken: two statements on one connection."""
        params = {"p_key": key, "p_token": token, "p_lease": lease, "p_age": older_than}
        with self._connect("take_sends") as connection:
            taken = rowcount(connection.execute(self._sql.take_sends, params)) == 1
            row = connection.execute(self._sql.read_sends, params).one_or_none()
        if row is None:
            return None, 0.0  # none pending (published meanwhile), or recorded too recently
        sends, holder, remaining = row
        if taken and holder == token and sends:
            return str(sends), 0.0
        return None, float(remaining or 0.0)

    def _dispatched(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """One fenced UPDATE; with ``awaiting`` the same one also writes the receipts."""
        statements = (self._sql.dispatched, self._sql.dispatched_awaiting)
        return self._fenced_with_awaiting("dispatched", statements, key, token, awaiting)

    # -- operations ----------------------------------------------------------------------------

    def _purge(self, batch: int) -> int:
        statement = self._sql.purge(batch)
        deleted = 0
        with self._connect("purge") as connection:
            while True:
                count = rowcount(connection.execute(statement))
                deleted += count
                if count < batch:
                    break
            connection.execute(self._sql.purge_live)
        if deleted:
            logger.info("purged %d expired records from %s", deleted, self._table_label)
        return deleted

    def _expired(self) -> tuple[int, int]:
        with self._connect("stats") as connection:
            expired, sending = connection.execute(self._sql.expired).one()
        return int(expired or 0), int(sending or 0)

    def _records(self, key_prefix: str, key_suffix: str, limit: int | None) -> list[Record]:
        """The live records whose key matches, read in one ``LIKE`` query (a scan of the table
        when ``key_prefix`` is empty: for the CLI, not for hot paths)."""
        statement = self._sql.records if limit is None else self._sql.records.limit(limit)
        pattern = f"{like_escaped(key_prefix)}%{like_escaped(key_suffix)}"
        with self._connect("records") as connection:
            result = connection.execute(statement, {"p_pattern": pattern})
            return [to_record(row) for row in result]

    # -- inside the caller's transaction -------------------------------------------------------

    def _complete_in(self, session: Session, done: Completion) -> bool:
        """The fenced completion through ``session``'s transaction (not committed here): the
        handler's rows, the mark and its sends commit together."""
        with self._errors("complete_in"):
            return self._complete_on(session.connection(), done)

    def _mark_in(self, session: Session, mark: Marking) -> bool:
        """The mark through ``session``'s transaction (not committed here), read with a locking
        read where a plain one would see an old snapshot."""
        with self._errors("mark_in"):
            return self._mark_on(session.connection(), mark, locking=True)

    def _record_sends_in(
        self,
        connection: Connection,
        key: str,
        sends: str,
        token: str,
        keep_for: float,
        dispatch_lease: float,
    ) -> None:
        """The outbox's record through ``connection``'s transaction, not committed here."""
        self._ensure_ready("record_sends_in")
        with self._errors("record_sends_in"):
            mark = Marking(key, keep_for, None, None, sends, token, dispatch_lease)
            wrote = self._mark_on(connection, mark, locking=True)
        if not wrote:
            raise InvalidInput(f"outbox record {key!r} exists already")

    @property
    def table_label(self) -> str:
        """The keys table as messages name it (``schema.table``)."""
        return self._table_label

    @property
    def where(self) -> str:
        """The database as messages name it (its URL without the password)."""
        return self._redacted

    def describe(self) -> str:
        return f"{type(self).__name__} {self._redacted} (table {self._table_label})"


__all__ = ["RACE_ATTEMPTS", "SQLBase", "like_escaped"]
