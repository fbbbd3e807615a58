"""The audit pipeline: classify every event of every key, aggregate per queue / per task /
overall, and recommend a retention window.

All work over events is Spark DataFrame operations (one window over each key's events, then
aggregations with grouping sets); the driver only ever collects aggregates whose size does not
grow with the log (one row per queue, task, bucket or window), plus at most
``sample_rows`` example rows of leaks and stuck claims for the human-readable report.

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
    GAP_BUCKETS,
    METRIC_FIELDS,
    NEAR_MISS_RATIO,
    PERCENTILES,
    RUN_EVENTS,
    WHAT_IF_FIELDS,
    recommend,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

logger = logging.getLogger("taskonce.spark_ext")

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

_STEPS = (
    "reading and classifying events",
    "counting per queue and task",
    "counting keys and leaks",
    "finding stuck claims",
    "measuring redelivery gaps",
    "replaying windows and timeline",
)


@dataclasses.dataclass
class AuditResult:
    """What :func:`audit` found.

    :ivar report: the report in its public shape (docs/audit.md) (``report.json``).
    :ivar details: per scope, what the public shape leaves out: ``events``, ``duplicates``,
        ``duplicate_rate``, ``leaked_runs``, ``keep_for_in_force_s``, ``buckets`` (label →
        count), ``first_ts``/``last_ts``; keyed ``"overall"``, ``"queue:<name>"``,
        ``"task:<name>"``.
    :ivar what_if: the what-if rows with ``store_bytes`` (store name → bytes) added.
    :ivar info: about the input and the run: ``malformed`` rows dropped, ``span_s``,
        ``keys_per_s``, ``percentiles`` (``"exact"`` or ``"approximate"``), ``broker_bounds``,
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


def classify(events: DataFrame, keep_for_s: float | None = None) -> DataFrame:
    """Per-event classification over each key's timeline (one window, ordered by time and then
    source order).

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
        F.col("event").isin(sorted(EVENT_NAMES))
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
        longest.
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
    from pyspark import StorageLevel
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if safety_factor <= 0:
        raise ValueError("safety_factor must be positive")
    bounds = (
        dict(broker_bounds)
        if isinstance(broker_bounds, Mapping)
        else {f"bound {i + 1}": float(b) for i, b in enumerate(broker_bounds)}
    )
    bound_values = [float(v) for v in bounds.values()]
    windows = sorted({float(w) for w in simulate_windows})
    sizes = dict(BYTES_PER_KEY if bytes_per_key is None else bytes_per_key)
    steps = len(_STEPS) + (1 if out else 0)

    def step(number: int) -> None:
        description = _STEPS[number - 1] if number <= len(_STEPS) else "writing the outputs"
        if progress is not None:
            progress(number, steps, description)
        else:
            logger.info("audit step %d/%d: %s", number, steps, description)

    # 1. read, drop malformed rows, classify each key's events; keep the result for the passes
    step(1)
    raw = read_events(spark, paths, jdbc, fmt)
    previous_partitions = spark.conf.get("spark.sql.shuffle.partitions")
    partitions = shuffle_partitions or _shuffle_partitions(spark, raw, jdbc is not None)
    spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    logger.info("audit: %d shuffle partitions", partitions)
    classified = classify(raw, keep_for_s).persist(StorageLevel.MEMORY_AND_DISK)
    cached = [classified]
    try:
        # 2. event-level counts per scope
        step(2)
        gap_known = F.col("gap_ms").isNotNull()
        bucket_columns = []
        lower = None
        for label, upper in GAP_BUCKETS:
            condition = gap_known
            if lower is not None:
                condition = condition & (F.col("gap_ms") > F.lit(lower * 1000))
            if upper is not None:
                condition = condition & (F.col("gap_ms") <= F.lit(upper * 1000))
            bucket_columns.append(F.sum(_flag(condition)).alias(f"bucket {label}"))
            lower = upper
        keep_for_column = F.col("keep_for_s")
        # takeovers of a dead owner: seconds from its last sign of life to the takeover
        recovery = F.when(F.col("event") == "lease_taken_over", F.col("recovery_s"))
        counted = _scoped(
            classified,
            F.sum("is_valid").alias("events"),
            F.sum(1 - F.col("is_valid")).alias("malformed"),
            F.sum("is_delivery").alias("deliveries"),
            F.sum("is_run").alias("runs"),
            F.sum(_flag(F.col("event") == "duplicate_skipped")).alias("duplicates_skipped"),
            F.sum(_flag(F.col("event") == "in_progress_deferred")).alias("duplicates_in_flight"),
            F.sum(F.coalesce(F.col("leaked_run"), F.lit(0))).alias("leaked_runs"),
            F.sum("is_failure").alias("failures"),
            F.sum(_flag(F.col("event") == "released")).alias("releases"),
            F.sum(_flag(F.col("event") == "lease_taken_over")).alias("takeovers"),
            F.percentile_approx(recovery, [0.5, 0.95], APPROX_ACCURACY).alias("recovery_p"),
            F.max(recovery).alias("recovery_max_s"),
            F.sum(F.coalesce(F.col("near_miss"), F.lit(0))).alias("near_misses"),
            F.count("gap_ms").alias("gaps"),
            F.max("gap_ms").alias("gap_max_ms"),
            F.min(F.when(F.col("is_valid") == 1, F.col("t_ms"))).alias("first_ms"),
            F.max(F.when(F.col("is_valid") == 1, F.col("t_ms"))).alias("last_ms"),
            F.min(F.when(F.col("is_delivery") == 1, F.col("t_ms"))).alias("first_delivery_ms"),
            F.max(F.when(F.col("is_delivery") == 1, F.col("t_ms"))).alias("last_delivery_ms"),
            F.max_by(keep_for_column, F.when(keep_for_column.isNotNull(), F.col("t_ms"))).alias(
                "keep_for_in_force_s"
            ),
            *bucket_columns,
        )
        scopes: dict[str, dict[str, Any]] = {
            _scope_key(scope, name): {"scope": scope, "name": name, **values}
            for scope, name, values in counted
        }
        overall = scopes.setdefault(
            "overall", {"scope": "overall", "name": "", "events": 0, "gaps": 0}
        )
        total_events = int(overall.get("events") or 0)
        log_end_ms = overall.get("last_ms")

        # 3. key-level counts: distinct keys and leaked keys, each key under its first queue/task
        step(3)
        first = F.struct("t_ms", "seq")
        keys = (
            classified.filter(F.col("key").isNotNull() & (F.col("is_valid") == 1))
            .groupBy("key")
            .agg(
                F.min_by("queue_name", first).alias("queue_name"),
                F.min_by("task_name", first).alias("task_name"),
                F.max("is_delivery").alias("delivered"),
                F.sum("leaked_run").alias("leaked_runs"),
                F.min(F.when(F.col("leaked_run") == 1, F.col("t_ms"))).alias("first_leak_ms"),
                F.max(F.when(F.col("leaked_run") == 1, F.col("t_ms"))).alias("last_leak_ms"),
                F.min("anchor_ms").alias("first_run_ms"),
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        cached.append(keys)
        for scope, name, values in _scoped(
            keys,
            F.sum("delivered").alias("distinct_keys"),
            F.sum(_flag(F.col("leaked_runs") > 0)).alias("leaks"),
        ):
            scopes.setdefault(_scope_key(scope, name), {"scope": scope, "name": name}).update(
                values
            )
        leaks_table = keys.filter(F.col("leaked_runs") > 0).select(
            "key",
            F.col("queue_name").alias("queue"),
            F.col("task_name").alias("task"),
            "leaked_runs",
            F.timestamp_millis("first_run_ms").alias("first_run_at"),
            F.timestamp_millis("first_leak_ms").alias("first_leak_at"),
            F.timestamp_millis("last_leak_ms").alias("last_leak_at"),
        )

        # 4. stuck claims: each claim is a segment of its key's events
        step(4)
        owned = F.col("worker").eqNullSafe(F.col("owner"))
        segments = (
            classified.filter(F.col("key").isNotNull() & (F.col("seg") > 0))
            .groupBy("key", "seg")
            .agg(
                F.min(F.when(_in("event", CLAIM_START_EVENTS), F.col("t_ms"))).alias("start_ms"),
                F.max(F.when(_in("event", CLAIM_START_EVENTS), F.col("event"))).alias("how"),
                F.max(F.when(_in("event", CLAIM_START_EVENTS), F.col("lease_s"))).alias("lease_s"),
                F.max(F.when(_in("event", CLAIM_START_EVENTS), F.col("worker"))).alias("worker"),
                F.max(F.when(_in("event", CLAIM_START_EVENTS), F.col("queue_name"))).alias(
                    "queue_name"
                ),
                F.max(F.when(_in("event", CLAIM_START_EVENTS), F.col("task_name"))).alias(
                    "task_name"
                ),
                F.max(F.when((F.col("event") == "lease_renewed") & owned, F.col("t_ms"))).alias(
                    "renewed_ms"
                ),
                F.min(
                    F.when(
                        _in("event", CLAIM_END_EVENTS) & ((F.col("event") != "lease_lost") | owned),
                        F.col("t_ms"),
                    )
                ).alias("end_ms"),
            )
        )
        by_claim = Window.partitionBy("key").orderBy("seg")
        segments = segments.withColumn(
            "ended_ms", F.least(F.col("end_ms"), F.lead("start_ms").over(by_claim))
        ).withColumn(
            "deadline_ms",
            F.greatest(F.col("start_ms"), F.col("renewed_ms"))
            + ((F.col("lease_s") + F.lit(float(grace_s))) * 1000).cast("long"),
        )
        stuck = segments.filter(
            F.col("lease_s").isNotNull()
            & (
                (F.col("ended_ms") > F.col("deadline_ms"))
                | (
                    F.col("ended_ms").isNull()
                    & (F.lit(log_end_ms).cast("long") > F.col("deadline_ms"))
                )
            )
        ).persist(StorageLevel.MEMORY_AND_DISK)
        cached.append(stuck)
        for scope, name, values in _scoped(stuck, F.count(F.lit(1)).alias("stuck_claims")):
            scopes.setdefault(_scope_key(scope, name), {"scope": scope, "name": name}).update(
                values
            )
        stuck_table = stuck.select(
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

        # 5. gaps: percentiles per scope (exact when few), a log histogram for the chart
        step(5)
        duplicates = classified.filter(F.col("dup_kind").isNotNull()).persist(
            StorageLevel.MEMORY_AND_DISK
        )
        cached.append(duplicates)
        gap_count = int(overall.get("gaps") or 0)
        exact = gap_count <= EXACT_PERCENTILE_LIMIT
        fractions = [fraction for _, fraction in PERCENTILES]
        percentile = (
            F.percentile("gap_ms", fractions)
            if exact
            else F.percentile_approx("gap_ms", fractions, APPROX_ACCURACY)
        )
        if gap_count:
            for scope, name, values in _scoped(
                duplicates.filter(F.col("gap_ms").isNotNull()), percentile.alias("p")
            ):
                entry = scopes.setdefault(_scope_key(scope, name), {"scope": scope, "name": name})
                for (field, _), value in zip(PERCENTILES, values["p"] or [], strict=False):
                    entry[field] = _seconds(value)
        histogram_rows = (
            duplicates.filter(F.col("gap_ms").isNotNull())
            .groupBy(
                (
                    F.floor(F.log10(F.greatest(F.col("gap_ms"), F.lit(1)) / F.lit(1000.0)) * 4) / 4
                ).alias("bin")
            )
            .count()
            .orderBy("bin")
            .collect()
        )
        histogram = [(float(row["bin"]), int(row["count"])) for row in histogram_rows]

        # 6. what-if windows and the duplicates-over-time timeline
        step(6)
        first_ms = overall.get("first_delivery_ms")
        last_ms = overall.get("last_delivery_ms")
        span_s = ((last_ms - first_ms) / 1000.0) if first_ms is not None else 0.0
        distinct = int(overall.get("distinct_keys") or 0)
        keys_per_s = distinct / max(span_s, 1.0)
        what_if: list[dict[str, Any]] = []
        if windows:
            judged = _in("dup_kind", ("skipped", "rerun"))
            aggregates = []
            for index, window in enumerate(windows):
                limit = F.lit(int(window * 1000))
                kept = (F.col("dup_kind") == "in_flight") | (
                    judged & (F.col("gap_ms").isNull() | (F.col("gap_ms") <= limit))
                )
                lost = (F.col("dup_kind") == "concurrent") | (judged & (F.col("gap_ms") > limit))
                aggregates += [
                    F.sum(_flag(kept)).alias(f"s{index}"),
                    F.sum(_flag(lost)).alias(f"l{index}"),
                ]
            counts = duplicates.agg(*aggregates).collect()[0].asDict()
            for index, window in enumerate(windows):
                store_keys = math.ceil(keys_per_s * window - 1e-9)
                what_if.append(
                    {
                        "keep_for_s": int(window) if float(window).is_integer() else window,
                        "suppressed": int(counts[f"s{index}"] or 0),
                        "leaked": int(counts[f"l{index}"] or 0),
                        "store_keys": store_keys,
                        "store_bytes": {name: store_keys * size for name, size in sizes.items()},
                    }
                )
        bucket_s = _timeline_bucket(span_s)
        bucket_ms = bucket_s * 1000
        timeline_table = (
            classified.filter(F.col("is_delivery") == 1)
            .groupBy(
                F.col("queue_name").alias("queue"),
                ((F.floor(F.col("t_ms") / bucket_ms) * bucket_ms).cast("long")).alias("bucket_ms"),
            )
            .agg(
                F.sum(_flag(F.col("dup_kind").isNotNull())).alias("duplicates"),
                F.count(F.lit(1)).alias("deliveries"),
            )
            .select(
                "queue",
                F.timestamp_millis("bucket_ms").alias("bucket_start"),
                "bucket_ms",
                "duplicates",
                "deliveries",
            )
            .persist(StorageLevel.MEMORY_AND_DISK)
        )
        cached.append(timeline_table)
        queue_order = sorted(
            (
                -(int(v.get("duplicates_skipped") or 0) + int(v.get("leaked_runs") or 0)),
                v["name"],
            )
            for v in scopes.values()
            if v["scope"] == "queue"
        )[:8]
        shown = [name for _, name in queue_order]
        timeline = [
            {
                "bucket_start": _iso(int(row["bucket_ms"])),
                "queue": row["queue"],
                "duplicates": int(row["duplicates"]),
                "deliveries": int(row["deliveries"]),
            }
            for row in timeline_table.filter(F.col("queue").isin(shown))
            .orderBy("bucket_ms", "queue")
            .collect()
        ]

        handoff, producer = _handoff_figures(classified)

        # samples for the readable report
        leaks_sample = [
            _plain(row.asDict())
            for row in leaks_table.orderBy(F.desc("last_leak_at")).limit(sample_rows).collect()
        ]
        stuck_sample = [
            _plain(row.asDict())
            for row in stuck_table.orderBy(F.desc("claimed_at")).limit(sample_rows).collect()
        ]

        report, details = _build_report(
            scopes, total_events, bound_values, safety_factor, what_if, now
        )
        report["handoff"] = handoff
        report["producer"] = producer
        malformed = int(overall.get("malformed") or 0)
        if malformed:
            logger.warning("dropped %d malformed event row(s) (no event name or bad ts)", malformed)
        recommended = int(report["overall"]["recommended_keep_for_s"])
        info: dict[str, Any] = {
            "sources": [*paths, *([f"jdbc:{jdbc.table}"] if jdbc else [])],
            "malformed": malformed,
            "first_ts": _iso(overall.get("first_ms")),
            "last_ts": _iso(overall.get("last_ms")),
            "span_s": round(span_s, 3),
            "keys_per_s": keys_per_s,
            "percentiles": "exact" if exact else "approximate",
            "broker_bounds": bounds,
            "safety_factor": safety_factor,
            "grace_s": grace_s,
            "near_miss_ratio": NEAR_MISS_RATIO,
            "bytes_per_key": sizes,
            "recommended_store_keys": math.ceil(keys_per_s * recommended - 1e-9),
        }
        info["recommended_store_bytes"] = {
            name: info["recommended_store_keys"] * size for name, size in sizes.items()
        }
        tables = {
            "duplicates": duplicates.select(
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
            "leaks": leaks_table,
            "stuck_claims": stuck_table,
            "timeline": timeline_table,
        }
        result = AuditResult(
            report=report,
            details=details,
            what_if=what_if,
            info=info,
            leaks_sample=leaks_sample,
            stuck_sample=stuck_sample,
            histogram=histogram,
            timeline=timeline,
            timeline_bucket_s=bucket_s,
            tables=tables,
        )
        if out is not None:
            step(steps)
            from taskonce.spark_ext.report import write_outputs

            write_outputs(spark, result, out, charts=charts)
        return result
    finally:
        for frame in cached:
            frame.unpersist()
        spark.conf.set("spark.sql.shuffle.partitions", previous_partitions or "200")


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


def _handoff_figures(classified: DataFrame) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hand-off's figures, for the tasks' own sends (``"handoff"``) and for the producer
    outbox (``"producer"``, ``taskonce.send_on_commit``), in one pass.

    Records whose sends were stored (``sends_deferred``: with a task's outcome, or at the
    application's commit), how long until they were published (``sends_dispatched`` by the
    worker, the committing process or a relay, ``sends_redispatched`` by a redelivery) — the
    dispatch lag, to the first publication after it — those still unpublished at the log's end
    (stranded) and the discarded ones. A task's record is its ``key``; a producer's events have
    no key (no incoming message) and name their outbox record as ``message_id``."""
    from pyspark.sql import functions as F

    handler = F.col("key").isNotNull()
    producer = F.col("key").isNull() & F.col("message_id").startswith("outbox:")
    events = classified.filter(
        (F.col("is_valid") == 1)
        & (handler | producer)
        & _in(
            "event", ("sends_deferred", "sends_dispatched", "sends_redispatched", "sends_discarded")
        )
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
