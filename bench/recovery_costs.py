"""What recovery from dead workers costs: the worker identity on every claim, and the liveness
records each worker process writes.

1. **Claim with vs without the identity field**, per store, in the same run: batches of
   ``claim(…, worker=None)`` (the claim as it was before) and ``claim(…, worker=<identity>)``
   alternate, on fresh keys; the ratio of their medians, and the round trips of each (counted
   as in ``bench/store_ops.py``). The hot path must stay one round trip.
2. **One liveness write** (``beat``): its median latency and round trips, per store.
3. **Liveness writes per second of one busy worker process**: a guard runs tasks back to back
   on Redis for ``--seconds``; every ``beat`` the process sends is counted, beside the number
   of claims.

Run: ``.venv/bin/python bench/recovery_costs.py [--write-docs]`` (needs the local services).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import taskonce
from bench.docs_section import command_lines, write_section
from bench.store_ops import (
    DEFAULT_URLS,
    FINGERPRINT,
    KEEP_FOR,
    LABELS,
    LEASE,
    OWNER,
    Sample,
    Target,
    command_line,
    fresh_keys,
    open_redis,
    open_sql,
    stat,
    timed_batch,
)
from taskonce.worker import BEAT_INTERVAL, LIVENESS_WINDOW, identity

SECTION = "## Recovery: worker identity and liveness records"
STORES = ("redis", "postgresql", "mariadb", "sqlite")


def claim_rows(target: Target, iterations: int, batch: int) -> list[str]:
    store = target.store
    worker = str(identity())

    def before(key: str) -> object:
        return store.claim(key, OWNER, LEASE, KEEP_FOR, FINGERPRINT)

    def with_identity(key: str) -> object:
        return store.claim(key, OWNER, LEASE, KEEP_FOR, FINGERPRINT, worker)

    def beat(_key: str) -> object:
        store.beat(worker, LIVENESS_WINDOW)
        return None

    for fn in (before, with_identity, beat):  # warm up connections and statement caches
        timed_batch(fn, fresh_keys(min(50, iterations)), [])
    plain: list[Sample] = []
    tagged: list[Sample] = []
    beats: list[Sample] = []
    for round_no in range(max(1, iterations // batch)):
        order = [(before, plain), (with_identity, tagged), (beat, beats)]
        if round_no % 2:
            order.reverse()
        for fn, out in order:
            timed_batch(fn, fresh_keys(batch), out)
    trips: dict[str, str] = {}
    if target.count_trips is not None:
        for name, fn in (("before", before), ("with", with_identity), ("beat", beat)):
            trips[name] = f"{target.count_trips(fn, fresh_keys(20)):.0f}"
    a, b, c = stat(plain), stat(tagged), stat(beats)
    label = LABELS[target.name]
    return [
        f"| {label} | claim, no identity (before) | {trips.get('before', '—')} "
        f"| {a.median_us:.1f} | {a.p99_us:.1f} | 1.00 |",
        f"| {label} | claim with worker identity | {trips.get('with', '—')} "
        f"| {b.median_us:.1f} | {b.p99_us:.1f} | {b.median_us / a.median_us:.2f} |",
        f"| {label} | liveness write (`beat`) | {trips.get('beat', '—')} "
        f"| {c.median_us:.1f} | {c.p99_us:.1f} | {c.median_us / a.median_us:.2f} |",
    ]


def writes_per_second(redis_url: str, seconds: float) -> tuple[float, float, int]:
    """A guard on Redis running no-op tasks back to back for ``seconds``: liveness writes per
    second, claims per second, and the liveness writes that happened on the hot path."""
    prefix = f"bench-live-{os.getpid()}"
    store = taskonce.open_store(redis_url, prefix=prefix)
    beats = 0
    hot_path_beats = 0
    original: Callable[[str, float], None] = store.beat
    in_claim = threading.local()

    def counting(worker: str, ttl: float) -> None:
        nonlocal beats, hot_path_beats
        beats += 1
        if getattr(in_claim, "active", False):
            hot_path_beats += 1
        original(worker, ttl)

    store.beat = counting  # type: ignore[method-assign]
    guard = taskonce.Guard(store)
    claims = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            in_claim.active = True
            guard.run(f"m{claims}", "bench", lambda: None)
            in_claim.active = False
            claims += 1
        elapsed = time.monotonic() - start
    finally:
        guard.close()
        client = store._client  # type: ignore[attr-defined]
        names = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(names), 1000):
            client.delete(*names[i : i + 1000])
        store.close()
    return beats / elapsed, claims / elapsed, hot_path_beats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--iterations", type=int, default=400, help="timed calls per variant")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of part 3")
    parser.add_argument("--redis-url", default=DEFAULT_URLS["redis"])
    parser.add_argument("--postgresql-url", default=DEFAULT_URLS["postgresql"])
    parser.add_argument("--mariadb-url", default=DEFAULT_URLS["mariadb"])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = sorted(set(stores) - set(STORES))
    if unknown:
        parser.error(f"--stores: unknown {unknown}; choose from {','.join(STORES)}")
    when = datetime.datetime.now(datetime.timezone.utc)
    rows: list[str] = []
    tmpdir = Path(tempfile.mkdtemp(prefix="taskonce-bench-"))
    try:
        for name in stores:
            print(f"{LABELS[name]}: {args.iterations} claims of each kind …", flush=True)
            target = open_redis(args) if name == "redis" else open_sql(name, args, tmpdir)
            try:
                rows += claim_rows(target, args.iterations, args.batch)
            finally:
                target.cleanup()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    print(f"a busy worker process on Redis for {args.seconds:g} s …", flush=True)
    per_second, claims_per_second, hot = writes_per_second(args.redis_url, args.seconds)

    header = [
        "| Store | Operation | Round trips | Median µs | p99 µs | Ratio to the claim before |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    ratios = [float(r.rsplit("|", 2)[1]) for r in rows[1::3]]
    lines = [
        SECTION,
        "",
        f"Measured {when:%Y-%m-%d %H:%M} UTC by `bench/recovery_costs.py`. Claims without and "
        "with the owner's worker identity alternate in batches on fresh keys in the same run "
        f"({args.iterations} timed calls each); *Ratio* is each median over the median of the "
        "claim without identity. Round trips are counted as in the store operations section.",
        "",
        *header,
        *rows,
        "",
        f"- The identity costs {statistics.median(ratios):.2f}× the claim without it "
        f"(median over the stores; range {min(ratios):.2f}–{max(ratios):.2f}×), and the claim "
        "stays one round trip.",
        f"- A busy worker process (no-op tasks back to back on Redis, {args.seconds:g} s, "
        f"{claims_per_second:,.0f} claims/s) wrote {per_second:.2f} liveness records per "
        f"second — one every {BEAT_INTERVAL:g} s, whatever the task rate; {hot} of them on a "
        "task's path (the process's first claim only).",
        "",
        *command_lines(command_line()),
    ]
    text = "\n".join(lines)
    print()
    print(text)
    if args.write_docs:
        write_section(text)
        print("wrote the section to docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
