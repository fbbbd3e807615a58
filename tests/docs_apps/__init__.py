"""A user's application as the docs name it (``myapp``), for the docs' blocks that need one:
``tests/docs_apps`` goes on ``sys.path`` (``PYTHONPATH`` of a worker, ``addPyFile`` of a Spark
session), so the pages' ``from myapp.tasks import charge`` and ``"myapp.tasks:charge"`` work as
written. ``try_a_duplicate.py`` is docs/celery.md's producer. See :func:`fixed_names`."""

from __future__ import annotations

import contextlib
import fcntl
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
