"""Write a synthetic taskonce event log: N events with a chosen duplicate rate and redelivery gap
distribution, as a guard would have written them, plus the figures the audit must find.

Each message goes through the guard's state machine (docs/how-it-works.md): eager queues claim
and complete (some fail once and are retried: claimed, released, claimed, completed; a few claims
never end: stuck), lazy queues mark after the handler (a few race: concurrent_duplicate). A share
of the messages is delivered again after a gap drawn from a log-normal distribution (median, sigma),
plus a share that comes back at a fixed late gap (a broker's visibility timeout). A duplicate
within the key's keep_for after completion is skipped (``duplicate_skipped``), one during the
run is deferred (``in_progress_deferred``, then skipped when delivered again), one after the
mark expired runs again: a leak.

Usage (from the repository root)::

    .venv/bin/python bench/gen_events.py --events 1000000 --out /tmp/events.jsonl \
        --dup-rate 0.05 --gap-median 30 --gap-sigma 2 --late-rate 0.01 --late-gap 3600 \
        --truth /tmp/events.truth.json

The events of one message are written together, so the file is ordered by message, not by
time (the audit does not need time order). ``--truth`` writes the expected audit figures
(events, deliveries, runs, distinct keys, duplicates skipped / in flight, failures, releases,
leaks, stuck claims for the given grace).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import io
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, TextIO

START = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc).timestamp()


@functools.lru_cache(maxsize=200_000)
def _second(seconds: int) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.")


def iso(t: float) -> str:
    """ISO 8601 UTC with milliseconds (as taskonce writes ``ts``)."""
    ms = round(t * 1000)
    return f"{_second(ms // 1000)}{ms % 1000:03d}Z"


class Writer:
    """Formats events as JSONL lines (no json.dumps per line: this is the hot loop)."""

    def __init__(self, handle: TextIO, lease: float, keep_for: float) -> None:
        self.handle = handle
        self.count = 0
        self.last_t = START
        self.ident: tuple[str, str, str, str, str] = ("", "", "", "", "")
        self.lease = json.dumps(lease)
        self.keep_for = json.dumps(keep_for)
        self._buffer: list[str] = []

    def event(self, t: float, name: str, attempt: int = 0, ran: float | None = None) -> None:
        """One event of the current message (``self.ident``); ``ran``: handler seconds."""
        queue, message_id, task, mode, worker = self.ident
        self.last_t = max(self.last_t, t)
        duration = "null" if ran is None else f"{ran * 1000:.3f}"
        self._buffer.append(
            f'{{"ts":"{iso(t)}","event":"{name}","key":"{queue}:{message_id}",'
            f'"queue":"{queue}","message_id":"{message_id}","task":"{task}",'
            f'"framework":"celery","mode":"{mode}","worker":"{worker}","attempt":{attempt},'
            f'"redelivered":null,"duration_ms":{duration},"lease_s":{self.lease},'
            f'"keep_for_s":{self.keep_for}}}\n'
        )
        self.count += 1
        if len(self._buffer) >= 4096:
            self.flush()

    def flush(self) -> None:
        self.handle.write("".join(self._buffer))
        self._buffer.clear()


#: The audit figures the generator knows exactly; bench/audit_scale.py checks the audit
#: against them.
TRUTH_FIELDS = (
    "deliveries",
    "runs",
    "distinct_keys",
    "duplicates_skipped",
    "duplicates_in_flight",
    "failures",
    "releases",
    "leaks",
    "stuck_claims",
)


def generate(args: argparse.Namespace, handle: TextIO) -> dict[str, Any]:
    """Write events until there are at least ``args.events``; returns the truth."""
    rng = random.Random(args.seed)
    writer = Writer(handle, args.lease, args.keep_for)
    queues = [f"q{i}" for i in range(args.queues)]
    lazy_queues = set(queues[len(queues) - args.lazy_queues :]) if args.lazy_queues else set()
    truth = dict.fromkeys(
        TRUTH_FIELDS,
        0,
    )
    mu = math.log(args.gap_median)
    number = 0
    stuck_at: list[float] = []
    while writer.count < args.events:
        number += 1
        queue = queues[number % len(queues)]
        task = f"app.tasks.{queue}_t{number % args.tasks_per_queue}"
        message_id = f"{number:012x}-{rng.getrandbits(32):08x}"
        worker = f"w{rng.randrange(args.workers)}:{1000 + rng.randrange(8)}"
        t0 = START + number / args.rate
        duration = rng.expovariate(1 / args.duration)
        lazy = queue in lazy_queues
        mode = "lazy" if lazy else "eager"
        truth["distinct_keys"] += 1

        writer.ident = (queue, message_id, task, mode, worker)
        emit = writer.event

        if lazy:
            done = t0 + duration
            emit(done, "marked", ran=duration)
            truth["deliveries"] += 1
            truth["runs"] += 1
            if rng.random() < args.concurrent_rate:
                emit(done + 0.002, "concurrent_duplicate", ran=duration)
                truth["deliveries"] += 1
                truth["runs"] += 1
                truth["leaks"] += 1
                continue
        else:
            emit(t0, "claimed")
            truth["deliveries"] += 1
            truth["runs"] += 1
            if rng.random() < args.stuck_rate:
                stuck_at.append(t0)  # the worker died; nothing else ever happens to it
                continue
            if rng.random() < args.fail_rate:
                emit(t0 + duration, "released", ran=duration)
                t0 = t0 + duration + args.retry_backoff
                emit(t0, "claimed", attempt=1)
                truth["deliveries"] += 1
                truth["runs"] += 1
                truth["failures"] += 1
                truth["releases"] += 1
            done = t0 + duration
            emit(done, "completed", ran=duration)
        first = t0 if not lazy else done
        if rng.random() >= args.dup_rate:
            continue
        if rng.random() < args.late_rate:
            gap = args.late_gap * (1 + rng.uniform(-0.01, 0.01))
        else:
            gap = rng.lognormvariate(mu, args.gap_sigma)
        at = first + gap
        truth["deliveries"] += 1
        if not lazy and at < done:  # still running: deferred, skipped when delivered again
            emit(at, "in_progress_deferred")
            emit(done + 0.01, "duplicate_skipped")
            truth["duplicates_in_flight"] += 1
            truth["duplicates_skipped"] += 1
            truth["deliveries"] += 1
        elif at <= done + args.keep_for:
            emit(at, "duplicate_skipped")
            truth["duplicates_skipped"] += 1
        else:  # the mark expired: the handler runs again
            truth["runs"] += 1
            truth["leaks"] += 1
            if lazy:
                emit(at + duration, "marked", ran=duration)
            else:
                emit(at, "claimed")
                emit(at + duration, "completed", ran=duration)
    writer.flush()
    truth["events"] = writer.count
    truth["messages"] = number
    truth["stuck_claims"] = sum(1 for t in stuck_at if t + args.lease + args.grace < writer.last_t)
    return truth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, required=True, help="at least this many events")
    parser.add_argument("--out", required=True, help="the JSONL file (.gz: gzip-compressed)")
    parser.add_argument("--truth", help="write the expected audit figures here (JSON)")
    parser.add_argument("--dup-rate", type=float, default=0.05, help="share delivered twice")
    parser.add_argument("--gap-median", type=float, default=30.0, help="median gap (s)")
    parser.add_argument("--gap-sigma", type=float, default=2.0, help="log-normal sigma")
    parser.add_argument(
        "--late-rate", type=float, default=0.01, help="share of duplicates at --late-gap"
    )
    parser.add_argument("--late-gap", type=float, default=3600.0, help="late gap (s)")
    parser.add_argument("--keep-for", type=float, default=86400.0, help="keep_for (s)")
    parser.add_argument("--lease", type=float, default=300.0, help="lease (s)")
    parser.add_argument("--grace", type=float, default=60.0, help="stuck grace in the truth")
    parser.add_argument("--fail-rate", type=float, default=0.01, help="share failing once")
    parser.add_argument("--retry-backoff", type=float, default=2.0, help="retry delay (s)")
    parser.add_argument("--stuck-rate", type=float, default=0.0005, help="claims never ended")
    parser.add_argument("--concurrent-rate", type=float, default=0.001, help="lazy races")
    parser.add_argument("--duration", type=float, default=0.05, help="mean handler time (s)")
    parser.add_argument("--rate", type=float, default=500.0, help="messages per second")
    parser.add_argument("--queues", type=int, default=4)
    parser.add_argument("--lazy-queues", type=int, default=1, help="the last N queues are lazy")
    parser.add_argument("--tasks-per-queue", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.monotonic()
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as handle:
            truth = generate(args, handle)
    else:
        with open(path, "w", encoding="utf-8", buffering=io.DEFAULT_BUFFER_SIZE * 64) as handle:
            truth = generate(args, handle)
    truth["parameters"] = vars(args)
    if args.truth:
        Path(args.truth).write_text(json.dumps(truth, indent=2) + "\n", encoding="utf-8")
    elapsed = time.monotonic() - started
    print(
        f"wrote {truth['events']:,} events ({truth['messages']:,} messages) to {path} "
        f"in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
