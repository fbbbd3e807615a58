"""Keys and payload fingerprints: what identifies one logical delivery."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from taskonce.errors import InvalidInput
from taskonce.stores.base import MAX_KEY_LENGTH

_CONTROL = re.compile(r"[\x00-\x1f]")
# Canonical JSON of a payload. One encoder for every call: json.dumps with any non-default
# option builds a new JSONEncoder each time, a measurable share of a guarded delivery.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def _escape_queue(queue: str) -> str:
    # ":" separates queue from id; escaping it keeps ("a:b", "c") and ("a", "b:c") apart.
    return queue.replace("%", "%25").replace(":", "%3A")


def queue_of(key: str) -> str | None:
    """The queue of a key that :func:`make_key` made (None for identity ``id``: no queue)."""
    head, separator, _ = key.partition(":")
    return head.replace("%3A", ":").replace("%25", "%") if separator else None


def make_key(message_id: object, queue: object, identity: str) -> str:
    """The store key of a delivery: ``queue:message_id`` (identity ``id+queue``) or the id alone.

    Raises :class:`InvalidInput` for a missing or empty id, a non-string queue, control
    characters, or a key longer than :data:`~taskonce.stores.base.MAX_KEY_LENGTH`.
    """
    if message_id is None or (isinstance(message_id, str) and not message_id.strip()):
        raise InvalidInput(
            f"message id {message_id!r} is missing or empty; a guarded message needs a stable, "
            "non-empty string id (Celery task id / Dramatiq message_id)"
        )
    if not isinstance(message_id, str):
        raise InvalidInput(
            f"message id must be a string, got {type(message_id).__name__} {message_id!r}; "
            f"pass str({message_id!r}) if that value is the stable id of this message"
        )
    if not isinstance(queue, str) or not queue.strip():
        raise InvalidInput(
            f"queue {queue!r} must be a non-empty string (got {type(queue).__name__})"
        )
    if _CONTROL.search(message_id) or _CONTROL.search(queue):
        raise InvalidInput(
            f"message id {message_id!r} or queue {queue!r} contains control characters"
        )
    try:
        (message_id + queue).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(
            f"message id {message_id!r} or queue {queue!r} is not valid Unicode text (a lone "
            "surrogate); a store key must encode as UTF-8"
        ) from None
    key = message_id if identity == "id" else f"{_escape_queue(queue)}:{message_id}"
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInput(
            f"key for message id {message_id[:40]!r}… on queue {queue[:40]!r} is {len(key)} "
            f"characters; the limit is {MAX_KEY_LENGTH}"
        )
    return key


#: hex digits of a payload fingerprint (96 bits)
FINGERPRINT_HEX = 24


def fingerprint(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A stable digest of task name, args and kwargs, serialised as canonical JSON: the first
    96 bits of their SHA-256, as 24 hex digits.

    A payload check compares two payloads under one message id, so 96 bits are plenty (two
    different ones would have to collide in them), and every remembered message carries one:
    a full SHA-256 alone was twice the rest of a completed Redis record (docs/performance.md).
    Tuples and lists hash alike (brokers turn one into the other); dict key order does not
    matter. Arguments JSON cannot represent raise :class:`InvalidInput`.
    """
    try:
        text = _CANONICAL.encode([task, list(args), dict(kwargs)])
    except (TypeError, ValueError) as exc:
        raise InvalidInput(
            f"arguments of task {task!r} cannot be fingerprinted as JSON ({exc}); pass "
            "JSON-serialisable arguments or set check_payload=False for this task"
        ) from exc
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX]


class _Tokens:
    """Owner tokens: 32 hex digits, a random half drawn once per process and a counter.

    A token only has to differ from every other claim's token (it fences writes; it is no
    secret: whoever can read the store can read it). Drawing all 16 bytes from the OS for
    every claim cost a system call per delivery; a forked child draws its own random half
    before its first token, so parent and child never share one.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._head = ""
        self._count = itertools.count()

    def next(self) -> str:
        pid = os.getpid()
        if pid != self._pid:
            self._head = secrets.token_hex(8)
            self._count = itertools.count()
            self._pid = pid
        return f"{self._head}{next(self._count):016x}"


_owner_tokens = _Tokens()


def owner_token() -> str:
    """A new claim's owner token (unique per claim, not secret)."""
    return _owner_tokens.next()
