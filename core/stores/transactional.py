"""The transactional part of the store contract: a store that writes its records inside the
caller's database transaction (the SQL store and Django's). Its public methods follow the
rules of :mod:`taskonce.stores.base` (checked arguments, :class:`~taskonce.errors.LeaseLost`
only from a primitive's answer); its primitives take the caller's session or connection.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

from taskonce.errors import InvalidInput, LeaseLost
from taskonce.stores import arguments as check
from taskonce.stores.base import Completion, Marking, Store

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.orm import Session

__all__ = ["TransactionalStore"]


class TransactionalStore(Store):
    """A store that can write its records inside the caller's database transaction: the
    transactional mode (the mark commits with the handler's writes) and the producer outbox
    (sends commit with the application's rows). The guard and the outbox check for it with
    ``isinstance``. Implementations: the SQL store and Django's."""

    @abc.abstractmethod
    def open_session(self) -> Session:
        """A session on the store's database, its transaction begun: the handler writes through
        it and :meth:`complete_in` / :meth:`mark_in` add the record; the caller commits."""

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
        """:meth:`StoreKeys.complete`, written through ``session``'s transaction (not
        committed): :class:`LeaseLost` when the claim is no longer ``owner``'s."""
        done = check.completion(key, owner, keep_for, result, sends, dispatch_lease)
        if not self._complete_in(session, done):
            raise LeaseLost(key, "complete")

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
        """:meth:`StoreKeys.mark`, written through ``session``'s transaction (not committed).

        A concurrent transaction's uncommitted mark of the same key makes this wait for it
        (PostgreSQL, InnoDB; SQLite serialises write transactions anyway): when it commits this
        returns False — a concurrent duplicate, so the caller rolls back — and when it rolls
        back this writes the mark and returns True."""
        return self._mark_in(
            session,
            check.marking(key, keep_for, fingerprint, result, sends, token, dispatch_lease),
        )

    @abc.abstractmethod
    def check_shared(self, bind: Engine | Connection, in_transaction: bool = False) -> None:
        """:class:`~taskonce.errors.ConfigError` unless ``bind`` reaches this store's
        database."""

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
        for ``dispatch_lease`` seconds) through ``connection``'s transaction (not committed):
        the producer outbox's rows, which commit or roll back with the application's.
        :class:`~taskonce.errors.InvalidInput` when ``key`` is recorded already."""
        encoded = check.encode_sends(check.check_sends(sends))
        if encoded is None:
            raise InvalidInput(f"outbox record {key!r} holds no sends")
        self._record_sends_in(
            connection,
            check.check_key(key),
            encoded,
            check.check_token("token", token),
            check.check_seconds("keep_for", keep_for),
            check.check_seconds("dispatch_lease", dispatch_lease, zero=True),
        )

    @abc.abstractmethod
    def _complete_in(self, session: Session, done: Completion) -> bool:
        """:meth:`complete_in`'s fenced write: False when the claim is not ``owner``'s."""

    @abc.abstractmethod
    def _mark_in(self, session: Session, mark: Marking) -> bool:
        """:meth:`mark_in`'s write."""

    @abc.abstractmethod
    def _record_sends_in(
        self,
        connection: Connection,
        key: str,
        sends: str,
        token: str,
        keep_for: float,
        dispatch_lease: float,
    ) -> None:
        """:meth:`record_sends_in`'s write."""
