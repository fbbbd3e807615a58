"""The test project's databases: created on the services when missing, migrated, emptied."""

from __future__ import annotations

import os
from collections.abc import Iterable

#: The aliases of the test project's databases, by the store kind tests name them with.
ALIASES = {"django-postgresql": "default", "django-mariadb": "mariadb", "django-sqlite": "sqlite"}


def setup_django() -> None:
    """Configure Django with the test project's settings in this process (once)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()


def _create(alias: str, name: str) -> None:
    if alias == "default":
        import psycopg

        with psycopg.connect(
            "host=127.0.0.1 port=5432 user=postgres dbname=test", autocommit=True
        ) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
                conn.execute(f'CREATE DATABASE "{name}"')
    elif alias == "mariadb":
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", autocommit=True)
        try:
            with conn.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
        finally:
            conn.close()


_migrated: set[str] = set()


def ready(aliases: Iterable[str] = ("default",)) -> None:
    """Django set up, and each alias's database created and migrated (once per process)."""
    setup_django()
    from django.conf import settings
    from django.core.management import call_command

    for alias in aliases:
        if alias in _migrated:
            continue
        _create(alias, settings.DATABASES[alias]["NAME"])
        call_command("migrate", database=alias, verbosity=0, interactive=False)
        _migrated.add(alias)


def empty(alias: str, tables: Iterable[str] = ("taskonce_keys", "taskonce_keys_live")) -> None:
    """Delete every row of ``tables`` on ``alias``."""
    from django.db import connections

    with connections[alias].cursor() as cursor:
        for table in tables:
            cursor.execute(f"DELETE FROM {connections[alias].ops.quote_name(table)}")
