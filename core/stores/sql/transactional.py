"""The SQL store's transactional extension: the store's writes inside the caller's database
transaction. The transactional mode (``Policy(transactional=True)``) writes the mark in the
handler's transaction (:meth:`SQLTransactions.open_session`, :meth:`SQLTransactions.mark_in`,
:meth:`SQLTransactions.complete_in`); the producer outbox writes sends in the application's
(:meth:`SQLTransactions.check_shared`, :meth:`SQLTransactions.record_sends_in`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from taskonce.errors import ConfigError, InvalidInput
from taskonce.stores.base import TransactionalStore
from taskonce.stores.sql.connecting import FAMILIES, sqlite_path
from taskonce.stores.sql.schema import check_key, check_token


class SQLTransactions(TransactionalStore):
    """:class:`~taskonce.stores.base.TransactionalStore` on the SQL store's tables: the part
    of :class:`~taskonce.stores.sql.SQLStore` that writes through a caller's transaction. It
    uses the store's engines and its two writes (a fenced completion, a mark), which the store
    provides."""

    _url: URL
    _family: str
    _memory: bool
    _ready: bool
    _redacted: str
    _table_label: str

    @abc.abstractmethod
    def _errors(self, operation: str) -> contextlib.AbstractContextManager[None]:
        """Database errors during ``operation`` raised as StoreUnavailable."""

    @abc.abstractmethod
    def _ensure_ready(self, operation: str) -> None:
        """Create the store's tables unless they are known to exist."""

    @abc.abstractmethod
    def _transactional_engine(self) -> Engine:
        """The engine with ordinary transactions."""

    @abc.abstractmethod
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
        """The fenced completion through ``connection``."""

    @abc.abstractmethod
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
        """The mark through ``connection``."""

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
        check_key(key)
        check_token("fingerprint", fingerprint)
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
        family = FAMILIES.get(url.get_backend_name())
        theirs: tuple[Any, ...] = (family, url.host or None, url.port, url.database or None)
        ours: tuple[Any, ...] = (
            self._family,
            self._url.host or None,
            self._url.port,
            self._url.database or None,
        )
        if self._family == "sqlite":
            theirs, ours = (family, sqlite_path(url)), (self._family, sqlite_path(self._url))
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
        check_key(key)
        check_token("token", token)
        self._ensure_ready("record_sends_in")
        with self._errors("record_sends_in"):
            wrote = self._mark(
                connection, key, keep_for, None, None, sends, token, dispatch_lease, locking=True
            )
        if not wrote:
            raise InvalidInput(f"outbox record {key!r} exists already")


__all__ = ["SQLTransactions"]
