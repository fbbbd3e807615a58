"""The SQL store's statements run on a Django connection.

The store's logic (:class:`~taskonce.stores.sql.SQLStore`) speaks to a SQLAlchemy
``Connection``: ``execute(statement, params)`` and a result. :class:`DjangoConnection` gives it
that on the connection Django already holds for an alias in this thread: each statement is
compiled once for the database's dialect with Django's ``%s`` placeholders and run through
Django's cursor, so the store opens no connection (and no pool) of its own and its writes land
in whatever transaction Django has open on the alias.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import Compiled

#: Django's ``connection.vendor`` → the SQL store's dialect family.
VENDORS = {"postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


def dialect_for(family: str) -> Dialect:
    """A SQLAlchemy dialect of ``family`` that writes ``%s`` placeholders, as every Django
    backend's cursor takes them. Only compiles: it never connects."""
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    dialect: Dialect
    if family == "postgresql":
        dialect = postgresql.psycopg.dialect(paramstyle="format")  # type: ignore[no-untyped-call]
    elif family == "mysql":
        dialect = mysql.pymysql.dialect(paramstyle="format")
    else:
        dialect = sqlite.pysqlite.dialect(paramstyle="format")
    return dialect


class Row(tuple):  # type: ignore[type-arg]
    """A result row read by position, by slice, by name (``row.key``) or through ``_mapping``,
    as the store's code reads SQLAlchemy's rows."""

    _names: Mapping[str, int]

    def __new__(cls, values: Sequence[Any], names: Mapping[str, int]) -> Row:
        row = super().__new__(cls, values)
        row._names = names
        return row

    def __getattr__(self, name: str) -> Any:
        try:
            return self[self._names[name]]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def _mapping(self) -> dict[str, Any]:
        return {name: self[index] for name, index in self._names.items()}


class Result:
    """What one statement returned: its rows (all read at once) and its row count."""

    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self.rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def one_or_none(self) -> Row | None:
        if len(self.rows) > 1:
            raise sa.exc.MultipleResultsFound("more than one row")
        return self.rows[0] if self.rows else None

    def one(self) -> Row:
        row = self.one_or_none()
        if row is None:
            raise sa.exc.NoResultFound("no row")
        return row

    def scalar_one_or_none(self) -> Any:
        row = self.one_or_none()
        return None if row is None else row[0]


class Compiler:
    """The store's statements compiled for one dialect, each once (the store's fixed
    statements are compiled when first run; one built per call, such as a purge batch, each
    time)."""

    def __init__(self, family: str, fixed: Sequence[Any]) -> None:
        self.dialect = dialect_for(family)
        self._fixed = {id(statement) for statement in fixed}
        self._compiled: dict[int, Compiled] = {}

    def compile(self, statement: Any) -> Compiled:
        compiled = self._compiled.get(id(statement))
        if compiled is None:
            compiled = statement.compile(dialect=self.dialect)
            if id(statement) in self._fixed:
                self._compiled[id(statement)] = compiled
        return compiled


class DjangoConnection:
    """``execute(statement, params)`` through Django's connection ``wrapper`` (a
    ``django.db.backends.base.base.BaseDatabaseWrapper``), for the store's code."""

    def __init__(self, wrapper: Any, compiler: Compiler) -> None:
        self.wrapper = wrapper
        self._compiler = compiler

    def execute(self, statement: Any, params: Mapping[str, Any] | None = None) -> Result:
        compiled = self._compiler.compile(statement)
        state = compiled.construct_expanded_state(dict(params or {}))  # type: ignore[attr-defined]
        processors = state.processors
        values = [
            processors[name](value) if name in processors else value
            for name, value in zip(
                state.positiontup or (), state.positional_parameters, strict=True
            )
        ]
        with self.wrapper.cursor() as cursor:
            cursor.execute(state.statement, values)
            description = cursor.description
            rows: list[Row] = []
            if description:
                names = {column[0]: index for index, column in enumerate(description)}
                rows = [Row(values, names) for values in cursor.fetchall()]
            return Result(rows, cursor.rowcount)


__all__ = ["VENDORS", "Compiler", "DjangoConnection", "Result", "Row", "dialect_for"]
