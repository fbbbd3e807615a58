"""Keys and payload fingerprints: what identifies one logical delivery."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import pickle
import re
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from taskonce.errors import InvalidInput
from taskonce.stores.base import MAX_KEY_LENGTH

if TYPE_CHECKING:
    from taskonce.ticket import Delivery

logger = logging.getLogger("taskonce")

_CONTROL = re.compile(r"[\x00-\x1f]")
# Canonical JSON of a payload. One encoder for every call: json.dumps with any non-default
# option builds a new JSONEncoder each time, a measurable share of a guarded delivery.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def queue_prefix(queue: str) -> str:
    """The start of every key :func:`make_key` makes on ``queue`` (identity ``id+queue``):
    the queue, escaped, and its ``:``. Escaping keeps ("a:b", "c") and ("a", "b:c") apart."""
    return queue.replace("%", "%25").replace(":", "%3A") + ":"


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
    key = message_id if identity == "id" else f"{queue_prefix(queue)}{message_id}"
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInput(
            f"key for message id {message_id[:40]!r}… on queue {queue[:40]!r} is {len(key)} "
            f"characters; the limit is {MAX_KEY_LENGTH}"
        )
    return key


#: hex digits of a payload fingerprint (96 bits)
FINGERPRINT_HEX = 24


def canonical_json(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """Task name, args and kwargs as canonical JSON (keys sorted, no spaces), UTF-8: what
    :func:`fingerprint` hashes. Raises ``TypeError``/``ValueError`` for what JSON cannot
    represent."""
    return _CANONICAL.encode([task, list(args), dict(kwargs)]).encode("utf-8")


#: An adapter's encoder of a delivery's payload for the fingerprint: ``(task, args, kwargs)``
#: to bytes, as its framework encodes them (:attr:`taskonce.Delivery.encode_payload`). It
#: raises when it cannot; the guard then checks nothing for that delivery.
PayloadEncoder = Callable[[str, Sequence[Any], Mapping[str, Any]], bytes]


def digest(encoded: bytes) -> str:
    """The fingerprint of an encoded payload: the first 96 bits of its SHA-256, in hex."""
    return hashlib.sha256(encoded).hexdigest()[:FINGERPRINT_HEX]


def fingerprint(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A stable digest of task name, args and kwargs, serialised as canonical JSON: the first
    96 bits of their SHA-256, as 24 hex digits.

    A payload check compares two payloads under one message id, so 96 bits are plenty (two
    different ones would have to collide in them), and every remembered message carries one:
    a full SHA-256 alone was twice the rest of a completed Redis record (docs/performance.md).
    Tuples and lists hash alike (brokers turn one into the other); dict key order does not
    matter. Arguments JSON cannot represent raise :class:`InvalidInput`
    (:func:`payload_fingerprint` skips the check for them instead).
    """
    try:
        text = canonical_json(task, args, kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(
            f"arguments of task {task!r} cannot be fingerprinted as JSON ({exc}); pass "
            "JSON-serialisable arguments or set check_payload=False for this task"
        ) from exc
    return digest(text)


class _CanonicalPickler(pickle._Pickler):
    """Pickle with the elements of sets and frozensets in a fixed order: their iteration order
    follows string hashes, which differ from one process to the next, so the same set pickled
    by two processes may give two byte strings."""

    dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]] = dict(pickle._Pickler.dispatch)

    def _save_unordered(self, obj: Any) -> None:
        self.save_reduce(type(obj), (sorted(obj, key=canonical_pickle),), obj=obj)  # type: ignore[attr-defined]

    dispatch[set] = _save_unordered
    dispatch[frozenset] = _save_unordered


def canonical_pickle(value: Any) -> bytes:
    """``value`` pickled (protocol 4) with sets in a fixed order: the same value gives the same
    bytes in every process, for a payload fingerprint of what only pickle carries."""
    out = io.BytesIO()
    _CanonicalPickler(out, protocol=4).dump(value)
    return out.getvalue()


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def payload_fingerprint(
    delivery: Delivery, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str | None:
    """The payload fingerprint of ``delivery`` with these arguments, or None when it cannot be
    computed.

    The delivery's :attr:`~taskonce.Delivery.encode_payload` is the framework's own encoding of
    the payload (the adapter's: Celery's serializer, Dramatiq's encoder); without one,
    canonical JSON (:func:`canonical_json`). A payload that cannot be encoded is never a
    reason to refuse a message: the check is skipped for it, with one warning per task and
    process naming why.
    """
    task, encode = delivery.task, delivery.encode_payload
    try:
        return digest(
            canonical_json(task, args, kwargs) if encode is None else encode(task, args, kwargs)
        )
    except Exception as exc:
        with _WARNED_LOCK:
            first = task not in _WARNED
            _WARNED.add(task)
        if first:
            logger.warning(
                "the payload of task %r cannot be fingerprinted (%s: %s); its deliveries run "
                "without the payload check (a reused id with other arguments is not detected). "
                "Further deliveries of this task are not reported again.",
                task,
                type(exc).__name__,
                exc,
            )
        return None


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
