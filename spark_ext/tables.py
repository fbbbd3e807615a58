"""Writing an audit's Parquet tables: small ones (``metrics``, ``gap_buckets``, ``what_if``)
from the collected figures, large ones (``duplicates``, ``leaks``, ``stuck_claims``,
``timeline``) straight from Spark, never through the driver.

Each table is its own Spark job; :func:`start_tables` runs them from a few threads at once (on a
small machine most of a small job's time is scheduling, not work) and lets the caller draw the
charts meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taskonce.spark_ext.semantics import GAP_BUCKETS, METRIC_FIELDS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from taskonce.spark_ext.audit import AuditResult

#: The most table jobs running at once.
TABLE_THREADS = 4


class PendingTables:
    """The table writes :func:`start_tables` started; :meth:`wait` for them (re-raising the
    first failure)."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor, futures: list[Any]) -> None:
        self._pool = pool
        self._futures = futures

    def wait(self) -> None:
        """Block until every table is written; raise the first error of any."""
        try:
            for future in self._futures:
                future.result()
        finally:
            self._pool.shutdown(wait=True)


def start_tables(spark: SparkSession, result: AuditResult, folder: Path) -> PendingTables:
    """Start writing every table of ``result`` under ``folder`` (one Spark job each, from up to
    :data:`TABLE_THREADS` threads); the caller must :meth:`~PendingTables.wait`."""
    folder.mkdir(parents=True, exist_ok=True)
    uri = folder.resolve().as_uri()
    jobs: list[Callable[[], None]] = [
        lambda: _write_scope_tables(spark, result, uri),
        lambda: _write_what_if(spark, result, uri),
    ]
    for name in ("duplicates", "leaks", "stuck_claims", "timeline"):
        jobs.append(functools.partial(_write_table, result.tables[name], f"{uri}/{name}"))
    pool = concurrent.futures.ThreadPoolExecutor(TABLE_THREADS, thread_name_prefix="audit-table")
    return PendingTables(pool, [pool.submit(job) for job in jobs])


def _write_table(frame: Any, path: str) -> None:
    frame.write.mode("overwrite").parquet(path)


def _write_scope_tables(spark: SparkSession, result: AuditResult, uri: str) -> None:
    """The ``metrics`` (one row per scope) and ``gap_buckets`` (per scope and bucket) tables."""
    from pyspark.sql.types import (
        DoubleType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    metric_fields = [
        StructField("scope", StringType(), False),
        StructField("name", StringType(), False),
    ]
    for field in METRIC_FIELDS:
        kind = DoubleType() if field.startswith("gap_") else LongType()
        metric_fields.append(StructField(field, kind, False))
    metric_fields += [
        StructField("events", LongType(), False),
        StructField("duplicates", LongType(), False),
        StructField("duplicate_rate", DoubleType(), False),
        StructField("leaked_runs", LongType(), False),
        StructField("keep_for_in_force_s", DoubleType(), True),
    ]
    metric_rows = []
    bucket_rows = []
    for scope, name, metrics, detail in _scope_rows(result):
        metric_rows.append(
            (
                scope,
                name,
                *[metrics[field] for field in METRIC_FIELDS],
                detail["events"],
                detail["duplicates"],
                float(detail["duplicate_rate"]),
                detail["leaked_runs"],
                detail["keep_for_in_force_s"],
            )
        )
        for label, _ in GAP_BUCKETS:
            bucket_rows.append((scope, name, label, detail["buckets"][label]))
    spark.createDataFrame(metric_rows, StructType(metric_fields)).coalesce(1).write.mode(
        "overwrite"
    ).parquet(f"{uri}/metrics")
    spark.createDataFrame(
        bucket_rows,
        StructType(
            [
                StructField("scope", StringType(), False),
                StructField("name", StringType(), False),
                StructField("bucket", StringType(), False),
                StructField("count", LongType(), False),
            ]
        ),
    ).coalesce(1).write.mode("overwrite").parquet(f"{uri}/gap_buckets")


def _write_what_if(spark: SparkSession, result: AuditResult, uri: str) -> None:
    """The ``what_if`` table: one row per simulated window, a bytes column per store."""
    from pyspark.sql.types import (
        DoubleType,
        LongType,
        StructField,
        StructType,
    )

    stores = sorted(result.info["bytes_per_key"])
    what_if_schema = StructType(
        [
            StructField("keep_for_s", DoubleType(), False),
            StructField("suppressed", LongType(), False),
            StructField("leaked", LongType(), False),
            StructField("store_keys", LongType(), False),
            *[StructField(f"store_bytes_{_slug(name)}", LongType(), False) for name in stores],
        ]
    )
    what_if_rows = [
        (
            float(row["keep_for_s"]),
            row["suppressed"],
            row["leaked"],
            row["store_keys"],
            *[row["store_bytes"][name] for name in stores],
        )
        for row in result.what_if
    ]
    spark.createDataFrame(what_if_rows, what_if_schema).coalesce(1).write.mode("overwrite").parquet(
        f"{uri}/what_if"
    )


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower())


def _scope_rows(result: AuditResult) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    rows = [("overall", "", result.report["overall"], result.details["overall"])]
    for scope, plural in (("queue", "queues"), ("task", "tasks")):
        for name, metrics in result.report[plural].items():
            rows.append((scope, name, metrics, result.details[f"{scope}:{name}"]))
    return rows
