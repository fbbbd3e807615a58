"""The per-key pass: the key rows that hold anything rare (a claim that may be stuck, a
duplicate, a takeover, a hand-off event, a leak), and from them the stuck claims."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from taskonce.events import Event
from taskonce.spark_ext.common import SENDS_EVENTS, any_of, first_position
from taskonce.spark_ext.scopes import scoped
from taskonce.spark_ext.semantics import CLAIM_END_EVENTS, CLAIM_START_EVENTS

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

#: The events the gaps pass keeps whatever their dup_kind.
KEPT_EVENTS = (*SENDS_EVENTS, Event.LEASE_TAKEN_OVER.value)


def rare_rows(grouped: DataFrame, grace_s: float) -> DataFrame:
    """The key rows (of :func:`~taskonce.spark_ext.classification.group_by_key`) that hold
    anything rare: a claim that may be stuck (:func:`may_be_stuck`) or a notable event
    (:func:`notable`); one scan of the kept rows serves the stuck claims and the gaps pass."""
    from pyspark.sql import functions as F

    return grouped.filter((F.col("key").isNotNull() & may_be_stuck(grace_s)) | notable())


def _claim(position: Column, index: Column) -> Column:
    """One claim of a key row (its start at ``position`` in ``events``, the ``index``-th of the
    row's ``_starts``) as a struct: its start, owner's last renewal and end (see
    :func:`stuck_claims`)."""
    from pyspark.sql import functions as F

    events = F.col("events")
    count = F.size(events)
    end_names = F.array(*[F.lit(n) for n in CLAIM_END_EVENTS])
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
                lambda e: (e["event"] == Event.LEASE_RENEWED.value) & e["worker"].eqNullSafe(owner),
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
                    & ((e["event"] != Event.LEASE_LOST.value) | e["worker"].eqNullSafe(owner))
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


def stuck_claims(grouped: DataFrame, grace_s: float, log_end_ms: int | None) -> DataFrame:
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
    starts = F.filter(
        F.sequence(F.lit(1), count),
        lambda i: F.array_contains(start_names, F.element_at(events, i)["event"]),
    )
    claims = (
        grouped.filter(F.col("key").isNotNull() & may_be_stuck(grace_s))
        .select("key", "events", starts.alias("_starts"))
        .filter(F.size("_starts") > 0)
        .select("key", F.inline(F.transform("_starts", _claim)))
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


def may_be_stuck(grace_s: float) -> Column:
    """True for each key row (of
    :func:`~taskonce.spark_ext.classification.group_by_key`) that may hold a stuck claim, false
    for one that cannot: a cheap filter in built-in array functions (which Spark compiles to
    code) before the claims' higher-order functions (interpreted element by element), which
    then run on the few keys it leaves.

    A claim is stuck only when it has a lease (a number of seconds: see :func:`stuck_claims`)
    and either ended after its deadline (start plus lease and grace, or later) or never ended.
    Its end is an event of its key, so the first case needs the key's events to span more than the
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
    last_start_from_end = first_position(reversed_names, CLAIM_START_EVENTS)
    after_last_start = F.slice(
        names, count - last_start_from_end + 2, F.greatest(last_start_from_end - 1, F.lit(0))
    )
    ending = [name for name in CLAIM_END_EVENTS if name != Event.LEASE_LOST.value]
    open_at_end = ~any_of(after_last_start, ending)
    return last_start_from_end.isNotNull() & least_lease.isNotNull() & (long_enough | open_at_end)


def notable() -> Column:
    """True for each key row (of
    :func:`~taskonce.spark_ext.classification.group_by_key`) that holds a notable event: a
    duplicate delivery (skipped, deferred or concurrent, or a rerun: a leaked key) or a kept
    one."""
    from pyspark.sql import functions as F

    duplicates = (
        Event.DUPLICATE_SKIPPED.value,
        Event.IN_PROGRESS_DEFERRED.value,
        Event.CONCURRENT_DUPLICATE.value,
    )
    return any_of(F.col("events")["event"], (*duplicates, *KEPT_EVENTS)) | F.col("leaked")


def stuck_counts(stuck: DataFrame) -> list[tuple[str, str, dict[str, Any]]]:
    """The number of stuck claims per scope (:func:`~taskonce.spark_ext.scopes.scoped`)."""
    from pyspark.sql import functions as F

    return scoped(stuck, F.count(F.lit(1)).alias("stuck_claims"))


def stuck_table(stuck: DataFrame) -> DataFrame:
    """The ``stuck_claims`` table: one row per stuck claim."""
    from pyspark.sql import functions as F

    return stuck.select(
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
