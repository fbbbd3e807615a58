"""What the audit's passes share: the event names it reads, the scope name of events without a
queue or task, and small helpers over Spark columns (built-in functions only) and figures."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import TYPE_CHECKING

from taskonce.events import EVENT_NAMES, Event
from taskonce.spark_ext.semantics import RECHECK_EVENT

if TYPE_CHECKING:
    from pyspark.sql import Column

#: The event names the audit reads (any other makes its row malformed).
KNOWN_EVENTS = frozenset({*EVENT_NAMES, RECHECK_EVENT})

#: Up to this many duplicates, percentiles are exact (Spark ``percentile``, linear
#: interpolation between the closest ranks); above, ``percentile_approx`` with
#: :data:`APPROX_ACCURACY`.
EXACT_PERCENTILE_LIMIT = 200_000
APPROX_ACCURACY = 100_000
#: Scope name for events without a queue or task.
NONE_NAME = "(none)"
#: The hand-off's events.
SENDS_EVENTS = (
    Event.SENDS_DEFERRED.value,
    Event.SENDS_DISPATCHED.value,
    Event.SENDS_REDISPATCHED.value,
    Event.SENDS_DISCARDED.value,
)


def in_names(column: str, names: Iterable[str]) -> Column:
    """Whether ``column`` holds one of ``names``."""
    from pyspark.sql import functions as F

    return F.col(column).isin(list(names))


def flag(condition: Column) -> Column:
    """1 where ``condition`` holds, else 0."""
    from pyspark.sql import functions as F

    return F.when(condition, 1).otherwise(0)


# Built-in array functions over an array of event names (``events.event``), no lambdas: Spark
# compiles these to code, while higher-order functions (transform, filter, exists) are
# interpreted element by element.


def first_position(names: Column, wanted: Iterable[str]) -> Column:
    """The least 1-based position in ``names`` of any of ``wanted``; null without one."""
    from pyspark.sql import functions as F

    found = [F.nullif(F.array_position(names, F.lit(name)), F.lit(0)) for name in wanted]
    return F.least(*found) if len(found) > 1 else found[0]


def any_of(names: Column, wanted: Iterable[str]) -> Column:
    """Whether ``names`` holds any of ``wanted`` (null when it holds a null and none of them;
    a keyed row's events are all valid, so never null there)."""
    from pyspark.sql import functions as F

    return F.arrays_overlap(names, F.array(*[F.lit(name) for name in wanted]))


def scope_key(scope: str, name: str) -> str:
    """The key of a scope in the audit's per-scope dicts: ``overall``, ``queue:<name>`` or
    ``task:<name>``."""
    return "overall" if scope == "overall" else f"{scope}:{name}"


def iso(ms: int | None) -> str | None:
    """Epoch milliseconds as ISO 8601 UTC text to the millisecond (None for None)."""
    if ms is None:
        return None
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def seconds(ms: float | None) -> float:
    """Milliseconds as seconds to the millisecond (0.0 for None)."""
    return 0.0 if ms is None else round(float(ms) / 1000.0, 3)


def number(value: float) -> int | float:
    """A whole number as an int, any other as a float."""
    return int(value) if float(value).is_integer() else float(value)
