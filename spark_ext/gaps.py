"""The gaps pass: the notable events (duplicates, takeovers, hand-off events) spread from the
per-key pass's rare rows; from them the leaked keys, the take-over recovery and redelivery gap
percentiles per scope, and the gaps' histogram for the chart."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from taskonce.events import Event
from taskonce.spark_ext.classification import classified_events
from taskonce.spark_ext.common import (
    APPROX_ACCURACY,
    EXACT_PERCENTILE_LIMIT,
    in_names,
    scope_key,
    seconds,
)
from taskonce.spark_ext.per_key import KEPT_EVENTS, notable
from taskonce.spark_ext.scopes import scoped
from taskonce.spark_ext.semantics import PERCENTILES

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def notable_events(rare: DataFrame, keep_for_s: float | None) -> DataFrame:
    """The classified events (:func:`~taskonce.spark_ext.classification.classified_events`) of
    the rare key rows (:func:`~taskonce.spark_ext.per_key.rare_rows`) that are duplicates or
    kept events (:data:`~taskonce.spark_ext.per_key.KEPT_EVENTS`)."""
    from pyspark.sql import functions as F

    # only the key rows holding a notable event are spread into events
    return classified_events(rare.filter(notable()), keep_for_s).filter(
        F.col("dup_kind").isNotNull() | in_names("event", KEPT_EVENTS)
    )


def leaks_table(duplicates: DataFrame) -> DataFrame:
    """The ``leaks`` table: each leaked key under its first queue/task; its first run is the
    anchor of its gaps."""
    from pyspark.sql import functions as F

    return (
        duplicates.filter(F.col("leaked_run") == 1)
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


def add_percentiles(kept: DataFrame, scopes: dict[str, dict[str, Any]]) -> bool:
    """Add to ``scopes`` the take-over recovery percentiles and the gap percentiles of each
    scope, from the ``kept`` events of :func:`notable_events` (exact up to
    :data:`~taskonce.spark_ext.common.EXACT_PERCENTILE_LIMIT` gaps, else approximate); whether
    they are exact."""
    from pyspark.sql import functions as F

    overall = scopes["overall"]
    gap_count = int(overall.get("gaps") or 0)
    exact = gap_count <= EXACT_PERCENTILE_LIMIT
    fractions = [fraction for _, fraction in PERCENTILES]
    percentile = (
        F.percentile("gap_ms", fractions)
        if exact
        else F.percentile_approx("gap_ms", fractions, APPROX_ACCURACY)
    )
    # One aggregation for the take-over recovery (seconds from a dead owner's last sign of
    # life to the takeover) and the gap percentiles: each aggregate sees only its own rows'
    # values (the others' are null, which both percentiles skip), and a scope takes each
    # figure only when it has rows of that kind, as when they were two aggregations.
    takeover = F.col("event") == Event.LEASE_TAKEN_OVER.value
    recovery = F.when(takeover, F.col("recovery_s"))
    has_gap = F.col("gap_ms").isNotNull()
    for scope, name, values in scoped(
        kept.filter(takeover | has_gap if gap_count else takeover),
        F.percentile_approx(recovery, [0.5, 0.95], APPROX_ACCURACY).alias("recovery_p"),
        F.max(recovery).alias("recovery_max_s"),
        F.count(F.when(takeover, F.lit(1))).alias("_takeovers"),
        *([percentile.alias("p"), F.count("gap_ms").alias("_gaps")] if gap_count else []),
    ):
        entry = scopes.setdefault(scope_key(scope, name), {"scope": scope, "name": name})
        if values.pop("_takeovers"):
            entry.update(recovery_p=values["recovery_p"], recovery_max_s=values["recovery_max_s"])
        if gap_count and values.pop("_gaps"):
            for (field, _), value in zip(PERCENTILES, values["p"] or [], strict=False):
                entry[field] = seconds(value)
    return exact


def histogram(duplicates: DataFrame) -> list[tuple[float, int]]:
    """(log10 bin lower edge in seconds, count) of all gaps, a quarter decade per bin."""
    from pyspark.sql import functions as F

    histogram_rows = (
        duplicates.filter(F.col("gap_ms").isNotNull())
        .groupBy(
            (F.floor(F.log10(F.greatest(F.col("gap_ms"), F.lit(1)) / F.lit(1000.0)) * 4) / 4).alias(
                "bin"
            )
        )
        .count()
        .orderBy("bin")
        .collect()
    )
    return [(float(row["bin"]), int(row["count"])) for row in histogram_rows]
