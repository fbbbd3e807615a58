"""The classify pass: read the events, group them by key (the one shuffle over all events) and
classify each event of each key from its key's row.

:func:`classify` is the per-event definition (one window over each key's timeline) that the
audit's own classification (:func:`group_by_key`, then :func:`classified_events`) gives the same
figures as, row for row.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING

from taskonce.events import Event
from taskonce.spark_ext.common import (
    KNOWN_EVENTS,
    NONE_NAME,
    any_of,
    first_position,
    flag,
    in_names,
)
from taskonce.spark_ext.inputs import CORRUPT_COLUMN
from taskonce.spark_ext.semantics import (
    ANCHOR_EVENTS,
    CLAIM_START_EVENTS,
    DELIVERY_EVENTS,
    DONE_EVENTS,
    FAILURE_EVENTS,
    FRAMEWORK_BROKERS,
    NEAR_MISS_RATIO,
    RUN_EVENTS,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

#: Input bytes per shuffle partition, and the most partitions chosen by default.
SHUFFLE_BYTES = 64 * 1024 * 1024
MAX_SHUFFLE_PARTITIONS = 2000

#: The event fields the audit uses; the others (``mode``, ``duration_ms``, ``reason``,
#: ``count``) are dropped before the shuffle by key, and ``framework`` crosses it only as a
#: small number (:data:`FRAMEWORK_FLAGS`).
AUDIT_COLUMNS = (
    "t_ms",
    "framework",
    "event",
    "key",
    "queue",
    "message_id",
    "task",
    "worker",
    "attempt",
    "redelivered",
    "lease_s",
    "keep_for_s",
    "recovery_s",
    CORRUPT_COLUMN,
    "seq",
)
#: The frameworks whose brokers' redelivery bounds are known (semantics.FRAMEWORK_BROKERS), as
#: bits: each key row ORs its events' bits, so the frameworks a log names cost the shuffle one
#: small number per event, not a string.
FRAMEWORK_FLAGS = {name: 1 << index for index, name in enumerate(sorted(FRAMEWORK_BROKERS))}


def _per_key(column: Column) -> Column:
    """``column`` for rows with a key, null for the others."""
    from pyspark.sql import functions as F

    return F.when(F.col("key").isNotNull(), column)


def _running(events: DataFrame) -> DataFrame:
    """:func:`classify`'s first step: malformed rows lose their event name (``is_valid`` 0),
    and each keyed row gets its key's running ``done_before``, ``anchor_ms``, ``seg`` and
    ``owner`` over one window by key."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    ordered = Window.partitionBy("key").orderBy("t_ms", "seq")
    before = ordered.rowsBetween(Window.unboundedPreceding, -1)
    so_far = ordered.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    valid = (
        F.col("event").isin(sorted(KNOWN_EVENTS))
        & F.col("t_ms").isNotNull()
        & F.col(CORRUPT_COLUMN).isNull()
    )
    # malformed rows (unknown event name, unreadable ts or line) lose their event name, so
    # they count in nothing but the malformed total
    events = events.withColumn("is_valid", F.when(valid, 1).otherwise(0)).withColumn(
        "event", F.when(valid, F.col("event"))
    )
    # One window over all rows (rows without a key form one group whose key-dependent columns
    # are nulled: see _per_key): no union, so the result stays partitioned by key and the
    # later per-key aggregations need no second shuffle.
    events = events.select(
        "*",
        _per_key(
            F.coalesce(F.sum(flag(in_names("event", DONE_EVENTS))).over(before), F.lit(0))
        ).alias("done_before"),
        _per_key(F.min(F.when(in_names("event", ANCHOR_EVENTS), F.col("t_ms"))).over(so_far)).alias(
            "anchor_ms"
        ),
        _per_key(F.sum(flag(in_names("event", CLAIM_START_EVENTS))).over(so_far)).alias("seg"),
        _per_key(
            F.last(
                F.when(in_names("event", CLAIM_START_EVENTS), F.col("worker")), ignorenulls=True
            ).over(so_far)
        ).alias("owner"),
    )
    return events


def classify(events: DataFrame, keep_for_s: float | None = None) -> DataFrame:
    """Per-event classification over each key's timeline (one window, ordered by time and then
    source order): the definition the audit's own classification from each key's grouped row
    (:func:`group_by_key`) gives the same figures as, row for row.

    Adds: ``done_before`` (completed/marked events of the key before this one), ``anchor_ms``
    (the key's first claim or mark so far), ``seg`` (the number of claims started so far),
    ``owner`` (the worker that started the current claim), ``dup_kind`` (``skipped``,
    ``in_flight``, ``concurrent``, ``rerun`` or null), ``gap_ms``, ``leaked_run``,
    ``near_miss`` and the 0/1 flags ``is_delivery``, ``is_run``, ``is_failure``.
    ``is_valid`` is 0 for malformed rows (no known event name, unreadable ``ts`` or line: their
    ``event`` is nulled); events without a key pass through with the key-dependent columns
    null. The result is partitioned by ``key``.
    """
    from pyspark.sql import functions as F

    events = _running(events)
    dup_kind = _per_key(
        F.when(F.col("event") == Event.DUPLICATE_SKIPPED.value, "skipped")
        .when(F.col("event") == Event.IN_PROGRESS_DEFERRED.value, "in_flight")
        .when(F.col("event") == Event.CONCURRENT_DUPLICATE.value, "concurrent")
        .when(in_names("event", RUN_EVENTS) & (F.col("done_before") > 0), "rerun")
    )
    events = events.withColumn("dup_kind", dup_kind)
    events = events.withColumn(
        "gap_ms",
        F.when(
            F.col("dup_kind").isNotNull() & F.col("anchor_ms").isNotNull(),
            F.greatest(F.col("t_ms") - F.col("anchor_ms"), F.lit(0).cast("long")),
        ),
    )
    keep_for = F.coalesce(F.col("keep_for_s"), F.lit(keep_for_s).cast("double"))
    both = events.withColumn(
        "leaked_run", flag(in_names("dup_kind", ("concurrent", "rerun")))
    ).withColumn(
        "near_miss",
        flag(
            in_names("dup_kind", ("skipped", "in_flight"))
            & (F.col("gap_ms") > keep_for * (NEAR_MISS_RATIO * 1000.0))
        ),
    )
    name_of = {
        name: F.when(
            F.col("is_valid") == 1, F.coalesce(F.nullif(F.col(name), F.lit("")), F.lit(NONE_NAME))
        ).otherwise(F.lit(NONE_NAME))
        for name in ("queue", "task")
    }
    return both.drop(CORRUPT_COLUMN).select(
        "*",
        flag(in_names("event", DELIVERY_EVENTS)).alias("is_delivery"),
        flag(in_names("event", RUN_EVENTS)).alias("is_run"),
        flag(in_names("event", FAILURE_EVENTS)).alias("is_failure"),
        name_of["queue"].alias("queue_name"),
        name_of["task"].alias("task_name"),
    )


#: The fields of each event that the passes after the grouping by key use, in the order of the
#: per-key arrays (``t_ms`` then ``seq`` first: the arrays sort on them).
EVENT_FIELDS = (
    "t_ms",
    "seq",
    "event",
    "queue_name",
    "task_name",
    "worker",
    "lease_s",
    "keep_for_s",
    "recovery_s",
    "attempt",
    "redelivered",
    "message_id",
)


def _named(events: DataFrame) -> DataFrame:
    """Null the event name of malformed rows and add ``queue_name``/``task_name``: row by row,
    before any shuffle."""
    from pyspark.sql import functions as F

    valid = (
        F.col("event").isin(sorted(KNOWN_EVENTS))
        & F.col("t_ms").isNotNull()
        & F.col(CORRUPT_COLUMN).isNull()
    )
    name_of = {
        name: F.when(valid, F.coalesce(F.nullif(F.col(name), F.lit("")), F.lit(NONE_NAME)))
        .otherwise(F.lit(NONE_NAME))
        .alias(f"{name}_name")
        for name in ("queue", "task")
    }
    return events.select(
        "*",
        valid.alias("_valid"),
        name_of["queue"],
        name_of["task"],
    ).withColumn("event", F.when(F.col("_valid"), F.col("event")))


def _gathered(events: DataFrame) -> DataFrame:
    """:func:`group_by_key`'s shuffle: each key's valid events gathered into one sorted array,
    beside the row's last valid time, first and last delivery time and framework flags."""
    from pyspark.sql import functions as F

    named = _named(events)
    keyed = F.col("_valid") & F.col("key").isNotNull()
    fields = [
        (
            F.when(~keyed, F.col("message_id")).alias("message_id")
            if name == "message_id"
            else F.col(name)
        )
        for name in EVENT_FIELDS
    ]
    # The row's last valid event and its first and last delivery, as numbers beside the
    # array: the audit's span and log end then read three numeric columns of the kept rows,
    # not every row's array of events.
    delivery_t = F.when(in_names("event", DELIVERY_EVENTS), F.col("t_ms"))
    framework_flag: Column = F.lit(0)
    if "framework" in events.columns:
        for name, bit in FRAMEWORK_FLAGS.items():
            framework_flag = F.when(F.col("framework") == name, F.lit(bit)).otherwise(
                framework_flag
            )
    framework_flag = F.when(F.col("_valid"), framework_flag).otherwise(F.lit(0)).cast("byte")
    # Shuffled by the grouping columns first, so that the grouping finds each key's events in
    # one partition and aggregates them there once: grouped straight away, Spark would first
    # gather a partial list per key on the map side of the shuffle (sorting all events by key
    # to do it, since nearly every key is new), which only costs when a key's events are far
    # apart in the log. The same partitioning as the grouping's own shuffle.
    return (
        named.select(
            F.when(keyed, F.col("key")).alias("key"),
            F.when(~keyed, F.col("seq")).alias("_row"),
            F.struct(*fields).alias("_event"),
            F.when(F.col("_valid"), F.col("t_ms")).alias("_valid_t"),
            delivery_t.alias("_delivery_t"),
            framework_flag.alias("_framework"),
        )
        .repartition("key", "_row")
        .groupBy("key", "_row")
        .agg(
            F.sort_array(F.collect_list("_event")).alias("events"),
            F.max("_valid_t").alias("last_valid_ms"),
            F.min("_delivery_t").alias("first_delivery_ms"),
            F.max("_delivery_t").alias("last_delivery_ms"),
            F.bit_or("_framework").alias("frameworks"),
        )
    )


def group_by_key(events: DataFrame) -> DataFrame:
    """Each key's valid events as one row: ``key``, ``events`` (an array of structs of
    :data:`EVENT_FIELDS`, sorted by time and then source order), ``first_done`` and
    ``first_anchor`` (the 1-based positions in ``events`` of the key's first completed/marked
    event and of its first claim, mark or completion; 0 without one), ``delivered`` and
    ``leaked`` (a concurrent duplicate, or a run after the first completion),
    ``last_valid_ms``, ``first_delivery_ms`` and ``last_delivery_ms`` (the times of the row's
    last valid event and of its first and last delivery; null without one), and
    ``frameworks`` (the :data:`FRAMEWORK_FLAGS` of its valid events' ``framework``, ORed).

    Malformed rows and rows without a key are rows of their own (``key`` null, one event): they
    count in the totals and take no part in any key's timeline. One shuffle, the only one over
    all events.
    """
    from pyspark.sql import functions as F

    grouped = _gathered(events)

    # Array functions over the names only (see first_position): with lambdas over the
    # events, this grouping took twice as long.
    names = F.col("events")["event"]

    def first(wanted: Iterable[str]) -> Column:
        return F.coalesce(first_position(names, wanted), F.lit(0)).cast("int")

    grouped = grouped.select(
        "key",
        "events",
        first(DONE_EVENTS).alias("first_done"),
        first(ANCHOR_EVENTS).alias("first_anchor"),
        "last_valid_ms",
        "first_delivery_ms",
        "last_delivery_ms",
        "frameworks",
    )
    # a leaked run: a concurrent duplicate, or a run after the key's first completion
    after_done = F.slice(names, F.col("first_done") + 1, F.size(names) - F.col("first_done"))
    leaked = F.array_contains(names, F.lit(Event.CONCURRENT_DUPLICATE.value)) | (
        (F.col("first_done") > 0) & any_of(after_done, RUN_EVENTS)
    )
    delivered = any_of(names, DELIVERY_EVENTS)
    keyed_row = F.col("key").isNotNull()
    return grouped.select(
        "*",
        (keyed_row & delivered).alias("delivered"),
        (keyed_row & leaked).alias("leaked"),
    )


def classified_events(grouped: DataFrame, keep_for_s: float | None) -> DataFrame:
    """The per-event view of :func:`group_by_key`'s rows, classified as :func:`classify` does
    (``key``, the :data:`EVENT_FIELDS`, ``is_valid``, ``anchor_ms``, ``dup_kind``, ``gap_ms``,
    ``leaked_run``, ``near_miss``, ``is_delivery``, ``is_run``, ``is_failure``; and, on each
    key's first event only, ``key_delivered`` and ``key_leaked``, with the key's first queue
    and task as ``key_queue``, ``key_task``): each key's first completion and first anchor are
    known from its row, so every event is classified by its position alone, with no window."""
    from pyspark.sql import functions as F

    position = F.col("_pos") + 1
    anchor_t = F.try_element_at(F.col("events"), F.col("first_anchor"))["t_ms"]
    flat = grouped.select(
        "key",
        F.when(F.col("key").isNotNull() & (F.col("first_anchor") > 0), anchor_t).alias("_anchor_t"),
        "first_anchor",
        "first_done",
        "delivered",
        "leaked",
        F.col("events")[0]["queue_name"].alias("_key_queue"),
        F.col("events")[0]["task_name"].alias("_key_task"),
        F.posexplode("events").alias("_pos", "_e"),
    )
    first_of_key = F.col("_pos") == 0
    flat = flat.select(
        "key",
        *[F.col("_e")[name].alias(name) for name in EVENT_FIELDS],
        # each key once, under its first event's queue and task
        flag(first_of_key & F.col("delivered")).alias("key_delivered"),
        flag(first_of_key & F.col("leaked")).alias("key_leaked"),
        F.col("_key_queue").alias("key_queue"),
        F.col("_key_task").alias("key_task"),
        F.when(F.col("first_anchor") <= position, F.col("_anchor_t")).alias("anchor_ms"),
        ((F.col("first_done") > 0) & (F.col("first_done") < position)).alias("_done_before"),
    )
    keyed = F.col("key").isNotNull()
    dup_kind = F.when(
        keyed,
        F.when(F.col("event") == Event.DUPLICATE_SKIPPED.value, "skipped")
        .when(F.col("event") == Event.IN_PROGRESS_DEFERRED.value, "in_flight")
        .when(F.col("event") == Event.CONCURRENT_DUPLICATE.value, "concurrent")
        .when(in_names("event", RUN_EVENTS) & F.col("_done_before"), "rerun"),
    )
    flat = flat.withColumn("dup_kind", dup_kind).withColumn(
        "gap_ms",
        F.when(
            F.col("dup_kind").isNotNull() & F.col("anchor_ms").isNotNull(),
            F.greatest(F.col("t_ms") - F.col("anchor_ms"), F.lit(0).cast("long")),
        ),
    )
    keep_for = F.coalesce(F.col("keep_for_s"), F.lit(keep_for_s).cast("double"))
    return flat.select(
        *[name for name in flat.columns if name != "_done_before"],
        flag(F.col("event").isNotNull()).alias("is_valid"),
        flag(in_names("dup_kind", ("concurrent", "rerun"))).alias("leaked_run"),
        flag(
            in_names("dup_kind", ("skipped", "in_flight"))
            & (F.col("gap_ms") > keep_for * (NEAR_MISS_RATIO * 1000.0))
        ).alias("near_miss"),
        flag(in_names("event", DELIVERY_EVENTS)).alias("is_delivery"),
        flag(in_names("event", RUN_EVENTS)).alias("is_run"),
        flag(in_names("event", FAILURE_EVENTS)).alias("is_failure"),
    )


def shuffle_partitions(spark: SparkSession, raw: DataFrame, has_jdbc: bool) -> int:
    """About one shuffle partition per 64 MB of (uncompressed) input, at least the default
    parallelism: Spark's default of 200 makes a small log take minutes on a laptop."""
    parallelism = int(spark.sparkContext.defaultParallelism)
    total = 0
    for uri in raw.inputFiles():
        parsed = urllib.parse.urlsplit(uri)
        local = urllib.parse.unquote(parsed.path) if parsed.scheme in ("", "file") else uri
        try:
            size = os.path.getsize(local)
        except OSError:
            size = SHUFFLE_BYTES  # not a local file: count it as one partition's worth
        total += size * (6 if local.endswith(".gz") else 1)
    wanted = math.ceil(total / SHUFFLE_BYTES) + (2 * parallelism if has_jdbc else 0)
    return max(parallelism, min(wanted, MAX_SHUFFLE_PARTITIONS))


def log_bounds(grouped: DataFrame) -> tuple[int | None, list[str], float]:
    """One action over the kept key rows (of :func:`group_by_key`): the log's end (its last
    valid event), the frameworks its events name (of :data:`FRAMEWORK_FLAGS`) and the span
    from its first to its last delivery in seconds (which sets the timeline's buckets, counted
    in the per-scope pass's aggregation)."""
    from pyspark.sql import functions as F

    row = grouped.agg(
        F.max("last_valid_ms").alias("last_ms"),
        F.min("first_delivery_ms").alias("first_delivery_ms"),
        F.max("last_delivery_ms").alias("last_delivery_ms"),
        F.bit_or("frameworks").alias("frameworks"),
    ).first()
    log_end_ms = None if row is None else row["last_ms"]
    flags = int((row["frameworks"] if row is not None else None) or 0)
    frameworks = [name for name, bit in FRAMEWORK_FLAGS.items() if flags & bit]
    first_ms = None if row is None else row["first_delivery_ms"]
    last_ms = None if row is None else row["last_delivery_ms"]
    span_s = ((last_ms - first_ms) / 1000.0) if first_ms is not None else 0.0
    return log_end_ms, frameworks, span_s
