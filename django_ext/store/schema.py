"""The store's two tables on a Django database: the same DDL as ``taskonce init-db`` writes
(:mod:`taskonce.stores.sql.schema`), compiled for the alias's backend and run through Django's
schema editor. The app's migration calls :func:`create_tables`; a table already there (made by
``taskonce init-db`` before the project moved to ``django://``) is kept as it is. Later
migrations add newer columns with :func:`add_columns` (only those missing: a table made by a
newer ``init-db`` or ``0001`` has them already) and remove them with :func:`drop_columns`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from taskonce.stores.sql.schema import DEFAULT_TABLE, make_live_table, make_table

from .statements import VENDORS, dialect_for


def _mysql_collation(connection: Any) -> str:
    """A binary collation that compares keys exactly, as the SQL store's tables have."""
    version = tuple(connection.mysql_version)
    if connection.mysql_is_mariadb:
        return "utf8mb4_nopad_bin" if version >= (10, 2) else "utf8mb4_bin"
    return "utf8mb4_0900_bin" if version >= (8, 0) else "utf8mb4_bin"


def table_ddl(connection: Any, table: str = DEFAULT_TABLE) -> list[tuple[str, list[str]]]:
    """``(table name, [CREATE TABLE, CREATE INDEX …])`` for the keys table and its liveness
    table on Django ``connection``'s backend."""
    family = VENDORS[connection.vendor]
    dialect = dialect_for(family)
    options: dict[str, Any] = {}
    if family == "mysql":
        options = {
            "mysql_engine": "InnoDB",
            "mysql_charset": "utf8mb4",
            "mysql_collate": _mysql_collation(connection),
        }
    made = []
    for make in (make_table, make_live_table):
        created = make(sa.MetaData(), table, None, **options)
        statements = [str(sa.schema.CreateTable(created).compile(dialect=dialect)).strip()]
        statements += [
            str(sa.schema.CreateIndex(index).compile(dialect=dialect)) for index in created.indexes
        ]
        made.append((created.name, statements))
    return made


def create_tables(connection: Any, table: str = DEFAULT_TABLE) -> bool:
    """Create the store's tables on Django ``connection`` unless they exist; True when this
    call created the keys table."""
    existing = set(connection.introspection.table_names())
    created = False
    with connection.cursor() as cursor:
        for name, statements in table_ddl(connection, table):
            if name in existing:
                continue
            for statement in statements:
                cursor.execute(statement)
            created = created or name == table
    return created


def _keys_table(connection: Any, table: str) -> tuple[sa.Table, Any]:
    """The keys table as the store describes it, and the dialect of ``connection``."""
    return make_table(sa.MetaData(), table, None), dialect_for(VENDORS[connection.vendor])


def add_columns(connection: Any, columns: Sequence[str], table: str = DEFAULT_TABLE) -> list[str]:
    """Add keys table columns ``columns`` (nullable, as the store declares them) and the
    indexes on them, each unless it is there already; the columns this call added."""
    keys, dialect = _keys_table(connection, table)
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        present = {c.name for c in connection.introspection.get_table_description(cursor, table)}
        indexes = set(connection.introspection.get_constraints(cursor, table))
        added = [name for name in columns if name not in present]
        for name in added:
            column = keys.c[name]
            ddl = column.type.compile(dialect=dialect)
            cursor.execute(f"ALTER TABLE {quote(table)} ADD COLUMN {quote(name)} {ddl}")
        for index in keys.indexes:
            if index.name not in indexes and {c.name for c in index.columns} & set(columns):
                cursor.execute(str(sa.schema.CreateIndex(index).compile(dialect=dialect)))
    return added


def drop_columns(connection: Any, columns: Sequence[str], table: str = DEFAULT_TABLE) -> None:
    """Drop keys table columns ``columns`` and the indexes on them (a migration's reverse)."""
    keys, dialect = _keys_table(connection, table)
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        present = {c.name for c in connection.introspection.get_table_description(cursor, table)}
        indexes = set(connection.introspection.get_constraints(cursor, table))
        for index in keys.indexes:
            if index.name in indexes and {c.name for c in index.columns} & set(columns):
                cursor.execute(str(sa.schema.DropIndex(index).compile(dialect=dialect)))
        for name in columns:
            if name in present:
                cursor.execute(f"ALTER TABLE {quote(table)} DROP COLUMN {quote(name)}")


def drop_tables(connection: Any, table: str = DEFAULT_TABLE) -> None:
    """Drop the store's tables (the migration's reverse)."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        for name, _ in reversed(table_ddl(connection, table)):
            cursor.execute(f"DROP TABLE IF EXISTS {quote(name)}")


__all__ = ["add_columns", "create_tables", "drop_columns", "drop_tables", "table_ddl"]


def unapplied_migrations(alias: str, app_label: str = "taskonce") -> list[str]:
    """The migrations of taskonce's app (``app_label``) not applied yet on database ``alias``,
    in order (``taskonce.0002_receipts``, …); one query of Django's migration table.

    :raises django.db.DatabaseError: the database does not answer."""
    from django.db import connections
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connections[alias])
    targets = [node for node in executor.loader.graph.leaf_nodes() if node[0] == app_label]
    plan = executor.migration_plan(targets)
    return [f"{migration.app_label}.{migration.name}" for migration, _ in plan]
