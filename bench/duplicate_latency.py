"""How long a concurrent duplicate waits: a second delivery of a message id that arrives while
the first still runs, through real workers, before and after a change of the guard.

For each framework a real worker runs a guarded handler that takes ``--handler`` seconds
(18 ms); the benchmark publishes a message and at once a duplicate with the same id (Celery:
``send_task`` with the same ``task_id``; Dramatiq: ``broker.enqueue`` of the same
``Message``), so the worker's two pool processes (threads) take them at the same time: one
claims and runs, the other finds the claim running and is deferred (``in_progress_deferred``),
re-published with the guard's delay, and skipped (``duplicate_skipped``) once it comes back
and finds the key completed. Per pair, from the worker's JSONL events:

- *completed → skipped*: from the first run's ``completed`` event to the duplicate's
  ``duplicate_skipped`` event (the events' own ``ts``, millisecond resolution);
- *publish → skipped*: from the duplicate's publish (this process's clock, the same host) to
  its ``duplicate_skipped`` event.

A pair whose duplicate was not deferred (the first run had ended before the copy was looked at:
skipped at once) is not concurrent: it is counted and left out, and pairs are sent until
``--pairs`` concurrent ones were measured (at most three times as many attempts).

Stacks: Celery — ``celery worker -P prefork -c 2`` (``acks_late``), Redis broker, Redis store;
Dramatiq — ``dramatiq --processes 1 --threads 2``, RabbitMQ broker, Redis store. The policy is
the default one (eager, lease 300 s).

The code under test: ``--before REV`` and ``--after REV`` are git revisions of this
repository. Each is extracted with ``git archive`` into a temporary directory and laid out as
the ``taskonce`` package (its ``pyproject.toml``'s ``package-dir``); the workers run with that
directory first on ``PYTHONPATH``, ahead of the editable install, so one venv runs both (the
worker logs which ``taskonce`` it imported). ``worktree`` instead of a revision runs the
installed (editable) working tree. This module stays the workers' app module, so it only uses
API both revisions have.

    .venv/bin/python bench/duplicate_latency.py [--before 7355f89] [--after HEAD] [--pairs 20]
        [--frameworks celery,dramatiq] [--handler 0.018] [--write-docs]

Needs the local Redis (6379) and RabbitMQ (5672, guest/guest).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
HEADING = "## A concurrent duplicate's wait"
ENV = os.environ
ROLE = ENV.get("DL_ROLE", "")  # "celery" / "dramatiq" in a worker; empty in the benchmark
REDIS_BROKER = ENV.get("DL_REDIS_BROKER", "redis://127.0.0.1:6379/10")
RABBIT_BROKER = ENV.get("DL_RABBIT_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F")
STORE = ENV.get("DL_STORE", "redis://127.0.0.1:6379/15")
PREFIX = ENV.get("DL_PREFIX", "dl")
QUEUE = f"{PREFIX}.brief" if ROLE != "dramatiq" else f"{PREFIX}_brief"


# -- the workers' side (this module is their app) ---------------------------------------------


def _guard() -> Any:
    import taskonce

    return taskonce.Guard(
        taskonce.open_store(STORE, prefix=PREFIX), events=[taskonce.JsonlEvents(ENV["DL_EVENTS"])]
    )


def _ready() -> None:
    import taskonce

    Path(ENV["DL_READY"]).write_text(str(Path(taskonce.__file__).resolve().parent))


if ROLE == "celery":
    from celery import Celery, signals

    from taskonce.celery_ext import IdempotentTask, setup

    celery_app = Celery("duplicate_latency", broker=REDIS_BROKER, set_as_current=False)
    celery_app.conf.update(
        broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        task_default_queue=QUEUE,
        worker_prefetch_multiplier=1,
    )
    setup(celery_app, _guard())

    @celery_app.task(name="bench.brief", base=IdempotentTask, acks_late=True, shared=False)
    def brief(seconds: float) -> None:
        """A handler that takes ``seconds``."""
        time.sleep(seconds)

    @signals.worker_ready.connect
    def _celery_ready(**_: Any) -> None:
        _ready()

elif ROLE == "dramatiq":
    import dramatiq
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    from taskonce.dramatiq_ext import IdempotencyMiddleware

    class _Ready(dramatiq.Middleware):
        def after_worker_boot(self, broker: Any, worker: Any) -> None:
            _ready()

    broker = RabbitmqBroker(url=RABBIT_BROKER)
    broker.add_middleware(IdempotencyMiddleware(_guard()))
    broker.add_middleware(_Ready())

    @dramatiq.actor(broker=broker, queue_name=QUEUE, actor_name="brief")
    def brief_actor(seconds: float) -> None:
        """A handler that takes ``seconds``."""
        time.sleep(seconds)


# -- the code under test: a revision laid out as the taskonce package -----------------------


@dataclass
class Source:
    label: str  # what was asked for (a revision, or "worktree")
    commit: str  # the commit it resolved to ("" for the working tree)
    path: Path | None  # the directory to put first on PYTHONPATH (None: the editable install)


@contextlib.contextmanager
def source(rev: str) -> Iterator[Source]:
    if rev == "worktree":
        yield Source(rev, "", None)
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix=f"taskonce-src-{commit[:8]}-"))
    try:
        tree = tmp / "tree"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "archive", commit], cwd=ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        config = tomllib.loads((tree / "pyproject.toml").read_text())
        dirs: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
        path = tmp / "path"
        path.mkdir()
        # parents before children: "taskonce" -> core, then "taskonce.celery_ext" ->
        # celery_ext linked inside it, unless it already lies there (core/stores)
        for name in sorted(dirs, key=lambda n: n.count(".")):
            *parents, leaf = name.split(".")
            link = path.joinpath(*parents, leaf)
            target = (tree / dirs[name]).resolve()
            if not (link.exists() and link.resolve() == target):
                link.symlink_to(target, target_is_directory=True)
        yield Source(rev, commit, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- one framework's run ----------------------------------------------------------------------


@dataclass
class Pair:
    concurrent: bool
    from_completed: float = 0.0  # s, completed -> duplicate_skipped
    from_publish: float = 0.0  # s, the duplicate's publish -> duplicate_skipped
    deferrals: int = 0


@dataclass
class Run:
    framework: str
    source: Source
    imported: str = ""  # the taskonce directory the worker imported
    pairs: list[Pair] = field(default_factory=list)

    @property
    def measured(self) -> list[Pair]:
        return [p for p in self.pairs if p.concurrent]


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def at(event: dict[str, Any]) -> float:
    return datetime.datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def start_worker(command: list[str], env: dict[str, str], work: Path) -> subprocess.Popen[bytes]:
    log = work / "worker.log"
    with open(log, "ab") as handle:
        worker = subprocess.Popen(
            command, cwd=work, env=env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 90
    while not (work / "ready").exists():
        if worker.poll() is not None or time.monotonic() > deadline:
            stop_worker(worker)
            raise SystemExit(f"the worker did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    return worker


def stop_worker(worker: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=10)
            return


def measure(
    run: Run, publish: Callable[[str], None], events_path: Path, pairs: int, timeout: float
) -> None:
    """Send pairs (a message, then at once its duplicate) until ``pairs`` concurrent ones were
    measured; each pair is settled before the next is sent."""
    for attempt in range(3 * pairs):
        if len(run.measured) >= pairs:
            break
        message_id = str(uuid.uuid4())
        publish(message_id)
        published = time.time()
        publish(message_id)
        deadline = time.monotonic() + timeout
        while True:
            events = [e for e in read_events(events_path) if e.get("message_id") == message_id]
            names = [e["event"] for e in events]
            if "duplicate_skipped" in names and "completed" in names:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{run.framework}: pair {attempt} not settled: {names}")
            time.sleep(0.01)
        completed = next(e for e in events if e["event"] == "completed")
        skipped = next(e for e in events if e["event"] == "duplicate_skipped")
        deferrals = names.count("in_progress_deferred")
        pair = Pair(
            concurrent=deferrals > 0,
            from_completed=at(skipped) - at(completed),
            from_publish=at(skipped) - published,
            deferrals=deferrals,
        )
        run.pairs.append(pair)
        print(
            f"  {run.framework:<8} {run.source.label:<10} pair {attempt + 1:>2}: "
            + (
                f"completed→skipped {pair.from_completed:6.3f} s, publish→skipped "
                f"{pair.from_publish:6.3f} s, {deferrals} deferral(s)"
                if pair.concurrent
                else "not concurrent (skipped without a deferral), left out"
            ),
            flush=True,
        )
        time.sleep(0.2)


def worker_env(src: Source, role: str, prefix: str, work: Path) -> dict[str, str]:
    path = [str(src.path)] if src.path is not None else []
    path += [str(BENCH), ENV.get("PYTHONPATH", "")]
    return {
        **ENV,
        "DL_ROLE": role,
        "DL_PREFIX": prefix,
        "DL_EVENTS": str(work / "events.jsonl"),
        "DL_READY": str(work / "ready"),
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
    }


def drop_store_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(STORE)
    try:
        keys = list(client.scan_iter(match=f"*{prefix}*", count=1000))
        for key in keys:
            client.delete(key)
    finally:
        client.close()


def run_celery(src: Source, pairs: int, handler: float, timeout: float) -> Run:
    import redis
    from celery import Celery

    prefix = f"dl{uuid.uuid4().hex[:10]}"
    queue = f"{prefix}.brief"
    work = Path(tempfile.mkdtemp(prefix=f"taskonce-{prefix}-"))
    command = [
        sys.executable, "-m", "celery", "-A", "duplicate_latency:celery_app", "worker",
        "-P", "prefork", "-c", "2", "-Q", queue, "-n", f"{prefix}@%h", "--without-gossip",
        "--without-mingle", "--without-heartbeat", "-l", "WARNING",
    ]  # fmt: skip
    publisher = Celery(f"dl-publisher-{prefix}", broker=REDIS_BROKER, set_as_current=False)
    publisher.conf.update(
        broker_transport_options={"global_keyprefix": f"{prefix}:"},
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
    )
    run = Run("Celery", src)
    worker = start_worker(command, worker_env(src, "celery", prefix, work), work)
    try:
        run.imported = (work / "ready").read_text()

        def publish(message_id: str) -> None:
            publisher.send_task("bench.brief", args=(handler,), queue=queue, task_id=message_id)

        measure(run, publish, work / "events.jsonl", pairs, timeout)
    finally:
        stop_worker(worker)
        publisher.close()
        client = redis.Redis.from_url(REDIS_BROKER)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()
        drop_store_keys(prefix)
        shutil.rmtree(work, ignore_errors=True)
    return run


def run_dramatiq(src: Source, pairs: int, handler: float, timeout: float) -> Run:
    import dramatiq
    import pika
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    prefix = f"dl{uuid.uuid4().hex[:10]}"
    queue = f"{prefix}_brief"
    work = Path(tempfile.mkdtemp(prefix=f"taskonce-{prefix}-"))
    command = [
        sys.executable, "-m", "dramatiq", "duplicate_latency:broker", "--processes", "1",
        "--threads", "2", "--queues", queue, "--path", str(BENCH),
    ]  # fmt: skip
    publisher = RabbitmqBroker(url=RABBIT_BROKER)
    publisher.declare_queue(queue)
    run = Run("Dramatiq", src)
    worker = start_worker(command, worker_env(src, "dramatiq", prefix, work), work)
    try:
        run.imported = (work / "ready").read_text()

        def publish(message_id: str) -> None:
            message = dramatiq.Message(
                queue_name=queue, actor_name="brief", args=(handler,), kwargs={}, options={},
                message_id=message_id,
            )  # fmt: skip
            publisher.enqueue(message)

        measure(run, publish, work / "events.jsonl", pairs, timeout)
    finally:
        stop_worker(worker)
        publisher.close()
        with contextlib.suppress(Exception):
            connection = pika.BlockingConnection(pika.URLParameters(RABBIT_BROKER))
            channel = connection.channel()
            for suffix in ("", ".DQ", ".XQ"):
                channel.queue_delete(queue=queue + suffix)
            connection.close()
        drop_store_keys(prefix)
        shutil.rmtree(work, ignore_errors=True)
    return run


RUNNERS = {"celery": run_celery, "dramatiq": run_dramatiq}


# -- the report ------------------------------------------------------------------------------


def figures(run: Run, attr: str) -> str:
    values = [getattr(p, attr) for p in run.measured]
    if not values:
        return "— | —"
    return f"{statistics.median(values):.3f} | {max(values):.3f}"


def versions() -> str:
    import celery
    import dramatiq
    import redis

    client = redis.Redis.from_url(STORE)
    try:
        server = client.info("server")["redis_version"]
    finally:
        client.close()
    rabbit = "?"
    with contextlib.suppress(Exception):
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(RABBIT_BROKER))
        props = connection._impl.server_properties  # the server's own announcement
        rabbit = props.get("version", b"?")
        rabbit = rabbit.decode() if isinstance(rabbit, bytes) else str(rabbit)
        connection.close()
    return (
        f"Python {platform.python_version()}, Celery {celery.__version__}, Dramatiq "
        f"{dramatiq.__version__}, Redis {server}, RabbitMQ {rabbit}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="7355f89", help="revision of the old code (7355f89)")
    parser.add_argument("--after", default="HEAD", help="revision of the new code (HEAD)")
    parser.add_argument("--pairs", type=int, default=20, help="concurrent pairs per run (20)")
    parser.add_argument("--handler", type=float, default=0.018, help="handler seconds (0.018)")
    parser.add_argument("--frameworks", default="celery,dramatiq", help="celery,dramatiq")
    parser.add_argument("--timeout", type=float, default=60, help="s to settle one pair (60)")
    parser.add_argument("--write-docs", action="store_true", help="write docs/performance.md")
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    runs: dict[tuple[str, str], Run] = {}  # (framework, "before"/"after") -> run
    for side, rev in (("before", args.before), ("after", args.after)):
        with source(rev) as src:
            for framework in frameworks:
                run = RUNNERS[framework](src, args.pairs, args.handler, args.timeout)
                runs[(framework, side)] = run
                print(f"  {run.framework} {side} ({rev}): the worker imported {run.imported}")
    load_after = os.getloadavg()

    def label(side: str) -> str:
        src = next(r.source for (_, s), r in runs.items() if s == side)
        if not src.commit or src.commit.startswith(src.label):
            return src.label
        return f"{src.label} ({src.commit[:7]})"

    rows = [
        "| Framework | Before: completed → skipped, median / max s | After: median / max s | "
        "Before: publish → skipped, median / max s | After: median / max s | "
        "Pairs (before / after; not concurrent, left out) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for framework in frameworks:
        before, after = runs[(framework, "before")], runs[(framework, "after")]
        dropped = [len(r.pairs) - len(r.measured) for r in (before, after)]

        def pair_cell(left: str, right: str) -> str:
            return f"{left.replace(' | ', ' / ')} | {right.replace(' | ', ' / ')}"

        rows.append(
            f"| {before.framework} | "
            + pair_cell(figures(before, "from_completed"), figures(after, "from_completed"))
            + " | "
            + pair_cell(figures(before, "from_publish"), figures(after, "from_publish"))
            + f" | {len(before.measured)} / {len(after.measured)}; "
            f"{dropped[0]} / {dropped[1]} |"
        )
    table = "\n".join(rows)
    options = ["--before", args.before, "--after", args.after, "--pairs", str(args.pairs)]
    options += ["--handler", str(args.handler), "--frameworks", ",".join(frameworks)]
    if args.write_docs:
        options.append("--write-docs")
    command = "python bench/duplicate_latency.py " + shlex.join(options)
    print()
    print(f"before: {label('before')}; after: {label('after')}")
    print(table)
    print(f"command: {command}")
    if not args.write_docs:
        return 0

    from docs_section import command_lines, write_section  # bench/ is sys.path[0]

    load = (
        f"load average {' '.join(f'{x:.2f}' for x in load_before)} at the start, "
        f"{' '.join(f'{x:.2f}' for x in load_after)} at the end"
    )
    text = "\n".join(
        [
            HEADING,
            "",
            "A *concurrent duplicate* is a second delivery of a message id that arrives while the "
            "first still runs: the guard defers it (`in_progress_deferred`), the adapter "
            "publishes it again with the guard's delay, and when it comes back it finds the key "
            "completed and is skipped (`duplicate_skipped`). Before, the delay was what was left "
            "of the owner's lease or of its liveness window, whichever ended first: with the "
            "default lease (300 s) about 11 s, however short the first run. Now it is as long as "
            "the owner's claim has run so far, at least 0.25 s (`FIRST_RECHECK`), and never later "
            "than before, so the copy is looked at again at a doubling interval.",
            "",
            f"Through real workers, the handler taking {args.handler * 1000:.0f} ms, the default "
            "policy (eager, lease 300 s): Celery — `celery worker -P prefork -c 2` "
            "(`acks_late`), Redis broker, Redis store; Dramatiq — `dramatiq --processes 1 "
            "--threads 2`, RabbitMQ broker, Redis store. Each pair is a message and, published "
            "at once after it, a duplicate with the same id (Celery: `send_task` with the same "
            "`task_id`; Dramatiq: `broker.enqueue` of the same `Message`); the worker's two pool "
            "processes (threads) take them together. *Completed → skipped* runs from the first "
            "run's `completed` event to the duplicate's `duplicate_skipped` event (the events' "
            "`ts`, ms resolution); *publish → skipped* from the duplicate's publish to that "
            "event. A pair whose duplicate was skipped without a deferral (the first run had "
            "already ended) is not concurrent and is left out. "
            f"Before: {label('before')}; after: {label('after')} — each revision extracted with "
            "`git archive` and put first on the workers' `PYTHONPATH` as the `taskonce` "
            "package, ahead of the editable install, in the same venv and session.",
            "",
            table,
            "",
            "The after figures are the deferral (0.25 s for a run that has just begun) plus the "
            "broker's redelivery of a delayed message: Celery holds an ETA message in the "
            "worker and runs it on its timer; Dramatiq's consumer moves a delayed message back "
            "from its delay queue when it next looks at the delayed messages, which it does "
            "between reads of the broker, every `worker_timeout` when idle (1 s by default; the "
            "`dramatiq_worker_timeout` environment variable, in ms, sets it), so on an idle "
            "Dramatiq worker a copy deferred for less than that comes back about that much later. "
            "The before figures are the owner's liveness check (its 12 s window, counted from "
            "the owner's last liveness write), which came first with a 300 s lease.",
            "",
            *command_lines(command),
            f"Measured {started:%Y-%m-%d %H:%M} UTC on nproc {os.cpu_count()}, {versions()}; "
            f"{load}.",
            "",
        ]
    )
    write_section(text)
    print("written to docs/performance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
