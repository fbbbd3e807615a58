"""The receipts' columns on ``taskonce_keys`` (published sends awaiting their receipts, and when
the relay looks for them) and their index, with the same DDL as ``taskonce init-db`` (a table
that has them already is kept as it is)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

COLUMNS = ("receipts", "receipts_at")


def add(apps: Any, schema_editor: Any) -> None:
    from taskonce.django_ext.store.schema import add_columns

    add_columns(schema_editor.connection, COLUMNS)


def drop(apps: Any, schema_editor: Any) -> None:
    from taskonce.django_ext.store.schema import drop_columns

    drop_columns(schema_editor.connection, COLUMNS)


class Migration(migrations.Migration):
    dependencies = [("taskonce", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(add, drop)],
            state_operations=[
                migrations.AddField(
                    model_name="record", name="receipts", field=models.TextField(null=True)
                ),
                migrations.AddField(
                    model_name="record", name="receipts_at", field=models.FloatField(null=True)
                ),
            ],
        )
    ]
