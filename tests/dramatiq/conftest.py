"""Fixtures of the Dramatiq tests: real ``dramatiq`` worker subprocesses on real services.

A *stack* is a broker kind and a store kind: ``redis/redis`` (RedisBroker, Redis store),
``rabbitmq/postgresql`` (RabbitmqBroker, PostgreSQL store) and the two crossings. Names are
unique per test run so nothing collides with other users of the same services: Redis broker
DBs 5–8 with a random namespace, RabbitMQ queues with a random prefix (deleted afterwards),
the Redis store in DB 15 under a random prefix, the PostgreSQL store in a table of its own.
Each test counts its actor runs in a PostgreSQL table of its own (dropped after the test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from dramatiq import Message

from taskonce.events import read_jsonl
from taskonce.stores import Store
from tests.dramatiq.app import RECEIPT_QUEUES, App, Config, build
from tests.helpers import POSTGRES_URL, REDIS_URL, drop_store, require_service, wait_for

ROOT = Path(__file__).resolve().parents[2]
REDIS_BROKER = "redis://127.0.0.1:6379/{db}"
RESULTS_URL = "redis://127.0.0.1:6379/6"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
RUN_ID = uuid.uuid4().hex[:8]

#: The Redis broker DB of each use (5–8 are ours; the Celery tests use 1–4).
BROKER_DB = {"shared": 5, "store_down": 7, "crash": 8}


@dataclasses.dataclass(frozen=True)
class Stack:
    broker: str  # "redis" | "rabbitmq"
    store: str  # "redis" | "postgresql"

    @property
    def name(self) -> str:
        return f"{self.broker}/{self.store}"


REDIS_REDIS = Stack("redis", "redis")
RABBIT_PG = Stack("rabbitmq", "postgresql")
REDIS_PG = Stack("redis", "postgresql")
RABBIT_REDIS = Stack("rabbitmq", "redis")


class Worker:
    """One ``python -m dramatiq tests.dramatiq.worker_app`` process group."""

    def __init__(
        self,
        config: Config,
        log: Path,
        env: dict[str, str] | None = None,
        queues: list[str] | None = None,
        processes: int = 1,
    ) -> None:
        self.config = config
        self.processes = processes
        self.log = log
        self.env = env or {}
        self.queues = queues  # consume only these (names without the namespace); None: all
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        env = {**os.environ, **self.config.to_env(), "PYTHONPATH": str(ROOT), **self.env}
        env.pop("dramatiq_queue_prefetch", None)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dramatiq",
                    "tests.dramatiq.worker_app:broker",
                    "--processes",
                    str(self.processes),
                    "--threads",
                    "2",
                    "--path",
                    str(ROOT),
                    *(["--queues", *map(self.config.queue, self.queues)] if self.queues else []),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole process group (the dramatiq parent and its worker child)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Harness:
    """A running worker (or several, one after another) and the test side of one stack."""

    def __init__(self, config: Config, engine: sa.Engine, tmp: Path) -> None:
        self.config = config
        self.engine = engine
        self.tmp = tmp
        self.app: App = build(config)
        self.workers: list[Worker] = []

    # -- workers ---------------------------------------------------------------------------

    def start_worker(
        self,
        ready: bool = True,
        env: dict[str, str] | None = None,
        queues: list[str] | None = None,
        processes: int = 1,
    ) -> Worker:
        """Start a worker (with ``env`` added to its environment; consuming only ``queues``, names
        without the namespace, when given; ``processes`` worker processes); wait until it is
        ready (its pings need the main queues)."""
        log = self.tmp / f"worker-{len(self.workers)}.log"
        worker = Worker(self.config, log, env, queues, processes).start()
        self.workers.append(worker)
        if ready:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: Worker, timeout: float = 30) -> None:
        """Ready when a ping on every queue has run (each queue has its own consumer)."""
        table = self.new_runs_table()
        pings = ["ping", "ping_lazy", "ping_open"]
        if "ping_txn" in self.app.actors:
            pings.append("ping_txn")
        for name in pings:
            self.app.actors[name].send(table)

        def ready() -> bool:
            if not worker.alive:
                raise AssertionError(f"worker exited:\n{worker.output()[-4000:]}")
            return self.runs(table) >= len(pings)

        try:
            wait_for(ready, timeout=timeout, interval=0.1, what="the worker to run its pings")
        finally:
            self.drop_table(table)

    def stop_all(self) -> None:
        for worker in self.workers:
            worker.kill()

    # -- tables ----------------------------------------------------------------------------

    def new_runs_table(self) -> str:
        name = f"runs_{uuid.uuid4().hex[:12]}"
        with self.engine.connect() as conn:
            conn.execute(
                sa.text(
                    f"CREATE TABLE {name} (id serial PRIMARY KEY, message_id text NOT NULL, "
                    "pid int NOT NULL, attempt int NOT NULL, at timestamptz DEFAULT now())"
                )
            )
        return name

    def new_effects_table(self) -> str:
        name = f"effects_{uuid.uuid4().hex[:12]}"
        with self.engine.connect() as conn:
            conn.execute(
                sa.text(
                    f"CREATE TABLE {name} (id serial PRIMARY KEY, message_id text NOT NULL, "
                    "amount int NOT NULL)"
                )
            )
        return name

    def drop_table(self, name: str) -> None:
        with self.engine.connect() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))

    def runs(self, table: str, message_id: str | None = None) -> int:
        query = f"SELECT count(*) FROM {table}"
        params: dict[str, Any] = {}
        if message_id is not None:
            query += " WHERE message_id = :m"
            params["m"] = message_id
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(query), params).scalar_one())

    def run_rows(self, table: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text(f"SELECT message_id, pid, attempt FROM {table} ORDER BY id")
            )
            return [dict(row._mapping) for row in rows]

    def effects(self, table: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())

    # -- what the worker wrote -------------------------------------------------------------

    def events(
        self, message_id: str | None = None, name: str | None = None
    ) -> list[dict[str, Any]]:
        path = Path(self.config.events)
        if not path.exists():
            return []
        return [
            e
            for e in read_jsonl(path)
            if (message_id is None or e["message_id"] == message_id)
            and (name is None or e["event"] == name)
        ]

    def event_names(self, message_id: str) -> list[str]:
        return [e["event"] for e in self.events(message_id)]

    def acks(self, message_id: str, what: str | None = None) -> list[dict[str, Any]]:
        path = Path(self.config.acks)
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        # A delayed copy is acked twice: on its .DQ queue when it is moved back onto the
        # queue, and on the queue when processed. Only the latter is a delivery's end.
        return [
            a
            for a in lines
            if a["message_id"] == message_id
            and not a["queue"].endswith(".DQ")
            and (what is None or a["what"] == what)
        ]

    def wait(self, condition: Callable[[], Any], timeout: float = 20, what: str = "") -> Any:
        return wait_for(condition, timeout=timeout, interval=0.05, what=what)

    # -- sending ---------------------------------------------------------------------------

    def send(self, actor: str, *args: Any) -> Message[Any]:
        return self.app.actors[actor].send(*args)

    def enqueue(self, message: Message[Any], delay: int | None = None) -> Message[Any]:
        """Enqueue ``message`` as is: the same message id again (a duplicate on the wire)."""
        return self.app.broker.enqueue(message, delay=delay)


def make_config(stack: Stack, tmp: Path, use: str, **overrides: Any) -> Config:
    require_service("postgresql")
    require_service("redis")
    if stack.broker == "rabbitmq":
        require_service("rabbitmq")
    namespace = f"tod_{RUN_ID}_{uuid.uuid4().hex[:6]}"
    broker = RABBITMQ_URL if stack.broker == "rabbitmq" else REDIS_BROKER.format(db=BROKER_DB[use])
    fields: dict[str, Any] = {
        "broker": broker,
        "namespace": namespace,
        "events": str(tmp / "events.jsonl"),
        "acks": str(tmp / "acks.jsonl"),
        "runs_url": POSTGRES_URL,
        "results": RESULTS_URL,
    }
    if stack.store == "redis":
        fields.update(store=REDIS_URL, store_prefix=f"tod{uuid.uuid4().hex[:10]}")
    else:
        fields.update(store=POSTGRES_URL, store_table=f"tod_{uuid.uuid4().hex[:10]}")
    fields.update(overrides)
    return Config(**fields)


def cleanup_broker(config: Config) -> None:
    """Delete what the run left on the broker and in the Results backend."""
    import redis

    results = redis.Redis.from_url(RESULTS_URL)
    keys = list(results.scan_iter(match=f"{config.namespace}-results:*", count=1000))
    if keys:
        results.delete(*keys)
    results.close()
    if config.broker.startswith("amqp"):
        import pika

        with contextlib.suppress(Exception):
            connection = pika.BlockingConnection(pika.URLParameters(config.broker))
            channel = connection.channel()
            for name in ("main", "lazy", "txn", "open", *RECEIPT_QUEUES):
                for suffix in ("", ".DQ", ".XQ"):
                    channel.queue_delete(queue=config.queue(name) + suffix)
            connection.close()
    else:
        client = redis.Redis.from_url(config.broker)
        keys = list(client.scan_iter(match=f"{config.namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def store_of(config: Config) -> Store:
    """The store a config names, opened on the test side (for cleanup and inspection)."""
    import taskonce

    if config.store_prefix:
        return taskonce.open_store(config.store, prefix=config.store_prefix)
    return taskonce.open_store(config.store, table=config.store_table)


@pytest.fixture(scope="session")
def pg_engine() -> Iterator[sa.Engine]:
    require_service("postgresql")
    engine = sa.create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


@contextlib.contextmanager
def harness_for(
    stack: Stack, tmp: Path, engine: sa.Engine, use: str, start: bool = True, **overrides: Any
) -> Iterator[Harness]:
    config = make_config(stack, tmp, use, **overrides)
    harness = Harness(config, engine, tmp)
    try:
        if start:
            harness.start_worker()
        yield harness
    except BaseException:
        for i, worker in enumerate(harness.workers):
            sys.stderr.write(f"--- worker {i} log (tail) ---\n{worker.output()[-6000:]}\n")
        raise
    finally:
        harness.stop_all()
        harness.app.broker.close()
        cleanup_broker(config)
        with contextlib.suppress(Exception):  # a test may leave its own store down
            drop_store(store_of(config))
        harness.app.guard.close()


@pytest.fixture(scope="module")
def shared(
    request: pytest.FixtureRequest, pg_engine: sa.Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    """One worker per stack, shared by the tests of a module (parametrised indirectly)."""
    stack: Stack = request.param
    tmp = tmp_path_factory.mktemp(stack.name.replace("/", "-"))
    with harness_for(stack, tmp, pg_engine, "shared") as harness:
        yield harness


@pytest.fixture
def runs_table(shared: Harness) -> Iterator[str]:
    """A PostgreSQL table of this test, where its actors count their runs."""
    name = shared.new_runs_table()
    yield name
    shared.drop_table(name)


@pytest.fixture
def effects_table(shared: Harness) -> Iterator[str]:
    name = shared.new_effects_table()
    yield name
    shared.drop_table(name)


__all__ = [
    "RABBIT_PG",
    "RABBIT_REDIS",
    "REDIS_PG",
    "REDIS_REDIS",
    "Harness",
    "Stack",
    "Worker",
    "harness_for",
    "make_config",
]
