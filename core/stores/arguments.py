"""The checks of a store call's arguments, the same for every store: the base's public methods
(:mod:`taskonce.stores.base`) run them before anything reaches the server, so a bad argument
is refused with the same :class:`~taskonce.errors.InvalidInput` and the same text on every
store, and nothing is written.

The limits are the SQL store's columns (:data:`~taskonce.stores.answers.MAX_KEY_LENGTH`,
:data:`~taskonce.stores.answers.MAX_TOKEN_LENGTH`,
:data:`~taskonce.stores.answers.MAX_WORKER_LENGTH`): a key that one store takes is taken by
every store, so moving from memory or Redis to SQL never starts refusing keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from taskonce import checks
from taskonce.errors import InvalidInput
from taskonce.stores.answers import (
    MAX_KEY_LENGTH,
    MAX_TOKEN_LENGTH,
    MAX_WORKER_LENGTH,
    Awaiting,
    Completion,
    Marking,
)

_INF = float("inf")

__all__ = [
    "check_awaiting",
    "check_fingerprint",
    "check_key",
    "check_keys",
    "check_limit",
    "check_result",
    "check_seconds",
    "check_sends",
    "check_text",
    "check_token",
    "check_worker",
    "completion",
    "encode_sends",
    "marking",
]


def _bounded(name: str, value: object, limit: int, shown: int) -> str:
    """``value`` unless it is not a non-empty string of at most ``limit`` characters; the
    error shows its first ``shown`` characters."""
    if type(value) is str and 0 < len(value) <= limit:
        return value  # the common case first: every store call runs this
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{name} {value!r} must be a non-empty string")
    if len(value) > limit:
        raise InvalidInput(
            f"{name} {value[:shown]!r}… is {len(value)} characters; the limit is {limit}"
        )
    return value


def check_key(key: object) -> str:
    """``key`` unless it is not a non-empty string of at most ``MAX_KEY_LENGTH`` characters."""
    return _bounded("key", key, MAX_KEY_LENGTH, 40)


def check_text(name: str, value: object) -> str:
    """``value`` unless it is not a ``str`` (a part of a key to match; may be empty)."""
    if not isinstance(value, str):
        raise InvalidInput(f"{name} {value!r} must be a string")
    return value


def check_keys(keys: object) -> list[str]:
    """``keys`` as a list, each checked as a key (a ``str`` is refused: it is one key)."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise InvalidInput(f"keys {keys!r} must be a sequence of keys")
    return [check_key(key) for key in keys]


def check_token(name: str, value: object) -> str:
    """``value`` unless it is not a non-empty string of at most ``MAX_TOKEN_LENGTH``
    characters (an owner or dispatch token)."""
    return _bounded(name, value, MAX_TOKEN_LENGTH, 20)


def check_fingerprint(fingerprint: object) -> str | None:
    """``fingerprint``: None, or a token (:func:`check_token`)."""
    return None if fingerprint is None else check_token("fingerprint", fingerprint)


def check_worker(worker: object, *, optional: bool = False) -> str | None:
    """``worker`` unless it is not a non-empty string of at most ``MAX_WORKER_LENGTH``
    characters (None allowed with ``optional``)."""
    if worker is None and optional:
        return None
    return _bounded("worker identity", worker, MAX_WORKER_LENGTH, 20)


def check_seconds(name: str, value: object, *, zero: bool = False) -> float:
    """``value`` as seconds: a finite number above 0 (at least 0 with ``zero``); never a
    ``bool`` (:func:`taskonce.checks.check_seconds`)."""
    if type(value) is float or type(value) is int:  # the common case first (NaN fails it)
        if 0 <= value < _INF if zero else 0 < value < _INF:
            return float(value)
    return checks.check_seconds(name, value, zero=zero, error=InvalidInput)


def check_limit(name: str, value: object, *, minimum: int = 1) -> int:
    """``value`` as a count of at least ``minimum`` (:func:`taskonce.checks.check_count`)."""
    return checks.check_count(name, value, minimum=minimum, error=InvalidInput)


def check_result(result: object) -> str | None:
    """``result``: None or JSON text."""
    if result is not None and not isinstance(result, str):
        raise InvalidInput(f"result {result!r} must be None or JSON text")
    return result


def check_sends(sends: object) -> Sequence[str]:
    """``sends``: a sequence of JSON texts (a ``str`` is refused: it is one send)."""
    if sends == ():
        return ()  # the common case: nothing sent
    if isinstance(sends, str) or not isinstance(sends, Sequence):
        raise InvalidInput(f"sends {sends!r} must be a sequence of JSON texts")
    for send in sends:
        if not isinstance(send, str):
            raise InvalidInput(f"send {send!r} must be JSON text")
    return sends


def check_awaiting(awaiting: object) -> Awaiting | None:
    """``awaiting``: None or an :class:`~taskonce.stores.answers.Awaiting`."""
    if awaiting is not None and not isinstance(awaiting, Awaiting):
        raise InvalidInput(f"awaiting {awaiting!r} must be None or an Awaiting")
    return awaiting


def encode_sends(sends: Sequence[str]) -> str | None:
    """The sends a write records, as the one JSON array text every store keeps; None for none."""
    return json.dumps(list(sends)) if sends else None


def completion(
    key: object,
    owner: object,
    keep_for: object,
    result: object,
    sends: object,
    dispatch_lease: object,
) -> Completion:
    """A completion's arguments checked, its sends encoded (``complete``, ``complete_in``)."""
    return Completion(
        check_key(key),
        check_token("owner", owner),
        check_seconds("keep_for", keep_for),
        check_result(result),
        encode_sends(check_sends(sends)),
        check_seconds("dispatch_lease", dispatch_lease, zero=True),
    )


def marking(
    key: object,
    keep_for: object,
    fingerprint: object,
    result: object,
    sends: object,
    token: object,
    dispatch_lease: object,
) -> Marking:
    """A mark's arguments checked, its sends encoded (``mark``, ``mark_in``); the dispatch
    token only matters, and is only checked, with sends."""
    encoded = encode_sends(check_sends(sends))
    return Marking(
        check_key(key),
        check_seconds("keep_for", keep_for),
        check_fingerprint(fingerprint),
        check_result(result),
        encoded,
        check_token("token", token) if encoded else "",
        check_seconds("dispatch_lease", dispatch_lease, zero=True),
    )
