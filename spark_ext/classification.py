"""The classify pass: read the events (:func:`prepared`), tell the plain keys from the others
(:func:`key_shapes`), group the others' events by key (:func:`grouped_rows`) and classify each
of their events from its key's row (:func:`classified_events`); the plain keys' events are
classified row by row (:func:`plain_events`).

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


def prepared(events: DataFrame) -> DataFrame:
    """The events as every pass after the read uses them, row by row, before any shuffle:
    malformed rows lose their event name (``_valid`` false) and their key (they take part in
    no key's timeline), ``queue_name``/``task_name`` (:data:`NONE_NAME` where absent or
    malformed), ``message_id`` only on rows without a key (a keyed row's lives in its key),
    ``_framework`` as :data:`FRAMEWORK_FLAGS` bits, and the other :data:`EVENT_FIELDS`."""
    from pyspark.sql import functions as F

    valid = (
        F.col("event").isin(sorted(KNOWN_EVENTS))
        & F.col("t_ms").isNotNull()
        & F.col(CORRUPT_COLUMN).isNull()
    )
    keyed = valid & F.col("key").isNotNull()
    name_of = {
        name: F.when(valid, F.coalesce(F.nullif(F.col(name), F.lit("")), F.lit(NONE_NAME)))
        .otherwise(F.lit(NONE_NAME))
        .alias(f"{name}_name")
        for name in ("queue", "task")
    }
    framework_flag: Column = F.lit(0)
    if "framework" in events.columns:
        for name, bit in FRAMEWORK_FLAGS.items():
            framework_flag = F.when(F.col("framework") == name, F.lit(bit)).otherwise(
                framework_flag
            )
    rest = [name for name in EVENT_FIELDS if name not in ("event", "queue_name", "task_name")]
    return events.select(
        F.when(keyed, F.col("key")).alias("key"),
        valid.alias("_valid"),
        F.when(valid, F.col("event")).alias("event"),
        name_of["queue"],
        name_of["task"],
        *[
            F.when(~keyed, F.col("message_id")).alias("message_id")
            if name == "message_id"
            else F.col(name)
            for name in rest
        ],
        F.when(valid, framework_flag).otherwise(F.lit(0)).cast("byte").alias("_framework"),
    )


def _gathered(events: DataFrame) -> DataFrame:
    """:func:`grouped_rows`' shuffle: each key's events (of :func:`prepared`) gathered into one
    sorted array, beside the row's last valid time, first and last delivery time and framework
    flags."""
    from pyspark.sql import functions as F

    # The row's last valid event and its first and last delivery, as numbers beside the
    # array: the audit's span and log end then read three numeric columns of the kept rows,
    # not every row's array of events.
    delivery_t = F.when(in_names("event", DELIVERY_EVENTS), F.col("t_ms"))
    # Shuffled by the grouping columns first, so that the grouping finds each key's events in
    # one partition and aggregates them there once: grouped straight away, Spark would first
    # gather a partial list per key on the map side of the shuffle (sorting all events by key
    # to do it, since nearly every key is new), which only costs when a key's events are far
    # apart in the log. The same partitioning as the grouping's own shuffle.
    return (
        events.select(
            "key",
            F.when(F.col("key").isNull(), F.col("seq")).alias("_row"),
            F.struct(*[F.col(name) for name in EVENT_FIELDS]).alias("_event"),
            F.when(F.col("_valid"), F.col("t_ms")).alias("_valid_t"),
            delivery_t.alias("_delivery_t"),
            "_framework",
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
    count in the totals and take no part in any key's timeline. One shuffle over all events;
    the audit itself groups only its rare keys' events (:func:`grouped_rows` of
    :func:`prepared` rows, see :func:`key_shapes`).
    """
    return grouped_rows(prepared(events))


def grouped_rows(events: DataFrame) -> DataFrame:
    """:func:`group_by_key` of rows already :func:`prepared`."""
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


def key_shapes(events: DataFrame, grace_s: float) -> DataFrame:
    """Each key of the :func:`prepared` events, and whether it is *plain*: its valid events are
    a claim and then its completion, with no room for a stuck claim (ended within the least
    lease of the key plus ``grace_s``: see :func:`~taskonce.spark_ext.per_key.may_be_stuck`),
    or one mark. A plain key has no duplicate, no leak, no stuck claim and no notable event, so
    its events are classified row by row (:func:`plain_events`); only the other keys' events
    are gathered by key (:func:`grouped_rows`). One aggregation of numbers, combined on the
    map side of its shuffle as the floor's grouping is."""
    from pyspark.sql import functions as F

    def at(name: str, column: str) -> Column:
        return F.min(F.when(F.col("event") == name, F.col(column)))

    claimed, completed, marked = (
        Event.CLAIMED.value,
        Event.COMPLETED.value,
        Event.MARKED.value,
    )
    shapes = (
        events.filter(F.col("key").isNotNull())
        .groupBy("key")
        .agg(
            F.count(F.lit(1)).alias("_n"),
            F.sum(flag(F.col("event") == claimed)).alias("_claims"),
            F.sum(flag(F.col("event") == completed)).alias("_completions"),
            F.sum(flag(F.col("event") == marked)).alias("_marks"),
            at(claimed, "t_ms").alias("_claim_t"),
            at(claimed, "seq").alias("_claim_seq"),
            at(completed, "t_ms").alias("_done_t"),
            at(completed, "seq").alias("_done_seq"),
            F.min("t_ms").alias("_first_t"),
            F.max("t_ms").alias("_last_t"),
            F.min("lease_s").alias("_least_lease"),
        )
    )
    claim_first = (F.col("_claim_t") < F.col("_done_t")) | (
        (F.col("_claim_t") == F.col("_done_t")) & (F.col("_claim_seq") < F.col("_done_seq"))
    )
    # the same test as may_be_stuck's, on the key's first and last time and least lease
    long_enough = (F.col("_last_t") - F.col("_first_t") + 1000) > (
        (F.col("_least_lease") + F.lit(float(grace_s))) * 1000.0
    )
    claim_then_completion = (
        (F.col("_n") == 2)
        & (F.col("_claims") == 1)
        & (F.col("_completions") == 1)
        & claim_first
        & ~(F.col("_least_lease").isNotNull() & long_enough)
    )
    one_mark = (F.col("_n") == 1) & (F.col("_marks") == 1)
    return shapes.select("key", (claim_then_completion | one_mark).alias("plain"))


def split_by_shape(events: DataFrame, rare_keys: DataFrame) -> tuple[DataFrame, DataFrame]:
    """The :func:`prepared` events in two: those to group by key (:func:`grouped_rows`): the
    events of ``rare_keys`` (the keys that are not plain) and the rows without a key (each
    its own row, as a producer's hand-off events or a malformed line); and those of plain
    keys, to classify row by row (:func:`plain_events`)."""
    from pyspark.sql import functions as F

    keyed = events.filter(F.col("key").isNotNull())
    grouped = events.filter(F.col("key").isNull()).unionByName(
        keyed.join(rare_keys, "key", "left_semi")
    )
    return grouped, keyed.join(rare_keys, "key", "left_anti")


#: The columns of the classified events that the per-scope pass counts.
SCOPE_COLUMNS = (
    "queue_name",
    "task_name",
    "t_ms",
    "event",
    "keep_for_s",
    "is_valid",
    "is_delivery",
    "is_run",
    "is_failure",
    "dup_kind",
    "gap_ms",
    "leaked_run",
    "near_miss",
    "key_delivered",
    "key_leaked",
)


def plain_events(events: DataFrame) -> DataFrame:
    """The :data:`SCOPE_COLUMNS` of :func:`prepared` events of plain keys (:func:`key_shapes`),
    row by row, as :func:`classified_events` classifies them: no duplicate, gap, leak or near
    miss; a plain key is counted once, on its claim or mark (its first event)."""
    from pyspark.sql import functions as F

    return events.select(
        "queue_name",
        "task_name",
        "t_ms",
        "event",
        "keep_for_s",
        flag(F.col("event").isNotNull()).alias("is_valid"),
        flag(in_names("event", DELIVERY_EVENTS)).alias("is_delivery"),
        flag(in_names("event", RUN_EVENTS)).alias("is_run"),
        flag(in_names("event", FAILURE_EVENTS)).alias("is_failure"),
        F.lit(None).cast("string").alias("dup_kind"),
        F.lit(None).cast("long").alias("gap_ms"),
        F.lit(0).alias("leaked_run"),
        F.lit(0).alias("near_miss"),
        flag(in_names("event", (Event.CLAIMED.value, Event.MARKED.value))).alias("key_delivered"),
        F.lit(0).alias("key_leaked"),
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


def log_bounds(events: DataFrame) -> tuple[int | None, list[str], float]:
    """One action over the :func:`prepared` events: the log's end (its last valid event), the
    frameworks its events name (of :data:`FRAMEWORK_FLAGS`) and the span from its first to its
    last delivery in seconds (which sets the timeline's buckets, counted in the per-scope
    pass's aggregation)."""
    from pyspark.sql import functions as F

    delivery_t = F.when(in_names("event", DELIVERY_EVENTS), F.col("t_ms"))
    row = events.agg(
        F.max(F.when(F.col("_valid"), F.col("t_ms"))).alias("last_ms"),
        F.min(delivery_t).alias("first_delivery_ms"),
        F.max(delivery_t).alias("last_delivery_ms"),
        F.bit_or("_framework").alias("frameworks"),
    ).first()
    log_end_ms = None if row is None else row["last_ms"]
    flags = int((row["frameworks"] if row is not None else None) or 0)
    frameworks = [name for name, bit in FRAMEWORK_FLAGS.items() if flags & bit]
    first_ms = None if row is None else row["first_delivery_ms"]
    last_ms = None if row is None else row["last_delivery_ms"]
    span_s = ((last_ms - first_ms) / 1000.0) if first_ms is not None else 0.0
    return log_end_ms, frameworks, span_s
