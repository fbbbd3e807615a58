"""The audit's vocabulary: which events are deliveries, runs, duplicates and failures, the report's
field names, the gap buckets, and the rounding of a recommended window.

Everything here is plain Python (no Spark), so it can be documented and tested on its own; the
definitions are written out in docs/audit.md.
"""

from __future__ import annotations

import math
import re

#: A delivery: the broker handed the message to a worker and the guard decided something.
DELIVERY_EVENTS = (
    "claimed",
    "lease_taken_over",
    "marked",
    "duplicate_skipped",
    "in_progress_deferred",
    "concurrent_duplicate",
    "payload_mismatch",
)
#: A run: a handler ran (eager claims and take-overs; lazy marks and concurrent duplicates).
RUN_EVENTS = ("claimed", "lease_taken_over", "marked", "concurrent_duplicate")
#: A claim starts (eager mode): the key is held by one owner until it ends.
CLAIM_START_EVENTS = ("claimed", "lease_taken_over")
#: A claim ends: completed or released by its owner, or the owner learnt it lost the lease.
CLAIM_END_EVENTS = ("completed", "released", "marked", "lease_lost")
#: The key is handled: from here on, another run is a leak.
DONE_EVENTS = ("completed", "marked")
#: A gap is measured from the first of these for the key ("its first claim or mark").
ANCHOR_EVENTS = (*RUN_EVENTS, "completed")
#: A delivery or run that did not end in success or a deliberate skip.
FAILURE_EVENTS = ("released", "lease_lost", "store_error", "payload_mismatch")

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
#: Bytes one handled key takes in the store, as measured by bench/store_ops.py
#: (docs/performance.md, "Store operations": a completed key with a 64-character fingerprint
#: and no stored result). Store sizes in the report are keys × these.
BYTES_PER_KEY = {"Redis": 232, "PostgreSQL": 292}


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
    """``"NAME=DURATION"`` or ``"DURATION"`` → (name, seconds); the name defaults to the text."""
    name, sep, value = text.partition("=")
    if not sep:
        return text.strip(), parse_duration(text)
    return name.strip(), parse_duration(value)


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
