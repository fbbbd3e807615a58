"""The what-if pass: the log's traffic (span and keys per second), the duplicates replayed
against each simulated keep_for window, and the duplicates-over-time timeline of the largest
queues."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taskonce.spark_ext.common import flag, in_names, iso

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

#: The most queues the timeline shows (those with the most duplicates).
TIMELINE_QUEUES = 8


def traffic(overall: Mapping[str, Any]) -> tuple[float, float]:
    """The span from the first to the last delivery in seconds, and the distinct keys per
    second over it (a span under a second counts as one), from the overall scope's figures."""
    first_ms = overall.get("first_delivery_ms")
    last_ms = overall.get("last_delivery_ms")
    span_s = ((last_ms - first_ms) / 1000.0) if first_ms is not None else 0.0
    distinct = int(overall.get("distinct_keys") or 0)
    keys_per_s = distinct / max(span_s, 1.0)
    return span_s, keys_per_s


def what_if_rows(
    duplicates: DataFrame,
    windows: Sequence[float],
    keys_per_s: float,
    sizes: Mapping[str, int],
) -> list[dict[str, Any]]:
    """Per simulated window: the duplicates it would have suppressed and leaked, and the keys
    (and bytes per store) it would keep; one aggregation over the duplicates for all windows,
    none without any."""
    from pyspark.sql import functions as F

    what_if: list[dict[str, Any]] = []
    if not windows:
        return what_if
    judged = in_names("dup_kind", ("skipped", "rerun"))
    aggregates = []
    for index, window in enumerate(windows):
        limit = F.lit(int(window * 1000))
        kept = (F.col("dup_kind") == "in_flight") | (
            judged & (F.col("gap_ms").isNull() | (F.col("gap_ms") <= limit))
        )
        lost = (F.col("dup_kind") == "concurrent") | (judged & (F.col("gap_ms") > limit))
        aggregates += [
            F.sum(flag(kept)).alias(f"s{index}"),
            F.sum(flag(lost)).alias(f"l{index}"),
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
    return what_if


def timeline_rows(
    timeline_table: DataFrame, scopes: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The timeline for the chart: duplicates and deliveries per bucket of the
    :data:`TIMELINE_QUEUES` queues with the most duplicates (skipped and leaked runs)."""
    from pyspark.sql import functions as F

    queue_order = sorted(
        (
            -(int(v.get("duplicates_skipped") or 0) + int(v.get("leaked_runs") or 0)),
            v["name"],
        )
        for v in scopes.values()
        if v["scope"] == "queue"
    )[:TIMELINE_QUEUES]
    shown = [name for _, name in queue_order]
    return [
        {
            "bucket_start": iso(int(row["bucket_ms"])),
            "queue": row["queue"],
            "duplicates": int(row["duplicates"]),
            "deliveries": int(row["deliveries"]),
        }
        for row in timeline_table.filter(F.col("queue").isin(shown))
        .orderBy("bucket_ms", "queue")
        .collect()
    ]
