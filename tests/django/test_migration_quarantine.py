"""Migration 0003 (crash-loop quarantine's ``crashes`` column): backwards to 0002 drops it,
forwards adds it again with the store's own DDL, and the store counts take-overs and
quarantines keys on the table it leaves."""

from __future__ import annotations

from typing import Any

import pytest

from taskonce.errors import ConfigError
from taskonce.stores.base import Status
from tests.django.test_migration_receipts import layout
from tests.django_project import databases
from tests.helpers import require_service


@pytest.mark.parametrize("alias", ["default", "mariadb", "sqlite"])
def test_0003_backwards_and_forwards(alias: str) -> None:
    if alias != "sqlite":
        require_service("postgresql" if alias == "default" else alias)
    databases.ready([alias])
    from django.core.management import call_command

    from taskonce.django_ext import DjangoStore

    assert "crashes" in layout(alias)[0]
    try:
        call_command("migrate", "taskonce", "0002", database=alias, verbosity=0)
        columns, indexes = layout(alias)
        assert "crashes" not in columns and "receipts" in columns
        assert sorted(indexes.values()) == [["expires_at"], ["sends_at"]]
        # a worker refuses to start on it, naming the migration and the command
        unapplied = r"migration\(s\) taskonce.0003_quarantine have not run .* manage.py migrate"
        with pytest.raises(ConfigError, match=unapplied):
            DjangoStore(alias).check_ready()
    finally:
        call_command("migrate", "taskonce", database=alias, verbosity=0)
    columns, indexes = layout(alias)
    assert "crashes" in columns
    assert sorted(indexes.values()) == [["expires_at"], ["sends_at"]]  # no index of its own
    databases.empty(alias)
    store: Any = DjangoStore(alias)
    try:
        store.claim("q:a", "o1", 300, 600, None, "h/1/2/3")
        assert store.take_over("q:a", "o1", "o2", 300, 600, "h/1/2/4") == 1
        store.quarantine("q:a", "o2", 600)
        from taskonce.django_ext.models import Record

        row = Record.objects.using(alias).get(key="q:a")
        assert (row.status, row.crashes, row.state) == ("quarantined", 1, "quarantined")
        assert store.get("q:a").status is Status.QUARANTINED
    finally:
        databases.empty(alias)
