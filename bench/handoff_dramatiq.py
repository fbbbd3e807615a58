"""A Dramatiq actor that sends one message: guarded with the hand-off against a plain one.

Each round enqueues ``--messages`` messages for an actor that sends one message to another
queue (which nobody consumes), starts a ``dramatiq.Worker`` in this process (``--threads``
worker threads) on a RedisBroker and times until the last message is acknowledged. Variants,
interleaved round by round (order alternating) so machine noise hits all of them alike:

- ``plain``: no taskonce; the send goes to the broker inside the actor;
- ``guarded, deferred (<store>)``: ``IdempotencyMiddleware`` (eager) on a Redis or PostgreSQL
  store: the send is captured, written with the outcome (same script / same transaction),
  enqueued after it, then marked dispatched (one more write);
- ``guarded, not deferred (<store>)``: the same guard with ``defer_sends=False`` (the send
  leaves at once, as before the hand-off), to separate the hand-off's share from the guard's.

The ratios (median of ``--rounds``) against ``plain`` are printed and written to
``docs/performance.md`` under the section heading below (only that section is replaced).

    .venv/bin/python bench/handoff_dramatiq.py [--messages 1000] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import sys
import time
import uuid
from typing import Any

import dramatiq
import redis
from deferred_sends import drop, open_bench_store
from docs_section import command_lines, write_section  # bench/ is on sys.path
from dramatiq.brokers.redis import RedisBroker
from dramatiq_throughput import AckCounter

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware

HEADING = "## Hand-off: a Dramatiq actor that sends one message"
STORES = {"Redis": "redis", "PostgreSQL": "postgresql"}  # label: deferred_sends store kind


def one_round(variant: str, broker_url: str, messages: int, threads: int) -> float:
    """Messages per second of one variant."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    broker = RedisBroker(url=broker_url, namespace=namespace)
    guard: taskonce.Guard | None = None
    if variant != "plain":
        label = variant[variant.index("(") + 1 : -1]
        deferred = "not deferred" not in variant
        guard = taskonce.Guard(
            open_bench_store(STORES[label]),
            default=taskonce.Policy(mode="eager", defer_sends=deferred),
        )
        broker.add_middleware(IdempotencyMiddleware(guard, relay_every=0))
    counter = AckCounter(messages)
    broker.add_middleware(counter)

    @dramatiq.actor(broker=broker, queue_name="sink")
    def sink(i: int) -> None:
        return None

    @dramatiq.actor(broker=broker, queue_name="bench", max_retries=0)
    def sender(i: int) -> None:
        sink.send(i)

    for i in range(messages):
        sender.send(i)
    worker = dramatiq.Worker(broker, queues={"bench"}, worker_threads=threads, worker_timeout=100)
    began = time.perf_counter()
    worker.start()
    if not counter.done.wait(timeout=600):
        raise RuntimeError(f"{variant}: only {counter.count}/{messages} acknowledged")
    elapsed = time.perf_counter() - began
    worker.stop()
    client = redis.Redis.from_url(broker_url)
    queued = client.llen(f"{namespace}:sink")
    for key in client.scan_iter(match=f"{namespace}:*", count=1000):
        client.delete(key)
    client.close()
    if queued != messages:
        raise RuntimeError(f"{variant}: {queued} messages sent for {messages}")
    if guard is not None:
        drop(guard.store)
    broker.close()
    return messages / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/8")
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dramatiq").setLevel(logging.ERROR)
    command = shlex.join([".venv/bin/python", "bench/handoff_dramatiq.py", *sys.argv[1:]])
    variants = ["plain"]
    for label in STORES:
        variants += [f"guarded, deferred ({label})", f"guarded, not deferred ({label})"]
    rates: dict[str, list[float]] = {v: [] for v in variants}
    load = [f"{x:.2f}" for x in os.getloadavg()]
    for round_no in range(args.rounds):
        for variant in variants if round_no % 2 == 0 else reversed(variants):
            rate = one_round(variant, args.broker, args.messages, args.threads)
            rates[variant].append(rate)
            print(f"round {round_no + 1}: {variant:<36} {rate:8,.0f} msg/s", flush=True)
    load += [f"{x:.2f}" for x in os.getloadavg()]
    section = render(rates, args, command, load)
    print()
    print(section)
    if not args.no_write:
        write_section(section)
    return 0


def render(rates: dict[str, list[float]], args: Any, command: str, load: list[str]) -> str:
    plain = statistics.median(rates["plain"])
    lines = [
        HEADING,
        "",
        f"An actor that sends one message per run, {args.messages} messages, RedisBroker, "
        f"{args.threads} worker threads in one process, median of {args.rounds} rounds "
        f"(load average {' '.join(load[:1])} at the start, {' '.join(load[3:4])} at the end). "
        "Ratio: messages per second against the plain actor, measured in the same run.",
        "",
        "| variant | msg/s | ratio to plain |",
        "| --- | ---: | ---: |",
    ]
    for variant, values in rates.items():
        rate = statistics.median(values)
        lines.append(f"| {variant} | {rate:,.0f} | {rate / plain:.2f}x |")
    lines += [
        "",
        "A deferred send costs the guard one more write (marking it dispatched) and a larger "
        "record write; the difference between the *deferred* and *not deferred* rows is the "
        "hand-off's share.",
        "",
        *command_lines(command),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
