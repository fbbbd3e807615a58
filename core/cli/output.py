"""What the commands print: one answer per command, human or ``--json``; times in ISO 8601
(local time, or UTC with ``--utc``) and durations in words; the answer for a key without a
live record."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, TextIO

from taskonce.exits import EXIT_NOT_FOUND
from taskonce.keys import queue_of
from taskonce.stores import Store

#: How a store key is written, for "no live record" answers.
KEY_FORM = (
    "keys are QUEUE:ID (e.g. celery:<task id>; --queue QUEUE ID builds one), or the message "
    "id alone with identity='id'"
)
#: How many similar keys a "no live record" answer suggests.
SUGGESTIONS = 5


def answer(out: TextIO, args: argparse.Namespace, data: Any, human: str) -> None:
    """Write a command's answer: ``data`` as JSON with ``--json``, else ``human``."""
    out.write((json.dumps(data, sort_keys=True) if args.json else human) + "\n")


def queue_column(key: str) -> str:
    """The queue part of a key (keys of identity ``id`` have none: ``-``)."""
    return queue_of(key) or "-"


def when(timestamp: float, utc: bool) -> str:
    """A store time as ISO 8601, in local time or UTC, to the second."""
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc)
    return (moment if utc else moment.astimezone()).isoformat(timespec="seconds")


def duration_in_words(seconds: float) -> str:
    """``seconds`` as its two largest units: ``4 min 12 s``, ``6 d 23 h``, ``850 ms``."""
    if seconds < 1:
        return f"{max(0.0, seconds) * 1000:.0f} ms"
    rest = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size} {unit}")
            rest %= size
    return " ".join(parts[:2])


def _similar_keys(store: Store, key: str) -> list[str]:
    """Live keys the operator may have meant by ``key``, which has no record: its message id
    (the text after the last ':') on any queue, or that id alone (identity ``id``)."""
    message_id = key.rpartition(":")[2] or key
    try:
        found = set(store.keys_ending(f":{message_id}", SUGGESTIONS + 1))
    except NotImplementedError:  # a store that cannot list its records
        found = set()
    if message_id != key and store.get(message_id) is not None:
        found.add(message_id)
    found.discard(key)
    return sorted(found)[:SUGGESTIONS]


def not_found(
    out: TextIO, args: argparse.Namespace, store: Store, key: str, data: Any, human: str
) -> int:
    """The answer for a key without a live record: ``human`` (with --json ``data``, the hint
    then on stderr), how a key is written and the similar live keys; exit status 1."""
    message_id = key.rpartition(":")[2] or key
    similar = _similar_keys(store, key)
    if similar:
        found = f"live keys ending in ':{message_id}': {', '.join(similar)}"
    else:
        found = f"no live key ends in ':{message_id}' either"
    if args.json:
        out.write(json.dumps(data, sort_keys=True) + "\n")
        sys.stderr.write(f"taskonce: {KEY_FORM}\ntaskonce: {found}\n")
    else:
        out.write(f"{human}\n{KEY_FORM}\n{found}\n")
    return EXIT_NOT_FOUND
