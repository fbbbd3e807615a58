"""Test helpers: the real services of the machine, stores, waiting on conditions.

A service that does not answer skips its tests locally (the reason shows with ``-ra``) and
fails them in CI (``CI=true``), so CI never passes by skipping.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import taskonce
from taskonce.stores import Store

REDIS_URL = os.environ.get("TASKONCE_TEST_REDIS", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get(
    "TASKONCE_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get("TASKONCE_TEST_MARIADB", "mysql+pymysql://root@127.0.0.1:3306/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

_SERVICES = {
    "redis": ("127.0.0.1", 6379),
    "postgresql": ("127.0.0.1", 5432),
    "mariadb": ("127.0.0.1", 3306),
    "rabbitmq": ("127.0.0.1", 5672),
}


def require_service(name: str) -> None:
    """Skip (locally) or fail (in CI) when a service's port does not answer."""
    host, port = _SERVICES[name]
    try:
        with socket.create_connection((host, port), timeout=2):
            return
    except OSError as exc:
        message = f"{name} at {host}:{port} is not answering ({exc}); start it (see .ci/services)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


STORE_KINDS = ["memory", "redis", "postgresql", "mariadb", "sqlite"]
# The SQL store on a Django database's own connection (django://ALIAS), per backend: the
# store-level tests (contract, properties, sends) run on these too.
DJANGO_KINDS = ["django-postgresql", "django-mariadb", "django-sqlite"]
# Redis as deployed (tests/redis_topologies.py), started once per session on first use: the
# store contract runs on these too.
REDIS_DEPLOYMENTS = ["redis-cluster", "redis-sentinel"]


def make_store(kind: str, tmp_path: Any) -> Store:
    """A fresh, empty store of ``kind`` with its own namespace (prefix or table)."""
    suffix = uuid.uuid4().hex[:10]
    if kind == "memory":
        return taskonce.MemoryStore()
    if kind == "redis":
        require_service("redis")
        return taskonce.open_store(REDIS_URL, prefix=f"t{suffix}")
    if kind == "sqlite":
        return taskonce.open_store(f"sqlite:///{tmp_path}/store-{suffix}.db")
    if kind in DJANGO_KINDS:
        from taskonce.django_ext import DjangoStore
        from tests.django_project import databases

        alias = databases.ALIASES[kind]
        if alias != "sqlite":
            require_service("postgresql" if alias == "default" else alias)
        databases.ready([alias])
        databases.empty(alias)
        return DjangoStore(alias)
    if kind in REDIS_DEPLOYMENTS:
        from tests import redis_topologies

        deployment = (
            redis_topologies.cluster if kind == "redis-cluster" else redis_topologies.sentinel
        )
        return taskonce.open_store(deployment().url, prefix=f"t{suffix}")
    url = POSTGRES_URL if kind == "postgresql" else MARIADB_URL
    require_service(kind)
    return taskonce.open_store(url, table=f"t_{suffix}")


def opened_store(kind: str, tmp_path: Any) -> Iterator[Store]:
    """A fresh store of ``kind`` for a fixture to yield; what it created is dropped after."""
    store = make_store(kind, tmp_path)
    try:
        yield store
    finally:
        drop_store(store)


def drop_store(store: Store) -> None:
    """Remove what ``make_store`` created (its Redis keys or its table)."""
    if store.__class__.__name__ == "RedisStore":
        client = store._client  # type: ignore[attr-defined]
        keys = list(client.scan_iter(match=store._pattern(), count=1000))  # type: ignore[attr-defined]
        keys += store._indexes()  # type: ignore[attr-defined]  # the hand-off's sends indexes
        pipe = client.pipeline()  # one DEL each: on a cluster they live in different slots
        for name in keys:
            pipe.delete(name)
        pipe.execute()
    elif store.__class__.__name__ == "DjangoStore":
        from tests.django_project import databases

        databases.empty(store.alias)  # type: ignore[attr-defined]
    elif store.__class__.__name__ == "SQLStore":
        store._table.drop(store._engine, checkfirst=True)  # type: ignore[attr-defined]
        store._live_table.drop(store._engine, checkfirst=True)  # type: ignore[attr-defined]
    store.close()


class RedisServer:
    """A throwaway redis-server on a free port, stopped (only it) by its pid."""

    def __init__(self, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        self.process: Any = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import shutil
        import subprocess

        binary = shutil.which("redis-server")
        if binary is None:
            message = "redis-server is not installed (apt-get install redis-server)"
            if IN_CI:
                pytest.fail(message)
            pytest.skip(message)
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        if self.password:
            command += ["--requirepass", self.password]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def answers() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                return False

        wait_for(answers, timeout=10, what=f"redis-server on port {self.port}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


def event_time(event: dict[str, Any]) -> float:
    """A taskonce event's ``ts`` as seconds since the epoch."""
    import datetime

    return datetime.datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()
