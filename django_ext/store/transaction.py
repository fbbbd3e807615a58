"""The handler's transaction on a Django database: what the transactional mode
(``Policy(transactional=True)``) runs a handler in when the store is ``django://ALIAS``.

The guard opens it before the handler runs (``transaction.atomic(using=ALIAS)``, entered), the
handler writes through the ORM as usual, and the guard writes the mark on the same connection
and commits — or rolls back when the handler raised or the mark met a concurrent copy's.
Writes on other aliases are not in it.
"""

from __future__ import annotations

import logging
from typing import Any

from taskonce.errors import StoreUnavailable
from taskonce.record import handlers_own

from .statements import Compiler, DjangoConnection

logger = logging.getLogger("taskonce.django_ext")


class DjangoTransaction:
    """An entered ``transaction.atomic(using=alias)`` that the guard commits or rolls back.

    It has the part of a SQLAlchemy ``Session`` the guard uses: :meth:`connection` (the store's
    statements on Django's connection), :meth:`commit`, :meth:`rollback`, :meth:`close`.
    """

    def __init__(self, alias: str, compiler: Compiler) -> None:
        from django.db import transaction

        self.alias = alias
        self._compiler = compiler
        self._atomic = transaction.atomic(using=alias)
        self._atomic.__enter__()
        self._open = True

    def _wrapper(self) -> Any:
        from django.db import connections

        return connections[self.alias]

    def connection(self) -> DjangoConnection:
        """The store's statements inside this transaction.

        :raises TransactionManagementError: the handler caught a database error inside the
            transaction without an ``atomic()`` block of its own, so Django will only roll it
            back: nothing of this run can be committed.
        """
        wrapper = self._wrapper()
        if wrapper.needs_rollback:
            from django.db.transaction import TransactionManagementError

            raise handlers_own(  # the handler's failure, not taskonce's (taskonce.record)
                TransactionManagementError(
                    f"the handler caught a database error inside taskonce's transaction on "
                    f"database {self.alias!r} without an atomic() block of its own, so Django "
                    "can only roll the transaction back: nothing of this run was committed "
                    "(wrap the statement that may fail in transaction.atomic())"
                )
            )
        return DjangoConnection(wrapper, self._compiler)

    def commit(self) -> None:
        """Leave the ``atomic`` block, committing the handler's rows and the mark together
        (or, nested in an outer block, releasing the savepoint). An integrity error the
        database raises only at the commit is the handler's own and is raised as it is."""
        from django.db import DatabaseError, IntegrityError

        self.connection()  # refuses a transaction Django will only roll back
        self._open = False
        try:
            self._atomic.__exit__(None, None, None)
        except IntegrityError as exc:
            handlers_own(exc)  # the handler's failure, not taskonce's (taskonce.record)
            raise
        except DatabaseError as exc:
            raise StoreUnavailable(
                f"commit on database {self.alias!r} failed: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            ) from exc

    def rollback(self) -> None:
        """Leave the ``atomic`` block, rolling back everything written in it."""
        if not self._open:
            return
        from django.db import DatabaseError, transaction

        self._open = False
        try:
            transaction.set_rollback(True, using=self.alias)
            self._atomic.__exit__(None, None, None)
        except DatabaseError as exc:  # a broken connection: Django closes it, nothing commits
            logger.warning("rolling back on database %r failed: %s", self.alias, exc)

    def close(self) -> None:
        """Roll back unless committed."""
        self.rollback()


__all__ = ["DjangoTransaction"]
