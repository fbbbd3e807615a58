"""taskonce side by side with celery-once, celery-singleton and Powertools' idempotency.

The sixth guard, ``handwritten``, is what a user would write instead (:mod:`bench.handwritten`).

One real Celery worker (prefork, 2 processes) runs the same order task under each guard
(:mod:`bench.peers.app`); the comparison's own redis-servers are the broker and the store every
guard keeps its records in. Behaviour: each scenario is played once per guard and the body's
runs are counted in PostgreSQL. Speed: no-op tasks per second of each guard, plain Celery as
the baseline, rounds interleaved in one run; per message, the worker's CPU (``/proc/<pid>/stat``
of its processes), the producer's CPU (this process while it sends), and the store's work:
its ``INFO commandstats`` (commands, scripts, top-level usec) and its redis-server's CPU time
(:mod:`bench.harness`). ``--write-docs`` writes both tables' blocks in ``docs/comparison.md``.

Run: ``make compare`` (installs the peers from ``bench/peers/requirements.txt``), or
``.venv/bin/python -m bench.peers.compare [--rounds 3 --messages 300] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness import (  # noqa: E402
    PG_URL,
    RedisServer,
    StoreMeter,
    group_cpu,
    interleaved,
    loadavg,
    measured_line,
    table,
    wait_until,
    write_block,
)

PEERS = ("plain", "taskonce", "celery_once", "celery_singleton", "powertools", "handwritten")
NAMES = {
    "plain": "plain Celery (no guard)",
    "taskonce": "taskonce (eager, Redis store)",
    "celery_once": "celery-once",
    "celery_singleton": "celery-singleton",
    "powertools": "Powertools idempotency (Redis)",
    "handwritten": "hand-written SET NX PX",
    "one_trip": "plain Celery + one `DEL` after the body (yardstick)",
}
DOC = ROOT / "docs" / "comparison.md"
#: Seconds a scenario waits for a redelivery before it says "not run again".
REDELIVERY_WINDOW = 60.0


class Bench:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.prefix = f"peers{uuid.uuid4().hex[:8]}"
        self.broker = RedisServer(folder, "broker")
        self.locks = RedisServer(folder, "locks")
        self.table = f"{self.prefix}_runs"
        self.worker: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.broker.start()
        self.locks.start()
        os.environ.update(
            PEERS_BROKER=self.broker.url,
            PEERS_LOCKS=self.locks.url,
            PEERS_PG=PG_URL,
            PEERS_PREFIX=self.prefix,
        )
        self.pg = psycopg.connect(PG_URL, autocommit=True)
        self.pg.execute(
            f"CREATE TABLE {self.table} (id serial PRIMARY KEY, label text NOT NULL, "
            "pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        ready = self.folder / "ready"
        env = {**os.environ, "PEERS_READY": str(ready), "PYTHONPATH": str(ROOT)}
        with open(self.folder / "worker.log", "ab") as log:
            argv = [
                sys.executable, "-m", "celery", "-A", "bench.peers.app", "worker", "-P", "prefork",
                "-c", "2", "-Q", f"{self.prefix}.q", "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "WARNING",
            ]  # fmt: skip
            self.worker = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        wait_until(ready.exists, 120, "the worker to be ready")
        import bench.peers.app as app  # configured by the environment set above

        self.app = app
        self.tasks = {
            "plain": app.plain_order,
            "one_trip": app.one_trip_order,
            "taskonce": app.taskonce_order,
            "celery_once": app.once_order,
            "celery_singleton": app.singleton_order,
            "powertools": app.powertools_order,
            "handwritten": app.handwritten_order,
        }
        self.client = redis.Redis.from_url(self.broker.url)
        self.store = redis.Redis.from_url(self.locks.url)
        self.meter = StoreMeter(self.store, self.locks.pid)

    def stop(self) -> None:
        if self.worker is not None:
            with_suppress(lambda: os.killpg(self.worker.pid, signal.SIGKILL))  # type: ignore[union-attr]
            self.worker.wait(timeout=30)
        self.broker.kill()
        self.locks.kill()
        with_suppress(lambda: self.pg.execute(f"DROP TABLE IF EXISTS {self.table}"))

    # -- helpers ---------------------------------------------------------------------------

    def runs(self, label: str) -> list[tuple[int, float]]:
        rows = self.pg.execute(
            f"SELECT pid, extract(epoch from at) FROM {self.table} WHERE label = %s ORDER BY id",
            (label,),
        ).fetchall()
        return [(int(pid), float(at)) for pid, at in rows]

    def idle(self) -> bool:
        """The broker holds no message of ours: none queued, none delivered and unacknowledged."""
        queued = self.client.llen(f"{self.prefix}:{self.prefix}.q")
        return queued == 0 and self.client.hlen(f"{self.prefix}:unacked") == 0

    def settle(self, extra: float = 2.0) -> None:
        wait_until(self.idle, 120, "the broker to be idle")
        time.sleep(extra)  # a task still finishing its bookkeeping
        wait_until(self.idle, 120, "the broker to be idle")

    def send(self, peer: str, label: str, mode: str = "", task_id: str | None = None) -> Any:
        return self.tasks[peer].apply_async((self.table, label, mode), task_id=task_id)

    # -- behaviour -------------------------------------------------------------------------

    def same_id_twice(self, peer: str) -> str:
        label = f"{peer}-dup-{uuid.uuid4().hex[:6]}"
        task_id = str(uuid.uuid4())
        self.send(peer, label, task_id=task_id)
        wait_until(lambda: self.runs(label), 60, "the first run")
        self.settle()
        # the broker delivers the same message again (a redelivery, or the producer's retry)
        self.app.app.send_task(
            f"{peer}.order", args=(self.table, label, ""), task_id=task_id, queue=f"{self.prefix}.q"
        )
        self.settle()
        return f"{len(self.runs(label))}"

    def second_order(self, peer: str) -> str:
        label = f"{peer}-order-{uuid.uuid4().hex[:6]}"
        self.send(peer, label, "sleep")
        wait_until(lambda: self.runs(label), 60, "the first run")
        self.send(peer, label, "sleep")  # a second, legitimate order with the same arguments
        self.settle()
        return f"{len(self.runs(label))} of 2"

    def killed_mid_body(self, peer: str) -> str:
        label = f"{peer}-kill-{uuid.uuid4().hex[:6]}"
        self.send(peer, label, "hang_first")
        first = wait_until(lambda: self.runs(label), 60, "the first run")
        killed = time.time()
        os.kill(first[0][0], signal.SIGKILL)
        try:
            again = wait_until(
                lambda: len(self.runs(label)) >= 2 and self.runs(label), REDELIVERY_WINDOW, "rerun"
            )
        except TimeoutError:
            self.settle()
            return f"no (not within {REDELIVERY_WINDOW:.0f} s)"
        self.settle()
        return f"yes, after {again[1][1] - killed:.1f} s"

    def fails_once(self, peer: str) -> str:
        label = f"{peer}-retry-{uuid.uuid4().hex[:6]}"
        self.send(peer, label, "fail_first")
        wait_until(lambda: self.runs(label), 60, "the first run")
        self.settle(3.0)
        runs = len(self.runs(label))
        return f"{'yes' if runs >= 2 else 'no'} ({runs} run{'' if runs == 1 else 's'})"

    def send_then_crash(self, peer: str) -> str:
        label = f"{peer}-send-{uuid.uuid4().hex[:6]}"
        self.send(peer, label, "send_then_die")
        try:
            wait_until(lambda: len(self.runs(label)) >= 2, REDELIVERY_WINDOW, "the rerun")
        except TimeoutError:
            pass
        self.settle(3.0)
        return f"{len(self.runs(f'{label}-child'))} (body ran {len(self.runs(label))}×)"

    # -- speed -----------------------------------------------------------------------------

    def throughput(self, peer: str, messages: int) -> Speed:
        """One round of ``messages`` no-op tasks of ``peer``: sent to a fresh queue the worker
        does not consume, then drained by it (``add_consumer``) at its own pace. The rate is
        timed from the first completion to the last, not from ``add_consumer``: kombu's Redis
        transport adds the queue to its next BRPOP, and the one in flight on the old queues
        runs out its 1 s timeout first; that wait shrinks as the sends take longer, which made
        guards that lock at ``apply_async`` look faster than plain Celery."""
        assert self.worker is not None
        counter = f"r{uuid.uuid4().hex[:8]}"
        queue = f"{self.prefix}.speed.{counter}"
        store_before = self.meter.read()  # the store's work of the sends counts too
        producer_before, send_began = time.process_time(), time.perf_counter()
        mode = f"noop:{messages}"  # the body stamps the first and the last completion
        for i in range(messages):
            self.tasks[peer].apply_async((counter, f"{counter}-{i}", mode), queue=queue)
        producer = time.process_time() - producer_before
        send_s = time.perf_counter() - send_began
        key = f"{self.prefix}:{queue}"
        wait_until(lambda: self.client.llen(key) >= messages, 60, f"{peer}'s queue to fill")

        def drained() -> bool:
            return self.client.llen(key) == 0 and self.client.hlen(f"{self.prefix}:unacked") == 0

        done = f"{self.prefix}:done:{counter}"  # the body's completion count, and its stamps
        worker_before = group_cpu(self.worker.pid)
        started = time.perf_counter()
        self.app.app.control.add_consumer(queue, reply=False)
        wait_until(
            lambda: int(self.client.get(done) or 0) >= messages,
            300,
            f"{peer}'s round",
        )
        wait_until(drained, 120, "the last acknowledgements")  # completions come before them
        elapsed = time.perf_counter() - started
        first, last = (float(self.client.get(f"{done}:{end}") or 0) for end in ("first", "last"))
        worker = group_cpu(self.worker.pid) - worker_before
        work = self.meter.since(store_before)
        self.app.app.control.cancel_consumer(queue, reply=False)
        self.settle(0.5)
        return Speed(
            rate=(messages - 1) / (last - first),  # first to last completion, both in the worker
            wake_s=elapsed - (last - first),
            worker_us=worker / messages * 1e6,
            producer_us=producer / messages * 1e6,
            send_us=send_s / messages * 1e6,
            store_us=work.usec / messages,
            store_cpu_us=work.cpu_s / messages * 1e6,
            commands=work.commands / messages,
            scripts=work.scripts / messages,
            by_command={
                name: (calls / messages, spent / messages)
                for name, (calls, spent) in work.by_command.items()
            },
        )


@dataclasses.dataclass(frozen=True)
class Speed:
    """One throughput round of one guard; the ``_us`` figures are CPU µs per message."""

    rate: float  # tasks per second, first completion to last
    wake_s: float  # add_consumer to the first completion, plus the last acknowledgement
    worker_us: float  # the worker's processes (main and pool)
    producer_us: float  # this process while it sends (celery-once and singleton lock here)
    send_us: float  # wall time of the sends per message
    store_us: float  # the store's top-level commands by INFO commandstats usec
    store_cpu_us: float  # the store's redis-server process
    commands: float  # store commands per message (those scripts run included)
    scripts: float  # of which scripts (EVAL/EVALSHA)
    #: per command: (calls, commandstats usec) per message; a command a script ran counts its
    #: calls here and its time inside the script's
    by_command: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def with_suppress(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # clean-up of a bench: best effort
        pass


SCENARIOS = (
    ("same message delivered twice (same task id)", "same_id_twice", "body runs"),
    ("second order, same arguments, new id, while the first runs", "second_order", "orders run"),
    ("worker SIGKILLed mid-body (acks_late): runs again?", "killed_mid_body", ""),
    ("body fails once, then succeeds on retry: retried?", "fails_once", ""),
    ("body sends a child, then the worker dies: child runs", "send_then_crash", ""),
)


def speed_tables(speeds: dict[str, list[Speed]]) -> list[str]:
    """The speed table (medians of each guard's rounds, plain Celery as the baseline) and the
    store's commands per message by name."""

    def med(peer: str, field: str) -> float:
        return statistics.median(getattr(speed, field) for speed in speeds[peer])

    plain = "plain" in speeds
    rows = []

    def send_and_run(speed: Speed) -> float:
        return speed.send_us + 1e6 / speed.rate

    def times(value: float) -> str:
        return f"{value:.2f}×"

    def microseconds(value: float) -> str:
        return f"{value:+.0f}"

    def paired(
        peer: str, figure: Callable[[Speed, Speed], float], show: Callable[[float], str]
    ) -> str:
        """The median over rounds of ``figure(guard's round, plain's round)``, each guard's
        round set against plain Celery's round of the same pass (the machine's speed drifts
        between passes more than the guards differ), with the lowest and highest."""
        if not plain or peer == "plain":
            return "—"
        rounds = zip(speeds[peer], speeds["plain"], strict=True)
        values = sorted(figure(mine, base) for mine, base in rounds)
        middle = show(statistics.median(values))
        if len(values) < 3:
            return middle
        return f"{middle} ({show(values[0])} to {show(values[-1])})"

    for peer in speeds:
        whole = statistics.median(send_and_run(speed) for speed in speeds[peer])
        ratio = paired(peer, lambda mine, base: mine.rate / base.rate, times)
        whole_ratio = paired(
            peer, lambda mine, base: send_and_run(base) / send_and_run(mine), times
        )
        above = paired(peer, lambda mine, base: mine.worker_us - base.worker_us, microseconds)
        both = paired(
            peer,
            lambda mine, base: (
                mine.worker_us + mine.producer_us - (base.worker_us + base.producer_us)
            ),
            microseconds,
        )
        rows.append(
            [NAMES[peer], f"{med(peer, 'rate'):.0f}", ratio, f"{whole:.0f}", whole_ratio]
            + [f"{med(peer, 'worker_us'):.0f}", above, f"{med(peer, 'producer_us'):.0f}", both]
            + [f"{med(peer, f):.0f}" for f in ("store_us", "store_cpu_us")]
            + [f"{med(peer, f):.1f}" for f in ("commands", "scripts")]
        )
    commands = []
    for peer in speeds:
        names = {name for speed in speeds[peer] for name in speed.by_command}
        median = {
            name: (
                statistics.median(s.by_command.get(name, (0.0, 0.0))[0] for s in speeds[peer]),
                statistics.median(s.by_command.get(name, (0.0, 0.0))[1] for s in speeds[peer]),
            )
            for name in names
        }
        commands.append([NAMES[peer], by_command(median) or "none"])
    header = (
        "guard|tasks/s|vs plain|send + run µs|vs plain|worker CPU µs|above plain|producer CPU µs|"
        "producer + worker above plain|store µs (commandstats)|store process µs|store commands|"
        "of which scripts"
    )
    return [
        table(header.split("|"), rows, "l" + "r" * 12),
        "The store's commands per message, by name, with the `INFO commandstats` µs of each "
        "(medians of the rounds; a command a script runs shows its calls, its time is the "
        "script's):",
        table(["guard", "store commands per message"], commands),
    ]


def by_command(per_message: dict[str, tuple[float, float]]) -> str:
    """``EVALSHA 2 (41.0 µs), HMGET 2, …``: busiest first; below 0.01 per message left out."""
    items = sorted(per_message.items(), key=lambda item: (-item[1][1], -item[1][0]))
    return ", ".join(
        f"{name.upper()} {calls:.2g}" + (f" ({spent:.1f} µs)" if spent >= 0.05 else "")
        for name, (calls, spent) in items
        if calls >= 0.01
    )


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so the worker and the servers are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--skip-behaviour", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help=f"write {DOC.name}'s tables")
    args = parser.parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    folder = ROOT / "build" / "peers" / time.strftime("%Y%m%dT%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    bench = Bench(folder)
    command = ".venv/bin/python -m bench.peers.compare " + " ".join(argv or sys.argv[1:])
    load_start = loadavg()
    try:
        bench.start()
        behaviour: dict[str, dict[str, str]] = {}
        if not args.skip_behaviour:
            for peer in peers:
                behaviour[peer] = {}
                for title, method, _ in SCENARIOS:
                    behaviour[peer][title] = getattr(bench, method)(peer)
                    print(f"{NAMES[peer]}: {title}: {behaviour[peer][title]}", flush=True)
        # the one-round-trip yardstick runs in the speed rounds only (its behaviour is plain's)
        timed = [*peers, "one_trip"] if "plain" in peers else peers
        speeds: dict[str, list[Speed]] = {p: [] for p in timed}
        for peer in timed:  # warm-up round, not counted
            bench.throughput(peer, min(50, args.messages))
        for round_no, peer in interleaved(args.rounds, timed):
            speeds[peer].append(bench.throughput(peer, args.messages))
            print(f"round {round_no + 1} {NAMES[peer]}: {speeds[peer][-1]}", flush=True)
    finally:
        bench.stop()
    blocks = {}
    if behaviour:
        rows = [[title, *(behaviour[p][title] for p in peers)] for title, _, _ in SCENARIOS]
        blocks["peers-behaviour"] = table(["scenario", *(NAMES[p] for p in peers)], rows)
    blocks["peers-speed"] = "\n\n".join(
        [
            f"{args.messages} tasks per round, {args.rounds} rounds of each guard.",
            *speed_tables(speeds),
            measured_line(command, load_start),
        ]
    )
    print("\n\n".join(blocks.values()))
    if args.write_docs:
        for name, text in blocks.items():
            write_block(name, text, DOC)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
