"""A small event log whose audit is worked out by hand (the expected figures below).

One queue per situation, times in seconds after T0 = 2026-01-01T00:00:00Z, keep_for 3600 s and
lease 60 s unless said otherwise; the audit runs with grace 30 s.

- ``clean`` (task ``t.a``): k1 claimed 0 / completed 1; k2 claimed 10 / completed 12.
- ``retry`` (task ``t.a``): k3 claimed 0, released 2 (the handler raised), claimed 5 (the
  retry), completed 6 — a retry, not a duplicate; a payload_mismatch of k3 at 50; a
  store_error of k13 at 60.
- ``dups``: k4 claimed 0, in_progress_deferred 2, completed 4, duplicate_skipped 30 and 3000
  (3000 > 0.8 × 3600: a near miss); k5 claimed 100, completed 101, duplicate_skipped 160.
  Gaps 2, 30, 3000, 60.
- ``leak`` (keep_for 600): k6 claimed 0, completed 1, claimed again 4000 (its mark expired),
  completed 4001. Gap 4000; one leaked key.
- ``lazy`` (lazy mode, keep_for 600): k7 marked 10, concurrent_duplicate 11 (gap 1); k8 marked
  20 and again 720 (after expiry; gap 700). Two leaked keys.
- ``stuck`` (grace 30): k9 claimed 0, never ended (stuck, open at the log's end); k10 claimed 0,
  renewed 40/80/120, completed 150 (alive: not stuck); k11 claimed 0 by w1, taken over 200 by
  w2 (after 0 + 60 + 30: stuck, recovered), completed 201; k12 claimed 0 by w1, taken over 70
  by w2 (in time), w1's lease_lost 75, completed 80 by w2.
- a ``purged`` event at 4500 (no key): the log's end; one line that is not JSON and one
  unknown event name: malformed, not counted.

Gaps overall: 1, 2, 30, 60, 700, 3000, 4000 → exact percentiles (linear interpolation):
p50 60, p95 3700, p99 3940, p99.9 3994, max 4000; recommended max(3994 × 2, 3600) = 7988
→ rounded up to the quarter hour: 8100.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
#: the reports' generated_at
NOW = datetime.datetime(2026, 2, 1, 12, 0, tzinfo=datetime.timezone.utc)
GRACE_S = 30.0
BROKER_BOUNDS = {"redis-visibility": 3600.0}
WINDOWS = (60.0, 600.0, 3600.0, 86400.0)


def ts(seconds: float) -> str:
    moment = T0 + datetime.timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def event(
    at: float,
    name: str,
    key: str | None,
    queue: str | None,
    task: str | None = None,
    *,
    mode: str = "eager",
    worker: str = "host:1",
    attempt: int = 0,
    lease_s: float = 60,
    keep_for_s: float = 3600,
    reason: str | None = None,
    recovery_s: float | None = None,
    framework: str = "python",
) -> dict[str, Any]:
    return {
        "ts": ts(at),
        "event": name,
        "key": key,
        "queue": queue,
        "message_id": key.split(":", 1)[1] if key else None,
        "task": task if task is not None else (f"t.{queue}" if queue else None),
        "framework": framework,
        "mode": mode,
        "worker": worker,
        "attempt": attempt,
        "redelivered": None,
        "duration_ms": 1.5 if name in ("completed", "marked", "released") else None,
        "lease_s": lease_s,
        "keep_for_s": keep_for_s,
        "reason": reason,
        "recovery_s": recovery_s,
    }


def worked_events() -> list[dict[str, Any]]:
    """The log's valid events, in file order."""
    e = event
    clean = [
        e(0, "claimed", "clean:k1", "clean", "t.a"),
        e(1, "completed", "clean:k1", "clean", "t.a"),
        e(10, "claimed", "clean:k2", "clean", "t.a"),
        e(12, "completed", "clean:k2", "clean", "t.a"),
    ]
    retry = [
        e(0, "claimed", "retry:k3", "retry", "t.a"),
        e(2, "released", "retry:k3", "retry", "t.a"),
        e(5, "claimed", "retry:k3", "retry", "t.a", attempt=1),
        e(6, "completed", "retry:k3", "retry", "t.a", attempt=1),
        e(50, "payload_mismatch", "retry:k3", "retry", "t.a"),
        e(60, "store_error", "retry:k13", "retry", "t.a"),
    ]
    dups = [
        e(0, "claimed", "dups:k4", "dups"),
        e(2, "in_progress_deferred", "dups:k4", "dups", worker="host:2"),
        e(4, "completed", "dups:k4", "dups"),
        e(30, "duplicate_skipped", "dups:k4", "dups", worker="host:2"),
        e(3000, "duplicate_skipped", "dups:k4", "dups", worker="host:2"),
        e(100, "claimed", "dups:k5", "dups"),
        e(101, "completed", "dups:k5", "dups"),
        e(160, "duplicate_skipped", "dups:k5", "dups"),
    ]
    leak = [
        e(0, "claimed", "leak:k6", "leak", keep_for_s=600),
        e(1, "completed", "leak:k6", "leak", keep_for_s=600),
        e(4000, "claimed", "leak:k6", "leak", keep_for_s=600, worker="host:3"),
        e(4001, "completed", "leak:k6", "leak", keep_for_s=600, worker="host:3"),
    ]
    lazy = [
        e(10, "marked", "lazy:k7", "lazy", mode="lazy", keep_for_s=600),
        e(11, "concurrent_duplicate", "lazy:k7", "lazy", mode="lazy", keep_for_s=600),
        e(20, "marked", "lazy:k8", "lazy", mode="lazy", keep_for_s=600),
        e(720, "marked", "lazy:k8", "lazy", mode="lazy", keep_for_s=600),
    ]
    w1, w2 = "host:11", "host:12"
    stuck = [
        e(0, "claimed", "stuck:k9", "stuck", worker=w1),
        e(0, "claimed", "stuck:k10", "stuck", worker=w1),
        e(40, "lease_renewed", "stuck:k10", "stuck", worker=w1),
        e(80, "lease_renewed", "stuck:k10", "stuck", worker=w1),
        e(120, "lease_renewed", "stuck:k10", "stuck", worker=w1),
        e(150, "completed", "stuck:k10", "stuck", worker=w1),
        e(0, "claimed", "stuck:k11", "stuck", worker=w1),
        e(200, "lease_taken_over", "stuck:k11", "stuck", worker=w2, reason="lease_expired"),
        e(201, "completed", "stuck:k11", "stuck", worker=w2),
        e(0, "claimed", "stuck:k12", "stuck", worker=w1),
        e(
            70,
            "lease_taken_over",
            "stuck:k12",
            "stuck",
            worker=w2,
            reason="owner_silent",
            recovery_s=12.5,
        ),
        e(75, "lease_lost", "stuck:k12", "stuck", worker=w1),
        e(80, "completed", "stuck:k12", "stuck", worker=w2),
    ]
    purged = [e(4500, "purged", None, None)]
    return clean + retry + dups + leak + lazy + stuck + purged


MALFORMED_LINES = ["this line is not JSON", json.dumps(event(5, "exploded", "x:y", "x"))]


def write_jsonl(path: Path, events: list[dict[str, Any]], malformed: bool = True) -> Path:
    lines = [json.dumps(item) for item in events]
    if malformed:
        lines[3:3] = MALFORMED_LINES
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def metrics(**values: float) -> dict[str, Any]:
    """A full per-scope metrics dict: zeros except ``values``."""
    base: dict[str, Any] = {
        "deliveries": 0,
        "distinct_keys": 0,
        "runs": 0,
        "duplicates_skipped": 0,
        "duplicates_in_flight": 0,
        "failures": 0,
        "releases": 0,
        "takeovers": 0,
        "quarantined": 0,
        "leaks": 0,
        "near_misses": 0,
        "stuck_claims": 0,
        "gap_p50_s": 0.0,
        "gap_p95_s": 0.0,
        "gap_p99_s": 0.0,
        "gap_p999_s": 0.0,
        "gap_max_s": 0.0,
        "recommended_keep_for_s": 3600,
    }
    for name, value in values.items():
        assert name in base, name
        base[name] = value
    return base


EXPECTED_OVERALL = metrics(
    deliveries=23,
    distinct_keys=12,
    runs=18,
    duplicates_skipped=3,
    duplicates_in_flight=1,
    failures=4,
    releases=1,
    takeovers=2,
    leaks=3,
    near_misses=1,
    stuck_claims=2,
    gap_p50_s=60.0,
    gap_p95_s=3700.0,
    gap_p99_s=3940.0,
    gap_p999_s=3994.0,
    gap_max_s=4000.0,
    recommended_keep_for_s=8100,
)

EXPECTED_QUEUES = {
    "clean": metrics(deliveries=2, distinct_keys=2, runs=2),
    # k3's two claims and its payload_mismatch; failures: released, payload_mismatch,
    # store_error; k13 was never delivered (store down), so it is not a distinct key
    "retry": metrics(deliveries=3, distinct_keys=1, runs=2, failures=3, releases=1),
    # gaps 2, 30, 60, 3000: p50 = 30 + 0.5 × 30; p95 = 60 + 0.85 × 2940; p99 = 60 + 0.97 ×
    # 2940; p99.9 = 60 + 0.997 × 2940 = 2991.18 → × 2 = 5982.36 → quarter hour 6300
    "dups": metrics(
        deliveries=6,
        distinct_keys=2,
        runs=2,
        duplicates_skipped=3,
        duplicates_in_flight=1,
        near_misses=1,
        gap_p50_s=45.0,
        gap_p95_s=2559.0,
        gap_p99_s=2911.8,
        gap_p999_s=2991.18,
        gap_max_s=3000.0,
        recommended_keep_for_s=6300,
    ),
    # one gap, 4000: every percentile is 4000 → 8000 → 8100
    "leak": metrics(
        deliveries=2,
        distinct_keys=1,
        runs=2,
        leaks=1,
        gap_p50_s=4000.0,
        gap_p95_s=4000.0,
        gap_p99_s=4000.0,
        gap_p999_s=4000.0,
        gap_max_s=4000.0,
        recommended_keep_for_s=8100,
    ),
    # gaps 1 and 700: p = 1 + q × 699; p99.9 × 2 = 1398.6 → 1440, below the bound 3600
    "lazy": metrics(
        deliveries=4,
        distinct_keys=2,
        runs=4,
        leaks=2,
        gap_p50_s=350.5,
        gap_p95_s=665.05,
        gap_p99_s=693.01,
        gap_p999_s=699.301,
        gap_max_s=700.0,
        recommended_keep_for_s=3600,
    ),
    "stuck": metrics(
        deliveries=6, distinct_keys=4, runs=6, takeovers=2, failures=1, stuck_claims=2
    ),
}

#: Task t.a is queues clean + retry; every other task is its queue.
EXPECTED_TASKS = {
    "t.a": metrics(deliveries=5, distinct_keys=3, runs=4, failures=3, releases=1),
    **{
        f"t.{name}": value
        for name, value in EXPECTED_QUEUES.items()
        if name not in ("clean", "retry")
    },
}

# in_flight (k4 at 2) is always suppressed, the concurrent duplicate (k7) always leaks; the
# others by gap: 30, 60, 3000 (skipped), 4000 and 700 (re-runs). 12 keys over the 4000 s
# between the first and last delivery: 0.003 keys/s × window, rounded up.
EXPECTED_WHAT_IF = [
    {"keep_for_s": 60, "suppressed": 3, "leaked": 4, "store_keys": 1},
    {"keep_for_s": 600, "suppressed": 3, "leaked": 4, "store_keys": 2},
    {"keep_for_s": 3600, "suppressed": 5, "leaked": 2, "store_keys": 11},
    {"keep_for_s": 86400, "suppressed": 6, "leaked": 1, "store_keys": 260},
]

EXPECTED_EVENTS = 40
EXPECTED_MALFORMED = 2
