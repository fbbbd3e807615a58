"""The chaos soak: messages through real workers while faults are injected, then a ledger check.

One run = one framework (Celery or Dramatiq), two workers of two processes each, the run's own
redis-server as the broker (appendonly), the store (a PostgreSQL table, or the run's own
redis-server, appendonly) and two PostgreSQL tables: *runs* (one row per body start) and the
*ledger* (one row per body effect). The controller publishes ``--messages`` messages evenly
over ``--seconds`` seconds and meanwhile injects a random fault every 1–3 s:

``kill_child``     SIGKILL a worker process that just started a body (mid-body)
``kill_worker``    SIGKILL a whole worker (its process group) and start a new one
``republish``      publish 1–5 already-sent messages again, with the same ids
``stop_child``     SIGSTOP a process mid-body past the lease and the liveness window, publish
                   its message again meanwhile (the copy takes its claim over), then SIGCONT
``store_stop``     SIGSTOP the store's redis-server past the lease, then SIGCONT
``store_kill``     SIGKILL the store's redis-server and start it again on its files
``pg_terminate``   ``pg_terminate_backend`` every PostgreSQL backend of this run's workers
                   (only backends whose application_name is this run's)
``broker_restart`` restart the broker's redis-server (SIGTERM, start again on its files)

Then it stops injecting, resumes whatever it paused, waits until every key has its ledger
rows and the broker holds no message (the *drain*), and checks the ledger key by key:

- transactional store: exactly one ledger row per key (and per child, with ``--handoff``);
- Redis store (not transactional): none lost, and a key with a second row only where a fault
  hit it mid-body, each such key explained by its events or by a fault on its process.

A parent the broker lost is published again by the soak, as a producer would. A child
(``--handoff``) never is: delivering it is taskonce's job once its parent's outcome is recorded,
and the run fails if its receipts do not repair a child the broker lost
(:mod:`tools.soak.children` counts what they did).

Output: a run folder (``events.jsonl``, ``faults.jsonl``, the workers' logs, ``report.json``)
and one summary line. Exit status 0 only if the promise held.

Run: ``.venv/bin/python -m tools.soak.soak --framework celery --store postgresql``
(``make chaos`` runs the long runs). Every server the soak stops is its own, stopped by pid;
the shared PostgreSQL is touched only through this run's own tables and backends.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import random
import shutil
import signal
import socket
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

from taskonce.handoff import derive_id  # noqa: E402
from taskonce.keys import make_key  # noqa: E402
from taskonce.worker import LIVENESS_WINDOW  # noqa: E402
from tools.soak.children import account, grace  # noqa: E402
from tools.soak.common import Config, create_tables, drop_tables  # noqa: E402
from tools.soak.verdict import judge, lost_by_broker  # noqa: E402

PG_URL = os.environ.get("TASKONCE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
FAULTS = (
    "kill_child",
    "kill_worker",
    "republish",
    "stop_child",
    "store_stop",
    "store_kill",
    "pg_terminate",
    "broker_restart",
)
REDIS_STORE_ONLY = ("store_stop", "store_kill")
#: Seconds without progress (ledger rows, broker messages, guard events) while the broker
#: still holds messages, after which the drain restarts the workers.
STALL = 45.0
#: Seconds between two samples of the broker's backlog and the ledger's rows (report.json).
SAMPLE_EVERY = 5.0
#: Events that say a parent's deferred sends (its child) were published: the broker took them.
DISPATCH_EVENTS = frozenset({"sends_dispatched", "sends_redispatched"})


def psycopg_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class RedisServer:
    """The run's own redis-server on a free port, appendonly in its own folder; stopped,
    paused and killed only by its pid."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        command = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--daemonize", "no", "--logfile", str(self.folder / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            wait_until(answers, 30, f"{self.name} redis-server on port {self.port}")
        finally:
            client.close()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if self.process is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def terminate(self) -> None:
        if self.process is not None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


class WorkerGroup:
    """One worker (a main process and its pool processes) in its own process group."""

    def __init__(self, framework: str, index: int, folder: Path, env: dict[str, str]) -> None:
        self.framework = framework
        self.index = index
        self.folder = folder
        self.env = env
        self.generation = 0
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.generation += 1
        log = self.folder / f"worker-{self.framework}-{self.index}-{self.generation}.log"
        if self.framework == "celery":
            name = f"chaos{self.index}g{self.generation}-{uuid.uuid4().hex[:4]}@%h"
            command = [
                sys.executable, "-m", "celery", "-A", "tools.soak.celery_app", "worker",
                "-P", "prefork", "-c", "2", "-n", name, "--without-gossip",
                "--without-mingle", "--without-heartbeat", "-l", "INFO",
            ]  # fmt: skip
        else:
            command = [
                sys.executable, "-m", "dramatiq", "tools.soak.dramatiq_app",
                "--processes", "2", "--threads", "1", "--path", str(ROOT),
            ]  # fmt: skip
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self) -> bool:
        """Whether the current generation logged that it consumes (Celery: ``ready.``;
        Dramatiq: both processes ``ready for action``)."""
        log = self.folder / f"worker-{self.framework}-{self.index}-{self.generation}.log"
        try:
            text = log.read_text(errors="replace")
        except FileNotFoundError:
            return False
        if self.framework == "celery":
            return " ready." in text
        return text.count("ready for action") >= 2

    def children(self) -> list[int]:
        """The pids of this worker's processes below its main one (pool processes)."""
        if not self.alive():
            return []
        assert self.process is not None
        return _descendants(self.process.pid)

    def kill(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGCONT)
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGCONT)
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=15)
        self.kill()  # whatever is left of the group, even when the main process exited


def _ready_or_dead(worker: WorkerGroup) -> bool:
    if not worker.alive():
        raise RuntimeError(f"worker {worker.index} exited at start; see its log in {worker.folder}")
    return worker.ready()


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parents[int(fields[1])].append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Publisher:
    """Publishes ``pay(key)`` with a given message id; raises when the broker is down."""

    def __init__(self, framework: str, config: Config) -> None:
        self.framework = framework
        self.config = config
        if framework == "celery":
            from celery import Celery

            self.app = Celery("chaos-publisher", broker=config.broker, set_as_current=False)
            self.app.conf.update(
                broker_connection_timeout=2,
                broker_transport_options={"visibility_timeout": 20},
            )
        else:
            from dramatiq.brokers.redis import RedisBroker

            self.broker = RedisBroker(  # type: ignore[no-untyped-call]
                url=config.broker,
                namespace=f"{config.namespace}-dq",
                socket_timeout=2,
                socket_connect_timeout=2,
            )
            self.broker.declare_queue(config.namespace)
            self.broker.declare_queue(config.child_queue)

    def publish(self, key: str, message_id: str, kind: str = "parent") -> None:
        """Publish ``pay(key)`` (``kind`` "parent") or ``child(key)`` (``kind`` "child", as
        the hand-off would: same queue, same id)."""
        actor = "pay" if kind == "parent" else "child"
        queue = self.config.namespace if kind == "parent" else self.config.child_queue
        if self.framework == "celery":
            self.app.send_task(
                f"chaos.{actor}",
                args=[key],
                task_id=message_id,
                queue=queue,
                retry=False,
            )
            return
        import dramatiq

        self.broker.enqueue(
            dramatiq.Message(
                queue_name=queue,
                actor_name=actor,
                args=(key,),
                kwargs={},
                options={},
                message_id=message_id,
                message_timestamp=int(time.time() * 1000),
            )
        )

    def in_flight(self, client: redis.Redis) -> int:
        """Messages the broker still holds: queued, delayed, or delivered but not acknowledged."""
        total = 0
        if self.framework == "celery":
            for name in client.scan_iter(match=f"{self.config.namespace}*"):
                if client.type(name) == b"list":
                    total += int(client.llen(name))
            return total + int(client.hlen("unacked"))
        for name in client.scan_iter(match=f"{self.config.namespace}-dq:*.msgs"):
            if b".XQ." not in name:
                total += int(client.hlen(name))
        return total

    def dead_lettered(self, client: redis.Redis) -> int:
        if self.framework == "celery":
            return 0
        return sum(
            int(client.hlen(name))
            for name in client.scan_iter(match=f"{self.config.namespace}-dq:*.XQ.msgs")
        )

    def close(self) -> None:
        if self.framework == "celery":
            self.app.close()
        else:
            self.broker.close()


@dataclasses.dataclass
class Options:
    framework: str = "celery"
    store: str = "postgresql"  # "postgresql" (transactional) | "redis" (not transactional)
    mode: str = "eager"
    handoff: bool = False
    messages: int = 2000
    seconds: float = 120.0
    drain_timeout: float = 600.0
    out: Path = ROOT / "build" / "chaos"
    faults: tuple[str, ...] = FAULTS
    seed: int | None = None
    lease: float = 8.0
    body: float = 0.15
    keep: bool = False  # keep the PostgreSQL tables (for inspection)
    #: hand-off: seconds after a child's publish its receipt is looked for (Policy)
    confirm_within: float = 10.0
    #: seconds between two sweeps of each worker's relay
    relay_every: float = 5.0

    @property
    def variant(self) -> str:
        store = "pg-tx" if self.store == "postgresql" else "redis"
        return f"{self.framework}-{store}-{self.mode}{'-handoff' if self.handoff else ''}"


class Soak:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.seed = options.seed if options.seed is not None else random.randrange(2**32)
        self.random = random.Random(self.seed)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        self.run_id = uuid.uuid4().hex[:8]
        self.folder = options.out / f"{stamp}-{options.variant}-{self.run_id}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.app_name = f"taskonce-chaos-{self.run_id}"
        self.faults_file = open(self.folder / "faults.jsonl", "a")
        self.broker = RedisServer(self.folder, "broker")
        self.store_server = RedisServer(self.folder, "store") if options.store == "redis" else None
        namespace = f"chaos_{self.run_id}"
        pg = f"{PG_URL}?application_name={self.app_name}"
        self.config = Config(
            broker="",
            store="",
            namespace=namespace,
            ledger=f"{namespace}_ledger",
            runs=f"{namespace}_runs",
            pg=pg,
            events=str(self.folder / "events.jsonl"),
            mode=options.mode,
            transactional=options.store == "postgresql",
            handoff=options.handoff,
            lease=options.lease,
            body=options.body,
            confirm_within=options.confirm_within if options.handoff else 0.0,
            relay_every=options.relay_every,
        )
        #: seconds a missing child may wait for taskonce's receipts to repair it
        self.child_grace = grace(options.confirm_within, options.relay_every)
        self.pg = psycopg.connect(psycopg_url(PG_URL), autocommit=True)
        self.workers: list[WorkerGroup] = []
        self.sent: dict[str, str] = {}  # key -> message id
        self.fault_counts: collections.Counter[str] = collections.Counter()
        #: pids a fault hit while they ran a body (killed or paused)
        self.victims: dict[int, str] = {}
        #: (monotonic time, action, what) to do later: SIGCONT of paused processes
        self.scheduled: list[tuple[float, Callable[[], None], str]] = []
        self.paused_store = False
        self.started = time.monotonic()
        #: keys the broker or framework lost (never delivered to a guarded handler)
        self.broker_lost: list[str] = []
        #: keys whose child its guard had claimed, but whose retry or redelivery the framework
        #: lost: published again by the soak, as a parent
        self.child_retries_lost: list[str] = []
        #: keys whose parent has its row but whose child has none, the broker empty: since when
        self.child_missing_since: dict[str, float] = {}
        #: times the drain restarted the workers to free messages stuck with a live consumer
        self.drain_restarts = 0
        #: (seconds since the start, messages the broker holds, ledger rows) every few seconds
        #: while faults are injected: whether the workers keep up with the rate
        self.samples: list[tuple[float, int, int]] = []
        self.next_sample = 0.0

    # -- logging ---------------------------------------------------------------------------

    def log_fault(self, kind: str, **detail: Any) -> None:
        record = {"ts": now_iso(), "t": round(time.monotonic() - self.started, 3), "kind": kind}
        record.update(detail)
        self.faults_file.write(json.dumps(record) + "\n")
        self.faults_file.flush()
        if kind in FAULTS:
            self.fault_counts[kind] += 1

    # -- set-up and tear-down --------------------------------------------------------------

    def setup(self) -> None:
        self.broker.start()
        self.config.broker = self.broker.url
        if self.store_server is not None:
            self.store_server.start()
            self.config.store = self.store_server.url
        else:
            self.config.store = (
                f"{PG_URL.replace('postgresql://', 'postgresql+psycopg://')}"
                f"?application_name={self.app_name}"
            )
        create_tables(self.pg, self.config)
        env = {**os.environ, **self.config.to_env(), "PYTHONPATH": str(ROOT)}
        env.pop("TASKONCE_WORKER_ID", None)
        for index in range(2):
            worker = WorkerGroup(self.options.framework, index, self.folder, env)
            worker.start()
            self.workers.append(worker)
        self.publisher = Publisher(self.options.framework, self.config)
        self.broker_client = redis.Redis.from_url(self.broker.url, socket_timeout=5)
        for worker in self.workers:
            wait_until(functools.partial(_ready_or_dead, worker), 120, f"worker {worker.index}")

    def teardown(self) -> None:
        for worker in self.workers:
            worker.stop()
        with contextlib.suppress(Exception):
            self.publisher.close()
        with contextlib.suppress(Exception):
            self.broker_client.close()
        self.broker.kill()
        if self.store_server is not None:
            self.store_server.kill()
        if not self.options.keep:
            drop_tables(self.pg, self.config)
            if self.store_server is None:
                for table in (self.config.namespace, f"{self.config.namespace}_live"):
                    self.pg.execute(f"DROP TABLE IF EXISTS {table}")
        self.pg.close()
        self.faults_file.close()

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        options = self.options
        try:
            self.setup()  # inside: a worker that fails to start leaves no server running
            keys = [f"k{i:06d}" for i in range(options.messages)]
            pending = list(keys)
            begin = time.monotonic()
            self.started = begin
            interval = options.seconds / max(len(keys), 1)
            next_fault = begin + self.random.uniform(1, 3)
            allowed = [
                kind
                for kind in options.faults
                if self.store_server is not None or kind not in REDIS_STORE_ONLY
            ]
            while True:
                now = time.monotonic()
                injecting = now - begin < options.seconds
                due = min(len(keys), int((now - begin) / interval) + 1) if interval else len(keys)
                while pending and len(keys) - len(pending) < due:
                    key = pending[0]
                    if not self._publish(key, self.sent.get(key) or str(uuid.uuid4())):
                        break
                    pending.pop(0)
                self._run_scheduled(now)
                if injecting and now >= self.next_sample:
                    self._sample(now - begin)
                    self.next_sample = now + SAMPLE_EVERY
                self._supervise()
                if injecting and allowed and now >= next_fault:
                    self._inject(self.random.choice(allowed))
                    next_fault = time.monotonic() + self.random.uniform(1, 3)
                if not injecting and not pending:
                    break
                time.sleep(0.01)
            injection_end = time.monotonic()
            self._resume_everything()
            drained, drain_error = self._drain(options.drain_timeout)
            drain_s = time.monotonic() - injection_end
            return self._verdict(drained, drain_error, drain_s, injection_end - begin)
        finally:
            self.teardown()

    def _publish(self, key: str, message_id: str, kind: str = "parent") -> bool:
        try:
            self.publisher.publish(key, message_id, kind)
        except Exception as exc:  # the broker is being restarted: try again next tick
            if kind == "parent":
                self.sent.setdefault(key, message_id)
            self.log_fault(
                "publish_failed", key=key, task=kind, error=f"{type(exc).__name__}: {exc}"
            )
            return False
        if kind == "parent":
            self.sent[key] = message_id
        return True

    def _sample(self, elapsed: float) -> None:
        try:
            in_flight = self.publisher.in_flight(self.broker_client)
            rows = self.pg.execute(f"SELECT count(*) FROM {self.config.ledger}").fetchone()
        except (psycopg.Error, redis.RedisError):
            return  # the broker is restarting: the next sample
        self.samples.append((round(elapsed, 1), in_flight, int(rows[0]) if rows else 0))

    def _throughput(self) -> dict[str, Any]:
        """What the samples say about the rate: the bodies the workers completed a second over
        the second half of the injection (steady state), the messages the broker held at its
        end and at most. A backlog that grows through the run means the rate was more than
        the workers sustain."""
        if len(self.samples) < 4:
            return {}
        half = self.samples[len(self.samples) // 2 :]
        (t0, _, rows0), (t1, backlog, rows1) = half[0], half[-1]
        return {
            "bodies_per_s": round((rows1 - rows0) / (t1 - t0), 1) if t1 > t0 else None,
            "backlog_end": backlog,
            "backlog_max": max(in_flight for _, in_flight, _ in self.samples),
            "backlog_samples": self.samples[:: max(1, len(self.samples) // 40)],
        }

    def _run_scheduled(self, now: float) -> None:
        due = [item for item in self.scheduled if item[0] <= now]
        self.scheduled = [item for item in self.scheduled if item[0] > now]
        for _, action, what in due:
            action()
            self.log_fault("resumed", what=what)

    def _supervise(self) -> None:
        """Start a worker again whose main process exited (a supervisor's job; Dramatiq's
        main process exits when one of its processes dies)."""
        for worker in self.workers:
            if worker.process is not None and not worker.alive():
                code = worker.process.returncode
                worker.kill()
                worker.start()
                self.log_fault("worker_restarted", worker=worker.index, exit_code=code)

    def _resume_everything(self) -> None:
        """Let the pauses still running end at their time (a pause cut short would not outlast
        the lease), keep workers up meanwhile."""
        while self.scheduled:
            self._run_scheduled(time.monotonic())
            self._supervise()
            time.sleep(0.05)
        self._supervise()

    # -- faults ----------------------------------------------------------------------------

    def _busy_pid(self) -> tuple[int, str] | None:
        """A pool process that started a body within the last body time, and its key."""
        children = {pid for worker in self.workers for pid in worker.children()}
        if not children:
            return None
        try:
            rows = self.pg.execute(
                f"SELECT pid, key FROM {self.config.runs} "
                "WHERE at > clock_timestamp() - make_interval(secs => %s) ORDER BY id DESC",
                (self.options.body,),
            ).fetchall()
        except psycopg.Error:
            return None
        busy = [(int(pid), str(key)) for pid, key in rows if pid in children]
        return self.random.choice(busy) if busy else None

    def _inject(self, kind: str) -> None:
        if kind in ("kill_child", "stop_child"):
            if kind == "stop_child" and any(w == "child" for *_, w in self.scheduled):
                kind = "kill_child"  # one pause at a time: a second would only overlap it
            victim = self._busy_pid()
            if victim is None:
                self.log_fault("skipped", wanted=kind, why="no process in a body")
                return
            pid, key = victim
            if kind == "kill_child":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.victims[pid] = "kill_child"
                self.log_fault(kind, pid=pid, key=key)
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            self.victims[pid] = "stop_child"
            pause = max(self.options.lease, LIVENESS_WINDOW) + 3
            republished = self._publish(key, self.sent[key])
            self.log_fault(kind, pid=pid, key=key, pause_s=pause, republished=republished)

            def resume(pid: int = pid) -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

            self.scheduled.append((time.monotonic() + pause, resume, "child"))
        elif kind == "kill_worker":
            worker = self.random.choice(self.workers)
            for pid in worker.children():
                self.victims[pid] = "kill_worker"
            worker.kill()
            worker.start()
            self.log_fault(kind, worker=worker.index, generation=worker.generation)
        elif kind == "republish":
            keys = self.random.sample(
                sorted(self.sent), min(len(self.sent), self.random.randint(1, 5))
            )
            done = [key for key in keys if self._publish(key, self.sent[key])]
            self.log_fault(kind, keys=done)
        elif kind == "store_stop":
            assert self.store_server is not None
            if self.paused_store:
                self.log_fault("skipped", wanted=kind, why="the store is paused already")
                return
            self.store_server.signal(signal.SIGSTOP)
            self.paused_store = True
            pause = self.options.lease + 2
            self.log_fault(kind, pid=self.store_server.process.pid, pause_s=pause)  # type: ignore[union-attr]

            def resume_store() -> None:
                assert self.store_server is not None
                self.store_server.signal(signal.SIGCONT)
                self.paused_store = False

            self.scheduled.append((time.monotonic() + pause, resume_store, "store"))
        elif kind == "store_kill":
            assert self.store_server is not None
            if self.paused_store:
                self.log_fault("skipped", wanted=kind, why="the store is paused")
                return
            old = self.store_server.process.pid  # type: ignore[union-attr]
            self.store_server.kill()
            self.store_server.start()
            self.log_fault(kind, old_pid=old, new_pid=self.store_server.process.pid)  # type: ignore[union-attr]
        elif kind == "pg_terminate":
            rows = self.pg.execute(
                "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                (self.app_name,),
            ).fetchall()
            self.log_fault(kind, backends=len(rows))
        elif kind == "broker_restart":
            old = self.broker.process.pid  # type: ignore[union-attr]
            self.broker.terminate()
            self.broker.start()
            self.log_fault(kind, old_pid=old, new_pid=self.broker.process.pid)  # type: ignore[union-attr]
        else:
            raise ValueError(f"unknown fault {kind!r}")

    # -- drain and verdict -----------------------------------------------------------------

    def _counts(self) -> dict[tuple[str, str], int]:
        rows = self.pg.execute(
            f"SELECT key, kind, count(*) FROM {self.config.ledger} GROUP BY key, kind"
        ).fetchall()
        return {(str(key), str(kind)): int(n) for key, kind, n in rows}

    def _expected(self) -> list[tuple[str, str]]:
        kinds = ["parent", "child"] if self.options.handoff else ["parent"]
        return [(key, kind) for key in self.sent for kind in kinds]

    def _drain(self, timeout: float) -> tuple[bool, str | None]:
        """Until every key has its rows and the broker has held no message for 3 s.

        A key that is missing while the broker holds nothing, and that the guard never
        recorded as handled (no event, or last a claim, a release for a retry, a deferral, a
        store error), was lost by the broker or the framework: a message taken off the queue
        by a consumer that died before recording it, a reply a restarting broker never sent.
        A careful producer publishes again what was not confirmed, with the same id; the soak
        does that too and counts it (``broker_lost``, with the key's last event in the faults
        log). A child (``--handoff``) is never published by the soak: once its parent has its
        row it is taskonce's to deliver, the relay publishing the parent's sends if they are
        still pending and its receipts publishing the child again if it never arrived. A child
        still missing :attr:`child_grace` seconds after the drain first saw it missing (the
        receipts' whole window and a relay period per look: :func:`tools.soak.children.grace`),
        a child taskonce gave up on (``send_unconfirmed``) that never ran, and a missing key or
        child whose last event says handled (completed, marked, skipped), are losses of
        taskonce's: the drain ends and the verdict says so.

        When the broker holds messages and nothing moves for :data:`STALL` seconds, they sit
        with a live consumer that never received them: the workers are restarted
        (``drain_restart`` in the faults log), after which the broker hands them out again.
        """
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        empty_since: float | None = None
        progress_at, seen_state = time.monotonic(), None
        while time.monotonic() < deadline:
            self._supervise()
            try:
                counts = self._counts()
                missing = [item for item in self._expected() if counts.get(item, 0) < 1]
                in_flight = self.publisher.in_flight(self.broker_client)
            except (psycopg.Error, redis.RedisError):
                time.sleep(0.5)
                continue
            state = (sum(counts.values()), in_flight, self._events_size())
            if state != seen_state:
                progress_at, seen_state = time.monotonic(), state
            empty = in_flight == 0
            if empty and not missing:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= 3:
                    return True, None
            else:
                quiet_since = None
            if empty and missing:
                empty_since = empty_since or time.monotonic()
                if time.monotonic() - empty_since >= 5:
                    failure = self._republish_lost(missing)
                    if failure is not None:
                        return False, failure
                    empty_since = None
            else:
                empty_since = None
            if not empty and time.monotonic() - progress_at >= STALL:
                # Messages the broker counts as delivered to a consumer that never got them (a
                # fetch whose reply a broker restart swallowed) stay with that live consumer
                # until it stops: restart the workers, as an operator would, and the broker
                # gives them to the new ones.
                self.drain_restarts += 1
                self.log_fault("drain_restart", in_flight=in_flight, missing=len(missing))
                for worker in self.workers:
                    worker.kill()
                    worker.start()
                progress_at = time.monotonic()
            time.sleep(0.5)
        return False, f"not drained after {timeout}s"

    def _republish_lost(self, missing: list[tuple[str, str]]) -> str | None:
        """Publish again the parents the broker lost; fail when taskonce lost a key or a child
        (see :meth:`_drain`). None while the run may go on."""
        events = self._events()
        last = {str(event.get("message_id")): str(event["event"]) for event in events}
        claimed = frozenset(
            str(event.get("message_id"))
            for event in events
            if event["event"] in ("claimed", "lease_taken_over")
        )
        message_ids = {item: self._message_id(*item) for item in missing}
        split = lost_by_broker(missing, message_ids, last, self._dispatched(events), claimed)
        if split.failure is not None:
            return split.failure
        given_up = {
            str(event.get("message_id")) for event in events if event["event"] == "send_unconfirmed"
        }
        for key in split.waiting:
            if message_ids[(key, "child")] in given_up:
                return (
                    f"{key}/child: taskonce re-sent it {self._resends(events, key)} time(s), "
                    "then gave up on it (send_unconfirmed), and it never ran"
                )
        now = time.monotonic()
        self.child_missing_since = {
            key: self.child_missing_since.get(key, now) for key in split.waiting
        }
        late = sorted(
            key
            for key, since in self.child_missing_since.items()
            if now - since >= self.child_grace
        )
        if late:
            key = late[0]
            why = (
                "its parent's deferred sends were never dispatched"
                if key in split.undispatched
                else f"taskonce re-sent it {self._resends(events, key)} time(s)"
            )
            return (
                f"{key}/child: missing {self.child_grace:.0f} s after its parent had its row and "
                f"the broker emptied; {why} ({len(late)} such key(s))"
            )
        for key, kind in split.republish:
            message_id = message_ids[(key, kind)]
            (self.broker_lost if kind == "parent" else self.child_retries_lost).append(key)
            self.log_fault(
                "republished_lost",
                key=key,
                task=kind,
                message_id=message_id,
                last_event=last.get(message_id),
            )
            self._publish(key, message_id, kind)
        return None

    def _resends(self, events: list[dict[str, Any]], key: str) -> int:
        """How many times taskonce published ``key``'s child again for want of a receipt."""
        parent = self._store_key(self.sent[key])
        return sum(
            int(event.get("count") or 1)
            for event in events
            if event["event"] == "sends_redispatched"
            and event.get("reason") == "unconfirmed"
            and event.get("key") == parent
        )

    def _store_key(self, message_id: str) -> str:
        """The guard's key of a message of this run (identity ``id+queue``, the queue being
        the namespace), made as the guard makes it."""
        return make_key(message_id, self.config.namespace, "id+queue")

    def _message_id(self, key: str, kind: str) -> str:
        """The id of a parent (as sent) or of its child: the hand-off derives a child's id from
        its parent's guard key and the send's ordinal (the body sends one child)."""
        parent = self.sent[key]
        return parent if kind == "parent" else derive_id(self._store_key(parent), 0)

    def _dispatched(self, events: list[dict[str, Any]]) -> set[str]:
        """The keys whose parent's deferred sends were published: a ``sends_dispatched`` (or
        ``sends_redispatched``) event names the parent's guard key; with the SQL store, also a
        completed parent record no longer holding pending sends (the store marks them
        dispatched only once the broker took them; a worker killed right after that write
        never logs the event)."""
        by_store_key = {self._store_key(message_id): key for key, message_id in self.sent.items()}
        done = {
            by_store_key[str(event.get("key"))]
            for event in events
            if event["event"] in DISPATCH_EVENTS and str(event.get("key")) in by_store_key
        }
        if self.store_server is None and self.options.handoff:
            try:
                rows = self.pg.execute(
                    f"SELECT key, status FROM {self.config.namespace}"
                ).fetchall()
            except psycopg.Error:
                return done
            done.update(
                by_store_key[str(key)]
                for key, status in rows
                if str(key) in by_store_key and status != "sending"
            )
        return done

    def _events_size(self) -> int:
        try:
            return os.stat(self.config.events).st_size
        except FileNotFoundError:
            return 0

    def _events(self) -> list[dict[str, Any]]:
        path = Path(self.config.events)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def _verdict(
        self, drained: bool, drain_error: str | None, drain_s: float, injected_s: float
    ) -> dict[str, Any]:
        counts = self._counts()
        runs = self.pg.execute(
            f"SELECT key, kind, pid, message_id FROM {self.config.runs}"
        ).fetchall()
        run_pids: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
        message_keys: dict[str, tuple[str, str]] = {}
        for key, kind, pid, message_id in runs:
            run_pids[(key, kind)].add(int(pid))
            message_keys[str(message_id)] = (str(key), str(kind))
        for key, message_id in self.sent.items():
            message_keys[message_id] = (key, "parent")
        # The soak finds a child, and taskonce's re-sends of it, by the id it derives: every
        # child that ran must have run under that id, or the accounting would miss it.
        unexpected_child_ids = sorted(
            f"{key}:{message_id}"
            for key, kind, _, message_id in runs
            if kind == "child" and message_id != self._message_id(str(key), "child")
        )
        if self.options.handoff:
            for key in self.sent:
                message_keys[self._message_id(key, "child")] = (key, "child")
        events = self._events()
        per_key: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        for event in events:
            item = message_keys.get(str(event.get("message_id")))
            if item is not None:
                per_key[item][event["event"]] += 1
        transactional = self.config.transactional
        verdict = judge(self._expected(), counts, per_key, run_pids, self.victims, transactional)
        children = account(
            events,
            {self._store_key(message_id): key for key, message_id in self.sent.items()},
            {self._message_id(key, "child"): key for key in self.sent}
            if self.options.handoff
            else {},
            counts,
        )
        held = drained and verdict.held and not unexpected_child_ids and not children.failure
        lost, doubled, unexplained = verdict.lost, verdict.doubled, verdict.unexplained
        event_counts = collections.Counter(event["event"] for event in events)
        report = {
            "variant": self.options.variant,
            "framework": self.options.framework,
            "store": self.options.store,
            "mode": self.options.mode,
            "transactional": transactional,
            "handoff": self.options.handoff,
            "promise": (
                "exactly one ledger row per key"
                if transactional
                else "no key lost; a second row only for a key a fault hit, explained"
            ),
            "held": held,
            "seed": self.seed,
            "messages": len(self.sent),
            "injected_s": round(injected_s, 1),
            "faults": dict(sorted(self.fault_counts.items())),
            "faults_total": sum(self.fault_counts.values()),
            "lost": len(lost),
            "lost_keys": lost[:100],
            "doubled": len(doubled),
            "explained": len(doubled) - len(unexplained),
            "unexplained_keys": unexplained[:100],
            "doubled_keys": dict(list(doubled.items())[:100]),
            "broker_lost": len(self.broker_lost),
            **(
                {
                    "confirm_within": self.options.confirm_within,
                    "relay_every": self.options.relay_every,
                    "child_grace_s": round(self.child_grace, 1),
                    **children.as_report(),
                    "children_failure": children.failure,
                    "child_retries_lost": len(self.child_retries_lost),
                    "child_retries_lost_keys": self.child_retries_lost[:100],
                }
                if self.options.handoff
                else {}
            ),
            "unexpected_child_ids": unexpected_child_ids[:100],
            "drain_restarts": self.drain_restarts,
            "rate": round(len(self.sent) / max(self.options.seconds, 1e-9), 2),
            **self._throughput(),
            "broker_lost_keys": self.broker_lost[:100],
            "dead_lettered": self._dead_lettered(),
            "drained": drained,
            "drain_error": drain_error,
            "drain_s": round(drain_s, 1),
            "runs": len(runs),
            "events": dict(sorted(event_counts.items())),
            "folder": str(self.folder),
        }
        (self.folder / "sent.json").write_text(json.dumps(self.sent) + "\n")
        (self.folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        return report

    def _dead_lettered(self) -> int:
        try:
            return self.publisher.dead_lettered(self.broker_client)
        except redis.RedisError:
            return -1


def summary(report: dict[str, Any]) -> str:
    faults = ", ".join(f"{kind}={n}" for kind, n in report["faults"].items()) or "none"
    retries = (
        f" + {report.get('child_retries_lost', 0)} children whose retry was lost"
        if report.get("handoff")
        else ""
    )
    children = (
        f" · children repaired by taskonce {report.get('children_repaired', 0)} (re-sends "
        f"finding the child already run {report.get('resends_found_run', 0)}, send_unconfirmed "
        f"{report.get('send_unconfirmed', 0)})"
        if report.get("handoff")
        else ""
    )
    return (
        f"{report['variant']}: {'HELD' if report['held'] else 'BROKEN'} · "
        f"{report['messages']} messages · {report['faults_total']} faults ({faults}) · "
        f"lost {report['lost']} · broker lost (published again) {report['broker_lost']}"
        f"{retries}{children} · "
        f"doubled {report['doubled']} · explained {report['explained']}"
        f" · drain {report['drain_s']} s · {report['folder']}"
    )


def parse(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("celery", "dramatiq"), default="celery")
    parser.add_argument("--store", choices=("postgresql", "redis"), default="postgresql")
    parser.add_argument("--mode", choices=("eager", "lazy"), default="eager")
    parser.add_argument("--handoff", action="store_true", help="each body sends a child task")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long faults go on")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="messages a second (instead of --messages: rate x seconds messages)",
    )
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "chaos")
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--body", type=float, default=0.15, help="seconds each body sleeps")
    parser.add_argument("--keep", action="store_true", help="keep the PostgreSQL tables")
    parser.add_argument(
        "--confirm-within",
        type=float,
        default=10.0,
        help="hand-off: seconds after a child's publish taskonce looks for its receipt",
    )
    args = parser.parse_args(argv)
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.confirm_within <= 0:
        parser.error("--confirm-within must be positive")
    faults = tuple(name for name in args.faults.split(",") if name)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults: {', '.join(unknown)}")
    return Options(
        framework=args.framework,
        store=args.store,
        mode=args.mode,
        handoff=args.handoff,
        messages=round(args.rate * args.seconds) if args.rate else args.messages,
        seconds=args.seconds,
        drain_timeout=args.drain_timeout,
        # absolute: redis-server changes into its --dir before it opens its --logfile
        out=args.out.resolve(),
        faults=faults,
        seed=args.seed,
        body=args.body,
        keep=args.keep,
        confirm_within=args.confirm_within,
    )


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so the servers and workers are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    report = Soak(parse(argv)).run()
    print(summary(report), flush=True)
    return 0 if report["held"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
