"""The documented project layout (tests/django/layout_project.py: ``proj/celery.py`` doing
``setup(app, taskonce.django_ext.guard())``, imported from ``proj/__init__.py``) run as a user
runs it, in subprocesses: a ``TASKONCE`` mistake is ``manage.py check``'s error under its id,
without a traceback, and still stops a worker; a store database that does not exist and
migrations that have not run are check errors; the docs' Django test example passes under
pytest-django as written."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from taskonce.django_ext.conf import UnconfiguredGuard
from taskonce.errors import ConfigError
from taskonce.exits import EXIT_CONFIG
from tests.django.layout_project import celery, docs_block, run, write_project
from tests.helpers import require_service

TYPO = '{"DEFALT": {"mode": "eager"}}'
BAD_MODE = '{"DEFAULT": {"mode": "eagre"}}'


def worker(folder: Path, timeout: float = 90) -> tuple[int, str, float]:
    """``celery -A proj worker`` in ``folder``: its exit status, its output, the seconds it
    took (it must stop by itself)."""
    import subprocess

    from tests.django.layout_project import env

    started = time.monotonic()
    done = subprocess.run(
        [celery(), "-A", "proj", "worker", "-P", "solo", "--without-mingle"],
        cwd=folder,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_a_taskonce_typo_is_a_check_error_without_a_traceback(tmp_path: Path) -> None:
    project = write_project(tmp_path, TYPO)
    check = run(project, "manage.py", "check")
    assert check.returncode == 1, check.stderr
    assert (
        "?: (taskonce.E001) settings.TASKONCE has no setting 'DEFALT' (did you mean 'DEFAULT'?)"
    ) in check.stderr
    assert "Traceback" not in check.stdout + check.stderr
    # one line says the guard is not usable, then the checks speak
    assert "the project's guard refuses every use (manage.py check says more)" in check.stderr
    # every command that runs the checks stops on it the same way
    migrate = run(project, "manage.py", "migrate", "--noinput")
    assert migrate.returncode == 1
    assert "(taskonce.E001)" in migrate.stderr and "Traceback" not in migrate.stderr


def test_the_documented_layout_starts_a_worker_without_django_settings_module(
    tmp_path: Path,
) -> None:
    """docs/django.md's layout as written: ``celery -A proj worker`` in a shell where
    DJANGO_SETTINGS_MODULE is not set starts (proj/celery.py sets it). The control: the same
    layout without that line stops at once, Django's settings not configured."""
    import os
    import signal
    import subprocess

    from tests.django.layout_project import CELERY, env
    from tests.helpers import wait_for

    project = write_project(tmp_path)
    assert "DJANGO_SETTINGS_MODULE" not in env()
    assert run(project, "manage.py", "migrate", "--noinput").returncode == 0
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [celery(), "-A", "proj", "worker", "-P", "solo", "--without-mingle", "-l", "INFO"],
            cwd=project, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:

        def ready() -> bool:
            assert process.poll() is None, log_path.read_text(errors="replace")
            return " ready." in log_path.read_text(errors="replace")

        wait_for(ready, timeout=60, interval=0.1, what="the layout's worker to be ready")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    setdefault = 'os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")\n'
    assert setdefault in CELERY
    (project / "proj" / "celery.py").write_text(CELERY.replace(setdefault, ""))
    status, output, _ = worker(project)
    assert status != 0
    assert "settings are not configured" in output


def test_a_bad_policy_value_is_e002(tmp_path: Path) -> None:
    check = run(write_project(tmp_path, BAD_MODE), "manage.py", "check")
    assert check.returncode == 1
    assert (
        "?: (taskonce.E002) settings.TASKONCE[\"DEFAULT\"]: Policy.mode='eagre' is not valid; "
        "choose one of eager, lazy"
    ) in check.stderr
    assert "Traceback" not in check.stdout + check.stderr


def test_the_worker_still_refuses_to_start(tmp_path: Path) -> None:
    status, output, _ = worker(write_project(tmp_path, TYPO))
    assert status == EXIT_CONFIG, output
    assert (
        "taskonce: settings.TASKONCE has no setting 'DEFALT' (did you mean 'DEFAULT'?); known: "
        "STORE, DEFAULT, QUEUES, EVENTS, SEND_LIMIT, DISPATCH_LEASE, RELAY_EVERY, START_TIMEOUT, "
        "STORE_RETRY_DELAY; the worker does not start"
    ) in output
    assert "Traceback" not in output


def test_the_stand_in_guard_refuses_every_use() -> None:
    error = ConfigError("settings.TASKONCE has no setting 'X'")
    guard = UnconfiguredGuard(error)
    guard.register_publisher("celery", lambda *a: None)  # what setup(app, guard) does
    guard.close()
    for use in (
        lambda: guard.run("m-1", "q", print),
        lambda: guard.store,
        lambda: guard.frameworks(),
        lambda: setattr(guard, "x", 1),
    ):
        with pytest.raises(ConfigError, match="has no setting 'X'"):
            use()
    assert repr(guard) == "<UnconfiguredGuard: settings.TASKONCE has no setting 'X'>"


def test_a_store_database_that_does_not_exist_is_refused_at_once(tmp_path: Path) -> None:
    require_service("postgresql")
    name = f"taskonce_missing_{uuid.uuid4().hex[:8]}"
    store = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    project = write_project(tmp_path, f'{{"STORE": "{store}"}}')
    check = run(project, "manage.py", "check")
    assert check.returncode == 1, check.stderr
    assert (
        f'?: (taskonce.E006) the store {store}: the server says database "{name}" does not exist'
    ) in check.stderr
    status, output, took = worker(project)
    assert status == EXIT_CONFIG, output
    assert (
        f'taskonce: store {store}: the server says database "{name}" does not exist; create '
        "that database or correct the URL; the worker does not start"
    ) in output
    assert took < 20  # not the 30 s a store that does not answer gets


def test_unapplied_migrations_are_a_check_error_that_migrate_mends(tmp_path: Path) -> None:
    project = write_project(tmp_path)
    check = run(project, "manage.py", "check")
    assert check.returncode == 1
    assert (
        "?: (taskonce.E007) taskonce's migration(s) taskonce.0001_initial, taskonce.0002_receipts"
    ) in check.stderr
    assert "HINT: python manage.py migrate --database default" in check.stderr
    # a new project makes its own migrations before the first migrate: not stopped by E007
    make = run(project, "manage.py", "makemigrations", "shop")
    assert make.returncode == 0, make.stderr
    assert (project / "shop" / "migrations" / "0001_initial.py").is_file()
    for argv in (("showmigrations", "shop"), ("sqlmigrate", "shop", "0001")):
        shown = run(project, "manage.py", *argv)
        assert shown.returncode == 0, shown.stderr
        assert "taskonce.E007" not in shown.stderr
    check = run(project, "manage.py", "check")  # check still says it
    assert check.returncode == 1 and "(taskonce.E007)" in check.stderr
    migrate = run(project, "manage.py", "migrate", "--noinput")  # not stopped by E007
    assert migrate.returncode == 0, migrate.stderr
    check = run(project, "manage.py", "check")
    assert check.returncode == 0, check.stderr
    assert "System check identified no issues" in check.stdout


def test_the_docs_django_test_example_passes_under_pytest_django(tmp_path: Path) -> None:
    tests = docs_block(
        "django.md", "# shop/tests.py (pytest with pytest-django: pytest --ds proj.settings)"
    )
    project = write_project(tmp_path, tests=tests)
    done = run(
        project, "-m", "pytest", "-p", "no:cacheprovider", "--ds", "proj.settings", "-q",
        "shop/tests.py",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


ACTORS = """\
import dramatiq

from .models import Order, Payment


@dramatiq.actor(queue_name="payments")
def charge(order_id):
    Order.objects.filter(pk=order_id).update(paid=True)
    Payment.objects.create(order_id=order_id, cents=500)
"""

#: What the project's settings add for django_dramatiq (docs/django.md, Five lines for Dramatiq).
WITH_DJANGO_DRAMATIQ = """
INSTALLED_APPS.insert(0, "django_dramatiq")
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.rabbitmq.RabbitmqBroker",
    "OPTIONS": {"url": "amqp://127.0.0.1:1"},  # the tests must not need it
    "MIDDLEWARE": ["taskonce.django_ext.IdempotencyMiddleware"],
}
"""


def test_the_docs_dramatiq_test_example_passes_with_the_stub_broker(tmp_path: Path) -> None:
    """docs/django.md's test settings and actor test, as written, in a django_dramatiq project;
    the control: the same test under a plain ``django_db`` mark fails (the actor's thread does
    not see the test's uncommitted order), as the page says."""
    settings = docs_block("django.md", "# proj/settings_test.py (pytest --ds proj.settings_test)")
    tests = docs_block("django.md", "# shop/test_actors.py")
    project = write_project(tmp_path)
    with (project / "proj" / "settings.py").open("a") as file:
        file.write(WITH_DJANGO_DRAMATIQ)
    (project / "proj" / "settings_test.py").write_text(settings)
    (project / "shop" / "actors.py").write_text(ACTORS)
    (project / "shop" / "test_actors.py").write_text(tests)
    argv = ("-m", "pytest", "-p", "no:cacheprovider", "--ds", "proj.settings_test", "-q")
    done = run(project, *argv, "shop/test_actors.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
    plain = tests.replace("@pytest.mark.django_db(transaction=True)", "@pytest.mark.django_db")
    assert plain != tests
    (project / "shop" / "test_plain.py").write_text(plain)
    done = run(project, *argv, "shop/test_plain.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout


DRAMATIQ_SETTINGS = """\
SECRET_KEY = "layout-tests-only"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
INSTALLED_APPS = ["django_dramatiq", "taskonce.django_ext"]
TASKONCE = {"DEFALT": {"mode": "eager"}}
DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.stub.StubBroker",
    "OPTIONS": {},
    "MIDDLEWARE": ["dramatiq.middleware.Retries", "taskonce.django_ext.IdempotencyMiddleware"],
}
"""


def test_with_django_dramatiq_the_check_reports_and_rundramatiq_refuses(tmp_path: Path) -> None:
    """django_dramatiq builds the broker, with taskonce's middleware, while Django sets up."""
    from tests.django.layout_project import MANAGE

    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "settings.py").write_text(DRAMATIQ_SETTINGS)
    (tmp_path / "manage.py").write_text(MANAGE)
    check = run(tmp_path, "manage.py", "check")
    assert check.returncode == 1
    assert "?: (taskonce.E001) settings.TASKONCE has no setting 'DEFALT'" in check.stderr
    assert "Traceback" not in check.stdout + check.stderr
    workers = run(tmp_path, "manage.py", "rundramatiq", "--processes", "1", "--threads", "1")
    assert workers.returncode == EXIT_CONFIG, workers.stdout + workers.stderr
    assert (
        "taskonce: settings.TASKONCE has no setting 'DEFALT' (did you mean 'DEFAULT'?)"
    ) in workers.stderr
    assert "the worker does not start" in workers.stderr
