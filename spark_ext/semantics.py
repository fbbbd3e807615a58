"""The audit's vocabulary: which events are deliveries, runs, duplicates and failures, the report's
field names, the gap buckets, and the rounding of a recommended window.

Everything here is plain Python (no Spark), so it can be documented and tested on its own; the
definitions are written out in docs/audit.md.
"""

from __future__ import annotations

import math
import re
from typing import Any

from taskonce.events import Event

#: A delivery: the broker handed the message to a worker and the guard decided something.
DELIVERY_EVENTS = (
    Event.CLAIMED.value,
    Event.LEASE_TAKEN_OVER.value,
    Event.MARKED.value,
    Event.DUPLICATE_SKIPPED.value,
    Event.IN_PROGRESS_DEFERRED.value,
    Event.CONCURRENT_DUPLICATE.value,
    Event.PAYLOAD_MISMATCH.value,
    Event.QUARANTINED.value,
)
#: A run: a handler ran (eager claims and take-overs; lazy marks and concurrent duplicates).
RUN_EVENTS = (
    Event.CLAIMED.value,
    Event.LEASE_TAKEN_OVER.value,
    Event.MARKED.value,
    Event.CONCURRENT_DUPLICATE.value,
)
#: A claim starts (eager mode): the key is held by one owner until it ends.
CLAIM_START_EVENTS = (Event.CLAIMED.value, Event.LEASE_TAKEN_OVER.value)
#: A claim ends: completed or released by its owner, or the owner learnt it lost the lease, or
#: (its owner dead) a later delivery quarantined the key.
CLAIM_END_EVENTS = (
    Event.COMPLETED.value,
    Event.RELEASED.value,
    Event.MARKED.value,
    Event.LEASE_LOST.value,
    Event.QUARANTINED.value,
)
#: The key is handled: from here on, another run is a leak.
DONE_EVENTS = (Event.COMPLETED.value, Event.MARKED.value)
#: A gap is measured from the first of these for the key ("its first claim or mark").
ANCHOR_EVENTS = (*RUN_EVENTS, Event.COMPLETED.value)
#: A delivery or run that did not end in success or a deliberate skip.
FAILURE_EVENTS = (
    Event.RELEASED.value,
    Event.LEASE_LOST.value,
    Event.STORE_ERROR.value,
    Event.PAYLOAD_MISMATCH.value,
    Event.QUARANTINED.value,
)
#: What the input calls an ``in_progress_deferred`` with ``reason: "recheck"``: the guard
#: deferring again a copy it had deferred before (still in progress elsewhere). Not a delivery,
#: not a duplicate: a copy deferred five times is one duplicate in flight, not five.
RECHECK_EVENT = "in_progress_deferred/recheck"

#: The report's per-scope fields, in the public report's order (docs/audit.md).
METRIC_FIELDS = (
    "deliveries",
    "distinct_keys",
    "runs",
    "duplicates_skipped",
    "duplicates_in_flight",
    "failures",
    "releases",
    "takeovers",
    "quarantined",
    "leaks",
    "near_misses",
    "stuck_claims",
    "gap_p50_s",
    "gap_p95_s",
    "gap_p99_s",
    "gap_p999_s",
    "gap_max_s",
    "recommended_keep_for_s",
)
#: The report's top-level fields, in the public report's order.
REPORT_FIELDS = ("generated_at", "events", "keep_for_s", "overall", "queues", "tasks", "what_if")
#: The fields of one what-if row.
WHAT_IF_FIELDS = ("keep_for_s", "suppressed", "leaked", "store_keys")

#: Percentiles reported, as (field, fraction).
PERCENTILES = (("gap_p50_s", 0.5), ("gap_p95_s", 0.95), ("gap_p99_s", 0.99), ("gap_p999_s", 0.999))

#: Gap buckets: (label, upper bound in seconds, inclusive); the last one is open.
GAP_BUCKETS: tuple[tuple[str, float | None], ...] = (
    ("<=1s", 1.0),
    ("<=1min", 60.0),
    ("<=5min", 300.0),
    ("<=1h", 3600.0),
    ("<=1d", 86400.0),
    (">1d", None),
)

#: A suppressed duplicate whose gap exceeds this share of the keep_for in force is a near miss.
NEAR_MISS_RATIO = 0.8
#: Default multiplier of the p99.9 gap in the recommendation.
DEFAULT_SAFETY_FACTOR = 2.0
#: Default grace after a claim's lease (plus its last renewal) before it counts as stuck.
DEFAULT_GRACE_S = 60.0
#: The smallest window ever recommended.
MIN_RECOMMENDED_S = 60
#: Bytes one handled key takes in the store with the default key names, a fingerprint and no
#: stored result (docs/performance.md): Redis, what the server's memory grew by per completed
#: key (``used_memory``, its expiry's entry included; bench/redis_server_cost.py), PostgreSQL,
#: the table and its indexes per row (bench/sql_rows.py). Store sizes in the report are
#: keys × these.
BYTES_PER_KEY = {"Redis": 206, "PostgreSQL": 381}


def nice_window(seconds: float) -> int:
    """Round a window up to a figure an operator would configure: at least
    :data:`MIN_RECOMMENDED_S`; whole minutes up to an hour, quarter hours up to a day, whole
    hours beyond.

    >>> nice_window(0), nice_window(61), nice_window(3601), nice_window(90000)
    (60, 120, 4500, 90000)
    """
    if not math.isfinite(seconds) or seconds <= MIN_RECOMMENDED_S:
        return MIN_RECOMMENDED_S
    for limit, step in ((3600, 60), (86400, 900)):
        if seconds <= limit:
            return int(math.ceil(seconds / step - 1e-9) * step)
    return int(math.ceil(seconds / 3600 - 1e-9) * 3600)


#: Brokers whose redelivery bound is known by default: name → (seconds, what sets it). A
#: message a worker took and did not acknowledge comes back after at most about this long —
#: so a duplicate can come this late, and a keep_for below it lets it run again.
KNOWN_BROKERS: dict[str, tuple[float, str]] = {
    "celery-redis": (3600.0, "Celery's Redis transport visibility_timeout, 1 h by default"),
    "celery-sqs": (1800.0, "Celery's SQS transport visibility_timeout, 30 min by default"),
    "celery-rabbitmq": (1800.0, "RabbitMQ's consumer_timeout, 30 min by default"),
    "dramatiq-rabbitmq": (1800.0, "RabbitMQ's consumer_timeout, 30 min by default"),
    "dramatiq-redis": (
        60.0,
        "Dramatiq's Redis heartbeat_timeout, 60 s by default (requeued at the next maintenance: "
        "later on a quiet broker)",
    ),
}
#: The broker assumed for a log whose events name a framework (``framework``) but no broker
#: bound is given: the one with the longest default bound among the framework's brokers, so
#: that the assumption never advises a window shorter than the framework's brokers may need.
FRAMEWORK_BROKERS = {"celery": "celery-redis", "dramatiq": "dramatiq-rabbitmq"}
#: With no broker bound known, the advice needs at least this many duplicates with a measured
#: gap: the p99.9 of fewer is no more than their maximum.
MIN_ADVICE_GAPS = 20
#: The advice's verdicts: a window to configure, or a log too short (in time or in
#: duplicates) to advise one.
ADVISE, TOO_SHORT = "advise", "too_short"


def known_bound(
    given: dict[str, float], frameworks: list[str]
) -> tuple[float | None, str | None, str | None]:
    """The broker bound the advice is held to: ``(seconds, name, source)``.

    The longest of the ``given`` bounds (``--broker-bound``; source ``"option"``); without
    any, the bound of the broker :data:`FRAMEWORK_BROKERS` assumes for the frameworks the
    events name (the longest; source ``"framework"``); else ``(None, None, None)``.
    """
    positive = {name: seconds for name, seconds in given.items() if seconds > 0}
    if positive:
        name = max(positive, key=lambda n: (positive[n], n))
        return positive[name], name, "option"
    assumed = [FRAMEWORK_BROKERS[f] for f in frameworks if f in FRAMEWORK_BROKERS]
    if assumed:
        name = max(assumed, key=lambda n: (KNOWN_BROKERS[n][0], n))
        return KNOWN_BROKERS[name][0], name, "framework"
    return None, None, None


def advise(
    span_s: float, gaps: int, recommended_s: float, bound_s: float | None
) -> tuple[str, list[str]]:
    """The verdict on a recommended window and, when it is :data:`TOO_SHORT`, why.

    The log is too short to advise when it spans less than the window it would recommend (a
    duplicate as late as that window could not have shown in it; the window is never below
    the known broker bound, so the log must span at least that bound too), or when no broker
    bound is known and it holds fewer than :data:`MIN_ADVICE_GAPS` duplicates with a measured
    gap.
    """
    reasons: list[str] = []
    if span_s < recommended_s:
        reasons.append(
            f"it spans less than the {human_duration(recommended_s)} window it would recommend "
            "(a duplicate that late could not have shown in it)"
        )
    if bound_s is None and gaps < MIN_ADVICE_GAPS:
        reasons.append(
            f"it holds {gaps} duplicate(s) with a measured gap, fewer than {MIN_ADVICE_GAPS}, "
            "and no broker bound is known"
        )
    return (TOO_SHORT if reasons else ADVISE), reasons


def bound_text(advice: dict[str, Any]) -> str:
    """The broker bound of a report's ``advice``, in words, with where it came from:
    ``"broker bound 3600 s (1 h, given as redis-visibility)"``."""
    seconds = advice.get("broker_bound_s")
    if seconds is None:
        return "no broker bound known (give --broker-bound)"
    name = advice.get("broker_bound_name")
    reading = human_duration(float(seconds))
    text = f"broker bound {seconds:g} s (" + ("" if reading == f"{seconds:g} s" else f"{reading}, ")
    if advice.get("broker_bound_source") == "framework":
        framework = next(
            (f for f, broker in FRAMEWORK_BROKERS.items() if broker == name), "the framework"
        )
        what = KNOWN_BROKERS[str(name)][1] if name in KNOWN_BROKERS else str(name)
        return (
            f"{text}assumed: the events name {framework} and no --broker-bound was given; "
            f"{what}, the longest of its brokers' defaults)"
        )
    return f"{text}given as {name})"


def advice_text(
    advice: dict[str, Any], scope: dict[str, Any], recommended_s: int, markup: bool = False
) -> str:
    """One scope's advice in words (``scope``: its entry in a report's ``advice``,
    ``recommended_s``: its ``recommended_keep_for_s``), with its evidence: the recommended
    window when the verdict is :data:`ADVISE`; otherwise that the log is too short to advise,
    why, and what the known broker bound still asks for. ``markup`` puts ``**bold**`` around
    the lead (report.md)."""
    bold = "**" if markup else ""
    recommended = int(recommended_s)
    evidence = (
        f"the log spans {human_duration(float(scope['span_s']))} and holds "
        f"{scope['duplicates']:,} duplicate(s), {scope['gaps']:,} with a measured gap; "
        f"{bound_text(advice)}"
    )
    if scope["verdict"] == ADVISE:
        return (
            f"Recommended keep_for {bold}{recommended} s ({human_duration(recommended)}){bold}, "
            f"from this evidence: {evidence}"
        )
    bound = advice.get("broker_bound_s")
    if bound is not None:
        least = nice_window(float(bound))
        then = (
            f"Keep keep_for at least {least} s ({human_duration(least)}, the broker bound) and "
            f"audit a log spanning at least {human_duration(recommended)}."
        )
    else:
        then = (
            f"Audit a log spanning at least {human_duration(recommended)} with "
            f"{MIN_ADVICE_GAPS}+ duplicates, or give your broker's bound (--broker-bound)."
        )
    return (
        f"{bold}No recommendation: the log is too short to advise{bold} — "
        + " and ".join(scope["reasons"])
        + f". Evidence: {evidence}. {then}"
    )


def recommend(p999_s: float | None, safety_factor: float, broker_bounds: list[float]) -> int:
    """``max(p99.9 gap × safety factor, the longest broker bound)``, rounded by
    :func:`nice_window`."""
    candidates = [bound for bound in broker_bounds if bound > 0]
    if p999_s is not None:
        candidates.append(p999_s * safety_factor)
    return nice_window(max(candidates, default=0.0))


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h|d|w)?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in ``"90"``, ``"90s"``, ``"5m"``, ``"1.5h"``, ``"7d"``, ``"1w"``, ``"250ms"``.

    Raises ValueError naming the text when it is not a duration.
    """
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"not a duration: {text!r} (e.g. 300, 90s, 5m, 1h, 7d)")
    unit = (match.group(2) or "s").lower()
    return float(match.group(1)) * _UNITS[unit]


def parse_broker_bound(text: str) -> tuple[str, float]:
    """``"NAME=DURATION"``, ``"DURATION"`` or a broker of :data:`KNOWN_BROKERS` (its default
    bound) → (name, seconds); the name defaults to the text."""
    name, sep, value = text.partition("=")
    if sep:
        return name.strip(), parse_duration(value)
    known = KNOWN_BROKERS.get(text.strip().lower())
    if known is not None:
        return text.strip().lower(), known[0]
    try:
        return text.strip(), parse_duration(text)
    except ValueError:
        raise ValueError(
            f"not a broker bound: {text!r} (a duration such as 1h, NAME=DURATION, or a broker "
            f"with a known default: {', '.join(KNOWN_BROKERS)})"
        ) from None


def human_duration(seconds: float) -> str:
    """A short reading of a duration: ``"45 s"``, ``"12.5 min"``, ``"3 h"``, ``"7 d"``."""
    if seconds < 120:
        return f"{seconds:g} s"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size or unit == "min":
            value = seconds / size
            return f"{value:.1f} {unit}".replace(".0 ", " ")
    raise AssertionError("unreachable")


def human_bytes(size: float) -> str:
    """``"1.5 MB"`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")
