"""The store's tables, ``taskonce_keys`` and ``taskonce_keys_live``, with the same DDL as
``taskonce init-db`` (tables made by it are kept)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


def create(apps: Any, schema_editor: Any) -> None:
    from taskonce.django_ext.store.schema import create_tables

    create_tables(schema_editor.connection)


def drop(apps: Any, schema_editor: Any) -> None:
    from taskonce.django_ext.store.schema import drop_tables

    drop_tables(schema_editor.connection)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(create, drop)],
            state_operations=[
                migrations.CreateModel(
                    name="Record",
                    fields=[
                        (
                            "key",
                            models.CharField(max_length=255, primary_key=True, serialize=False),
                        ),
                        ("status", models.CharField(max_length=16)),
                        ("owner", models.CharField(max_length=64, null=True)),
                        ("fingerprint", models.CharField(max_length=64, null=True)),
                        ("result", models.TextField(null=True)),
                        ("created_at", models.FloatField()),
                        ("lease_until", models.FloatField()),
                        ("expires_at", models.FloatField()),
                        ("worker", models.CharField(max_length=255, null=True)),
                        ("sends", models.TextField(null=True)),
                        ("sends_token", models.CharField(max_length=64, null=True)),
                        ("sends_at", models.FloatField(null=True)),
                        ("sends_lease", models.FloatField(null=True)),
                    ],
                    options={
                        "db_table": "taskonce_keys",
                        "verbose_name": "record",
                        "ordering": ("-created_at",),
                    },
                ),
                migrations.CreateModel(
                    name="WorkerSeen",
                    fields=[
                        (
                            "worker",
                            models.CharField(max_length=255, primary_key=True, serialize=False),
                        ),
                        ("seen_at", models.FloatField()),
                        ("alive_until", models.FloatField()),
                    ],
                    options={
                        "db_table": "taskonce_keys_live",
                        "verbose_name": "worker seen",
                        "verbose_name_plural": "workers seen",
                    },
                ),
            ],
        )
    ]
