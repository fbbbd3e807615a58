"""Worker CPU per message: no guard, taskonce, and the guard a user would write by hand.

No-op messages through real workers on a Redis broker, each guard keeping its records on a
Redis store; the broker and the store are this run's own redis-servers (free ports), so the
store's figures are its guard's alone. Variants, rounds interleaved (order reversed every
other round) so machine noise hits them alike:

- ``plain``: no guard;
- ``taskonce``: ``IdempotencyMiddleware`` / ``IdempotentTask``, eager, Redis store;
- ``hand-written``: :mod:`bench.handwritten`: ``SET key NX PX`` before the body, ``SET key
  done PX`` after it (no fencing, no events).

Dramatiq: one in-process ``dramatiq.Worker`` per round with 1, 2 and 8 threads, all messages
enqueued before it starts; its CPU is this process's ``getrusage`` over the round. Celery: one
``celery worker -P prefork -c N`` per pool size; each round fills a fresh queue, then
``add_consumer``s it; its CPU is the sum of ``/proc/<pid>/stat`` utime + stime of the worker's
processes over the round. A round is timed until the last message is acknowledged.

Store-server CPU per message: the store's redis-server's ``INFO commandstats`` usec (top-level
commands; a script's includes the commands it runs, counted once) and its process's CPU time
(``/proc``), divided by the round's messages.

    .venv/bin/python bench/worker_cpu.py [--messages 2000] [--rounds 3] [--threads 1,2,8]
        [--concurrency 2,1] [--frameworks dramatiq,celery] [--write-docs]

This file is also the Celery worker's app module (``celery -A worker_cpu``), configured by the
``WCPU_*`` environment variables the benchmark sets.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "bench")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import redis  # noqa: E402
from celery import Celery, signals  # noqa: E402

import taskonce  # noqa: E402
from bench.handwritten import celery_base  # noqa: E402
from taskonce.celery_ext import IdempotentTask, setup  # noqa: E402

HEADING = "## Worker CPU per message"
VARIANTS = ("plain", "taskonce", "hand-written")
ENV = os.environ
PREFIX = ENV.get("WCPU_PREFIX", "wcpu")

# -- the Celery worker's app (celery -A worker_cpu) -----------------------------------------

app = Celery("worker_cpu", broker=ENV.get("WCPU_BROKER", "memory://"), set_as_current=False)
app.conf.update(
    broker_transport_options={"global_keyprefix": f"{PREFIX}:"},
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    worker_disable_rate_limits=True,
    task_default_queue=f"{PREFIX}.idle",
    worker_prefetch_multiplier=4,
)
if ENV.get("WCPU_WORKER"):
    setup(app, taskonce.Guard(taskonce.open_store(ENV["WCPU_STORE"], prefix=f"{PREFIX}-to")))
_Handwritten = celery_base(ENV.get("WCPU_STORE", "redis://127.0.0.1:6379/0"), f"{PREFIX}-hand")


@app.task(name="wcpu.plain", acks_late=True, shared=False)
def plain() -> None:
    """A no-op."""


@app.task(name="wcpu.taskonce", base=IdempotentTask, acks_late=True, shared=False)
def guarded() -> None:
    """The same no-op under taskonce (eager: one claim and one completion per message)."""


@app.task(name="wcpu.hand-written", base=_Handwritten, acks_late=True, shared=False)
def handwritten() -> None:
    """The same no-op under the hand-written SET NX PX / SET PX guard."""


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = ENV.get("WCPU_READY")
    if path:
        Path(path).write_text(str(os.getpid()))


# -- measurement ------------------------------------------------------------------------------


class Result:
    """One round of one variant."""

    def __init__(
        self,
        rate: float,
        cpu_us: float,
        store_us: float,
        store_cpu_us: float,
        pool_us: float | None = None,
    ) -> None:
        self.rate = rate
        self.cpu_us = cpu_us  # the whole worker: its main process and its pool processes
        self.store_us = store_us
        self.store_cpu_us = store_cpu_us
        self.pool_us = pool_us  # Celery: the pool processes alone (they run the guard)


def _rusage_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def dramatiq_round(
    variant: str, broker_url: str, store_url: str, meter: Any, messages: int, threads: int
) -> Result:
    """One in-process Dramatiq worker with ``threads`` threads draining ``messages`` no-ops."""
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    from bench.handwritten import dramatiq_middleware
    from taskonce.dramatiq_ext import IdempotencyMiddleware

    namespace = f"wcpu-{uuid.uuid4().hex[:8]}"
    broker = RedisBroker(url=broker_url, namespace=namespace)
    guard: taskonce.Guard | None = None
    if variant == "taskonce":
        guard = taskonce.Guard(taskonce.open_store(store_url, prefix=namespace))
        broker.add_middleware(IdempotencyMiddleware(guard))
    elif variant == "hand-written":
        broker.add_middleware(dramatiq_middleware(store_url, namespace))
    done = threading.Event()
    acked = [0]
    lock = threading.Lock()

    class Count(dramatiq.Middleware):  # type: ignore[misc]
        def after_ack(self, broker: Any, message: Any) -> None:
            with lock:
                acked[0] += 1
                if acked[0] >= messages:
                    done.set()

    broker.add_middleware(Count())

    @dramatiq.actor(broker=broker, queue_name="wcpu", max_retries=0)
    def noop(i: int) -> None:
        return None

    for i in range(messages):
        noop.send(i)
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    store_before = meter.read()
    began, cpu_began = time.perf_counter(), _rusage_s()
    worker.start()
    if not done.wait(timeout=600):
        raise RuntimeError(f"{variant}: only {acked[0]}/{messages} acknowledged")
    elapsed, cpu = time.perf_counter() - began, _rusage_s() - cpu_began
    work = meter.since(store_before)
    worker.stop()
    if guard is not None:
        written = int(guard.store.stats()["keys"])
        guard.close()
        if written != messages:
            raise RuntimeError(f"taskonce wrote {written} records for {messages} messages")
    _clean(redis.Redis.from_url(broker_url), namespace)
    _clean(meter.client, namespace)
    broker.close()
    return Result(
        messages / elapsed,
        cpu / messages * 1e6,
        work.usec / messages,
        work.cpu_s / messages * 1e6,
    )


def _clean(client: Any, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 1000):
        client.delete(*keys[start : start + 1000])


class CeleryWorker:
    """``celery -A worker_cpu worker -P prefork -c N`` in its own session."""

    def __init__(self, broker_url: str, store_url: str, pool: int, folder: Path) -> None:
        self.prefix = f"wcpu{uuid.uuid4().hex[:8]}"
        self.broker_url = broker_url
        ready = folder / f"{self.prefix}.ready"
        env = {
            **ENV,
            "WCPU_WORKER": "1",
            "WCPU_PREFIX": self.prefix,
            "WCPU_BROKER": broker_url,
            "WCPU_STORE": store_url,
            "WCPU_READY": str(ready),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
        }
        command = [
            sys.executable, "-m", "celery", "-A", "worker_cpu", "worker", "-P", "prefork",
            "-c", str(pool), "-Q", f"{self.prefix}.idle", "-n", f"{self.prefix}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
        ]  # fmt: skip
        with open(folder / f"celery-c{pool}.log", "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the Celery worker did not start; see {folder}")
            time.sleep(0.05)
        self.publisher = Celery(f"wcpu-pub-{self.prefix}", broker=broker_url, set_as_current=False)
        self.publisher.conf.update(
            broker_transport_options={"global_keyprefix": f"{self.prefix}:"},
            broker_connection_retry_on_startup=True,
            task_ignore_result=True,
        )
        self.client = redis.Redis.from_url(broker_url)

    def round(self, variant: str, meter: Any, messages: int) -> Result:
        queue = f"{self.prefix}.{variant}.{uuid.uuid4().hex[:6]}"
        with self.publisher.producer_or_acquire() as producer:
            for _ in range(messages):
                self.publisher.send_task(f"wcpu.{variant}", queue=queue, producer=producer)
        key = f"{self.prefix}:{queue}"
        if self.client.llen(key) != messages:
            raise RuntimeError("the queue was not filled")
        store_before = meter.read()
        main_began, pool_began = _group_cpu(self.process.pid)
        began = time.perf_counter()
        self.publisher.control.add_consumer(queue, reply=False)
        deadline = time.monotonic() + 600
        while self.client.llen(key) or self.client.zcard(f"{self.prefix}:unacked_index"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: the worker did not drain its queue")
            time.sleep(0.01)
        elapsed = time.perf_counter() - began
        main_ended, pool_ended = _group_cpu(self.process.pid)
        work = meter.since(store_before)
        self.publisher.control.cancel_consumer(queue, reply=False)
        pool = pool_ended - pool_began
        return Result(
            messages / elapsed,
            (main_ended - main_began + pool) / messages * 1e6,
            work.usec / messages,
            work.cpu_s / messages * 1e6,
            pool / messages * 1e6,
        )

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=15)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        if hasattr(self, "publisher"):
            self.publisher.close()
            _clean(self.client, self.prefix)


def _group_cpu(pgid: int) -> tuple[float, float]:
    from bench.cpu_meter import group_cpu_split

    return group_cpu_split(pgid)


# -- the report -------------------------------------------------------------------------------


def _paired(
    mine: list[Result], other: list[Result], figure: Callable[[Result, Result], float]
) -> float:
    """The median over rounds of ``figure(mine's round, other's round)``: each round set
    against the other variant's round of the same pass, since the machine's speed drifts
    between passes more than the variants differ."""
    return statistics.median(figure(a, b) for a, b in zip(mine, other, strict=True))


def _rate_ratio(mine: Result, other: Result) -> float:
    return mine.rate / other.rate


def _cpu_above(mine: Result, other: Result) -> float:
    return mine.cpu_us - other.cpu_us


def _pool_above(mine: Result, other: Result) -> float:
    return (mine.pool_us or 0.0) - (other.pool_us or 0.0)


def render(
    results: dict[tuple[str, int, str], list[Result]],
    args: argparse.Namespace,
    command: str,
    load: tuple[str, str],
) -> str:
    from bench.docs_section import command_lines

    lines = [
        HEADING,
        "",
        f"No-op messages, {args.messages} per round, {args.rounds} rounds of each variant "
        "interleaved in one run (order reversed every other round); medians of the rounds. "
        "*vs plain*, *CPU above plain* and *of which pool* set each round against plain's "
        "round of the same pass and give the median of those ratios or differences (the "
        "machine's speed drifts between passes more than the variants differ); the verdicts "
        "below set taskonce against the hand-written guard the same way. Broker and store "
        "are the run's own redis-servers on loopback; taskonce is eager on the Redis store. "
        "*hand-written* is `bench/handwritten.py`: `SET key NX PX` before the body and "
        "`SET key done PX` after it, no fencing, no events — what a user would write instead. "
        "Dramatiq: one in-process `dramatiq.Worker` per round (all messages enqueued before it "
        "starts), its CPU the process's `getrusage` user + system time over the round. Celery: "
        "one `celery worker -P prefork -c N` (`acks_late=True`, prefetch 4) per pool size; "
        "each round fills a fresh queue, then `add_consumer`s it; its CPU the sum of "
        "`/proc/<pid>/stat` utime + stime of the worker's main and pool processes over the "
        "round; *of which pool*: the part of *CPU above plain* spent in the pool processes, "
        "where the guard runs (the rest is the main process's: consuming, handing messages "
        "to the pool, acknowledging). "
        "*Store µs/msg*: the store's `INFO commandstats` usec of top-level commands "
        "(a Lua script's includes the commands it runs, counted once) per message; *store "
        "process µs/msg*: the redis-server's own CPU time (`/proc`), network I/O included. "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({platform.machine()}); "
        f"load average {load[0]} at the start, {load[1]} at the end.",
        "",
        "| framework | workers | variant | tasks/s | vs plain | worker CPU µs/msg "
        "| CPU above plain | of which pool | store µs/msg (commandstats) "
        "| store process µs/msg |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    verdicts = []
    for framework, size in dict.fromkeys((f, s) for f, s, _ in results):
        rows = {
            v: results[(framework, size, v)] for v in VARIANTS if (framework, size, v) in results
        }
        med = {
            v: {
                field: statistics.median(getattr(r, field) or 0.0 for r in rs)
                for field in ("rate", "cpu_us", "store_us", "store_cpu_us", "pool_us")
            }
            for v, rs in rows.items()
        }
        label = (
            f"{size} thread{'s' if size > 1 else ''}" if framework == "Dramatiq" else f"-c {size}"
        )
        for variant, m in med.items():
            ratio, above, pool = "—", "—", "—"
            if variant != "plain":
                ratio = f"{_paired(rows[variant], rows['plain'], _rate_ratio):.2f}×"
                above = f"{_paired(rows[variant], rows['plain'], _cpu_above):+,.0f}"
                if framework == "Celery":
                    pool = f"{_paired(rows[variant], rows['plain'], _pool_above):+,.0f}"
            lines.append(
                f"| {framework} | {label} | {variant} | {m['rate']:,.0f} | {ratio} "
                f"| {m['cpu_us']:,.0f} | {above} | {pool} "
                f"| {m['store_us']:,.0f} | {m['store_cpu_us']:,.0f} |"
            )
        cpu = _paired(rows["taskonce"], rows["plain"], _cpu_above)
        beside_hand = _paired(rows["taskonce"], rows["hand-written"], _rate_ratio)
        verdicts.append(
            f"{framework} {label}: taskonce {cpu:+,.0f} µs above plain "
            f"({'met' if cpu <= 200 else 'missed'}), {beside_hand:.2f}× the "
            f"hand-written rate ({'met' if beside_hand >= 1 else 'missed'})"
        )
    lines += [
        "",
        "Against the aims (taskonce's worker CPU at most 200 µs per message above plain; "
        "taskonce at least as fast as the hand-written guard): " + "; ".join(verdicts) + ".",
        "",
        *command_lines(command),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.chaos.soak import RedisServer

    from bench.cpu_meter import StoreMeter
    from bench.docs_section import DOC, write_section

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each variant")
    parser.add_argument("--threads", default="1,2,8", help="Dramatiq worker threads")
    parser.add_argument("--concurrency", default="2,1", help="Celery prefork pool sizes")
    parser.add_argument("--frameworks", default="dramatiq,celery")
    parser.add_argument("--write-docs", action="store_true", help=f"write {HEADING!r}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dramatiq").setLevel(logging.ERROR)
    frameworks = [f for f in args.frameworks.split(",") if f]
    command = shlex.join([".venv/bin/python", "bench/worker_cpu.py", *sys.argv[1:]])
    folder = ROOT / "build" / "worker_cpu" / time.strftime("%Y%m%dT%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    broker, store = RedisServer(folder, "broker"), RedisServer(folder, "store")
    results: dict[tuple[str, int, str], list[Result]] = {}
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    workers: list[CeleryWorker] = []
    try:
        broker.start()
        store.start()
        assert store.process is not None
        meter = StoreMeter(redis.Redis.from_url(store.url), store.process.pid)

        def record(framework: str, size: int, variant: str, result: Result) -> None:
            results.setdefault((framework, size, variant), []).append(result)
            print(
                f"{framework} {size}: {variant:<12} {result.rate:7,.0f}/s  worker "
                f"{result.cpu_us:6,.0f} µs/msg (pool {result.pool_us or 0:6,.0f})  store "
                f"{result.store_us:5,.0f} µs/msg (process {result.store_cpu_us:5,.0f})",
                flush=True,
            )

        if "dramatiq" in frameworks:
            sizes = [int(t) for t in args.threads.split(",") if t]
            for size in sizes:  # warm-up, not counted: imports, scripts loaded
                for variant in VARIANTS:
                    dramatiq_round(variant, broker.url, store.url, meter, 200, size)
            for round_no in range(args.rounds):
                order = VARIANTS if round_no % 2 == 0 else tuple(reversed(VARIANTS))
                for size in sizes:
                    for variant in order:
                        result = dramatiq_round(
                            variant, broker.url, store.url, meter, args.messages, size
                        )
                        record("Dramatiq", size, variant, result)
        if "celery" in frameworks:
            pools = [int(c) for c in args.concurrency.split(",") if c]
            workers = [CeleryWorker(broker.url, store.url, pool, folder) for pool in pools]
            for worker in workers:
                for variant in VARIANTS:
                    worker.round(variant, meter, 200)
            for round_no in range(args.rounds):
                order = VARIANTS if round_no % 2 == 0 else tuple(reversed(VARIANTS))
                for pool, worker in zip(pools, workers, strict=True):
                    for variant in order:
                        record("Celery", pool, variant, worker.round(variant, meter, args.messages))
    finally:
        for worker in workers:
            worker.stop()
        broker.kill()
        store.kill()
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    section = render(results, args, command, (load_start, load_end))
    print()
    print(section)
    if args.write_docs:
        write_section(section, DOC)
        print(f"written to {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
