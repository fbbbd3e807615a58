"""The report pass: the hand-off's figures, the samples of leaks and stuck claims, the public
report (``report.json``'s shape, docs/audit.md) with its advice, the run's info and the full
tables."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from taskonce.events import Event
from taskonce.spark_ext.common import (
    APPROX_ACCURACY,
    NONE_NAME,
    SENDS_EVENTS,
    in_names,
    iso,
    number,
    seconds,
)
from taskonce.spark_ext.semantics import (
    GAP_BUCKETS,
    METRIC_FIELDS,
    MIN_ADVICE_GAPS,
    WHAT_IF_FIELDS,
    advise,
    recommend,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


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


def _part(row: Any, discarded: int) -> dict[str, Any]:
    """One part of the hand-off's figures (:data:`HANDOFF_FIELDS`) from its row of lags
    (None without records) and its number of discarded records."""
    records = int(row["records"]) if row else 0
    dispatched = int(row["dispatched"]) if row else 0
    p50, p99 = (row["p"] or [None, None]) if row and dispatched else (None, None)
    return {
        "records_deferred": records,
        "records_dispatched": dispatched,
        "stranded": records - dispatched,
        "discarded": discarded,
        "dispatch_lag_p50_s": seconds(p50),
        "dispatch_lag_p99_s": seconds(p99),
        "dispatch_lag_max_s": seconds(row["max_ms"] if row else None),
    }


def _sends_events(classified: DataFrame) -> DataFrame:
    """The valid hand-off events (``part``: ``handoff`` for a task's, ``producer`` for the
    producer outbox's; ``record``; ``event``; ``t_ms``)."""
    from pyspark.sql import functions as F

    handler = F.col("key").isNotNull()
    producer = F.col("key").isNull() & F.col("message_id").startswith("outbox:")
    return classified.filter(
        (F.col("is_valid") == 1) & (handler | producer) & in_names("event", SENDS_EVENTS)
    ).select(
        F.when(handler, F.lit("handoff")).otherwise(F.lit("producer")).alias("part"),
        F.coalesce(F.col("key"), F.col("message_id")).alias("record"),
        "event",
        "t_ms",
    )


def _dispatch_lags(events: DataFrame) -> DataFrame:
    """Per deferred record (of :func:`_sends_events`): when its sends were first stored and
    first published after that (null if never), and the lag between."""
    from pyspark.sql import functions as F

    deferred = (
        events.filter(F.col("event") == Event.SENDS_DEFERRED.value)
        .groupBy("part", "record")
        .agg(F.min("t_ms").alias("deferred_ms"))
    )
    sent = events.filter(
        in_names("event", (Event.SENDS_DISPATCHED.value, Event.SENDS_REDISPATCHED.value))
    ).select(
        F.col("part").alias("sent_part"),
        F.col("record").alias("sent_record"),
        F.col("t_ms").alias("sent_ms"),
    )
    return (
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


def handoff_figures(
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

    if not any_sends:
        return _part(None, 0), _part(None, 0)
    events = _sends_events(classified)
    figures = {
        row["part"]: row
        for row in _dispatch_lags(events)
        .groupBy("part")
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
        for row in events.filter(F.col("event") == Event.SENDS_DISCARDED.value)
        .groupBy("part")
        .count()
        .collect()
    }
    return (
        _part(figures.get("handoff"), discarded.get("handoff", 0)),
        _part(figures.get("producer"), discarded.get("producer", 0)),
    )


def plain(values: dict[str, Any]) -> dict[str, Any]:
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


def build_report(
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
                    entry[field] = seconds(values.get("gap_max_ms"))
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
            "first_ts": iso(values.get("first_ms")),
            "last_ts": iso(values.get("last_ms")),
            "first_delivery_ms": values.get("first_delivery_ms"),
            **recovery(values),
        }
    generated = (now or datetime.datetime.now(datetime.timezone.utc)).astimezone(
        datetime.timezone.utc
    )
    overall_keep_for = details["overall"]["keep_for_in_force_s"]
    report: dict[str, Any] = {
        "generated_at": generated.strftime("%Y-%m-%dT%H:%M:%S.")
        + f"{generated.microsecond // 1000:03d}Z",
        "events": total_events,
        "keep_for_s": number(overall_keep_for) if overall_keep_for is not None else 0,
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


def advice(
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
            seconds(max(log_end_ms - first, 0))
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
        "broker_bound_s": None if bound_s is None else number(bound_s),
        "broker_bound_name": name,
        "broker_bound_source": source,
        "frameworks": list(frameworks),
        "min_gaps": 0 if bound_s is not None else MIN_ADVICE_GAPS,
        "overall": scope("overall", report["overall"]),
        "queues": {n: scope(f"queue:{n}", m) for n, m in report["queues"].items()},
        "tasks": {n: scope(f"task:{n}", m) for n, m in report["tasks"].items()},
    }


def recovery(values: dict[str, Any]) -> dict[str, float | None]:
    """Recovery time percentiles of a scope's takeovers of dead owners (None without any)."""
    p = values.get("recovery_p") or [None, None]
    top = values.get("recovery_max_s")
    return {
        "recovery_p50_s": None if p[0] is None else float(p[0]),
        "recovery_p95_s": None if p[1] is None else float(p[1]),
        "recovery_max_s": None if top is None else float(top),
    }


def samples(
    leaks_table: DataFrame, stuck_table: DataFrame, sample_rows: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Up to ``sample_rows`` leaked keys and stuck claims, as plain dicts for the readable
    report."""
    from pyspark.sql import functions as F

    # the latest first; ties broken by the rows' own fields, so that two runs over the
    # same log show the same samples
    leaks_sample = [
        plain(row.asDict())
        for row in leaks_table.orderBy(F.desc("last_leak_at"), "key").limit(sample_rows).collect()
    ]
    stuck_sample = [
        plain(row.asDict())
        for row in stuck_table.orderBy(
            F.desc("claimed_at"), "key", "worker", "how", "deadline", "ended_at"
        )
        .limit(sample_rows)
        .collect()
    ]
    return leaks_sample, stuck_sample


def full_report(
    scopes: dict[str, dict[str, Any]],
    bound: tuple[float | None, str | None, str | None],
    frameworks: list[str],
    safety_factor: float,
    what_if: list[dict[str, Any]],
    now: datetime.datetime | None,
    log_end_ms: int | None,
    handoff: tuple[dict[str, Any], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The public report with its ``"handoff"``, ``"producer"`` (``handoff``'s two parts) and
    ``"advice"`` (for the broker ``bound``, semantics.known_bound's), and the per-scope
    details."""
    overall = scopes["overall"]
    total_events = int(overall.get("events") or 0)
    bound_s = bound[0]
    report, details = build_report(
        scopes,
        total_events,
        [] if bound_s is None else [bound_s],
        safety_factor,
        what_if,
        now,
    )
    report["handoff"], report["producer"] = handoff
    report["advice"] = advice(report, details, log_end_ms, bound, frameworks)
    return report, details


def output_tables(
    duplicates: DataFrame, leaks_table: DataFrame, stuck_table: DataFrame, timeline: DataFrame
) -> dict[str, DataFrame]:
    """The full per-row tables (``duplicates``, ``leaks``, ``stuck_claims``, ``timeline``)."""
    from pyspark.sql import functions as F

    return {
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
        "timeline": timeline,
    }
