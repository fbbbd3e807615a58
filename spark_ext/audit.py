"""The audit pipeline: classify every event of every key, aggregate per queue / per task /
overall, and recommend a retention window.

All work over events is Spark DataFrame operations with built-in functions only (one grouping
of the events by key, each key's row classified by its own aggregates and, for its claims,
higher-order functions over its events; then aggregations per queue and task pair, or with
grouping sets), in the passes of :class:`AuditRun`; the driver only ever collects aggregates
whose size does not grow with the log (one row per queue, task, queue and task pair, bucket or
window), plus at most ``sample_rows`` example rows of leaks and stuck claims for the
human-readable report.

Each pass has its module: ``classification`` (read, group by key, classify), ``per_key`` (stuck
claims), ``scopes`` (counts per scope), ``gaps`` (percentiles, histogram, leaked keys),
``what_if`` (windows and timeline) and ``summary`` (hand-off figures, samples, the report);
``common`` holds what they share. This module runs them (:class:`AuditRun`, :func:`audit`) and
re-exports their public names.

The meaning of every figure is written out in docs/audit.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taskonce.spark_ext.classification import (
    AUDIT_COLUMNS,
    EVENT_FIELDS,
    FRAMEWORK_FLAGS,
    MAX_SHUFFLE_PARTITIONS,
    SHUFFLE_BYTES,
    classified_events,
    classify,
    group_by_key,
    log_bounds,
    shuffle_partitions,
)
from taskonce.spark_ext.common import (
    APPROX_ACCURACY,
    EXACT_PERCENTILE_LIMIT,
    KNOWN_EVENTS,
    NONE_NAME,
    SENDS_EVENTS,
    iso,
)
from taskonce.spark_ext.gaps import add_percentiles, histogram, leaks_table, notable_events
from taskonce.spark_ext.inputs import JdbcSource, read_events
from taskonce.spark_ext.per_key import rare_rows, stuck_claims, stuck_counts, stuck_table
from taskonce.spark_ext.scopes import count_scopes, scopes_of, timeline_bucket
from taskonce.spark_ext.semantics import (
    BYTES_PER_KEY,
    DEFAULT_GRACE_S,
    DEFAULT_SAFETY_FACTOR,
    NEAR_MISS_RATIO,
    known_bound,
)
from taskonce.spark_ext.summary import (
    ADVICE_SCOPE_FIELDS,
    HANDOFF_FIELDS,
    full_report,
    handoff_figures,
    output_tables,
    samples,
)
from taskonce.spark_ext.what_if import timeline_rows, traffic, what_if_rows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "ADVICE_SCOPE_FIELDS",
    "APPROX_ACCURACY",
    "AUDIT_COLUMNS",
    "EVENT_FIELDS",
    "EXACT_PERCENTILE_LIMIT",
    "FRAMEWORK_FLAGS",
    "HANDOFF_FIELDS",
    "KNOWN_EVENTS",
    "MAX_SHUFFLE_PARTITIONS",
    "NONE_NAME",
    "SENDS_EVENTS",
    "SHUFFLE_BYTES",
    "AuditResult",
    "AuditRun",
    "ProgressFn",
    "audit",
    "classify",
    "group_by_key",
]

logger = logging.getLogger("taskonce.spark_ext")

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
        (:func:`~taskonce.spark_ext.classification.classified_events`) is computed from the
        kept rows when each pass reads it."""
        raw = self.read()
        self._previous_partitions = self.spark.conf.get("spark.sql.shuffle.partitions")
        partitions = self.shuffle_partitions or shuffle_partitions(
            self.spark, raw, self.jdbc is not None
        )
        self.spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
        self._partitions_set = True
        logger.info("audit: %d shuffle partitions", partitions)
        self.grouped = self._keep(group_by_key(raw))
        self.log_end_ms, self.frameworks, self.span_s = log_bounds(self.grouped)
        self.classified = classified_events(self.grouped, self.keep_for_s)
        return self.classified

    def per_key(self) -> None:
        """The key rows that hold anything rare (a claim that may be stuck, a duplicate, a
        takeover, a hand-off event, a leak), kept for this pass and :meth:`gaps`: one scan of
        the kept rows for both; from them the stuck claims
        (:func:`~taskonce.spark_ext.per_key.stuck_claims`)."""
        self.rare = self._keep(rare_rows(self.grouped, self.grace_s))
        self.stuck = self._keep(stuck_claims(self.rare, self.grace_s, self.log_end_ms))
        self._stuck_counts = stuck_counts(self.stuck)
        self.stuck_table = stuck_table(self.stuck)

    def per_scope(self) -> None:
        """The event counts of each scope (overall, queue, task): one aggregation per (queue,
        task) pair, rolled up (:func:`~taskonce.spark_ext.scopes.count_scopes`), joined with
        the key and claim counts of :meth:`per_key`."""
        self.timeline_bucket_s = timeline_bucket(self.span_s)
        counted, self.timeline_table = count_scopes(
            self.classified, self.timeline_bucket_s, self._keep
        )
        self.scopes = scopes_of(counted, self._stuck_counts)

    def gaps(self) -> None:
        """Keep the notable events (duplicates, takeovers, hand-off events) for this pass and
        the later ones, from :meth:`per_key`'s rare rows; from them the take-over recovery
        percentiles, the gap percentiles per scope (exact up to
        :data:`EXACT_PERCENTILE_LIMIT` gaps) and the log histogram for the chart."""
        from pyspark.sql import functions as F

        self.notable = self._keep(notable_events(self.rare, self.keep_for_s))
        self.duplicates = self.notable.filter(F.col("dup_kind").isNotNull())
        self.leaks_table = leaks_table(self.duplicates)
        self.exact = add_percentiles(self.notable, self.scopes)
        self.histogram = histogram(self.duplicates)

    def what_if(self) -> None:
        """Replay the duplicates against each simulated window; the duplicates-over-time
        timeline per queue."""
        self.span_s, self.keys_per_s = traffic(self.scopes["overall"])
        self.what_if_rows = what_if_rows(self.duplicates, self.windows, self.keys_per_s, self.sizes)
        self.timeline = timeline_rows(self.timeline_table, self.scopes)

    def result(self) -> AuditResult:
        """The hand-off figures, the samples of leaks and stuck claims, and the report."""
        handoff = handoff_figures(
            self.notable, any_sends=bool(self.scopes["overall"].get("sends_events"))
        )
        leaks_sample, stuck_sample = samples(self.leaks_table, self.stuck_table, self.sample_rows)
        report, details = full_report(
            self.scopes,
            known_bound(self.bounds, self.frameworks),
            self.frameworks,
            self.safety_factor,
            self.what_if_rows,
            self.now,
            self.log_end_ms,
            handoff,
        )
        return AuditResult(
            report=report,
            details=details,
            what_if=self.what_if_rows,
            info=self._info(int(report["overall"]["recommended_keep_for_s"])),
            leaks_sample=leaks_sample,
            stuck_sample=stuck_sample,
            histogram=self.histogram,
            timeline=self.timeline,
            timeline_bucket_s=self.timeline_bucket_s,
            tables=output_tables(
                self.duplicates, self.leaks_table, self.stuck_table, self.timeline_table
            ),
        )

    def _info(self, recommended: int) -> dict[str, Any]:
        """:attr:`AuditResult.info`, for the overall ``recommended`` keep_for; warns of the
        malformed rows dropped."""
        overall = self.scopes["overall"]
        malformed = int(overall.get("malformed") or 0)
        if malformed:
            logger.warning("dropped %d malformed event row(s) (no event name or bad ts)", malformed)
        jdbc = self.jdbc
        info: dict[str, Any] = {
            "sources": [*self.paths, *([f"jdbc:{jdbc.table}"] if jdbc else [])],
            "malformed": malformed,
            "first_ts": iso(overall.get("first_ms")),
            "last_ts": iso(overall.get("last_ms")),
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
        return info


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
    return _run_passes(run, spark, out, charts, progress)


def _run_passes(
    run: AuditRun,
    spark: SparkSession,
    out: str | None,
    charts: bool,
    progress: ProgressFn | None,
) -> AuditResult:
    """Run ``run``'s passes in order, then write the outputs to ``out`` (if given), telling
    ``progress`` of each step; close ``run`` whatever happens."""
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
