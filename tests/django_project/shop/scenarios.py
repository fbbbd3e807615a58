"""What the tests make a run of a shop task or actor do around its ORM writes, by keyword
arguments the tests add to the messages they publish (a view's sends carry none)::

    with rehearsal(message_id, **test):
        ...  # the ORM writes

- ``meet=SECONDS``: before the writes, wait (at most that long) until another run of the same
  message has started too: two copies inside their transactions at the same moment;
- ``hang=True``: after the writes, the first run of the message writes its pid to a marks
  file and blocks until the test SIGKILLs it;
- ``fail=True``: after the writes, the first run raises :class:`Declined` (its retry goes
  through);
- ``sleep=SECONDS``: after the writes, take that long.

Each run leaves a file ``<message id>.run.<uuid>`` in the marks directory
(``TASKONCE_DJANGO_MARKS``) as it starts, outside any transaction: the tests count runs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

MARKS = Path(os.environ.get("TASKONCE_DJANGO_MARKS") or tempfile.gettempdir())


class Declined(Exception):
    """The payment provider said no this time (``fail=True``): a retry goes through."""


def _first(message_id: str, what: str, text: str = "") -> bool:
    """Whether this is the first run of ``message_id`` to get here (an O_EXCL file)."""
    try:
        fd = os.open(MARKS / f"{message_id}.{what}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(text)
    return True


@contextlib.contextmanager
def rehearsal(
    message_id: str,
    meet: float = 0.0,
    hang: bool = False,
    fail: bool = False,
    sleep: float = 0.0,
) -> Iterator[None]:
    """Around a run's writes, what the test asked of it (see the module's docstring)."""
    (MARKS / f"{message_id}.run.{uuid.uuid4().hex}").touch()
    if meet:
        deadline = time.monotonic() + meet
        while len(list(MARKS.glob(f"{message_id}.run.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    yield
    if hang and _first(message_id, "hang", str(os.getpid())):
        time.sleep(300)  # the test SIGKILLs this process
    if fail and _first(message_id, "fail"):
        raise Declined(f"declined once, for message {message_id}")
    if sleep:
        time.sleep(sleep)
