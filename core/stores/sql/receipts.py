"""The SQL store's receipts part (:class:`~taskonce.stores.base.StoreReceipts`): the relay's
lease on a record's awaited receipts, their write-back, the receipts themselves (whether the
receivers' records exist) and the relay's work, each judged by the database's clock.

A record awaiting receipts is ``completed`` and keeps them in ``receipts``, its due time in
``sends_at`` (the relay's index; NULL once the rest were given up on, the entries kept for
``taskonce inspect``); the relay's lease on them uses the dispatch token and lease columns. A
record has sends pending (``sending``) or awaits receipts, never both, so these columns, free
once its sends were published, serve the receipts.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any

from sqlalchemy.engine import Connection

from taskonce.stores.base import Awaiting, DueForRelay, ReceiptLease
from taskonce.stores.sql.statements import Statements, rowcount
from taskonce.stores.transactional import TransactionalStore


def awaiting_params(awaiting: Awaiting) -> dict[str, Any]:
    """The bound parameters of a write of ``awaiting`` (:meth:`Statements.settle_receipts`,
    :attr:`Statements.dispatched_awaiting`)."""
    return {
        "p_entries": awaiting.entries,
        "p_due": None if awaiting.due is None else float(awaiting.due),
        "p_hold": float(awaiting.keep_at_least),
    }


class SQLReceipts(TransactionalStore):
    """:class:`~taskonce.stores.base.StoreReceipts`' primitives on the SQL stores' keys table:
    the part of :class:`~taskonce.stores.sql.base.SQLBase` the relay's look at receipts uses
    (:mod:`taskonce.receipts`). It runs the store's statements on the store's connection."""

    _sql: Statements

    @abc.abstractmethod
    def _connect(self, operation: str) -> contextlib.AbstractContextManager[Connection]:
        """A connection for ``operation`` (database errors raised as StoreUnavailable)."""

    def _take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
        """Take the lease (UPDATE fenced by due time and any other live lease), then read what
        was taken: two statements on one connection, as ``take_sends``."""
        params = {"p_key": key, "p_token": token, "p_lease": lease}
        with self._connect("take_receipts") as connection:
            taken = rowcount(connection.execute(self._sql.take_receipts, params)) == 1
            row = connection.execute(self._sql.read_receipts, params).one_or_none()
        if row is None:
            return ReceiptLease()  # none awaited, not due yet, given up on, or gone
        entries, holder, remaining, late = row
        if taken and holder == token and entries is not None:
            return ReceiptLease(entries, late=max(float(late), 0.0))
        return ReceiptLease(retry_after=max(float(remaining or 0.0), 0.0))

    def _settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        statements = (self._sql.clear_receipts, self._sql.settle_receipts)
        return self._fenced_with_awaiting("settle_receipts", statements, key, token, awaiting)

    def _fenced_with_awaiting(
        self,
        operation: str,
        statements: tuple[Any, Any],
        key: str,
        token: str,
        awaiting: Awaiting | None,
    ) -> bool:
        """One UPDATE fenced by ``token``: the first of ``statements``, or with ``awaiting``
        the second, which writes the receipts awaited too. True when it wrote."""
        params: dict[str, Any] = {"p_key": key, "p_token": token}
        plain, with_awaiting = statements
        statement = plain
        if awaiting is not None:
            statement = with_awaiting
            params.update(awaiting_params(awaiting))
        with self._connect(operation) as connection:
            return rowcount(connection.execute(statement, params)) == 1

    def _live_keys(self, keys: list[str]) -> set[str]:
        """One ``SELECT key … WHERE key IN (…)`` of the live records."""
        with self._connect("have_records") as connection:
            rows = connection.execute(self._sql.have_records, {"p_keys": keys})
            return {str(row[0]) for row in rows}

    def _due_for_relay(self, older_than: float, limit: int) -> DueForRelay:
        """One statement (:meth:`Statements._due_for_relay`): both halves, each oldest first."""
        params = {"p_age": older_than, "p_limit": limit}
        sends: list[tuple[float, str]] = []
        receipts: list[tuple[float, str]] = []
        with self._connect("due_for_relay") as connection:
            for kind, key, at in connection.execute(self._sql.due_for_relay, params):
                (sends if kind == "s" else receipts).append((float(at), str(key)))
        # UNION ALL keeps no order of its own: each half is sorted here (at most limit rows).
        return DueForRelay([k for _, k in sorted(sends)], [k for _, k in sorted(receipts)])


__all__ = ["SQLReceipts", "awaiting_params"]
