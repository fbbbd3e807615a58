"""The SQL store's transactions on its own engines: the transactional mode
(``Policy(transactional=True)``) opens the handler's session here
(:meth:`SQLTransactions.open_session`), and the producer outbox checks that an application's
engine reaches the store's database (:meth:`SQLTransactions.check_shared`). The writes through
either (``mark_in``, ``complete_in``, ``record_sends_in``) are the SQL base's
(:mod:`.base`), the same for Django's store.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any

from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session

from taskonce.errors import ConfigError
from taskonce.stores.sql.connecting import FAMILIES, sqlite_path


class SQLTransactions(abc.ABC):
    """The part of :class:`~taskonce.stores.sql.SQLStore` that opens sessions on its
    transactional engine and checks an application's engine against its own."""

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


__all__ = ["SQLTransactions"]
