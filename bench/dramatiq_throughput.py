"""No-op actor throughput on Dramatiq, with and without ``IdempotencyMiddleware``, same run.

Each round enqueues ``--messages`` messages for a no-op actor on a RedisBroker, then starts a
``dramatiq.Worker`` (in this process, with each of ``--threads`` worker thread counts) and
times from the start until the last message is acknowledged. Variants, interleaved round by
round so machine noise hits all of them alike:

- ``plain``: the broker's default middleware only;
- ``guarded eager``: plus ``IdempotencyMiddleware`` on a Redis store (claim + complete: two
  scripts per message, which the store sends as shared round trips when worker threads call
  it at the same moment);
- ``guarded lazy``: the same with ``mode="lazy"`` (get + mark);
- ``guarded eager, memory store``: the guard on an in-process ``MemoryStore`` — no round
  trip at all, so it isolates the Python cost of the guard and the middleware.

The table (median of ``--rounds``) is printed and, unless ``--no-write``, written to its block
of ``docs/performance.md``.

    .venv/bin/python bench/dramatiq_throughput.py [--messages 3000] [--rounds 3] [--threads 2,8]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import dramatiq
import harness as h
import redis
from dramatiq.brokers.redis import RedisBroker

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware

MEMORY = ", memory store"


class AckCounter(dramatiq.Middleware):
    """Sets ``done`` when ``target`` messages have been acknowledged."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.lock = threading.Lock()
        self.done = threading.Event()

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        with self.lock:
            self.count += 1
            if self.count >= self.target:
                self.done.set()


def one_round(
    variant: str, broker_url: str, store_url: str, messages: int, threads: int
) -> tuple[float, int, float]:
    """Messages per second of one variant, the number of records the guard wrote, and the
    process's CPU time (user + system) per message while the worker ran, in µs."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    broker = RedisBroker(url=broker_url, namespace=namespace)
    counter = AckCounter(messages)
    guard: taskonce.Guard | None = None
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    if variant != "plain":
        mode = "lazy" if variant.endswith("lazy") else "eager"
        store = (
            taskonce.MemoryStore()
            if variant.endswith(MEMORY)
            else taskonce.open_store(store_url, prefix=prefix)
        )
        guard = taskonce.Guard(store, default=taskonce.Policy(mode=mode))
        broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(counter)

    @dramatiq.actor(broker=broker, queue_name="bench", max_retries=0)
    def noop(i: int) -> None:
        return None

    pipe_client = redis.Redis.from_url(broker_url)
    for start in range(0, messages, 500):  # enqueue up front, outside the timed part
        for i in range(start, min(messages, start + 500)):
            noop.send(i)
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    began, cpu_began = time.perf_counter(), os.times()
    worker.start()
    if not counter.done.wait(timeout=600):
        raise RuntimeError(f"{variant}: only {counter.count}/{messages} acknowledged")
    elapsed, cpu_ended = time.perf_counter() - began, os.times()
    cpu = (cpu_ended.user - cpu_began.user) + (cpu_ended.system - cpu_began.system)
    worker.stop()
    written = 0
    if guard is not None and variant.endswith(MEMORY):
        written = int(guard.store.stats()["keys"])
        guard.close()
    elif guard is not None:
        written = int(guard.store.stats()["keys"])
        h.drop_keys(guard.store.client, prefix)  # type: ignore[attr-defined]
        guard.close()
    h.drop_keys(pipe_client, namespace)
    pipe_client.close()
    broker.close()
    return messages / elapsed, written, cpu / messages * 1e6


def render(
    results: dict[tuple[int, str], list[float]],
    cpus: dict[tuple[int, str], list[float]],
    args: argparse.Namespace,
    measured: str,
) -> str:
    rows, verdicts = [], []
    for (threads, variant), values in sorted(results.items(), key=lambda item: item[0][0]):
        plain = statistics.median(results[(threads, "plain")])
        median = statistics.median(values)
        rounds = ", ".join(f"{v:,.0f}" for v in values)
        cpu = statistics.median(cpus[(threads, variant)])
        rows.append([threads, variant, f"{median:,.0f}", rounds, f"{median / plain:.2f}×"])
        rows[-1].append(f"{cpu:,.0f}")
        if variant == "guarded eager":
            ratio = median / plain
            verdicts.append(
                f"{threads} threads {ratio:.2f}× ({'met' if ratio >= 0.85 else 'missed'})"
            )
    header = "worker threads|variant|msg/s (median)|all rounds|vs plain|CPU µs/msg".split("|")
    return "\n\n".join(
        [
            f"{args.messages} messages per round, {args.rounds} rounds (median); RedisBroker "
            f"`{args.broker}`, Redis store `{args.store}`; dramatiq {dramatiq.__version__}.",
            h.table(header, rows, "rlrlrr"),
            "Against the aim (guarded eager within 15 % of plain, ≥ 0.85×): "
            + "; ".join(verdicts)
            + ".",
            measured,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", default="2,8", help="comma-separated worker thread counts (default 2,8)"
    )
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/8")
    parser.add_argument("--store", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dramatiq").setLevel(logging.ERROR)
    command = h.command_line("bench/dramatiq_throughput.py")
    thread_counts = [int(t) for t in str(args.threads).split(",") if t.strip()]
    variants = ["plain", "guarded eager", "guarded lazy", f"guarded eager{MEMORY}"]
    results: dict[tuple[int, str], list[float]] = {
        (t, v): [] for t in thread_counts for v in variants
    }
    cpus: dict[tuple[int, str], list[float]] = {key: [] for key in results}
    load_start = h.loadavg()
    for round_no in range(args.rounds):
        for threads in thread_counts:
            for variant in variants if round_no % 2 == 0 else reversed(variants):
                rate, written, cpu = one_round(
                    variant, args.broker, args.store, args.messages, threads
                )
                if variant != "plain" and written != args.messages:
                    raise RuntimeError(f"{variant}: {written} records for {args.messages} messages")
                results[(threads, variant)].append(rate)
                cpus[(threads, variant)].append(cpu)
                print(
                    f"round {round_no + 1}, {threads} threads: {variant:<30} {rate:8,.0f} msg/s "
                    f"{cpu:6,.0f} µs CPU/msg",
                    flush=True,
                )
    section = render(results, cpus, args, h.measured_line(command, load_start))
    print(f"\n{section}")
    if not args.no_write:
        h.write_block("dramatiq-throughput", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
