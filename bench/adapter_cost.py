"""The adapters' own CPU per message: what the Celery task class and the Dramatiq middleware
add to the guard's ``begin`` + ``finish``, measured in one process, one thread.

Per message, new message id each time, no-op body, eager policy:

- ``guard``: ``guard.begin(Delivery(...))`` + ``guard.finish(ticket)``: what the adapters call;
- ``dramatiq hooks``: ``IdempotencyMiddleware.before_process_message`` and
  ``after_process_message`` on a real ``MessageProxy`` (built before the round is timed):
  everything the middleware does per delivery, the guard included;
- ``celery plain`` / ``celery guarded``: Celery's own tracer (``build_tracer``, what a prefork
  child runs per message) of a plain no-op task and of the same task with ``IdempotentTask``;
  their difference is the task class plus the guard.

The adapter's own share is ``dramatiq hooks − guard`` and ``celery guarded − celery plain −
guard``. Rounds interleaved; CPU is ``time.process_time``. ``--store memory://`` leaves the
store's round trips out (the Python alone); ``--profile`` prints a cProfile of each adapter.

    .venv/bin/python bench/adapter_cost.py [--messages 3000] [--rounds 5]
        [--store memory://|redis://127.0.0.1:6379/15] [--profile] [--write-docs]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Adapters' own CPU per message"

import dramatiq  # noqa: E402
from celery import Celery  # noqa: E402
from celery.app.trace import build_tracer  # noqa: E402
from docs_section import DOC, command_lines, write_section  # noqa: E402  (bench/ is sys.path[0])
from dramatiq.broker import MessageProxy  # noqa: E402
from dramatiq.brokers.stub import StubBroker  # noqa: E402

import taskonce  # noqa: E402
from taskonce.celery_ext import IdempotentTask, setup  # noqa: E402
from taskonce.dramatiq_ext import IdempotencyMiddleware  # noqa: E402
from taskonce.guard import Delivery  # noqa: E402


def _store(url: str, prefix: str) -> taskonce.Store:
    if url.startswith("memory"):
        return taskonce.open_store(url)
    return taskonce.open_store(url, prefix=prefix)


def guard_case(url: str, prefix: str) -> Callable[[], None]:
    guard = taskonce.Guard(_store(url, prefix))
    ids: list[str] = []

    def prepare(messages: int) -> None:
        ids[:] = [uuid.uuid4().hex for _ in range(messages)]

    def one() -> None:
        delivery = Delivery(message_id=ids.pop(), queue="q", task="noop", framework="dramatiq")
        guard.finish(guard.begin(delivery, (1,), {}), None)

    one.prepare = prepare  # type: ignore[attr-defined]
    return one


def dramatiq_case(url: str, prefix: str) -> Callable[[], None]:
    broker = StubBroker()
    middleware = IdempotencyMiddleware(taskonce.Guard(_store(url, prefix)))
    broker.add_middleware(middleware)

    @dramatiq.actor(broker=broker, queue_name="q")
    def noop(i: int) -> None:
        return None

    ready: list[MessageProxy] = []

    def prepare(messages: int) -> None:
        """Build the round's messages before it is timed: Dramatiq's work, not the adapter's."""
        ready[:] = [MessageProxy(noop.message(1)) for _ in range(messages)]

    def one() -> None:
        message = ready.pop()
        middleware.before_process_message(broker, message)
        middleware.after_process_message(broker, message, result=None)

    one.prepare = prepare  # type: ignore[attr-defined]
    return one


def celery_cases(url: str, prefix: str) -> tuple[Callable[[], None], Callable[[], None]]:
    app = Celery("adapter_cost", broker="memory://", set_as_current=False)
    app.conf.update(task_ignore_result=True, task_default_queue="q")
    setup(app, taskonce.Guard(_store(url, prefix)))

    @app.task(name="cost.plain", acks_late=True, shared=False)
    def plain(i: int) -> None:
        return None

    @app.task(name="cost.guarded", base=IdempotentTask, acks_late=True, shared=False)
    def guarded(i: int) -> None:
        return None

    app.finalize()

    def traced(task: Any) -> Callable[[], None]:
        tracer = build_tracer(task.name, task, app=app)

        def one() -> None:
            task_id = str(uuid.uuid4())
            request = {
                "id": task_id,
                "task": task.name,
                "delivery_info": {"exchange": "", "routing_key": "q", "redelivered": False},
                "headers": {"taskonce_queue": "q"},
                "taskonce_queue": "q",
                "retries": 0,
                "timelimit": (None, None),
                "is_eager": False,
            }
            tracer(task_id, (1,), {}, request)

        return one

    # The registered task objects, as a worker's tracer gets them (``plain``/``guarded`` are
    # the decorator's lazy proxies).
    return traced(app.tasks[plain.name]), traced(app.tasks[guarded.name])


def render(
    results: dict[str, list[float]], args: argparse.Namespace, command: str, load: tuple[str, str]
) -> str:
    """The section of docs/performance.md: medians and lowest rounds, the adapters' shares."""
    med = {name: statistics.median(values) for name, values in results.items()}
    low = {name: min(values) for name, values in results.items()}
    lines = [
        HEADING,
        "",
        "What the Celery task class and the Dramatiq middleware add per message to the guard's "
        "own `begin` + `finish`, in one process and one thread, no-op body, eager policy on "
        f"the store `{args.store}` (a memory store leaves the round trips out: Python alone). "
        "*guard*: `guard.begin` + `guard.finish`; *dramatiq hooks*: the middleware's "
        "`before_process_message` + `after_process_message` on a real `MessageProxy`; "
        "*celery plain* / *celery guarded*: Celery's own tracer (`build_tracer`, what a "
        "prefork child runs per message) of a no-op task, plain and with `IdempotentTask`. "
        f"{args.messages} messages per round, {args.rounds} rounds interleaved, CPU by "
        "`time.process_time`; the lowest round is the least disturbed by other processes. "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs; load average {load[0]} "
        f"at the start, {load[1]} at the end.",
        "",
        "| case | CPU µs/msg (median) | lowest round | all rounds |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, values in results.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        lines.append(f"| {name} | {med[name]:.1f} | {low[name]:.1f} | {rounds} |")
    shares = []
    for label, figures in (("median", med), ("lowest round", low)):
        dramatiq_own = figures["dramatiq hooks"] - figures["guard"]
        celery_own = figures["celery guarded"] - figures["celery plain"] - figures["guard"]
        shares.append(f"Dramatiq {dramatiq_own:.0f} µs, Celery {celery_own:.0f} µs ({label})")
    lines += [
        "",
        "The adapters' own share per message (*dramatiq hooks − guard*; *celery guarded − "
        "celery plain − guard*): " + "; ".join(shares) + ".",
        "",
        *command_lines(command),
    ]
    return "\n".join(lines)


def measure(fn: Callable[[], None], messages: int) -> float:
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare(messages)
    began = time.process_time()
    for _ in range(messages):
        fn()
    return (time.process_time() - began) / messages * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--store", default="memory://")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help=f"write {HEADING!r}")
    args = parser.parse_args(argv)
    prefix = f"cost{uuid.uuid4().hex[:8]}"
    celery_plain, celery_guarded = celery_cases(args.store, prefix)
    cases = {
        "guard": guard_case(args.store, prefix),
        "dramatiq hooks": dramatiq_case(args.store, prefix),
        "celery plain": celery_plain,
        "celery guarded": celery_guarded,
    }
    for fn in cases.values():  # warm-up
        measure(fn, 200)
    results: dict[str, list[float]] = {name: [] for name in cases}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for round_no in range(args.rounds):
        names = list(cases) if round_no % 2 == 0 else list(reversed(cases))
        for name in names:
            results[name].append(measure(cases[name], args.messages))
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = shlex.join([".venv/bin/python", "bench/adapter_cost.py", *sys.argv[1:]])
    section = render(results, args, command, (load, load_end))
    print(section)
    if args.write_docs:
        write_section(section, DOC)
        print(f"written to {DOC}")
    if args.profile:
        for name in ("dramatiq hooks", "celery guarded"):
            prepare = getattr(cases[name], "prepare", None)
            if prepare is not None:
                prepare(args.messages)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.messages):
                cases[name]()
            profile.disable()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
            print(f"\n== {name}: top 25 by own time ==\n{out.getvalue()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
