"""A user's application as the docs name it (``myapp``), for the docs' blocks that need one:
``tests/docs_apps`` goes on ``sys.path`` (``PYTHONPATH`` of a worker, ``addPyFile`` of a Spark
session), so the pages' ``from myapp.tasks import charge`` and ``"myapp.tasks:charge"`` work as
written. ``try_a_duplicate.py`` is docs/celery.md's producer. See :func:`fixed_names`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The folder to put on ``sys.path``.
PATH = Path(__file__).resolve().parent


@contextlib.contextmanager
def fixed_names(what: str) -> Iterator[None]:
    """Hold a lock file in the system's temporary directory while a test uses names the page
    fixes (a port, a queue), so two runs of it on this machine (other checkouts too) take
    turns instead of meeting there. pytest-timeout bounds the wait."""
    with open(Path(tempfile.gettempdir()) / f"taskonce-tests-{what}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def myapp_worker(app: str, env: dict[str, str], folder: Path) -> Iterator[Path]:
    """A real ``celery -A app worker`` (prefork, one child) of the user's app, ready; yields its
    log file and stops it (its process group) at the end. ``env`` names its own ``MYAPP_PREFIX``,
    which is also its node name."""
    from tests.helpers import wait_for

    log = folder / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "prefork",
             "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", f"{env['MYAPP_PREFIX']}@%h", "-l", "INFO"],
            cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def ready() -> bool:
        assert worker.poll() is None, log.read_text()
        return " ready." in log.read_text()

    try:
        wait_for(ready, timeout=60, interval=0.1, what="the worker to be ready")
        yield log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
