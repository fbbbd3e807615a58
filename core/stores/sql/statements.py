"""The SQL store's statements, built once per table and dialect family by small builders (one
per group: claims, liveness, fenced writes, marks, the hand-off, receipts, reads) and cached by
SQLAlchemy's compiled cache: every value is a bound parameter, and every time is the
database's clock (:data:`NOW_SQL`) inside the statement that acts on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect

from taskonce.stores.base import LIVENESS_RETENTION
from taskonce.stores.sql.schema import Stored

#: The database's clock as seconds since the epoch (DOUBLE), per dialect family.
#: MariaDB/MySQL: ``UTC_TIMESTAMP(6)`` measured from the epoch is independent of the session
#: time zone (``UNIX_TIMESTAMP(NOW(6))`` is off by an hour in a DST fall-back hour).
NOW_SQL = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1e6)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}

#: The oldest SQLite with ``INSERT … ON CONFLICT DO NOTHING``; older ones use ``OR IGNORE``.
SQLITE_UPSERT = (3, 24, 0)

_DOUBLE: sa.Double[float] = sa.Double()


def rowcount(result: Any) -> int:
    """The rows a statement's ``result`` changed (1 or 0 for the fenced writes)."""
    count: int = result.rowcount
    return count


class _Binds:
    """The bound parameters and literals the statements share."""

    def __init__(self, family: str) -> None:
        self.now: sa.ColumnElement[float] = sa.literal_column(NOW_SQL[family], type_=_DOUBLE)
        self.key = sa.bindparam("p_key", type_=sa.String())
        self.owner = sa.bindparam("p_owner", type_=sa.String())
        self.fingerprint = sa.bindparam("p_fingerprint", type_=sa.String())
        self.result = sa.bindparam("p_result", type_=sa.Text())
        self.lease = sa.bindparam("p_lease", type_=_DOUBLE)
        self.keep = sa.bindparam("p_keep", type_=_DOUBLE)
        self.seen_owner = sa.bindparam("p_seen_owner", type_=sa.String())
        self.seen_status = sa.bindparam("p_seen_status", type_=sa.String())
        self.worker = sa.bindparam("p_worker", type_=sa.String())
        self.sends = sa.bindparam("p_sends", type_=sa.Text())
        self.token = sa.bindparam("p_token", type_=sa.String())
        self.age = sa.bindparam("p_age", type_=_DOUBLE)
        self.send_lease = sa.bindparam("p_send_lease", type_=_DOUBLE)
        self.entries = sa.bindparam("p_entries", type_=sa.Text())
        self.due = sa.bindparam("p_due", type_=_DOUBLE)  # None: out of the relay's index
        self.hold = sa.bindparam("p_hold", type_=_DOUBLE)
        self.limit = sa.bindparam("p_limit", type_=sa.Integer())
        self.in_progress = sa.literal(Stored.IN_PROGRESS.value, sa.String())
        self.completed = sa.literal(Stored.COMPLETED.value, sa.String())
        self.sending = sa.literal(Stored.SENDING.value, sa.String())
        self.quarantined = sa.literal(Stored.QUARANTINED.value, sa.String())
        self.zero = sa.literal(0.0, _DOUBLE)

    def with_sends(self) -> dict[str, Any]:
        """The columns a write with deferred sends sets: pending, dispatch lease held."""
        return {
            "status": self.sending,
            "sends": self.sends,
            "sends_token": self.token,
            "sends_at": self.now,
            "sends_lease": self.now + self.send_lease,
        }

    def cleared(self) -> dict[str, Any]:
        """The hand-off's and the receipts' columns, all NULL: what replacing an expired record
        writes (a new record has no sends pending and awaits no receipts; it must not keep an
        old ``sends_at``, which would read as a due time of the relay) and what clearing the
        receipts writes."""
        return {
            "sends": sa.null(),
            "sends_token": sa.null(),
            "sends_at": sa.null(),
            "sends_lease": sa.null(),
            "receipts": sa.null(),
            "crashes": sa.null(),
        }

    def awaiting(self, expires_at: sa.ColumnElement[float]) -> dict[str, Any]:
        """The columns a write of awaited receipts sets on a ``completed`` record:
        ``p_entries``, due ``p_due`` seconds from now in ``sends_at`` (NULL when None: NULL
        arithmetic keeps it out of the relay's index; the entries stay, given up on), the
        lease let go, the record kept at least ``p_hold`` seconds from now."""
        held = self.now + self.hold
        return {
            "receipts": self.entries,
            "sends_at": self.now + self.due,
            "sends_token": sa.null(),
            "sends_lease": sa.null(),
            "expires_at": sa.case((expires_at >= held, expires_at), else_=held),
        }


class Statements:
    """The statements of one table on one dialect family.

    :param table: the keys table. :param live_table: the liveness table.
    :param family: ``postgresql``, ``mysql`` or ``sqlite``.
    :param sqlite_upsert: whether SQLite has ``INSERT … ON CONFLICT DO NOTHING``.
    """

    def __init__(
        self, table: sa.Table, live_table: sa.Table, family: str, sqlite_upsert: bool
    ) -> None:
        self.family = family
        self._table = table
        self._sqlite_upsert = sqlite_upsert
        b = self._b = _Binds(family)
        self.now = b.now
        c = table.c
        self.lease_remaining = sa.case(
            (sa.and_(c.status == b.in_progress, c.lease_until > b.now), c.lease_until - b.now),
            else_=b.zero,
        )
        self._claims(table)
        self._take_overs(table)
        self._liveness(live_table)
        self._fenced(table)
        self._marks(table)
        self._handoff(table)
        self._receipts(table)
        self._reads(table)

    def _insert_if_absent(self, into: sa.Table, values: Mapping[str, Any]) -> sa.Insert:
        """An INSERT that inserts nothing when the primary key is taken. Its cursor is closed
        at once (no RETURNING), so its rowcount (1 = inserted, 0 = a record was in the way) is
        kept explicitly."""
        primary = list(into.primary_key.columns)
        insert: sa.Insert
        if self.family == "postgresql":
            insert = (
                pg_dialect.insert(into)
                .values(values)
                .on_conflict_do_nothing(index_elements=primary)
            )
        elif self.family == "sqlite" and self._sqlite_upsert:
            insert = (
                sqlite_dialect.insert(into)
                .values(values)
                .on_conflict_do_nothing(index_elements=primary)
            )
        elif self.family == "sqlite":
            insert = sa.insert(into).values(values).prefix_with("OR IGNORE")
        else:
            insert = sa.insert(into).values(values).prefix_with("IGNORE")
        return insert.execution_options(preserve_rowcount=True)

    def _claims(self, table: sa.Table) -> None:
        """A claim: insert if absent, read what is in the way, replace an expired record, or
        take over a claim whose lease ran out."""
        b, c = self._b, table.c
        claimed = {
            "status": b.in_progress,
            "owner": b.owner,
            "fingerprint": b.fingerprint,
            "result": sa.null(),
            "created_at": b.now,
            "lease_until": b.now + b.lease,
            "expires_at": b.now + b.lease + b.keep,
            "worker": b.worker,
        }
        self.claim_insert = self._insert_if_absent(table, {"key": b.key, **claimed})
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
            b.now.label("db_now"),
            c.worker,
            c.receipts,  # a duplicate's answer shows what its record awaits (None: nothing)
            c.crashes,
            c.sends_at,
        ).where(c.key == b.key)
        # An expired record (mark or claim) counts as absent: replace it wholesale, provided
        # it is still the record that was read and still expired.
        self.claim_replace_expired = (
            sa.update(table)
            .where(
                c.key == b.key,
                c.status == b.seen_status,
                c.owner.is_not_distinct_from(b.seen_owner),
                c.expires_at <= b.now,
            )
            .values(**claimed, **b.cleared())
        )
        # A live record whose claim's lease ran out: take it over (created_at is kept).
        self.claim_take_over = (
            sa.update(table)
            .where(
                c.key == b.key,
                c.status == b.in_progress,
                c.owner == b.seen_owner,
                c.lease_until <= b.now,
                c.expires_at > b.now,
            )
            .values({k: v for k, v in claimed.items() if k not in ("status", "created_at")})
            .values(crashes=sa.func.coalesce(c.crashes, 0) + 1)
        )

    def _take_overs(self, table: sa.Table) -> None:
        """A live claim whose owner is known dead, handed on whatever its lease says, and the
        count of take-overs its new owner reads back."""
        b, c = self._b, table.c
        # A live claim whose owner is known dead: hand it on, fenced by the owner read.
        self.take_over = (
            sa.update(table)
            .where(
                c.key == b.key,
                c.status == b.in_progress,
                c.owner == b.seen_owner,
                c.expires_at > b.now,
            )
            .values(
                owner=b.owner,
                worker=b.worker,
                lease_until=b.now + b.lease,
                expires_at=b.now + b.lease + b.keep,
                crashes=sa.func.coalesce(c.crashes, 0) + 1,
            )
        )
        # The count a take-over wrote, read back by its new owner (fenced by the token).
        self.crashes = sa.select(c.crashes).where(
            c.key == b.key, c.owner == b.owner, c.status == b.in_progress
        )

    def _liveness(self, live_table: sa.Table) -> None:
        """A worker's liveness record: written (update, else insert), read, purged."""
        b, lc = self._b, live_table.c
        ttl = sa.bindparam("p_ttl", type_=_DOUBLE)
        self.beat_update = (
            sa.update(live_table)
            .where(lc.worker == b.worker)
            .values(seen_at=b.now, alive_until=b.now + ttl)
        )
        self.beat_insert = self._insert_if_absent(
            live_table, {"worker": b.worker, "seen_at": b.now, "alive_until": b.now + ttl}
        )
        self.seen = sa.select(
            (b.now - lc.seen_at).label("ago"), (lc.alive_until - b.now).label("remaining")
        ).where(lc.worker == b.worker)
        retention = sa.literal(LIVENESS_RETENTION, _DOUBLE)
        self.purge_live = sa.delete(live_table).where(lc.alive_until + retention <= b.now)

    def _fenced(self, table: sa.Table) -> None:
        """The writes after a claim, each fenced by the owner token: complete, release,
        renew (and an operator's release of whatever is recorded)."""
        b, c = self._b, table.c
        fence = (
            c.key == b.key,
            c.owner == b.owner,
            c.status == b.in_progress,
            c.expires_at > b.now,
        )
        self.complete = (
            sa.update(table)
            .where(*fence)
            .values(
                # lease_until stays: it tells an eager completion from a lazy mark (0)
                status=b.completed,
                owner=sa.null(),
                worker=sa.null(),
                result=b.result,
                expires_at=b.now + b.keep,
                crashes=sa.null(),
            )
        )
        # A claim whose owners died too often: kept keep_for, never claimed, until released.
        self.quarantine = (
            sa.update(table)
            .where(*fence)
            .values(
                status=b.quarantined, owner=sa.null(), worker=sa.null(), expires_at=b.now + b.keep
            )
        )
        self.complete_sends = self.complete.values(b.with_sends())
        self.release = sa.delete(table).where(*fence)
        self.release_any = sa.delete(table).where(c.key == b.key)
        # MariaDB/MySQL evaluate SET assignments left to right, seeing earlier assignments:
        # expires_at must be computed from the old lease_until, so it comes first.
        extension = b.now + b.lease - c.lease_until
        self.renew = (
            sa.update(table)
            .where(*fence)
            .ordered_values(
                (c.expires_at, c.expires_at + sa.case((extension > 0, extension), else_=b.zero)),
                (c.lease_until, b.now + b.lease),
            )
        )

    def _marks(self, table: sa.Table) -> None:
        """A lazy mark: insert if absent, else replace an expired record; with sends too."""
        b, c = self._b, table.c
        marked = {
            "status": b.completed,
            "owner": sa.null(),
            "fingerprint": b.fingerprint,
            "result": b.result,
            "created_at": b.now,
            "lease_until": b.zero,
            "expires_at": b.now + b.keep,
        }
        self.mark_insert = self._insert_if_absent(table, {"key": b.key, **marked})
        self.mark_replace_expired = (
            sa.update(table)
            .where(c.key == b.key, c.expires_at <= b.now)
            .values(**marked, **b.cleared(), worker=sa.null())
        )
        self.mark_insert_sends = self._insert_if_absent(
            table, {"key": b.key, **marked, **b.with_sends()}
        )
        self.mark_replace_expired_sends = self.mark_replace_expired.values(b.with_sends())
        live = sa.case((c.expires_at > b.now, 1), else_=0).label("live")
        self.liveness = sa.select(live).where(c.key == b.key)
        # Inside a REPEATABLE READ transaction (InnoDB) a plain SELECT reads an old snapshot;
        # a locking read sees the latest committed row.
        self.liveness_locking = (
            self.liveness.with_for_update(read=True) if self.family == "mysql" else self.liveness
        )

    def _handoff(self, table: sa.Table) -> None:
        """The hand-off: take the dispatch lease of pending sends, read them, and clear them
        once published."""
        b, c = self._b, table.c
        pending = sa.and_(c.key == b.key, c.status == b.sending, c.sends_at <= b.now - b.age)
        self.take_sends = (
            sa.update(table)
            .where(
                pending,
                sa.or_(c.sends_lease.is_(None), c.sends_lease <= b.now, c.sends_token == b.token),
            )
            .values(sends_token=b.token, sends_lease=b.now + b.lease)
        )
        self.read_sends = sa.select(
            c.sends, c.sends_token, sa.func.coalesce(c.sends_lease, b.zero) - b.now
        ).where(pending)
        self.dispatched = (
            sa.update(table)
            .where(c.key == b.key, c.status == b.sending, c.sends_token == b.token)
            .values(
                status=b.completed,
                sends=sa.null(),
                sends_token=sa.null(),
                sends_at=sa.null(),
                sends_lease=sa.null(),
            )
        )
        self.dispatched_awaiting = self.dispatched.values(b.awaiting(c.expires_at))

    def _receipts(self, table: sa.Table) -> None:
        """Receipts (:mod:`taskonce.receipts`): take the relay's lease on a record's awaited
        receipts when due, read them, write back what still awaits or clear them; whether
        records exist (the receipts themselves); and the relay's work in one statement."""
        b, c = self._b, table.c
        # Awaited receipts: a completed record (pending sends are 'sending') with receipts,
        # due by sends_at; given up on, sends_at is NULL and the comparison is never true.
        due = sa.and_(
            c.key == b.key,
            c.status == b.completed,
            c.receipts.is_not(None),
            c.sends_at <= b.now,
        )
        # The dispatch token and lease columns: a record awaiting receipts has no sends pending.
        self.take_receipts = (
            sa.update(table)
            .where(
                due,
                sa.or_(c.sends_lease.is_(None), c.sends_lease <= b.now, c.sends_token == b.token),
            )
            .values(sends_token=b.token, sends_lease=b.now + b.lease)
        )
        self.read_receipts = sa.select(
            c.receipts,
            c.sends_token,
            sa.func.coalesce(c.sends_lease, b.zero) - b.now,
            b.now - c.sends_at,
        ).where(due)
        fence = (c.key == b.key, c.receipts.is_not(None), c.sends_token == b.token)
        self.settle_receipts = sa.update(table).where(*fence).values(b.awaiting(c.expires_at))
        self.clear_receipts = sa.update(table).where(*fence).values(b.cleared())
        keys = sa.bindparam("p_keys", expanding=True, type_=sa.String())
        self.have_records = sa.select(c.key).where(c.key.in_(keys), c.expires_at > b.now)
        self.due_for_relay = self._due_for_relay(table)

    def _due_for_relay(self, table: sa.Table) -> sa.Executable:
        """Both halves of the relay's work in one statement: ``UNION ALL`` of two derived
        tables, each ``ORDER BY sends_at … LIMIT`` on the one ``sends_at`` index, tagged
        ``s``/``r`` and told apart by ``status`` (``sending``: sends pending, recorded at
        ``sends_at``; ``completed``: receipts awaited, due at ``sends_at``). Derived tables
        because SQLite allows neither parentheses nor ``LIMIT`` on a compound's members; the
        union's order is not relied on (the caller sorts by ``at``).

        Each half's range scan also passes the other half's due rows, filtered by ``status``:
        both kinds leave the range as soon as the relay gets to them (published, or looked at
        and due again later), so few are ever due at once.

        On PostgreSQL the clock is read once in a scalar subquery: ``clock_timestamp()`` is
        volatile, and a volatile bound can only filter an index scan, not bound it (the scan
        would read every record of the index to find the few that are due)."""
        b, c = self._b, table.c
        now: sa.ColumnElement[float] = b.now
        if self.family == "postgresql":
            now = sa.select(b.now).scalar_subquery()
        sends = (
            sa.select(sa.literal_column("'s'").label("kind"), c.key, c.sends_at.label("at"))
            .where(c.status == b.sending, c.sends_at <= now - b.age)
            .order_by(c.sends_at)
            .limit(b.limit)
            .subquery("due_sends")
        )
        receipts = (
            sa.select(sa.literal_column("'r'").label("kind"), c.key, c.sends_at.label("at"))
            .where(c.status == b.completed, c.receipts.is_not(None), c.sends_at <= now)
            .order_by(c.sends_at)
            .limit(b.limit)
            .subquery("due_receipts")
        )
        return sa.union_all(sa.select(sends), sa.select(receipts))

    def _reads(self, table: sa.Table) -> None:
        """Reads of live records (one key, or keys matching a LIKE pattern) and the count of
        expired ones."""
        b, c = self._b, table.c
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
            c.receipts,
            c.crashes,
            c.sends_at,
        )
        self.get = sa.select(*record_columns).where(c.key == b.key, c.expires_at > b.now)
        # p_pattern: a LIKE pattern with "/" as its escape character (see SQLStore.records)
        pattern = sa.bindparam("p_pattern", type_=sa.String())
        self.records = sa.select(*record_columns).where(
            c.key.like(pattern, escape="/"), c.expires_at > b.now
        )

        def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
            return sa.func.coalesce(sa.func.sum(sa.case((condition, 1), else_=0)), 0)

        # records a purge would delete, and those kept past their expiry for their sends
        expired = c.expires_at <= b.now
        self.expired = sa.select(
            count(expired).label("expired"),
            count(sa.and_(expired, c.status == b.sending)).label("expired_sending"),
        )

    def purge(self, batch: int) -> sa.Executable:
        """Delete at most ``batch`` expired rows (the expiry is re-checked on the deleted rows,
        so a row re-claimed meanwhile survives)."""
        c = self._table.c
        # A record whose sends are pending is kept until the relay publishes them. A record
        # awaiting receipts is not: it is kept at least its hold while awaited (dispatched and
        # settle_receipts extend its expiry), so one expired all the same (a relay away longer
        # than that) is purged like any expired record, its receipts no longer looked for.
        expired = sa.and_(c.expires_at <= self.now, c.status != Stored.SENDING.value)
        if self.family == "mysql":
            # MariaDB/MySQL refuse LIMIT inside IN (subquery) but allow DELETE … LIMIT, which
            # SQLAlchemy spells differently across 2.0.x/2.1; the identifiers are validated
            # and quoted, the limit is a bound parameter.
            preparer = mysql_dialect.dialect().identifier_preparer
            table_sql = preparer.format_table(self._table)  # validated by the schema, quoted
            return (
                sa.text(
                    f"DELETE FROM {table_sql} "  # noqa: S608 - no value is interpolated
                    f"WHERE {preparer.quote('expires_at')} <= {NOW_SQL['mysql']} "
                    f"AND {preparer.quote('status')} <> '{Stored.SENDING.value}' LIMIT :p_batch"
                )
                .bindparams(sa.bindparam("p_batch", value=batch, type_=sa.Integer()))
                .execution_options(preserve_rowcount=True)
            )
        chosen = sa.select(c.key).where(expired).limit(batch)
        if self.family == "postgresql":
            chosen = chosen.with_for_update(skip_locked=True)
        return sa.delete(self._table).where(c.key.in_(chosen.scalar_subquery()), expired)


__all__ = ["NOW_SQL", "SQLITE_UPSERT", "Statements", "rowcount"]
