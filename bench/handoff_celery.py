"""A Celery task that sends one message: guarded with the hand-off against a plain one.

Each task runs through Celery's own tracer in this process (``task.apply()``: the same
``__call__``, link/chain handling and result handling a worker runs, without a broker round trip
to receive it) and sends one message with ``.delay()`` to a real Redis broker. Variants, timed in
batches that alternate (order reversed every round) so machine noise hits all of them alike:

- ``plain``: no taskonce; ``.delay()`` publishes inside the body;
- ``guarded, deferred (<store>)``: ``IdempotentTask`` (eager mode) on a Redis or PostgreSQL
  store: the send is captured, written with the outcome, published after it, then marked
  dispatched;
- ``guarded, not deferred (<store>)``: the same with ``defer_sends=False``.

The medians per task and their ratio to ``plain`` are printed and written to
``docs/performance.md`` under the heading below (only that section is replaced).

    .venv/bin/python bench/handoff_celery.py [--tasks 500] [--rounds 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import uuid
from typing import Any

import redis
from celery import Celery
from deferred_sends import drop, open_bench_store  # bench/ is on sys.path
from docs_section import command_lines, write_section

import taskonce
from taskonce.celery_ext import IdempotentTask, setup

HEADING = "## Hand-off: a Celery task that sends one message"
PARAGRAPH = (
    "This is a task's own cost without the worker's: receiving, acknowledging and storing the "
    "result of a message are not in it, so the ratios are the largest the hand-off and the "
    "guard can show; through a worker (the Dramatiq table above) they are diluted. *Deferred* "
    "minus *not deferred* is the hand-off's share: the send rides in the outcome's write and "
    "one more write marks it dispatched."
)
STORES = {"Redis": "redis", "PostgreSQL": "postgresql"}  # label: deferred_sends store kind


def make_app(broker: str, prefix: str, guard: taskonce.Guard | None) -> tuple[Celery, Any]:
    app = Celery(f"bench-{prefix}", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": f"{prefix}:"},
        task_default_queue=f"{prefix}.sink",
        task_ignore_result=True,
        taskonce_relay_every=0,
    )

    @app.task(name="bench.sink", shared=False)
    def sink(i: int) -> None:
        return None

    if guard is None:

        @app.task(name="bench.sender", shared=False)
        def sender(i: int) -> None:
            sink.delay(i)

        return app, sender
    setup(app, guard)

    @app.task(name="bench.sender", base=IdempotentTask, acks_late=True, shared=False)
    def guarded_sender(i: int) -> None:
        sink.delay(i)

    return app, guarded_sender


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=500, help="tasks per batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/4")
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/handoff_celery.py", *sys.argv[1:]])
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    setups: dict[str, tuple[Celery, Any, taskonce.Guard | None]] = {}
    app, task = make_app(args.broker, prefix, None)
    setups["plain"] = (app, task, None)
    for label, kind in STORES.items():
        for deferred in (True, False):
            guard = taskonce.Guard(
                open_bench_store(kind), default=taskonce.Policy(defer_sends=deferred)
            )
            name = f"guarded, {'deferred' if deferred else 'not deferred'} ({label})"
            app, task = make_app(args.broker, prefix, guard)
            setups[name] = (app, task, guard)
    times: dict[str, list[float]] = {name: [] for name in setups}
    load = [f"{x:.2f}" for x in os.getloadavg()]
    try:
        for round_no in range(args.rounds):
            order = list(setups) if round_no % 2 == 0 else list(reversed(setups))
            for name in order:
                _, task, _ = setups[name]
                began = time.perf_counter()
                for _ in range(args.tasks):
                    task.apply((0,), task_id=str(uuid.uuid4()))
                per_task = (time.perf_counter() - began) / args.tasks * 1e6
                times[name].append(per_task)
                print(f"round {round_no + 1}: {name:<36} {per_task:8,.0f} µs/task", flush=True)
        load += [f"{x:.2f}" for x in os.getloadavg()]
        client = redis.Redis.from_url(args.broker)
        sent = client.llen(f"{prefix}:{prefix}.sink")
        expected = args.tasks * args.rounds * len(setups)
        if sent != expected:
            raise RuntimeError(f"{sent} messages sent for {expected} tasks")
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
        client.close()
    finally:
        for app, _, guard in setups.values():
            if guard is not None:
                drop(guard.store)
            app.close()
    section = render(times, args, command, load)
    print()
    print(section)
    if not args.no_write:
        write_section(section)
    return 0


def render(times: dict[str, list[float]], args: Any, command: str, load: list[str]) -> str:
    plain = statistics.median(times["plain"])
    lines = [
        HEADING,
        "",
        f"One task that sends one message with `.delay()` to a Redis broker, run through "
        f"Celery's tracer in one process (`task.apply()`), {args.tasks} tasks per batch, median "
        f"of {args.rounds} batches, variants alternating (load average {load[0]} at the start, "
        f"{load[3]} at the end, on 2 CPUs). Ratio: time per task against the plain task, "
        "measured in the same run (above 1: slower).",
        "",
        "| variant | µs per task | ratio to plain |",
        "| --- | ---: | ---: |",
    ]
    for name, values in times.items():
        value = statistics.median(values)
        lines.append(f"| {name} | {value:,.0f} | {value / plain:.2f}x |")
    lines += ["", PARAGRAPH, "", *command_lines(command)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
