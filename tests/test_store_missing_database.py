"""A store URL naming a database the server does not have is a configuration error, said at
once — not an outage waited out for 30 s at a worker's start (PostgreSQL and MariaDB, the real
servers). A server that does not answer is still an outage."""

from __future__ import annotations

import time
import uuid

import pytest

import taskonce
from taskonce.errors import ConfigError, StoreUnavailable
from tests.helpers import require_service

SERVERS = {
    "postgresql": (
        "postgresql+psycopg://postgres@127.0.0.1:5432",
        'database "{name}" does not exist',
    ),
    "mariadb": ("mysql+pymysql://root@127.0.0.1:3306", "Unknown database '{name}'"),
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_a_database_that_does_not_exist_refuses_a_workers_start_at_once(server: str) -> None:
    require_service(server)
    base, said = SERVERS[server]
    name = f"taskonce_missing_{uuid.uuid4().hex[:8]}"
    url = f"{base}/{name}"
    guard = taskonce.Guard(taskonce.open_store(url))
    try:
        started = time.monotonic()
        with pytest.raises(ConfigError) as raised:
            guard.wait_for_store(30)
        assert time.monotonic() - started < 5
        assert str(raised.value) == (
            f"store {url}: the server says {said.format(name=name)}; create that database or "
            "correct the URL"
        )
    finally:
        guard.close()


def test_a_server_that_does_not_answer_is_still_an_outage() -> None:
    store = taskonce.open_store("postgresql+psycopg://postgres@127.0.0.1:1/x")
    try:
        with pytest.raises(StoreUnavailable, match="failed during check_ready"):
            store.check_ready()
    finally:
        store.close()
