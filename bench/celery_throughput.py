"""Throughput of a no-op Celery task through a real worker, plain vs ``IdempotentTask``.

A prefork worker (``-c 2`` by default, ``acks_late=True``) on a Redis broker, the
guarded task on a Redis store. Each round fills a queue with N messages while the worker
is not consuming it, then tells the worker to consume it (``add_consumer``) and times
until the broker holds no queued and no unacknowledged message. Plain and guarded rounds
alternate in the same run; the table gives the median of each and their ratio, and is
written to its block of docs/performance.md (unless ``--no-write``).

    .venv/bin/python bench/celery_throughput.py [--messages 3000] [--rounds 3]
        [--concurrency 2,4] [--diagnose] [--no-write]

This file is also the worker's app module (``celery -A celery_throughput``), configured by the
``BENCH_*`` environment variables the benchmark sets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import harness as h
from celery import Celery, signals

import taskonce
from taskonce.celery_ext import IdempotentTask, setup

ROOT = Path(__file__).resolve().parents[1]
BROKER = os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/4")
STORE = os.environ.get("BENCH_STORE", "redis://127.0.0.1:6379/15")
PREFIX = os.environ.get("BENCH_PREFIX", "bench")

app = Celery("celery_throughput", broker=BROKER, set_as_current=False)
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    worker_disable_rate_limits=True,
    task_default_queue=f"{PREFIX}.idle",
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "4")),
)
if os.environ.get("BENCH_WORKER"):
    # memory:// (a store per pool process, no round trip) isolates the guard's own Python work
    options: dict[str, Any] = {} if STORE.startswith("memory") else {"prefix": PREFIX}
    setup(app, taskonce.Guard(taskonce.open_store(STORE, **options)))


@app.task(name="bench.plain", acks_late=True, shared=False)
def plain() -> None:
    """A no-op."""


@app.task(name="bench.guarded", base=IdempotentTask, acks_late=True, shared=False)
def guarded() -> None:
    """The same no-op, guarded (eager mode: one claim and one completion per message)."""


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = os.environ.get("BENCH_READY")
    if path:
        Path(path).write_text(str(os.getpid()))


# -- the benchmark --------------------------------------------------------------------------


def _start_worker(
    prefix: str, store: str, pool: int, ready: Path, log: Path
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "BENCH_WORKER": "1",
        "BENCH_PREFIX": prefix,
        "BENCH_BROKER": BROKER,
        "BENCH_STORE": store,
        "BENCH_READY": str(ready),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, "-m", "celery", "-A", "celery_throughput", "worker", "-P", "prefork",
        "-c", str(pool), "-Q", f"{prefix}.idle", "-n", f"{prefix}@%h", "--without-gossip",
        "--without-mingle", "--without-heartbeat", "-l", "WARNING",
    ]  # fmt: skip
    with open(log, "ab") as handle:
        worker = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not ready.exists():
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start; see {log}")
        time.sleep(0.05)
    return worker


def _round(publisher: Celery, client: Any, prefix: str, kind: str, messages: int) -> float:
    """Fill a fresh queue, let the worker drain it; messages per second."""
    queue = f"{prefix}.{kind}.{uuid.uuid4().hex[:6]}"
    with publisher.producer_or_acquire() as producer:
        for _ in range(messages):
            publisher.send_task(f"bench.{kind}", queue=queue, producer=producer)
    key = f"{prefix}:{queue}"
    assert client.llen(key) == messages, "the queue was not filled"
    started = time.perf_counter()
    publisher.control.add_consumer(queue, reply=False)
    while client.llen(key) or client.zcard(f"{prefix}:unacked_index"):
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    publisher.control.cancel_consumer(queue, reply=False)
    return messages / elapsed


def _store_label(url: str) -> str:
    return "memory store, per process" if url.startswith("memory") else "Redis store"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    parser.add_argument(
        "--concurrency", default="2", help="pool sizes to measure, comma-separated (2)"
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also measure the guard on a per-process memory store (no round trip)",
    )
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/performance.md")
    args = parser.parse_args(argv)
    pools = [int(c) for c in args.concurrency.split(",") if c.strip()]
    stores = [STORE] + (["memory://"] if args.diagnose else [])

    import redis

    load_start, command = h.loadavg(), h.command_line("bench/celery_throughput.py", argv)
    client = redis.Redis.from_url(BROKER)
    store_client = redis.Redis.from_url(STORE)
    # (pool, kind, store) -> rates; kind "plain" has store None
    results: dict[tuple[int, str, str | None], list[float]] = {}
    for pool in pools:
        for store in stores:
            prefix = f"bench{uuid.uuid4().hex[:8]}"
            workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"taskonce-{prefix}"
            workdir.mkdir(parents=True)
            publisher = Celery(f"bench-publisher-{prefix}", broker=BROKER, set_as_current=False)
            publisher.conf.update(
                broker_transport_options={"global_keyprefix": f"{prefix}:"},
                broker_connection_retry_on_startup=True,
                task_ignore_result=True,
            )
            worker = _start_worker(prefix, store, pool, workdir / "ready", workdir / "worker.log")
            try:
                _round(publisher, client, prefix, "plain", 200)  # warm-up: connections, imports
                _round(publisher, client, prefix, "guarded", 200)
                for _ in range(args.rounds):
                    for kind in ("plain", "guarded"):
                        rate = _round(publisher, client, prefix, kind, args.messages)
                        key = (pool, kind, None if kind == "plain" else store)
                        results.setdefault(key, []).append(rate)
                        label = kind if kind == "plain" else f"guarded, {_store_label(store)}"
                        print(f"  -c {pool}  {label:<34} {rate:8.0f} tasks/s", flush=True)
            finally:
                h.stop_group(worker)
                publisher.close()
                shutil.rmtree(workdir, ignore_errors=True)
                h.drop_keys(client, prefix)
                h.drop_keys(store_client, prefix)
    client.close()
    store_client.close()

    rows = []
    verdicts = []
    for pool in pools:
        plain_rate = statistics.median(results[(pool, "plain", None)])
        for key in [(pool, "plain", None), *[(pool, "guarded", s) for s in stores]]:
            rates = results[key]
            rate = statistics.median(rates)
            name = (
                "plain `Task`"
                if key[2] is None
                else f"`IdempotentTask` (eager, {_store_label(key[2])})"
            )
            rounds = ", ".join(f"{r:,.0f}" for r in rates)
            rows.append([pool, name, f"{rate:,.0f}", rounds, f"{rate / plain_rate:.2f}×"])
        guarded_rate = statistics.median(results[(pool, "guarded", STORE)])
        ratio = guarded_rate / plain_rate
        cost_ms = (1 / guarded_rate - 1 / plain_rate) * 1000
        verdicts.append(
            f"-c {pool}: {ratio:.2f}× ({'met' if ratio >= 0.85 else 'missed'}; the guard adds "
            f"{cost_ms:.2f} ms of worker time per message)"
        )
    header = "pool|task|tasks/s (median)|all rounds|vs plain".split("|")
    text = "\n\n".join(
        [
            f"{args.messages} messages per round, {args.rounds} rounds of each kind; broker "
            f"`{BROKER}`, store `{STORE}`.",
            h.table(header, rows, "rlrlr"),
            f"Against the aim (guarded within 15 % of plain, ≥ 0.85×): {'; '.join(verdicts)}.",
            h.measured_line(command, load_start),
        ]
    )
    print(f"\n{text}")
    if not args.no_write:
        h.write_block("celery-throughput", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
