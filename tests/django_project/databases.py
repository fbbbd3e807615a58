"""The test project's databases: created on the services when missing, migrated, emptied."""

from __future__ import annotations

from collections.abc import Iterable

#: The aliases of the test project's databases, by the store kind tests name them with.
ALIASES = {"django-postgresql": "default", "django-mariadb": "mariadb", "django-sqlite": "sqlite"}


#: What a worker process of the test project needs in its environment.
SETTINGS_MODULE = "tests.django_project.settings"


def setup_django() -> None:
    """Configure Django with the test project's settings in this process (once).

    Through ``settings.configure``, not ``DJANGO_SETTINGS_MODULE``: the environment is
    inherited by every worker process other tests start, and Celery turns its Django fixup on
    for any app made where that variable is set. A test that starts a worker of the project
    sets it in that worker's environment (:data:`SETTINGS_MODULE`)."""
    import django
    from django.apps import apps
    from django.conf import settings

    if not settings.configured:
        from tests.django_project import settings as project

        # Not its LOGGING: in a test process that would set the taskonce loggers' levels for
        # every test after this one (the project's worker processes keep it).
        values = {name: getattr(project, name) for name in dir(project) if name.isupper()}
        values.pop("LOGGING", None)
        settings.configure(**values)
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
