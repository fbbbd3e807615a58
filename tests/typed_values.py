"""Argument values that plain JSON cannot carry and the frameworks do (kombu's JSON: datetime,
Decimal, UUID, bytes; pickle: any object), shared by the test processes and the workers of the
serializer tests, with the check a task runs on what it received."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import uuid
from typing import Any

WHEN = datetime.datetime(2026, 1, 31, 12, 30, 15, 250000, tzinfo=datetime.timezone.utc)
OTHER_WHEN = WHEN + datetime.timedelta(days=1)
AMOUNT = decimal.Decimal("1234.5600")
IDENT = uuid.UUID("9bd0fdf8-8c43-485e-8165-473e5bdb792d")
#: not UTF-8: kombu's JSON carries it as Base64
BLOB = b"\x00\xff taskonce \xfe"

#: the four values, in the order the typed tasks take them
VALUES: tuple[Any, ...] = (WHEN, AMOUNT, IDENT, BLOB)


@dataclasses.dataclass(frozen=True)
class Parcel:
    """An object only pickle carries."""

    weight: decimal.Decimal
    sent: datetime.datetime
    tags: frozenset[str]


PARCEL = Parcel(decimal.Decimal("2.5"), WHEN, frozenset({"fragile", "gift"}))


def wrong_types(values: tuple[Any, ...], expected: tuple[Any, ...] = VALUES) -> str:
    """What differs between ``values`` and ``expected`` (type or value), or ``""``."""
    if len(values) != len(expected):
        return f"{len(values)} values, expected {len(expected)}"
    for i, (got, want) in enumerate(zip(values, expected, strict=True)):
        if type(got) is not type(want) or got != want:
            return (
                f"value {i}: {type(got).__name__} {got!r}, expected {type(want).__name__} {want!r}"
            )
    return ""
