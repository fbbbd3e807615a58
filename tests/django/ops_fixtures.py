"""Helpers of the operations tests (test_checks.py, test_admin.py, test_commands.py): the test
project's PostgreSQL database in this process, a few records in its store, and subprocess runs
of ``python -m django`` on the project's settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.django_project import databases
from tests.helpers import require_service

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = "tests.django_project.settings"

#: The records :func:`put_records` writes, by what they are.
CLAIMED = "payments:m-claimed"
HANDLED = "emails:m-handled"
SENDING = "emails:m-sending"
EXPIRED = "reports:m-expired"
OTHER = "payments:m-other"
KEYS = (CLAIMED, HANDLED, SENDING, EXPIRED, OTHER)


def project_store() -> Iterator[Any]:
    """The project's database (``default``, PostgreSQL) migrated and emptied, the guard of
    ``settings.TASKONCE`` forgotten before and after; yields a ``DjangoStore`` on it.

    ``DJANGO_SETTINGS_MODULE``, which setting Django up puts in the environment, is taken out
    again after: worker processes that later tests start would inherit it (Celery's Django
    fixup would then set the test project up in them)."""
    require_service("postgresql")
    had_settings = "DJANGO_SETTINGS_MODULE" in os.environ
    databases.ready(["default"])
    databases.empty("default")
    from taskonce.django_ext import DjangoStore, conf

    conf.reset()
    try:
        yield DjangoStore("default")
    finally:
        conf.reset()
        databases.empty("default")
        if not had_settings:
            os.environ.pop("DJANGO_SETTINGS_MODULE", None)


def put_records(store: Any) -> None:
    """One record of each state: a claim, a mark, a mark with a pending send, an expired mark,
    and a second claim on the claim's queue."""
    store.claim(CLAIMED, "owner-1", 300.0, 3600.0, None, "host:1:0")
    store.claim(OTHER, "owner-2", 300.0, 3600.0, None, "host:2:0")
    assert store.mark(HANDLED, 3600.0, None, None)
    send = json.dumps({"id": "child-1", "framework": "celery", "body": {"task": "shop.ship"}})
    assert store.mark(SENDING, 3600.0, None, None, sends=[send], token="t-1")
    assert store.mark(EXPIRED, 0.05, None, None)
    time.sleep(0.2)  # the last one has expired


def db_name() -> str:
    """This process's database name (the subprocesses must use the same)."""
    from django.conf import settings

    return str(settings.DATABASES["default"]["NAME"])


def django(
    *argv: str, settings: str = SETTINGS, extra_path: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGV --settings SETTINGS`` in a subprocess, on this process's
    databases (``extra_path`` goes first on PYTHONPATH, for a settings module of a test)."""
    env = dict(os.environ, TASKONCE_DJANGO_DB=db_name(), DJANGO_SETTINGS_MODULE=settings)
    paths = [str(extra_path)] if extra_path else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "django", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def settings_module(tmp_path: Path, name: str, body: str) -> Path:
    """A settings module ``name`` in ``tmp_path``: the test project's settings, then ``body``;
    returns the folder to put on PYTHONPATH."""
    (tmp_path / f"{name}.py").write_text(f"from {SETTINGS} import *  # noqa: F403\n\n{body}\n")
    return tmp_path
