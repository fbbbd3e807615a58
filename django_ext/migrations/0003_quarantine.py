"""Crash-loop quarantine's column on ``taskonce_keys``: ``crashes``, how many times a claim of
the key was taken over from a dead owner (``Policy.crash_limit``); a quarantined key has status
``quarantined``. The same DDL as ``taskonce init-db`` (a table that has it already is kept as
it is)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

COLUMNS = ("crashes",)


def add(apps: Any, schema_editor: Any) -> None:
    from taskonce.django_ext.store.schema import add_columns

    add_columns(schema_editor.connection, COLUMNS)


def drop(apps: Any, schema_editor: Any) -> None:
    from taskonce.django_ext.store.schema import drop_columns

    drop_columns(schema_editor.connection, COLUMNS)


class Migration(migrations.Migration):
    dependencies = [("taskonce", "0002_receipts")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(add, drop)],
            state_operations=[
                migrations.AddField(
                    model_name="record", name="crashes", field=models.IntegerField(null=True)
                ),
            ],
        )
    ]
