"""Migration 0002 (the receipts' columns and index): backwards to 0001 drops them, forwards adds
them again with the store's own DDL, and the store works on the table it leaves."""

from __future__ import annotations

from typing import Any

import pytest

from taskonce.stores.base import Awaiting
from tests.django_project import databases
from tests.helpers import require_service

COLUMNS = {"receipts", "receipts_at"}


def layout(alias: str) -> tuple[set[str], dict[str, list[str]]]:
    """The keys table's columns and its indexes' columns on ``alias``."""
    from django.db import connections

    wrapper = connections[alias]
    with wrapper.cursor() as cursor:
        columns = {
            c.name for c in wrapper.introspection.get_table_description(cursor, "taskonce_keys")
        }
        constraints = wrapper.introspection.get_constraints(cursor, "taskonce_keys")
    indexes = {name: info["columns"] for name, info in constraints.items() if info["index"]}
    return columns, indexes


@pytest.mark.parametrize("alias", ["default", "mariadb", "sqlite"])
def test_0002_backwards_and_forwards(alias: str) -> None:
    if alias != "sqlite":
        require_service("postgresql" if alias == "default" else alias)
    databases.ready([alias])
    from django.core.management import call_command

    from taskonce.django_ext import DjangoStore

    columns, indexes = layout(alias)
    assert COLUMNS <= columns and ["receipts_at"] in indexes.values()
    try:
        call_command("migrate", "taskonce", "0001", database=alias, verbosity=0)
        columns, indexes = layout(alias)
        assert not COLUMNS & columns
        assert ["receipts_at"] not in indexes.values()
        assert ["sends_at"] in indexes.values()  # the rest of 0001's table is kept
    finally:
        call_command("migrate", "taskonce", database=alias, verbosity=0)
    columns, indexes = layout(alias)
    assert COLUMNS <= columns and ["receipts_at"] in indexes.values()
    databases.empty(alias)
    store: Any = DjangoStore(alias)
    try:
        assert store.mark("q:a", 600, None, None, ('{"id":"a"}',), token="t1", dispatch_lease=30)
        assert store.dispatched("q:a", "t1", Awaiting("[]", 0.0, 600))
        assert store.due_for_relay().receipts == ["q:a"]
        from taskonce.django_ext.models import Record

        row = Record.objects.using(alias).get(key="q:a")
        assert row.receipts == "[]" and row.receipts_at is not None
    finally:
        databases.empty(alias)
