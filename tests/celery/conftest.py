"""Fixtures of the Celery tests: real ``celery worker`` subprocesses (prefork) on real brokers.

A *stack* is one broker (Redis or RabbitMQ), one taskonce store (Redis or PostgreSQL), one
worker running :mod:`tests.celery.app_under_test`, a JSONL events file and a publisher app in
the test process. Everything a stack creates carries its own random prefix (queue names,
Redis keys, table names) and is removed when the stack stops; the worker's process group is
always killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import taskonce
from taskonce.demo.common import delete_redis_keys
from tests.helpers import POSTGRES_URL, REDIS_URL, require_service, wait_for

ROOT = Path(__file__).resolve().parents[2]
REDIS_BROKER = "redis://127.0.0.1:6379/{db}"
RESULT_BACKEND = "redis://127.0.0.1:6379/2"
RABBIT_BROKER = os.environ.get("TASKONCE_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
#: Redis broker databases of the Celery tests (other suites use other numbers).
MATRIX_DB, VISIBILITY_DB, STORE_DOWN_DB = 1, 3, 4
QUEUE_NAMES = ("eager", "lazy", "tx", "off", "plain")


def new_prefix() -> str:
    return f"tc{uuid.uuid4().hex[:10]}"


def pg_connect() -> Any:
    import psycopg

    return psycopg.connect(
        POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    )


class Worker:
    """A ``celery worker`` subprocess in its own process group."""

    def __init__(
        self, directory: Path, env: dict[str, str], queues: list[str], concurrency: int = 2
    ):
        self.directory = directory
        self.ready_file = directory / "ready"
        self.log_file = directory / "worker.log"
        self.env = {**os.environ, **env, "TO_READY": str(self.ready_file)}
        self.queues = queues
        self.concurrency = concurrency
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> Worker:
        self.launch()

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited ({self.process.returncode}):\n{self.log()}")
            return self.ready_file.exists()

        try:
            wait_for(ready, timeout=timeout, interval=0.1, what="the celery worker to be ready")
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> Worker:
        """Start the process without waiting for it to be ready."""
        self.ready_file.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery.app_under_test", "worker",
            "-P", "prefork", "-c", str(self.concurrency), "-Q", ",".join(self.queues),
            "-n", f"{self.env.get('TO_PREFIX', 'tc')}-{uuid.uuid4().hex[:4]}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]  # fmt: skip
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        self.process = None
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=8)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the children too, even if the main exited
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


@dataclasses.dataclass
class Stack:
    """A running worker and everything the tests need to talk to it."""

    broker: str
    store: str
    prefix: str
    events_path: Path
    worker: Worker
    app: Celery
    store_url: str
    store_ns: str

    def q(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def events(self, message_id: str | None = None) -> list[dict[str, Any]]:
        try:
            text = self.events_path.read_text()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in text.splitlines() if line.strip()]
        if message_id is None:
            return events
        return [e for e in events if e.get("message_id") == message_id]

    def count(self, message_id: str, name: str) -> int:
        return sum(1 for e in self.events(message_id) if e["event"] == name)

    def send(
        self,
        name: str,
        args: tuple[Any, ...],
        queue: str,
        task_id: str | None = None,
        **options: Any,
    ) -> Any:
        return self.app.send_task(name, args=args, queue=self.q(queue), task_id=task_id, **options)


def publisher(
    broker_url: str, prefix: str, backend: str | None = RESULT_BACKEND, **transport: Any
) -> Celery:
    app = Celery(f"publisher-{prefix}", broker=broker_url, backend=backend, set_as_current=False)
    options = dict(transport)
    if broker_url.startswith("redis"):
        options["global_keyprefix"] = f"{prefix}:"
    app.conf.update(
        broker_transport_options=options,
        result_backend_transport_options={"global_keyprefix": f"{prefix}:"},
        task_default_queue=f"{prefix}.eager",
        broker_connection_retry_on_startup=True,
    )
    return app


def broker_url(kind: str, db: int) -> str:
    if kind == "rabbitmq":
        require_service("rabbitmq")
        return RABBIT_BROKER
    require_service("redis")
    return REDIS_BROKER.format(db=db)


def store_url(kind: str) -> tuple[str, str]:
    suffix = uuid.uuid4().hex[:10]
    if kind == "postgresql":
        require_service("postgresql")
        return POSTGRES_URL, f"tc_{suffix}"
    require_service("redis")
    return REDIS_URL, f"tc{suffix}"


def drop_store(url: str, namespace: str) -> None:
    from tests.helpers import drop_store as drop

    options = {"prefix": namespace} if url.startswith("redis") else {"table": namespace}
    drop(taskonce.open_store(url, **options))


def clean_broker(app: Celery, url: str, prefix: str, queues: list[str]) -> None:
    """Remove this prefix's queues (RabbitMQ) or keys (Redis broker and result backend)."""
    if url.startswith("redis"):
        for target in (url, RESULT_BACKEND):
            delete_redis_keys(target, f"{prefix}:*")
        return
    from kombu import Exchange, Queue

    with app.connection_for_write() as conn:
        channel = conn.channel()
        for name in queues:
            try:
                Queue(name, channel=channel).delete()
                Exchange(name, channel=channel).delete()
            except Exception:  # already gone, or the channel closed on a missing entity
                channel = conn.channel()
    delete_redis_keys(RESULT_BACKEND, f"{prefix}:*")


def worker_env(
    prefix: str, broker: str, store: str, namespace: str, events_path: Path,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:  # fmt: skip
    """The environment that configures :mod:`tests.celery.app_under_test` in a worker."""
    return {
        "TO_PREFIX": prefix,
        "TO_BROKER": broker,
        "TO_BACKEND": RESULT_BACKEND,
        "TO_STORE": store,
        "TO_STORE_NS": namespace,
        "TO_EVENTS": str(events_path),
        "TO_PG": POSTGRES_URL,
        "TO_LEASE": "3",
        **(extra or {}),
    }


def start_stack(
    tmp: Path, broker: str, store: str, db: int = MATRIX_DB, extra_env: dict[str, str] | None = None,
    store_pair: tuple[str, str] | None = None, transport: dict[str, Any] | None = None,
) -> Stack:  # fmt: skip
    require_service("postgresql")  # the run counts live there
    require_service("redis")  # the result backend
    prefix = new_prefix()
    burl = broker_url(broker, db)
    surl, namespace = store_pair or store_url(store)
    events_path = tmp / "events.jsonl"
    env = worker_env(prefix, burl, surl, namespace, events_path, extra_env)
    queues = [f"{prefix}.{name}" for name in QUEUE_NAMES]
    app = publisher(burl, prefix, **(transport or {}))
    worker = Worker(tmp, env, queues)
    try:
        worker.start()
    except BaseException:
        clean_broker(app, burl, prefix, queues)
        if store_pair is None:
            drop_store(surl, namespace)
        raise
    return Stack(broker, store, prefix, events_path, worker, app, surl, namespace)


def stop_stack(stack: Stack, drop: bool = True) -> None:
    try:
        stack.worker.stop()
    finally:
        try:
            clean_broker(
                stack.app, str(stack.app.conf.broker_url), stack.prefix,
                [stack.q(name) for name in QUEUE_NAMES],
            )  # fmt: skip
        finally:
            stack.app.close()
            if drop:
                drop_store(stack.store_url, stack.store_ns)


MATRIX = [
    pytest.param(("redis", "redis"), id="redis-broker/redis-store"),
    pytest.param(("redis", "postgresql"), id="redis-broker/pg-store"),
    pytest.param(("rabbitmq", "redis"), id="rabbitmq-broker/redis-store"),
    pytest.param(("rabbitmq", "postgresql"), id="rabbitmq-broker/pg-store"),
]


@pytest.fixture(scope="session", params=MATRIX)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A worker for one broker × store combination, shared by the tests that use it."""
    broker, store = request.param
    tmp = tmp_path_factory.mktemp(f"celery-{broker}-{store}")
    running = start_stack(tmp, broker, store)
    try:
        yield running
    finally:
        stop_stack(running)


@pytest.fixture
def pg() -> Iterator[Any]:
    require_service("postgresql")
    conn = pg_connect()
    try:
        yield conn
    finally:
        conn.close()


@dataclasses.dataclass
class Table:
    """A run-count table (``label, task_id, retries, pid``) or an effects table (``label``)."""

    name: str
    conn: Any

    def rows(self, label: str | None = None) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cur:
            if label is None:
                cur.execute(f"SELECT * FROM {self.name} ORDER BY 1")
            else:
                cur.execute(f"SELECT * FROM {self.name} WHERE label = %s ORDER BY 1", (label,))
            return list(cur.fetchall())

    def count(self, label: str | None = None) -> int:
        return len(self.rows(label))


@pytest.fixture
def runs(pg: Any) -> Iterator[Table]:
    """A fresh PostgreSQL table the tasks record their runs in; dropped after the test."""
    name = f"runs_{uuid.uuid4().hex[:12]}"
    pg.execute(
        f"CREATE TABLE {name} (id serial PRIMARY KEY, label text NOT NULL, task_id text, "
        "retries int, pid int, at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    try:
        yield Table(name, pg)
    finally:
        pg.execute(f"DROP TABLE IF EXISTS {name}")


@pytest.fixture
def effects(pg: Any) -> Iterator[Table]:
    """A fresh PostgreSQL table for transactional effects; dropped after the test."""
    name = f"fx_{uuid.uuid4().hex[:12]}"
    pg.execute(f"CREATE TABLE {name} (id serial PRIMARY KEY, label text NOT NULL)")
    try:
        yield Table(name, pg)
    finally:
        pg.execute(f"DROP TABLE IF EXISTS {name}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Transactional mode needs an SQL store: its tests run on the PostgreSQL-store stacks
    only (deselected, and counted as such, on the Redis-store ones)."""
    dropped = [
        item
        for item in items
        if item.get_closest_marker("sql_store_only") and "redis-store" in item.nodeid
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]
