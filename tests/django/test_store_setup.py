"""The Django store's set-up mistakes and its connections: each mistake is a ConfigError with a
text that says what to do, at the earliest moment; the store's own threads close the Django
connections they open."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from taskonce import ConfigError, open_store
from tests.django_project import databases

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def test_a_worker_start_on_an_unmigrated_database_is_refused_at_once(tmp_path: Path) -> None:
    """No table (``migrate`` never ran): the start check says so in one line, without waiting
    out its 30 s as it would for a server that does not answer yet."""
    result = run(
        """
        import time, django
        from django.conf import settings
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "new.db"}},
            INSTALLED_APPS=["taskonce.django_ext"],
        )
        django.setup()
        from taskonce import ConfigError
        from taskonce.django_ext import guard
        started = time.monotonic()
        try:
            guard().wait_for_store(30)
        except ConfigError as exc:
            print(f"{time.monotonic() - started:.1f}", exc)
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    took, _, message = result.stdout.strip().partition(" ")
    assert float(took) < 5
    assert message == (
        "store django://default: the table taskonce_keys does not exist in database 'default'; "
        "create it with: python manage.py migrate --database default"
    )


def test_a_worker_start_with_a_migration_not_applied_is_refused_at_once(tmp_path: Path) -> None:
    """The table is there (0001 ran) but a later migration did not: refused, naming it."""
    result = run(
        """
        import time, django
        from django.conf import settings
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "half.db"}},
            INSTALLED_APPS=["taskonce.django_ext"],
        )
        django.setup()
        from django.core.management import call_command
        call_command("migrate", "taskonce", "0001", verbosity=0)
        from taskonce import ConfigError
        from taskonce.django_ext import guard
        started = time.monotonic()
        try:
            guard().wait_for_store(30)
        except ConfigError as exc:
            print(f"{time.monotonic() - started:.1f}", exc)
        call_command("migrate", verbosity=0)
        guard().wait_for_store(30)  # all applied: ready
        print("ready")
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    first, _, last = result.stdout.strip().partition("\n")
    took, _, message = first.partition(" ")
    assert float(took) < 5
    # later migrations (if any) are named after it, in order
    assert message.startswith(
        "store django://default: taskonce's migration(s) taskonce.0002_receipts"
    )
    assert message.endswith(
        " have not run on database 'default'; apply them with: python manage.py migrate "
        "--database default"
    )
    assert last == "ready"


def test_an_unknown_alias_and_a_malformed_url_are_config_errors() -> None:
    databases.setup_django()
    with pytest.raises(ConfigError, match=r"no database 'nope' in settings.DATABASES \(there: "):
        open_store("django://nope")
    with pytest.raises(ConfigError, match="a Django database is named django://ALIAS"):
        open_store("django://default/extra")
    with pytest.raises(ConfigError, match="takes no options"):
        open_store("django://default", table="x")


def test_without_django_settings_the_url_says_what_it_needs(tmp_path: Path) -> None:
    result = run(
        """
        import taskonce
        try:
            taskonce.open_store("django://default")
        except taskonce.ConfigError as exc:
            print(exc)
        """,
        tmp_path,
    )
    assert result.stdout.startswith(
        "django://default needs Django's settings (DJANGO_SETTINGS_MODULE, django.setup())"
    ), result.stdout + result.stderr


def test_the_stores_own_threads_close_their_connections() -> None:
    """A liveness or heartbeat thread is no request: nothing of Django's closes its connection,
    so the store does after each write (CONN_MAX_AGE 0 here: closed at once)."""
    from django.db import connections

    from taskonce.django_ext import DjangoStore

    databases.ready(["default"])
    store = DjangoStore("default")
    seen: dict[str, object] = {}

    def beat() -> None:
        store.beat("w-close-test", 5)
        seen["own"] = connections["default"].connection

    def other() -> None:
        store.beat("w-close-test", 5)
        seen["other"] = connections["default"].connection
        connections.close_all()

    for name, target in (("taskonce-liveness", beat), ("worker-thread", other)):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join(30)
    assert seen["own"] is None  # closed by the store
    assert seen["other"] is not None  # a framework's thread: Django's rules, left open
    deadline = time.monotonic() + 10
    while store.seen("w-close-test") is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
