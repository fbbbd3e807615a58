"""Unexpected errors inside the guard or a store, told once.

A bug in taskonce, or a driver version it does not get along with, raises the same error on
every delivery. The message must not be lost to it (:mod:`taskonce.action` treats it like a
store outage), and the log must not drown in it either: the first occurrence of each distinct
error in a process is logged with its traceback, every repeat as one line that says how many
times it has been seen. *Distinct* is the exception's type, its first line of text and where
it was raised (the file and line of the innermost frame).
"""

from __future__ import annotations

import logging
import os
import threading
import traceback

logger = logging.getLogger("taskonce")

#: The most distinct errors remembered per process; beyond it, new ones are logged without
#: their traceback too (an error whose text carries a message id would otherwise make each
#: delivery a "new" error, each with a traceback).
MAX_DISTINCT = 256

_lock = threading.Lock()
_seen: dict[tuple[str, str, str], int] = {}


def signature(exc: BaseException) -> tuple[str, str, str]:
    """What makes two errors the same: type, first line of text, innermost raising site."""
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    frames = traceback.extract_tb(exc.__traceback__)
    site = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return kind, first, site


def report(exc: BaseException, where: str, then: str) -> None:
    """Log the unexpected ``exc`` met ``where`` (e.g. ``"before running charge[abc]"``) and what
    happens ``then``: with its traceback the first time this process meets this error, as one
    line after that."""
    sig = signature(exc)
    with _lock:
        count = _seen.get(sig, 0) + 1
        full = count == 1 and len(_seen) < MAX_DISTINCT
        if count > 1 or len(_seen) < MAX_DISTINCT:
            _seen[sig] = count
    if full:
        logger.error(
            "taskonce: unexpected error %s: %s: %s; %s. This is a bug in taskonce or an "
            "incompatible driver version, not a problem with the message: later occurrences "
            "are logged in one line",
            where,
            type(exc).__name__,
            exc,
            then,
            exc_info=exc,
        )
        return
    seen = (
        f"seen {count} times in this process, the traceback logged at the first"
        if count > 1
        else f"traceback not logged: over {MAX_DISTINCT} distinct errors in this process"
    )
    logger.error(
        "taskonce: unexpected error %s: %s: %s (%s); %s",
        where,
        type(exc).__name__,
        exc,
        seen,
        then,
    )


def forget() -> None:
    """Forget every error seen (tests; and a forked child, which logs its own first ones)."""
    with _lock:
        _seen.clear()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # the parent's may have been held by a thread gone here
    _seen.clear()


os.register_at_fork(after_in_child=_after_fork)

__all__ = ["MAX_DISTINCT", "forget", "report", "signature"]
