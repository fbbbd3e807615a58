"""Shared fixtures of the Django tests: the test project (tests/django_project) on PostgreSQL,
set up in this process, and real processes of it — ``celery worker``, ``rundramatiq``,
``runserver`` — each in its own process group, with cwd the repository's root and
``DJANGO_SETTINGS_MODULE=tests.django_project.settings``.

Everything a run creates carries its own name: the queues (``TASKONCE_DJANGO_QUEUE``), the
events file, the marks directory; the database is the test process's own (named after the
xdist worker, see the settings), so its rows are read here with the ORM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, require_service, wait_for

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = "tests.django_project.settings"


# -- the project in this process ----------------------------------------------------------------


def setup_project() -> str:
    """Django set up on the test project in this process and its PostgreSQL database migrated;
    the database's name (the processes started here get it and ``DJANGO_SETTINGS_MODULE`` in
    their environment; this process's environment keeps neither, see
    :func:`tests.django_project.databases.setup_django`)."""
    require_service("postgresql")
    from tests.django_project import databases

    databases.ready(["default"])
    from django.conf import settings

    return str(settings.DATABASES["default"]["NAME"])


@pytest.fixture(scope="session")
def django_project() -> str:
    """The test project, set up in this process (its database's name)."""
    return setup_project()


def new_ref(label: str = "order") -> str:
    """An order reference no other test (or run) uses."""
    return f"{label}-{uuid.uuid4().hex[:12]}"


def new_order(label: str = "order", cents: int = 100) -> Any:
    """A committed ``Order`` with a fresh reference."""
    from tests.django_project.shop.models import Order

    return Order.objects.create(ref=new_ref(label), cents=cents)


def payments(ref: str) -> int:
    """How many payments the order ``ref`` has (committed rows)."""
    from tests.django_project.shop.models import Payment

    return int(Payment.objects.filter(order__ref=ref).count())


def order_exists(ref: str) -> bool:
    from tests.django_project.shop.models import Order

    return bool(Order.objects.filter(ref=ref).exists())


def order_paid(ref: str) -> bool:
    from tests.django_project.shop.models import Order

    return bool(Order.objects.filter(ref=ref, paid=True).exists())


def outbox_pending() -> list[str]:
    """The keys of the producer outbox's records whose sends are not all published yet."""
    from taskonce.django_ext.models import Record

    return [
        str(key)
        for key in Record.objects.filter(key__startswith="outbox:", status="sending").values_list(
            "key", flat=True
        )
    ]


# -- a run's names, its events ------------------------------------------------------------------


class Run:
    """One module's names and files: the queue prefix, the events file the processes write
    (``TASKONCE_DJANGO_EVENTS``), the marks directory (``TASKONCE_DJANGO_MARKS``)."""

    def __init__(self, tmp: Path, database: str, **env: str) -> None:
        self.tmp = tmp
        self.queue = f"dj{uuid.uuid4().hex[:10]}"
        self.events_path = tmp / "events.jsonl"
        self.marks = tmp / "marks"
        self.marks.mkdir(exist_ok=True)
        self.extra = dict(env)
        self.database = database

    def q(self, suffix: str = "") -> str:
        """The queue ``QUEUE`` (default policy), ``QUEUE-lazy`` or ``QUEUE-optimistic``."""
        return f"{self.queue}-{suffix}" if suffix else self.queue

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a project process of this run."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
        env.update(
            DJANGO_SETTINGS_MODULE=SETTINGS,
            PYTHONPATH=str(ROOT),
            TASKONCE_DJANGO_DB=self.database,
            TASKONCE_DJANGO_QUEUE=self.queue,
            TASKONCE_DJANGO_EVENTS=str(self.events_path),
            TASKONCE_DJANGO_MARKS=str(self.marks),
            TASKONCE_DJANGO_DISPATCH_LEASE="3",
        )
        env.update(self.extra)
        env.update(extra)
        return env

    def events(
        self, message_id: str | None = None, name: str | None = None
    ) -> list[dict[str, Any]]:
        try:
            text = self.events_path.read_text()
        except FileNotFoundError:
            return []
        found = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [
            e
            for e in found
            if (message_id is None or e.get("message_id") == message_id)
            and (name is None or e["event"] == name)
        ]

    def names(self, message_id: str) -> list[str]:
        return [e["event"] for e in self.events(message_id)]

    def count(self, message_id: str, name: str) -> int:
        return len(self.events(message_id, name))

    def runs(self, message_id: str) -> int:
        """Runs of ``message_id`` that made their writes (tests/django_project/shop/scenarios)."""
        return len(list(self.marks.glob(f"{message_id}.run.*")))

    def hung_pid(self, message_id: str) -> int:
        """The pid of the run of ``message_id`` that blocks (``hang=True``), once it does."""
        path = self.marks / f"{message_id}.hang"
        text = wait_for(
            lambda: path.exists() and path.read_text(), timeout=30, what="the run to block"
        )
        return int(text)


# -- processes ----------------------------------------------------------------------------------


class ProjectProcess:
    """A process of the project (``command`` run from the repository's root) in its own
    process group, its output in a log file; stopped, with its children, by its group."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], tmp: Path) -> None:
        self.name = name
        self.command = command
        self.env = env
        self.log_path = tmp / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ProjectProcess:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_until(self, condition: Callable[[], Any], timeout: float = 60, what: str = "") -> None:
        """Wait for ``condition``; fail with the log if the process exits first."""

        def check() -> Any:
            if not self.alive():
                code = None if self.process is None else self.process.returncode
                raise AssertionError(f"{self.name} exited ({code}):\n{self.log()[-6000:]}")
            return condition()

        wait_for(check, timeout=timeout, interval=0.05, what=what or f"{self.name} to be ready")

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left of it."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=8)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)

    def kill(self) -> None:
        """SIGKILL the whole process group at once."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


def celery_worker(run: Run, concurrency: int = 2, **env: str) -> ProjectProcess:
    """``celery -A tests.django_project.celery worker -P prefork`` on the run's three queues,
    started and ready."""
    queues = ",".join(run.q(suffix) for suffix in ("", "lazy", "optimistic"))
    command = [
        sys.executable, "-m", "celery", "-A", "tests.django_project.celery", "worker",
        "-P", "prefork", "-c", str(concurrency), "-Q", queues,
        "-n", f"{run.queue}-{uuid.uuid4().hex[:4]}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    ]  # fmt: skip
    worker = ProjectProcess("celery", command, run.env(**env), run.tmp).start()
    try:
        worker.wait_until(lambda: " ready." in worker.log(), what="the celery worker to be ready")
    except BaseException:
        worker.stop()
        raise
    return worker


def dramatiq_worker(run: Run, processes: int = 1, threads: int = 2, **env: str) -> ProjectProcess:
    """``python -m django rundramatiq`` (django_dramatiq: the ``dramatiq`` command on
    ``django_dramatiq.setup`` and the shop's actors module), started and ready."""
    command = [
        sys.executable, "-m", "django", "rundramatiq",
        "--processes", str(processes), "--threads", str(threads),
    ]  # fmt: skip
    worker = ProjectProcess(
        "dramatiq", command, run.env(TASKONCE_DJANGO_DRAMATIQ="1", **env), run.tmp
    ).start()
    try:
        worker.wait_until(
            lambda: worker.log().count("Worker process is ready for action.") >= processes,
            what="the dramatiq worker to be ready",
        )
    except BaseException:
        worker.stop()
        raise
    return worker


class WebServer(ProjectProcess):
    """``python -m django runserver`` on a free port (no autoreload)."""

    def __init__(self, run: Run, **env: str) -> None:
        self.port = free_port()
        command = [
            sys.executable, "-m", "django", "runserver", f"127.0.0.1:{self.port}",
            "--noreload", "--skip-checks",
        ]  # fmt: skip
        super().__init__("web", command, run.env(**env), run.tmp)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def start(self) -> WebServer:
        super().start()
        try:
            self.wait_until(self.answers, what="runserver to answer")
        except BaseException:
            self.stop()
            raise
        return self

    def post(self, path: str, timeout: float = 30, **form: Any) -> tuple[int, dict[str, Any]]:
        """POST ``form`` to ``path``: the status and the JSON answer (``{}`` when none)."""
        import urllib.error
        import urllib.parse
        import urllib.request

        data = urllib.parse.urlencode({k: str(v) for k, v in form.items()}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return int(response.status), json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return int(exc.code), {}


__all__ = [
    "ROOT",
    "SETTINGS",
    "ProjectProcess",
    "Run",
    "WebServer",
    "celery_worker",
    "dramatiq_worker",
    "new_order",
    "new_ref",
    "order_exists",
    "order_paid",
    "outbox_pending",
    "payments",
    "setup_project",
]
