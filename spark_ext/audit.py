"""The audit pipeline: classify every event of every key, aggregate per queue / per task /
overall, and recommend a retention window.

All work over events is Spark DataFrame operations with built-in functions only (one grouping
of the events by key, each key's row classified by its own aggregates and, for its claims,
higher-order functions over its events; then aggregations per queue and task pair, or with
grouping sets), in the passes of :class:`AuditRun`; the driver only ever collects aggregates
whose size does not grow with the log (one row per queue, task, queue and task pair, bucket or
window), plus at most ``sample_rows`` example rows of leaks and stuck claims for the
human-readable report.

The meaning of every figure is written out in docs/audit.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taskonce.events import EVENT_NAMES
from taskonce.spark_ext.inputs import CORRUPT_COLUMN, JdbcSource, read_events
from taskonce.spark_ext.semantics import (
    ANCHOR_EVENTS,
    BYTES_PER_KEY,
    CLAIM_END_EVENTS,
    CLAIM_START_EVENTS,
    DEFAULT_GRACE_S,
    DEFAULT_SAFETY_FACTOR,
    DELIVERY_EVENTS,
    DONE_EVENTS,
    FAILURE_EVENTS,
    FRAMEWORK_BROKERS,
    GAP_BUCKETS,
    METRIC_FIELDS,
    MIN_ADVICE_GAPS,
    NEAR_MISS_RATIO,
    PERCENTILES,
    RECHECK_EVENT,
    RUN_EVENTS,
    WHAT_IF_FIELDS,
    advise,
    known_bound,
    recommend,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

logger = logging.getLogger("taskonce.spark_ext")

#: The event names the audit reads (any other makes its row malformed).
KNOWN_EVENTS = frozenset({*EVENT_NAMES, RECHECK_EVENT})

#: Up to this many duplicates, percentiles are exact (Spark ``percentile``, linear
#: interpolation between the closest ranks); above, ``percentile_approx`` with
#: :data:`APPROX_ACCURACY`.
EXACT_PERCENTILE_LIMIT = 200_000
APPROX_ACCURACY = 100_000
#: Input bytes per shuffle partition, and the most partitions chosen by default.
SHUFFLE_BYTES = 64 * 1024 * 1024
MAX_SHUFFLE_PARTITIONS = 2000
#: Scope name for events without a queue or task.
NONE_NAME = "(none)"

ProgressFn = Callable[[int, int, str], None]

#: The progress steps: one per pass of :class:`AuditRun`, then "writing the outputs".
_STEPS = (
    "reading and classifying events",
    "counting stuck claims",
    "counting per queue and task",
    "measuring redelivery gaps and leaks",
    "replaying windows and timeline",
    "summing up the hand-off and the report",
)
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
#: The hand-off's events.
SENDS_EVENTS = ("sends_deferred", "sends_dispatched", "sends_redispatched", "sends_discarded")
# The events :meth:`AuditRun.gaps` keeps whatever their dup_kind.
_KEPT_EVENTS = (*SENDS_EVENTS, "lease_taken_over")


@dataclasses.dataclass
class AuditResult:
    """What :func:`audit` found.

    :ivar report: the report in its public shape (docs/audit.md) (``report.json``), with the
        advice's evidence and verdict per scope in ``report["advice"]``.
    :ivar details: per scope, what the public shape leaves out: ``events``, ``duplicates``,
        ``duplicate_rate``, ``leaked_runs``, ``keep_for_in_force_s``, ``buckets`` (label →
        count), ``first_ts``/``last_ts``, ``first_delivery_ms``; keyed ``"overall"``,
        ``"queue:<name>"``, ``"task:<name>"``.
    :ivar what_if: the what-if rows with ``store_bytes`` (store name → bytes) added.
    :ivar info: about the input and the run: ``malformed`` rows dropped, ``span_s``,
        ``keys_per_s``, ``percentiles`` (``"exact"`` or ``"approximate"``), ``broker_bounds``,
        ``frameworks`` (those the events name whose brokers' bounds are known),
        ``safety_factor``, ``grace_s``, ``bytes_per_key``, recommended store size, sources.
    :ivar leaks_sample: up to ``sample_rows`` leaked keys (dicts), latest first.
    :ivar stuck_sample: up to ``sample_rows`` stuck claims (dicts), latest first.
    :ivar histogram: (log10 bin lower edge in seconds, count) of all gaps, for the chart.
    :ivar timeline: rows ``{"bucket_start": iso, "queue": name, "duplicates": n,
        "deliveries": n}`` for the chart (largest queues only).
    :ivar tables: the full per-row tables as DataFrames (``duplicates``, ``leaks``,
        ``stuck_claims``, ``timeline``); they recompute from the source when used again.
    """

    report: dict[str, Any]
    details: dict[str, dict[str, Any]]
    what_if: list[dict[str, Any]]
    info: dict[str, Any]
    leaks_sample: list[dict[str, Any]]
    stuck_sample: list[dict[str, Any]]
    histogram: list[tuple[float, int]]
    timeline: list[dict[str, Any]]
    timeline_bucket_s: int
    tables: dict[str, DataFrame]

    def problems(self) -> list[str]:
        """Why ``--fail-on-leak`` fails: leaks, and every queue whose keep_for in force is
        below its recommended window. Empty when all is well."""
        found: list[str] = []
        leaks = int(self.report["overall"]["leaks"])
        if leaks:
            found.append(f"{leaks} key(s) leaked: their handler ran again outside a retry")
        for name, metrics in self.report["queues"].items():
            keep_for = self.details.get(f"queue:{name}", {}).get("keep_for_in_force_s")
            wanted = metrics["recommended_keep_for_s"]
            if keep_for is not None and keep_for < wanted:
                found.append(
                    f"queue {name!r}: keep_for {keep_for:g} s is below the recommended {wanted} s"
                )
        return found


def _in(column: str, names: Iterable[str]) -> Column:
    from pyspark.sql import functions as F

    return F.col(column).isin(list(names))


def _flag(condition: Column) -> Column:
    from pyspark.sql import functions as F

    return F.when(condition, 1).otherwise(0)


# Built-in array functions over an array of event names (``events.event``), no lambdas: Spark
# compiles these to code, while higher-order functions (transform, filter, exists) are
# interpreted element by element.


def _first_position(names: Column, wanted: Iterable[str]) -> Column:
    """The least 1-based position in ``names`` of any of ``wanted``; null without one."""
    from pyspark.sql import functions as F

    found = [F.nullif(F.array_position(names, F.lit(name)), F.lit(0)) for name in wanted]
    return F.least(*found) if len(found) > 1 else found[0]


def _any_of(names: Column, wanted: Iterable[str]) -> Column:
    """Whether ``names`` holds any of ``wanted`` (null when it holds a null and none of them;
    a keyed row's events are all valid, so never null there)."""
    from pyspark.sql import functions as F

    return F.arrays_overlap(names, F.array(*[F.lit(name) for name in wanted]))


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
    # are nulled below): no union, so the result stays partitioned by key and the later
    # per-key aggregations need no second shuffle.
    keyed = F.col("key").isNotNull()

    def per_key(column: Column) -> Column:
        return F.when(keyed, column)

    events = events.select(
        "*",
        per_key(F.coalesce(F.sum(_flag(_in("event", DONE_EVENTS))).over(before), F.lit(0))).alias(
            "done_before"
        ),
        per_key(F.min(F.when(_in("event", ANCHOR_EVENTS), F.col("t_ms"))).over(so_far)).alias(
            "anchor_ms"
        ),
        per_key(F.sum(_flag(_in("event", CLAIM_START_EVENTS))).over(so_far)).alias("seg"),
        per_key(
            F.last(
                F.when(_in("event", CLAIM_START_EVENTS), F.col("worker")), ignorenulls=True
            ).over(so_far)
        ).alias("owner"),
    )
    dup_kind = per_key(
        F.when(F.col("event") == "duplicate_skipped", "skipped")
        .when(F.col("event") == "in_progress_deferred", "in_flight")
        .when(F.col("event") == "concurrent_duplicate", "concurrent")
        .when(_in("event", RUN_EVENTS) & (F.col("done_before") > 0), "rerun")
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
        "leaked_run", _flag(_in("dup_kind", ("concurrent", "rerun")))
    ).withColumn(
        "near_miss",
        _flag(
            _in("dup_kind", ("skipped", "in_flight"))
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
        _flag(_in("event", DELIVERY_EVENTS)).alias("is_delivery"),
        _flag(_in("event", RUN_EVENTS)).alias("is_run"),
        _flag(_in("event", FAILURE_EVENTS)).alias("is_failure"),
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
    delivery_t = F.when(_in("event", DELIVERY_EVENTS), F.col("t_ms"))
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
    grouped = (
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

    # Array functions over the names only (see _first_position): with lambdas over the
    # events, this grouping took twice as long.
    names = F.col("events")["event"]

    def first(wanted: Iterable[str]) -> Column:
        return F.coalesce(_first_position(names, wanted), F.lit(0)).cast("int")

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
    leaked = F.array_contains(names, F.lit("concurrent_duplicate")) | (
        (F.col("first_done") > 0) & _any_of(after_done, RUN_EVENTS)
    )
    delivered = _any_of(names, DELIVERY_EVENTS)
    keyed_row = F.col("key").isNotNull()
    return grouped.select(
        "*",
        (keyed_row & delivered).alias("delivered"),
        (keyed_row & leaked).alias("leaked"),
    )


def _classified_events(grouped: DataFrame, keep_for_s: float | None) -> DataFrame:
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
        _flag(first_of_key & F.col("delivered")).alias("key_delivered"),
        _flag(first_of_key & F.col("leaked")).alias("key_leaked"),
        F.col("_key_queue").alias("key_queue"),
        F.col("_key_task").alias("key_task"),
        F.when(F.col("first_anchor") <= position, F.col("_anchor_t")).alias("anchor_ms"),
        ((F.col("first_done") > 0) & (F.col("first_done") < position)).alias("_done_before"),
    )
    keyed = F.col("key").isNotNull()
    dup_kind = F.when(
        keyed,
        F.when(F.col("event") == "duplicate_skipped", "skipped")
        .when(F.col("event") == "in_progress_deferred", "in_flight")
        .when(F.col("event") == "concurrent_duplicate", "concurrent")
        .when(_in("event", RUN_EVENTS) & F.col("_done_before"), "rerun"),
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
        _flag(F.col("event").isNotNull()).alias("is_valid"),
        _flag(_in("dup_kind", ("concurrent", "rerun"))).alias("leaked_run"),
        _flag(
            _in("dup_kind", ("skipped", "in_flight"))
            & (F.col("gap_ms") > keep_for * (NEAR_MISS_RATIO * 1000.0))
        ).alias("near_miss"),
        _flag(_in("event", DELIVERY_EVENTS)).alias("is_delivery"),
        _flag(_in("event", RUN_EVENTS)).alias("is_run"),
        _flag(_in("event", FAILURE_EVENTS)).alias("is_failure"),
    )


def _claims(grouped: DataFrame, grace_s: float, log_end_ms: int | None) -> DataFrame:
    """The stuck claims. Each claim is the slice of its key's events from a claim start to the
    next one: its owner is the worker that started it (or, when that start names none, the
    last one that did), its end the first end event (a ``lease_lost`` only from its owner) or
    the next claim's start; it is stuck when that end, or the log's end for a claim never
    ended, comes after its deadline (start or last renewal by the owner, plus lease and
    grace)."""
    from pyspark.sql import functions as F

    events = F.col("events")
    count = F.size(events)
    start_names = F.array(*[F.lit(n) for n in CLAIM_START_EVENTS])
    end_names = F.array(*[F.lit(n) for n in CLAIM_END_EVENTS])
    starts = F.filter(
        F.sequence(F.lit(1), count),
        lambda i: F.array_contains(start_names, F.element_at(events, i)["event"]),
    )

    def claim(position: Column, index: Column) -> Column:
        start = F.element_at(events, position)
        following = F.coalesce(F.try_element_at(F.col("_starts"), index + 2), count + 1)
        earlier_owner = F.try_element_at(
            F.filter(
                F.transform(
                    F.slice(F.col("_starts"), 1, index), lambda p: F.element_at(events, p)["worker"]
                ),
                lambda w: w.isNotNull(),
            ),
            F.lit(-1),
        )
        owner = F.coalesce(start["worker"], earlier_owner)
        span = F.slice(events, position, following - position)
        renewed = F.array_max(
            F.transform(
                F.filter(
                    span,
                    lambda e: (e["event"] == "lease_renewed") & e["worker"].eqNullSafe(owner),
                ),
                lambda e: e["t_ms"],
            )
        )
        ended = F.array_min(
            F.transform(
                F.filter(
                    span,
                    lambda e: (
                        F.array_contains(end_names, e["event"])
                        & ((e["event"] != "lease_lost") | e["worker"].eqNullSafe(owner))
                    ),
                ),
                lambda e: e["t_ms"],
            )
        )
        return F.struct(
            start["t_ms"].alias("start_ms"),
            start["event"].alias("how"),
            start["lease_s"].alias("lease_s"),
            start["worker"].alias("worker"),
            start["queue_name"].alias("queue_name"),
            start["task_name"].alias("task_name"),
            renewed.alias("renewed_ms"),
            F.least(ended, F.try_element_at(events, following)["t_ms"]).alias("ended_ms"),
        )

    claims = (
        grouped.filter(F.col("key").isNotNull() & _may_be_stuck(grace_s))
        .select("key", "events", starts.alias("_starts"))
        .filter(F.size("_starts") > 0)
        .select("key", F.inline(F.transform("_starts", claim)))
    )
    # A lease that is no number of seconds (NaN, infinite, a deadline beyond a long of
    # milliseconds: a log taskonce did not write) gives no deadline, so its claim is not
    # judged, as one without a lease; a plain cast or sum would stop the whole audit on it
    # (ANSI mode).
    claims = claims.withColumn(
        "deadline_ms",
        F.try_add(
            F.greatest(F.col("start_ms"), F.col("renewed_ms")),
            ((F.col("lease_s") + F.lit(float(grace_s))) * 1000).try_cast("long"),
        ),
    )
    return claims.filter(
        F.col("deadline_ms").isNotNull()
        & (
            (F.col("ended_ms") > F.col("deadline_ms"))
            | (F.col("ended_ms").isNull() & (F.lit(log_end_ms).cast("long") > F.col("deadline_ms")))
        )
    )


def _may_be_stuck(grace_s: float) -> Column:
    """True for each key row (of :func:`group_by_key`) that may hold a stuck claim, false for
    one that cannot: a cheap filter in built-in array functions (which Spark compiles to code)
    before the claims' higher-order functions (interpreted element by element), which then run
    on the few keys it leaves.

    A claim is stuck only when it has a lease (a number of seconds: see :func:`_claims`) and
    either ended after its deadline (start plus lease and grace, or later) or never ended. Its
    end is an event of its key, so the first case needs the key's events to span more than the
    least lease of the key plus the grace; the second needs the key's last claim start to be
    followed by no completion, release or mark (a lease loss by another worker does not end
    it, so a lease loss keeps the key in).
    """
    from pyspark.sql import functions as F

    events = F.col("events")
    names = events["event"]
    count = F.size(events)
    least_lease = F.array_min(events["lease_s"])
    # a second of slack for the rounding of the deadline to whole milliseconds
    long_enough = (F.element_at(events, -1)["t_ms"] - events[0]["t_ms"] + 1000) > (
        (least_lease + F.lit(float(grace_s))) * 1000.0
    )
    reversed_names = F.reverse(names)
    last_start_from_end = _first_position(reversed_names, CLAIM_START_EVENTS)
    after_last_start = F.slice(
        names, count - last_start_from_end + 2, F.greatest(last_start_from_end - 1, F.lit(0))
    )
    ending = [name for name in CLAIM_END_EVENTS if name != "lease_lost"]
    open_at_end = ~_any_of(after_last_start, ending)
    return last_start_from_end.isNotNull() & least_lease.isNotNull() & (long_enough | open_at_end)


def _notable() -> Column:
    """True for each key row (of :func:`group_by_key`) that holds a notable event: a duplicate
    delivery (skipped, deferred or concurrent, or a rerun: a leaked key) or a kept one."""
    from pyspark.sql import functions as F

    duplicates = ("duplicate_skipped", "in_progress_deferred", "concurrent_duplicate")
    return _any_of(F.col("events")["event"], (*duplicates, *_KEPT_EVENTS)) | F.col("leaked")


def _scoped(frame: DataFrame, *aggregates: Column) -> list[tuple[str, str, dict[str, Any]]]:
    """Aggregate over the grouping sets (), (queue), (task) and collect: (scope, name, values)
    with scope ``overall``, ``queue`` or ``task``."""
    from pyspark.sql import functions as F

    rows = (
        frame.groupingSets([[], ["queue_name"], ["task_name"]], "queue_name", "task_name")
        .agg(
            F.grouping("queue_name").alias("_gq"),
            F.grouping("task_name").alias("_gt"),
            *aggregates,
        )
        .collect()
    )
    out: list[tuple[str, str, dict[str, Any]]] = []
    for row in rows:
        values = row.asDict()
        gq, gt = values.pop("_gq"), values.pop("_gt")
        queue, task = values.pop("queue_name"), values.pop("task_name")
        if gq and gt:
            out.append(("overall", "", values))
        elif not gq:
            out.append(("queue", str(queue), values))
        else:
            out.append(("task", str(task), values))
    return out


def _pair_totals(
    frame: DataFrame, by: Sequence[Column], aggregates: Mapping[str, tuple[str, Column]]
) -> DataFrame:
    """The aggregates of :func:`_rolled_up` per (queue, task) pair and the ``by`` columns."""
    from pyspark.sql import functions as F

    columns: list[Column] = []
    for name, (how, column) in aggregates.items():
        if how == "latest":
            at = F.when(column.isNotNull(), F.col("t_ms"))
            # of the values at the same latest time, the greatest: the same whatever the order
            # Spark meets the rows in
            columns += [
                F.max_by(column, F.struct(at, column)).alias(name),
                F.max(at).alias(f"{name}@"),
            ]
        else:
            columns.append(column.alias(name))
    return frame.groupBy("queue_name", "task_name", *by).agg(*columns)


def _rolled_up(
    frame: DataFrame, **aggregates: tuple[str, Column]
) -> list[tuple[str, str, dict[str, Any]]]:
    """Like :func:`_scoped`, for aggregates that combine: aggregate per (queue, task) pair in
    Spark, then roll the pairs up to the scopes here (one row per pair reaches the driver, as
    many as the log has tasks). Each aggregate is ``name=(how, column)``: ``how`` is ``sum``,
    ``min`` or ``max`` (of ``column``), or ``latest``: the value of ``column`` at the greatest
    ``t_ms`` among the rows where it is not null (``max_by``; of several values at that time,
    the greatest).

    Cheaper than grouping sets over every event: those copy each row three times (one per
    grouping set) before aggregating."""
    return _roll_up(_pair_totals(frame, (), aggregates).collect(), aggregates)


def _roll_up(
    rows: Iterable[Any], aggregates: Mapping[str, tuple[str, Column]]
) -> list[tuple[str, str, dict[str, Any]]]:
    """Roll rows of :func:`_pair_totals` (finer than pairs too) up to the scopes: overall, each
    queue, each task."""
    scopes: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        values = row.asDict()
        for scope, name in (
            ("overall", ""),
            ("queue", str(values["queue_name"])),
            ("task", str(values["task_name"])),
        ):
            entry = scopes.get((scope, name))
            if entry is None:
                scopes[(scope, name)] = {n: values[n] for n in aggregates} | {
                    f"{n}@": values[f"{n}@"]
                    for n, (how, _) in aggregates.items()
                    if how == "latest"
                }
                continue
            for field, (how, _) in aggregates.items():
                mine, theirs = entry[field], values[field]
                if how == "latest":
                    at = values[f"{field}@"]
                    if at is not None and (
                        entry[f"{field}@"] is None
                        or (at, theirs) > (entry[f"{field}@"], entry[field])
                    ):
                        entry[field], entry[f"{field}@"] = theirs, at
                elif theirs is None:
                    continue
                elif mine is None:
                    entry[field] = theirs
                elif how == "sum":
                    entry[field] = mine + theirs
                elif how == "min":
                    entry[field] = min(mine, theirs)
                else:
                    entry[field] = max(mine, theirs)
    return [
        (scope, name, {field: entry[field] for field in aggregates})
        for (scope, name), entry in scopes.items()
    ]


def _scope_key(scope: str, name: str) -> str:
    return "overall" if scope == "overall" else f"{scope}:{name}"


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    moment = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _seconds(ms: float | None) -> float:
    return 0.0 if ms is None else round(float(ms) / 1000.0, 3)


def _timeline_bucket(span_s: float) -> int:
    """A bucket width giving at most ~60 points over the span."""
    for width in (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400):
        if span_s / width <= 60:
            return width
    return 7 * 86400


class AuditRun:
    """One audit, pass by pass: :meth:`classify` (read the events and group them by key, one
    row per key kept in memory or on local disk for the passes after it; each pass reads the
    classified events from it), :meth:`per_key` (stuck claims), :meth:`per_scope` (the event
    counts, distinct and leaked keys of each queue, task and overall, and the timeline's
    counts in the same aggregation), :meth:`gaps` (redelivery gap percentiles and histogram,
    the leaked keys), :meth:`what_if` (the simulated windows and the timeline) and
    :meth:`result` (the hand-off figures, samples and the report). :func:`audit` runs them in
    this order; ``bench/audit_scale.py`` times each.

    Each pass ends with the Spark actions it needs, so its time is its own; :meth:`close`
    frees what the passes kept and restores the session's shuffle partitions.

    The arguments are :func:`audit`'s.
    """

    grouped: DataFrame
    classified: DataFrame
    rare: DataFrame
    stuck: DataFrame
    leaks_table: DataFrame
    stuck_table: DataFrame
    notable: DataFrame
    duplicates: DataFrame
    timeline_table: DataFrame

    def __init__(
        self,
        spark: SparkSession,
        paths: Sequence[str] = (),
        *,
        jdbc: JdbcSource | None = None,
        fmt: str = "auto",
        keep_for_s: float | None = None,
        broker_bounds: Mapping[str, float] | Sequence[float] = (),
        safety_factor: float = DEFAULT_SAFETY_FACTOR,
        simulate_windows: Sequence[float] = (),
        grace_s: float = DEFAULT_GRACE_S,
        bytes_per_key: Mapping[str, int] | None = None,
        sample_rows: int = 20,
        now: datetime.datetime | None = None,
        shuffle_partitions: int | None = None,
    ) -> None:
        if safety_factor <= 0:
            raise ValueError("safety_factor must be positive")
        self.spark = spark
        self.paths = list(paths)
        self.jdbc = jdbc
        self.fmt = fmt
        self.keep_for_s = keep_for_s
        self.bounds = (
            dict(broker_bounds)
            if isinstance(broker_bounds, Mapping)
            else {f"bound {i + 1}": float(b) for i, b in enumerate(broker_bounds)}
        )
        self.windows = sorted({float(w) for w in simulate_windows})
        self.safety_factor = safety_factor
        self.grace_s = grace_s
        self.sizes = dict(BYTES_PER_KEY if bytes_per_key is None else bytes_per_key)
        self.sample_rows = sample_rows
        self.now = now
        self.shuffle_partitions = shuffle_partitions
        self.log_end_ms: int | None = None
        self.frameworks: list[str] = []
        self.scopes: dict[str, dict[str, Any]] = {}
        self.histogram: list[tuple[float, int]] = []
        self.exact = True
        self.what_if_rows: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.timeline_bucket_s = 1
        self.span_s = 0.0
        self.keys_per_s = 0.0
        self._stuck_counts: list[tuple[str, str, dict[str, Any]]] = []
        self._cached: list[DataFrame] = []
        self._previous_partitions: str | None = None
        self._partitions_set = False

    def _keep(self, frame: DataFrame) -> DataFrame:
        """Persist ``frame`` for the later passes (memory, spilling to local disk)."""
        from pyspark import StorageLevel

        kept = frame.persist(StorageLevel.MEMORY_AND_DISK)
        self._cached.append(kept)
        return kept

    def close(self) -> None:
        """Free the kept frames and restore the session's shuffle partitions."""
        for frame in self._cached:
            frame.unpersist()
        self._cached.clear()
        if self._partitions_set:
            self.spark.conf.set("spark.sql.shuffle.partitions", self._previous_partitions or "200")
            self._partitions_set = False

    def read(self) -> DataFrame:
        """The events (lazy: Spark reads them when :meth:`classify` runs), only the fields the
        audit uses: the others would travel through the shuffle by key and fill the cache for
        nothing."""
        raw = read_events(self.spark, self.paths, self.jdbc, self.fmt)
        return raw.select(*AUDIT_COLUMNS)

    def classify(self) -> DataFrame:
        """Read the events and group them by key (:func:`group_by_key`, the one shuffle over
        all events), kept for the later passes; one action builds the kept frame and finds the
        log's end (its last valid event). The per-event view the later passes aggregate
        (:func:`_classified_events`) is computed from the kept rows when each pass reads it."""
        from pyspark.sql import functions as F

        raw = self.read()
        self._previous_partitions = self.spark.conf.get("spark.sql.shuffle.partitions")
        partitions = self.shuffle_partitions or _shuffle_partitions(
            self.spark, raw, self.jdbc is not None
        )
        self.spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
        self._partitions_set = True
        logger.info("audit: %d shuffle partitions", partitions)
        self.grouped = self._keep(group_by_key(raw))
        # the first and last delivery (their span sets the timeline's buckets, which the
        # per-scope pass counts in the same aggregation as the scopes)
        row = self.grouped.agg(
            F.max("last_valid_ms").alias("last_ms"),
            F.min("first_delivery_ms").alias("first_delivery_ms"),
            F.max("last_delivery_ms").alias("last_delivery_ms"),
            F.bit_or("frameworks").alias("frameworks"),
        ).first()
        self.log_end_ms = None if row is None else row["last_ms"]
        flags = int((row["frameworks"] if row is not None else None) or 0)
        self.frameworks = [name for name, bit in FRAMEWORK_FLAGS.items() if flags & bit]
        first_ms = None if row is None else row["first_delivery_ms"]
        last_ms = None if row is None else row["last_delivery_ms"]
        self.span_s = ((last_ms - first_ms) / 1000.0) if first_ms is not None else 0.0
        self.classified = _classified_events(self.grouped, self.keep_for_s)
        return self.classified

    def per_key(self) -> None:
        """The key rows that hold anything rare (a claim that may be stuck, a duplicate, a
        takeover, a hand-off event, a leak), kept for this pass and :meth:`gaps`: one scan of
        the kept rows for both; from them the stuck claims (:func:`_claims`)."""
        from pyspark.sql import functions as F

        self.rare = self._keep(
            self.grouped.filter(
                (F.col("key").isNotNull() & _may_be_stuck(self.grace_s)) | _notable()
            )
        )
        self.stuck = self._keep(_claims(self.rare, self.grace_s, self.log_end_ms))
        self._stuck_counts = _scoped(self.stuck, F.count(F.lit(1)).alias("stuck_claims"))
        self.stuck_table = self.stuck.select(
            "key",
            F.col("queue_name").alias("queue"),
            F.col("task_name").alias("task"),
            "worker",
            "how",
            "lease_s",
            F.timestamp_millis("start_ms").alias("claimed_at"),
            F.timestamp_millis("renewed_ms").alias("last_renewed_at"),
            F.timestamp_millis("deadline_ms").alias("deadline"),
            F.timestamp_millis("ended_ms").alias("ended_at"),
            F.col("ended_ms").isNull().alias("open_at_log_end"),
        )

    def per_scope(self) -> None:
        """The event counts of each scope (overall, queue, task): one aggregation per (queue,
        task) pair, rolled up (:func:`_rolled_up`), joined with the key and claim counts of
        :meth:`per_key`."""
        from pyspark.sql import functions as F

        classified = self.classified
        gap_known = F.col("gap_ms").isNotNull()
        bucket_columns = []
        lower = None
        for label, upper in GAP_BUCKETS:
            condition = gap_known
            if lower is not None:
                condition = condition & (F.col("gap_ms") > F.lit(lower * 1000))
            if upper is not None:
                condition = condition & (F.col("gap_ms") <= F.lit(upper * 1000))
            bucket_columns.append((label, F.sum(_flag(condition))))
            lower = upper
        valid_t = F.when(F.col("is_valid") == 1, F.col("t_ms"))
        delivery_t = F.when(F.col("is_delivery") == 1, F.col("t_ms"))
        bucket_s = _timeline_bucket(self.span_s)
        bucket_ms = bucket_s * 1000
        self.timeline_bucket_s = bucket_s
        delivery = F.col("is_delivery") == 1
        aggregates: dict[str, tuple[str, Column]] = dict(
            events=("sum", F.sum("is_valid")),
            malformed=("sum", F.sum(1 - F.col("is_valid"))),
            deliveries=("sum", F.sum("is_delivery")),
            runs=("sum", F.sum("is_run")),
            duplicates_skipped=("sum", F.sum(_flag(F.col("event") == "duplicate_skipped"))),
            duplicates_in_flight=("sum", F.sum(_flag(F.col("event") == "in_progress_deferred"))),
            leaked_runs=("sum", F.sum(F.coalesce(F.col("leaked_run"), F.lit(0)))),
            failures=("sum", F.sum("is_failure")),
            releases=("sum", F.sum(_flag(F.col("event") == "released"))),
            takeovers=("sum", F.sum(_flag(F.col("event") == "lease_taken_over"))),
            near_misses=("sum", F.sum(F.coalesce(F.col("near_miss"), F.lit(0)))),
            distinct_keys=("sum", F.sum("key_delivered")),
            leaks=("sum", F.sum("key_leaked")),
            gaps=("sum", F.count("gap_ms")),
            gap_max_ms=("max", F.max("gap_ms")),
            first_ms=("min", F.min(valid_t)),
            last_ms=("max", F.max(valid_t)),
            first_delivery_ms=("min", F.min(delivery_t)),
            last_delivery_ms=("max", F.max(delivery_t)),
            keep_for_in_force_s=("latest", F.col("keep_for_s")),
            # not a figure of its own: with none, the hand-off's figures need no Spark job
            sends_events=("sum", F.sum(_flag(_in("event", SENDS_EVENTS)))),
            **{f"bucket {label}": ("sum", column) for label, column in bucket_columns},
        )
        # the same aggregation per timeline bucket too (for the timeline of what_if): rolled up
        # here, summed per queue and bucket there, with no second scan of the events
        totals = self._keep(
            _pair_totals(
                classified,
                [
                    ((F.floor(F.col("t_ms") / bucket_ms) * bucket_ms).cast("long")).alias(
                        "bucket_ms"
                    )
                ],
                {
                    **aggregates,
                    "_timeline_duplicates": (
                        "sum",
                        F.sum(_flag(delivery & F.col("dup_kind").isNotNull())),
                    ),
                    "_timeline_deliveries": ("sum", F.sum(_flag(delivery))),
                },
            )
        )
        counted = _roll_up(totals.collect(), aggregates)
        self.timeline_table = (
            totals.filter(F.col("_timeline_deliveries") > 0)
            .groupBy(F.col("queue_name").alias("queue"), "bucket_ms")
            .agg(
                F.sum("_timeline_duplicates").alias("duplicates"),
                F.coalesce(F.sum("_timeline_deliveries"), F.lit(0).cast("long")).alias(
                    "deliveries"
                ),
            )
            .select(
                "queue",
                F.timestamp_millis("bucket_ms").alias("bucket_start"),
                "bucket_ms",
                "duplicates",
                "deliveries",
            )
        )
        scopes: dict[str, dict[str, Any]] = {
            _scope_key(scope, name): {"scope": scope, "name": name, **values}
            for scope, name, values in counted
        }
        scopes.setdefault("overall", {"scope": "overall", "name": "", "events": 0, "gaps": 0})
        for scope, name, values in self._stuck_counts:
            scopes.setdefault(_scope_key(scope, name), {"scope": scope, "name": name}).update(
                values
            )
        self.scopes = scopes

    def gaps(self) -> None:
        """Keep the notable events (duplicates, takeovers, hand-off events) for this pass and
        the later ones, from :meth:`per_key`'s rare rows; from them the take-over recovery
        percentiles, the gap percentiles per scope (exact up to
        :data:`EXACT_PERCENTILE_LIMIT` gaps) and the log histogram for the chart."""
        from pyspark.sql import functions as F

        # only the key rows holding a notable event are spread into events
        self.notable = self._keep(
            _classified_events(self.rare.filter(_notable()), self.keep_for_s).filter(
                F.col("dup_kind").isNotNull() | _in("event", _KEPT_EVENTS)
            )
        )
        self.duplicates = self.notable.filter(F.col("dup_kind").isNotNull())
        # each leaked key under its first queue/task; its first run is the anchor of its gaps
        self.leaks_table = (
            self.duplicates.filter(F.col("leaked_run") == 1)
            .groupBy("key")
            .agg(
                F.first("key_queue").alias("queue"),
                F.first("key_task").alias("task"),
                F.count(F.lit(1)).alias("leaked_runs"),
                F.timestamp_millis(F.min("anchor_ms")).alias("first_run_at"),
                F.timestamp_millis(F.min("t_ms")).alias("first_leak_at"),
                F.timestamp_millis(F.max("t_ms")).alias("last_leak_at"),
            )
        )
        overall = self.scopes["overall"]
        gap_count = int(overall.get("gaps") or 0)
        self.exact = gap_count <= EXACT_PERCENTILE_LIMIT
        fractions = [fraction for _, fraction in PERCENTILES]
        percentile = (
            F.percentile("gap_ms", fractions)
            if self.exact
            else F.percentile_approx("gap_ms", fractions, APPROX_ACCURACY)
        )
        # One aggregation for the take-over recovery (seconds from a dead owner's last sign of
        # life to the takeover) and the gap percentiles: each aggregate sees only its own rows'
        # values (the others' are null, which both percentiles skip), and a scope takes each
        # figure only when it has rows of that kind, as when they were two aggregations.
        takeover = F.col("event") == "lease_taken_over"
        recovery = F.when(takeover, F.col("recovery_s"))
        has_gap = F.col("gap_ms").isNotNull()
        for scope, name, values in _scoped(
            self.notable.filter(takeover | has_gap if gap_count else takeover),
            F.percentile_approx(recovery, [0.5, 0.95], APPROX_ACCURACY).alias("recovery_p"),
            F.max(recovery).alias("recovery_max_s"),
            F.count(F.when(takeover, F.lit(1))).alias("_takeovers"),
            *([percentile.alias("p"), F.count("gap_ms").alias("_gaps")] if gap_count else []),
        ):
            entry = self.scopes.setdefault(_scope_key(scope, name), {"scope": scope, "name": name})
            if values.pop("_takeovers"):
                entry.update(
                    recovery_p=values["recovery_p"], recovery_max_s=values["recovery_max_s"]
                )
            if gap_count and values.pop("_gaps"):
                for (field, _), value in zip(PERCENTILES, values["p"] or [], strict=False):
                    entry[field] = _seconds(value)
        histogram_rows = (
            self.duplicates.filter(F.col("gap_ms").isNotNull())
            .groupBy(
                (
                    F.floor(F.log10(F.greatest(F.col("gap_ms"), F.lit(1)) / F.lit(1000.0)) * 4) / 4
                ).alias("bin")
            )
            .count()
            .orderBy("bin")
            .collect()
        )
        self.histogram = [(float(row["bin"]), int(row["count"])) for row in histogram_rows]

    def what_if(self) -> None:
        """Replay the duplicates against each simulated window; the duplicates-over-time
        timeline per queue."""
        from pyspark.sql import functions as F

        overall = self.scopes["overall"]
        first_ms = overall.get("first_delivery_ms")
        last_ms = overall.get("last_delivery_ms")
        span_s = ((last_ms - first_ms) / 1000.0) if first_ms is not None else 0.0
        distinct = int(overall.get("distinct_keys") or 0)
        keys_per_s = distinct / max(span_s, 1.0)
        self.span_s, self.keys_per_s = span_s, keys_per_s
        what_if: list[dict[str, Any]] = []
        if self.windows:
            judged = _in("dup_kind", ("skipped", "rerun"))
            aggregates = []
            for index, window in enumerate(self.windows):
                limit = F.lit(int(window * 1000))
                kept = (F.col("dup_kind") == "in_flight") | (
                    judged & (F.col("gap_ms").isNull() | (F.col("gap_ms") <= limit))
                )
                lost = (F.col("dup_kind") == "concurrent") | (judged & (F.col("gap_ms") > limit))
                aggregates += [
                    F.sum(_flag(kept)).alias(f"s{index}"),
                    F.sum(_flag(lost)).alias(f"l{index}"),
                ]
            counts = self.duplicates.agg(*aggregates).collect()[0].asDict()
            for index, window in enumerate(self.windows):
                store_keys = math.ceil(keys_per_s * window - 1e-9)
                what_if.append(
                    {
                        "keep_for_s": int(window) if float(window).is_integer() else window,
                        "suppressed": int(counts[f"s{index}"] or 0),
                        "leaked": int(counts[f"l{index}"] or 0),
                        "store_keys": store_keys,
                        "store_bytes": {
                            name: store_keys * size for name, size in self.sizes.items()
                        },
                    }
                )
        self.what_if_rows = what_if
        queue_order = sorted(
            (
                -(int(v.get("duplicates_skipped") or 0) + int(v.get("leaked_runs") or 0)),
                v["name"],
            )
            for v in self.scopes.values()
            if v["scope"] == "queue"
        )[:8]
        shown = [name for _, name in queue_order]
        self.timeline = [
            {
                "bucket_start": _iso(int(row["bucket_ms"])),
                "queue": row["queue"],
                "duplicates": int(row["duplicates"]),
                "deliveries": int(row["deliveries"]),
            }
            for row in self.timeline_table.filter(F.col("queue").isin(shown))
            .orderBy("bucket_ms", "queue")
            .collect()
        ]

    def result(self) -> AuditResult:
        """The hand-off figures, the samples of leaks and stuck claims, and the report."""
        from pyspark.sql import functions as F

        handoff, producer = _handoff_figures(
            self.notable, any_sends=bool(self.scopes["overall"].get("sends_events"))
        )
        # the latest first; ties broken by the rows' own fields, so that two runs over the
        # same log show the same samples
        leaks_sample = [
            _plain(row.asDict())
            for row in self.leaks_table.orderBy(F.desc("last_leak_at"), "key")
            .limit(self.sample_rows)
            .collect()
        ]
        stuck_sample = [
            _plain(row.asDict())
            for row in self.stuck_table.orderBy(
                F.desc("claimed_at"), "key", "worker", "how", "deadline", "ended_at"
            )
            .limit(self.sample_rows)
            .collect()
        ]
        overall = self.scopes["overall"]
        total_events = int(overall.get("events") or 0)
        bound_s, bound_name, bound_source = known_bound(self.bounds, self.frameworks)
        report, details = _build_report(
            self.scopes,
            total_events,
            [] if bound_s is None else [bound_s],
            self.safety_factor,
            self.what_if_rows,
            self.now,
        )
        report["handoff"] = handoff
        report["producer"] = producer
        report["advice"] = _advice(
            report, details, self.log_end_ms, (bound_s, bound_name, bound_source), self.frameworks
        )
        malformed = int(overall.get("malformed") or 0)
        if malformed:
            logger.warning("dropped %d malformed event row(s) (no event name or bad ts)", malformed)
        recommended = int(report["overall"]["recommended_keep_for_s"])
        jdbc = self.jdbc
        info: dict[str, Any] = {
            "sources": [*self.paths, *([f"jdbc:{jdbc.table}"] if jdbc else [])],
            "malformed": malformed,
            "first_ts": _iso(overall.get("first_ms")),
            "last_ts": _iso(overall.get("last_ms")),
            "span_s": round(self.span_s, 3),
            "keys_per_s": self.keys_per_s,
            "percentiles": "exact" if self.exact else "approximate",
            "broker_bounds": self.bounds,
            "frameworks": self.frameworks,
            "safety_factor": self.safety_factor,
            "grace_s": self.grace_s,
            "near_miss_ratio": NEAR_MISS_RATIO,
            "bytes_per_key": self.sizes,
            "recommended_store_keys": math.ceil(self.keys_per_s * recommended - 1e-9),
        }
        info["recommended_store_bytes"] = {
            name: info["recommended_store_keys"] * size for name, size in self.sizes.items()
        }
        tables = {
            "duplicates": self.duplicates.select(
                "key",
                F.col("queue_name").alias("queue"),
                F.col("task_name").alias("task"),
                "event",
                F.col("dup_kind").alias("kind"),
                F.timestamp_millis("t_ms").alias("at"),
                F.timestamp_millis("anchor_ms").alias("first_run_at"),
                (F.col("gap_ms") / 1000.0).alias("gap_s"),
                (F.col("near_miss") == 1).alias("near_miss"),
                "keep_for_s",
                "worker",
                "attempt",
                "redelivered",
            ),
            "leaks": self.leaks_table,
            "stuck_claims": self.stuck_table,
            "timeline": self.timeline_table,
        }
        return AuditResult(
            report=report,
            details=details,
            what_if=self.what_if_rows,
            info=info,
            leaks_sample=leaks_sample,
            stuck_sample=stuck_sample,
            histogram=self.histogram,
            timeline=self.timeline,
            timeline_bucket_s=self.timeline_bucket_s,
            tables=tables,
        )


def audit(
    spark: SparkSession,
    paths: Sequence[str] = (),
    *,
    jdbc: JdbcSource | None = None,
    fmt: str = "auto",
    out: str | None = None,
    keep_for_s: float | None = None,
    broker_bounds: Mapping[str, float] | Sequence[float] = (),
    safety_factor: float = DEFAULT_SAFETY_FACTOR,
    simulate_windows: Sequence[float] = (),
    grace_s: float = DEFAULT_GRACE_S,
    bytes_per_key: Mapping[str, int] | None = None,
    progress: ProgressFn | None = None,
    sample_rows: int = 20,
    charts: bool = True,
    now: datetime.datetime | None = None,
    shuffle_partitions: int | None = None,
) -> AuditResult:
    """Audit event logs: what was delivered, what ran, which duplicates came how late, what
    leaked, which claims got stuck, and the keep_for the evidence asks for.

    :param spark: a SparkSession (its master decides where the work runs). For ``jdbc`` its
        classpath must hold the driver jar (``spark.jars``).
    :param paths: JSONL files (``.gz`` too), Parquet files or folders, or globs of them.
    :param jdbc: a SQL table of events, read besides ``paths``.
    :param fmt: ``auto`` (by file name), ``json`` or ``parquet``.
    :param out: a local folder: writes the Parquet tables, ``report.json``, ``report.md`` and
        ``report.html`` with PNG charts there (replacing those of an earlier run).
    :param keep_for_s: the keep_for to judge near misses by for events that carry none.
    :param broker_bounds: the brokers' redelivery bounds in seconds (e.g. Redis
        ``visibility_timeout``), by name or as a list; the recommendation is never below the
        longest. Without any, the bound of the longest default among the brokers of the
        frameworks the events name (semantics.FRAMEWORK_BROKERS: Celery 3600 s, Dramatiq
        1800 s), stated as assumed in ``report["advice"]``.
    :param safety_factor: the p99.9 gap is multiplied by this.
    :param simulate_windows: keep_for values (seconds) to replay the log with (what-if).
    :param grace_s: a claim not ended within its lease plus this (after its last renewal) is
        stuck.
    :param bytes_per_key: store name → bytes per handled key, for store sizes; default
        :data:`~taskonce.spark_ext.semantics.BYTES_PER_KEY`.
    :param progress: called as ``progress(step, steps, description)`` at each step; default
        logs at INFO.
    :param sample_rows: example leaked keys and stuck claims kept for the readable report.
    :param charts: draw PNG charts (needs matplotlib) when writing ``out``.
    :param now: the report's ``generated_at`` (default: now, UTC).
    :param shuffle_partitions: Spark shuffle partitions for this audit (default: about one per
        64 MB of input, at least the default parallelism); restored afterwards.
    """
    run = AuditRun(
        spark,
        paths,
        jdbc=jdbc,
        fmt=fmt,
        keep_for_s=keep_for_s,
        broker_bounds=broker_bounds,
        safety_factor=safety_factor,
        simulate_windows=simulate_windows,
        grace_s=grace_s,
        bytes_per_key=bytes_per_key,
        sample_rows=sample_rows,
        now=now,
        shuffle_partitions=shuffle_partitions,
    )
    passes: tuple[Callable[[], object], ...] = (
        run.classify,
        run.per_key,
        run.per_scope,
        run.gaps,
        run.what_if,
    )
    steps = len(_STEPS) + (1 if out else 0)

    def step(number: int) -> None:
        description = _STEPS[number - 1] if number <= len(_STEPS) else "writing the outputs"
        if progress is not None:
            progress(number, steps, description)
        else:
            logger.info("audit step %d/%d: %s", number, steps, description)

    try:
        for number, one_pass in enumerate(passes, 1):
            step(number)
            one_pass()
        step(len(passes) + 1)
        result = run.result()
        if out is not None:
            step(steps)
            from taskonce.spark_ext.report import write_outputs

            write_outputs(spark, result, out, charts=charts)
        return result
    finally:
        run.close()


#: The hand-off's figures in ``report.json`` (``"handoff"``), in this order.
HANDOFF_FIELDS = (
    "records_deferred",
    "records_dispatched",
    "stranded",
    "discarded",
    "dispatch_lag_p50_s",
    "dispatch_lag_p99_s",
    "dispatch_lag_max_s",
)


def _handoff_figures(
    classified: DataFrame, any_sends: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hand-off's figures, for the tasks' own sends (``"handoff"``) and for the producer
    outbox (``"producer"``, ``taskonce.send_on_commit``), in one pass.

    Records whose sends were stored (``sends_deferred``: with a task's outcome, or at the
    application's commit), how long until they were published (``sends_dispatched`` by the
    worker, the committing process or a relay, ``sends_redispatched`` by a redelivery) — the
    dispatch lag, to the first publication after it — those still unpublished at the log's end
    (stranded) and the discarded ones. A task's record is its ``key``; a producer's events have
    no key (no incoming message) and name their outbox record as ``message_id``.

    With ``any_sends`` false (the log holds no hand-off event) the figures are all zero
    without a Spark job."""
    from pyspark.sql import functions as F

    figures: dict[str, Any] = {}
    discarded: dict[str, int] = {}

    def part(name: str) -> dict[str, Any]:
        row = figures.get(name)
        records = int(row["records"]) if row else 0
        dispatched = int(row["dispatched"]) if row else 0
        p50, p99 = (row["p"] or [None, None]) if row and dispatched else (None, None)
        return {
            "records_deferred": records,
            "records_dispatched": dispatched,
            "stranded": records - dispatched,
            "discarded": discarded.get(name, 0),
            "dispatch_lag_p50_s": _seconds(p50),
            "dispatch_lag_p99_s": _seconds(p99),
            "dispatch_lag_max_s": _seconds(row["max_ms"] if row else None),
        }

    if not any_sends:
        return part("handoff"), part("producer")
    handler = F.col("key").isNotNull()
    producer = F.col("key").isNull() & F.col("message_id").startswith("outbox:")
    events = classified.filter(
        (F.col("is_valid") == 1) & (handler | producer) & _in("event", SENDS_EVENTS)
    ).select(
        F.when(handler, F.lit("handoff")).otherwise(F.lit("producer")).alias("part"),
        F.coalesce(F.col("key"), F.col("message_id")).alias("record"),
        "event",
        "t_ms",
    )
    deferred = (
        events.filter(F.col("event") == "sends_deferred")
        .groupBy("part", "record")
        .agg(F.min("t_ms").alias("deferred_ms"))
    )
    sent = events.filter(_in("event", ("sends_dispatched", "sends_redispatched"))).select(
        F.col("part").alias("sent_part"),
        F.col("record").alias("sent_record"),
        F.col("t_ms").alias("sent_ms"),
    )
    lags = (
        deferred.join(
            sent,
            (deferred["part"] == sent["sent_part"])
            & (deferred["record"] == sent["sent_record"])
            & (sent["sent_ms"] >= deferred["deferred_ms"]),
            "left",
        )
        .groupBy("part", "record", "deferred_ms")
        .agg(F.min("sent_ms").alias("sent_ms"))
        .withColumn("lag_ms", F.col("sent_ms") - F.col("deferred_ms"))
    )
    figures = {
        row["part"]: row
        for row in lags.groupBy("part")
        .agg(
            F.count(F.lit(1)).alias("records"),
            F.count("sent_ms").alias("dispatched"),
            F.percentile_approx("lag_ms", [0.5, 0.99], APPROX_ACCURACY).alias("p"),
            F.max("lag_ms").alias("max_ms"),
        )
        .collect()
    }
    discarded = {
        row["part"]: int(row["count"])
        for row in events.filter(F.col("event") == "sends_discarded")
        .groupBy("part")
        .count()
        .collect()
    }

    return part("handoff"), part("producer")


def _shuffle_partitions(spark: SparkSession, raw: DataFrame, has_jdbc: bool) -> int:
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


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Timestamps as ISO text, so samples serialise."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            out[name] = value.astimezone(datetime.timezone.utc).isoformat(timespec="milliseconds")
        else:
            out[name] = value
    return out


def _build_report(
    scopes: dict[str, dict[str, Any]],
    total_events: int,
    bounds: list[float],
    safety_factor: float,
    what_if: list[dict[str, Any]],
    now: datetime.datetime | None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The public report (its exact shape is in docs/audit.md) and the per-scope details."""
    details: dict[str, dict[str, Any]] = {}
    metrics: dict[str, dict[str, Any]] = {}
    for scope_key, values in scopes.items():
        if values["scope"] != "overall" and values["name"] == NONE_NAME:
            if not values.get("deliveries") and not values.get("failures"):
                continue  # events without a queue/task, such as purged: not a scope of their own
        if values["scope"] != "overall" and not values.get("events"):
            continue  # only malformed rows
        entry: dict[str, Any] = {}
        for field in METRIC_FIELDS:
            if field.startswith("gap_"):
                if field == "gap_max_s":
                    entry[field] = _seconds(values.get("gap_max_ms"))
                else:
                    entry[field] = float(values.get(field) or 0.0)
            elif field == "recommended_keep_for_s":
                p999 = values.get("gap_p999_s") if values.get("gaps") else None
                entry[field] = recommend(p999, safety_factor, bounds)
            else:
                entry[field] = int(values.get(field) or 0)
        metrics[scope_key] = entry
        duplicates = (
            entry["duplicates_skipped"]
            + entry["duplicates_in_flight"]
            + int(values.get("leaked_runs") or 0)
        )
        deliveries = entry["deliveries"]
        keep_for = values.get("keep_for_in_force_s")
        details[scope_key] = {
            "scope": values["scope"],
            "name": values["name"],
            "events": int(values.get("events") or 0),
            "duplicates": duplicates,
            "duplicate_rate": (duplicates / deliveries) if deliveries else 0.0,
            "leaked_runs": int(values.get("leaked_runs") or 0),
            "gaps": int(values.get("gaps") or 0),
            "keep_for_in_force_s": float(keep_for) if keep_for is not None else None,
            "buckets": {label: int(values.get(f"bucket {label}") or 0) for label, _ in GAP_BUCKETS},
            "first_ts": _iso(values.get("first_ms")),
            "last_ts": _iso(values.get("last_ms")),
            "first_delivery_ms": values.get("first_delivery_ms"),
            **_recovery(values),
        }
    generated = (now or datetime.datetime.now(datetime.timezone.utc)).astimezone(
        datetime.timezone.utc
    )
    overall_keep_for = details["overall"]["keep_for_in_force_s"]
    report: dict[str, Any] = {
        "generated_at": generated.strftime("%Y-%m-%dT%H:%M:%S.")
        + f"{generated.microsecond // 1000:03d}Z",
        "events": total_events,
        "keep_for_s": _number(overall_keep_for) if overall_keep_for is not None else 0,
        "overall": metrics["overall"],
        "queues": {
            details[k]["name"]: metrics[k] for k in sorted(metrics) if k.startswith("queue:")
        },
        "tasks": {details[k]["name"]: metrics[k] for k in sorted(metrics) if k.startswith("task:")},
        "what_if": [{field: row[field] for field in WHAT_IF_FIELDS} for row in what_if],
    }
    return report, details


#: The fields of one scope's advice in ``report.json`` (``"advice"``), in this order.
ADVICE_SCOPE_FIELDS = ("verdict", "span_s", "duplicates", "gaps", "span_needed_s", "reasons")


def _advice(
    report: dict[str, Any],
    details: dict[str, dict[str, Any]],
    log_end_ms: int | None,
    bound: tuple[float | None, str | None, str | None],
    frameworks: list[str],
) -> dict[str, Any]:
    """``report.json``'s ``"advice"``: the evidence behind each scope's
    ``recommended_keep_for_s`` and its verdict (semantics.advise). The broker bound is the
    log's (``--broker-bound``, else assumed from the frameworks the events name); a scope's
    span runs from its first delivery to the log's last event (the latest a duplicate of its
    messages could have shown)."""
    bound_s, name, source = bound

    def scope(key: str, metrics: dict[str, Any]) -> dict[str, Any]:
        detail = details[key]
        first = detail.get("first_delivery_ms")
        span_s = (
            _seconds(max(log_end_ms - first, 0))
            if first is not None and log_end_ms is not None
            else 0.0
        )
        recommended = int(metrics["recommended_keep_for_s"])
        verdict, reasons = advise(span_s, int(detail["gaps"]), recommended, bound_s)
        return {
            "verdict": verdict,
            "span_s": span_s,
            "duplicates": int(detail["duplicates"]),
            "gaps": int(detail["gaps"]),
            "span_needed_s": recommended,
            "reasons": reasons,
        }

    return {
        "broker_bound_s": None if bound_s is None else _number(bound_s),
        "broker_bound_name": name,
        "broker_bound_source": source,
        "frameworks": list(frameworks),
        "min_gaps": 0 if bound_s is not None else MIN_ADVICE_GAPS,
        "overall": scope("overall", report["overall"]),
        "queues": {n: scope(f"queue:{n}", m) for n, m in report["queues"].items()},
        "tasks": {n: scope(f"task:{n}", m) for n, m in report["tasks"].items()},
    }


def _recovery(values: dict[str, Any]) -> dict[str, float | None]:
    """Recovery time percentiles of a scope's takeovers of dead owners (None without any)."""
    p = values.get("recovery_p") or [None, None]
    top = values.get("recovery_max_s")
    return {
        "recovery_p50_s": None if p[0] is None else float(p[0]),
        "recovery_p95_s": None if p[1] is None else float(p[1]),
        "recovery_max_s": None if top is None else float(top),
    }


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)
