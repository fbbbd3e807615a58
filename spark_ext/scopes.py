"""The per-scope pass: the event counts of each scope (overall, each queue, each task), one
aggregation per (queue, task) pair and timeline bucket rolled up on the driver, and the helpers
that aggregate over scopes for the other passes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taskonce.events import Event
from taskonce.spark_ext.common import SENDS_EVENTS, flag, in_names, scope_key
from taskonce.spark_ext.semantics import GAP_BUCKETS

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

Scoped = list[tuple[str, str, dict[str, Any]]]


def scoped(frame: DataFrame, *aggregates: Column) -> list[tuple[str, str, dict[str, Any]]]:
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


def pair_totals(
    frame: DataFrame, by: Sequence[Column], aggregates: Mapping[str, tuple[str, Column]]
) -> DataFrame:
    """The aggregates of :func:`rolled_up` per (queue, task) pair and the ``by`` columns."""
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


def rolled_up(
    frame: DataFrame, **aggregates: tuple[str, Column]
) -> list[tuple[str, str, dict[str, Any]]]:
    """Like :func:`scoped`, for aggregates that combine: aggregate per (queue, task) pair in
    Spark, then roll the pairs up to the scopes here (one row per pair reaches the driver, as
    many as the log has tasks). Each aggregate is ``name=(how, column)``: ``how`` is ``sum``,
    ``min`` or ``max`` (of ``column``), or ``latest``: the value of ``column`` at the greatest
    ``t_ms`` among the rows where it is not null (``max_by``; of several values at that time,
    the greatest).

    Cheaper than grouping sets over every event: those copy each row three times (one per
    grouping set) before aggregating."""
    return roll_up(pair_totals(frame, (), aggregates).collect(), aggregates)


def roll_up(
    rows: Iterable[Any], aggregates: Mapping[str, tuple[str, Column]]
) -> list[tuple[str, str, dict[str, Any]]]:
    """Roll rows of :func:`pair_totals` (finer than pairs too) up to the scopes: overall, each
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
                _combine(entry, values, field, how)
    return [
        (scope, name, {field: entry[field] for field in aggregates})
        for (scope, name), entry in scopes.items()
    ]


def _combine(entry: dict[str, Any], values: dict[str, Any], field: str, how: str) -> None:
    """Fold one row's ``values`` of aggregate ``field`` into its scope's ``entry``."""
    mine, theirs = entry[field], values[field]
    if how == "latest":
        at = values[f"{field}@"]
        if at is not None and (
            entry[f"{field}@"] is None or (at, theirs) > (entry[f"{field}@"], entry[field])
        ):
            entry[field], entry[f"{field}@"] = theirs, at
    elif theirs is None:
        return
    elif mine is None:
        entry[field] = theirs
    elif how == "sum":
        entry[field] = mine + theirs
    elif how == "min":
        entry[field] = min(mine, theirs)
    else:
        entry[field] = max(mine, theirs)


def timeline_bucket(span_s: float) -> int:
    """A bucket width giving at most ~60 points over the span."""
    for width in (1, 5, 10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 86400):
        if span_s / width <= 60:
            return width
    return 7 * 86400


def _bucket_columns() -> list[tuple[str, Column]]:
    """Per gap bucket (semantics.GAP_BUCKETS): its label and the count of its gaps."""
    from pyspark.sql import functions as F

    gap_known = F.col("gap_ms").isNotNull()
    bucket_columns = []
    lower = None
    for label, upper in GAP_BUCKETS:
        condition = gap_known
        if lower is not None:
            condition = condition & (F.col("gap_ms") > F.lit(lower * 1000))
        if upper is not None:
            condition = condition & (F.col("gap_ms") <= F.lit(upper * 1000))
        bucket_columns.append((label, F.sum(flag(condition))))
        lower = upper
    return bucket_columns


def scope_aggregates() -> dict[str, tuple[str, Column]]:
    """The figures counted per scope over the classified events, as :func:`rolled_up`'s
    ``name=(how, column)``."""
    from pyspark.sql import functions as F

    bucket_columns = _bucket_columns()
    valid_t = F.when(F.col("is_valid") == 1, F.col("t_ms"))
    delivery_t = F.when(F.col("is_delivery") == 1, F.col("t_ms"))
    aggregates: dict[str, tuple[str, Column]] = dict(
        events=("sum", F.sum("is_valid")),
        malformed=("sum", F.sum(1 - F.col("is_valid"))),
        deliveries=("sum", F.sum("is_delivery")),
        runs=("sum", F.sum("is_run")),
        duplicates_skipped=("sum", F.sum(flag(F.col("event") == Event.DUPLICATE_SKIPPED.value))),
        duplicates_in_flight=(
            "sum",
            F.sum(flag(F.col("event") == Event.IN_PROGRESS_DEFERRED.value)),
        ),
        leaked_runs=("sum", F.sum(F.coalesce(F.col("leaked_run"), F.lit(0)))),
        failures=("sum", F.sum("is_failure")),
        releases=("sum", F.sum(flag(F.col("event") == Event.RELEASED.value))),
        takeovers=("sum", F.sum(flag(F.col("event") == Event.LEASE_TAKEN_OVER.value))),
        quarantined=("sum", F.sum(flag(F.col("event") == Event.QUARANTINED.value))),
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
        sends_events=("sum", F.sum(flag(in_names("event", SENDS_EVENTS)))),
        **{f"bucket {label}": ("sum", column) for label, column in bucket_columns},
    )
    return aggregates


def count_scopes(
    classified: DataFrame, bucket_s: int, keep: Callable[[DataFrame], DataFrame]
) -> tuple[Scoped, DataFrame]:
    """The figures of :func:`scope_aggregates` per scope, and the timeline table (duplicates
    and deliveries per queue and bucket of ``bucket_s`` seconds): one aggregation per (queue,
    task) pair and bucket, kept by ``keep`` and collected, rolled up here."""
    from pyspark.sql import functions as F

    bucket_ms = bucket_s * 1000
    delivery = F.col("is_delivery") == 1
    aggregates = scope_aggregates()
    # the same aggregation per timeline bucket too (for the timeline of what_if): rolled up
    # here, summed per queue and bucket there, with no second scan of the events
    totals = keep(
        pair_totals(
            classified,
            [((F.floor(F.col("t_ms") / bucket_ms) * bucket_ms).cast("long")).alias("bucket_ms")],
            {
                **aggregates,
                "_timeline_duplicates": (
                    "sum",
                    F.sum(flag(delivery & F.col("dup_kind").isNotNull())),
                ),
                "_timeline_deliveries": ("sum", F.sum(flag(delivery))),
            },
        )
    )
    counted = roll_up(totals.collect(), aggregates)
    return counted, _timeline_table(totals)


def _timeline_table(totals: DataFrame) -> DataFrame:
    """The ``timeline`` table from :func:`count_scopes`'s totals per pair and bucket."""
    from pyspark.sql import functions as F

    return (
        totals.filter(F.col("_timeline_deliveries") > 0)
        .groupBy(F.col("queue_name").alias("queue"), "bucket_ms")
        .agg(
            F.sum("_timeline_duplicates").alias("duplicates"),
            F.coalesce(F.sum("_timeline_deliveries"), F.lit(0).cast("long")).alias("deliveries"),
        )
        .select(
            "queue",
            F.timestamp_millis("bucket_ms").alias("bucket_start"),
            "bucket_ms",
            "duplicates",
            "deliveries",
        )
    )


def scopes_of(counted: Scoped, stuck_counts: Scoped) -> dict[str, dict[str, Any]]:
    """The scopes' figures by :func:`~taskonce.spark_ext.common.scope_key`: ``counted`` (of
    :func:`count_scopes`) with the stuck claims' counts; ``overall`` always there."""
    scopes: dict[str, dict[str, Any]] = {
        scope_key(scope, name): {"scope": scope, "name": name, **values}
        for scope, name, values in counted
    }
    scopes.setdefault("overall", {"scope": "overall", "name": "", "events": 0, "gaps": 0})
    for scope, name, values in stuck_counts:
        scopes.setdefault(scope_key(scope, name), {"scope": scope, "name": name}).update(values)
    return scopes
