"""The store goes down under a running worker: fail_closed does not run and does not lose the
message (it runs once the store is back); fail_open runs it and emits ``store_error``.

The store is a ``redis-server`` of this test on a free port, stopped (SIGKILL) and restarted
by its pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from tests.dramatiq.conftest import REDIS_REDIS, harness_for
from tests.helpers import IN_CI, free_port, wait_for


class RedisServer:
    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False
        finally:
            client.close()

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(self.answers, timeout=10, what=f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None
        wait_for(lambda: not self.answers(), timeout=10, what="redis-server to stop")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        message = "redis-server binary not found (needed to stop and restart a store)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.stop()


def test_store_down_fail_closed_waits_fail_open_runs(
    own_redis: RedisServer, pg_engine: sa.Engine, tmp_path: Path
) -> None:
    with harness_for(
        REDIS_REDIS, tmp_path, pg_engine, "store_down", store=own_redis.url, store_error_backoff=200
    ) as h:
        runs = h.new_runs_table()
        try:
            own_redis.stop()
            closed = h.send("record", runs)  # main queue: fail_closed (the default)
            opened = h.send("fail_open", runs)  # open queue: fail_open
            h.wait(lambda: h.runs(runs, opened.message_id) == 1, what="the fail_open run")
            h.wait(
                lambda: len(h.events(closed.message_id, "store_error")) >= 3,
                what="fail_closed to try (and put back) the message three times",
            )
            assert h.runs(runs, closed.message_id) == 0
            assert h.event_names(opened.message_id) == ["store_error"]
            # Each try was acknowledged only after a copy went back to the broker:
            assert len(h.acks(closed.message_id, "ack")) >= 2
            assert h.acks(closed.message_id, "nack") == []

            own_redis.start()  # empty: a fresh server on the same port
            h.wait(
                lambda: "completed" in h.event_names(closed.message_id),
                timeout=20,
                what="the held-back message to run once the store is back",
            )
            assert h.runs(runs, closed.message_id) == 1
            assert h.runs(runs, opened.message_id) == 1
            names = h.event_names(closed.message_id)
            assert names[-2:] == ["claimed", "completed"]
            assert set(names[:-2]) == {"store_error"}
            # Redeliveries for a store error are not Retries: attempt stays 0.
            assert {e["attempt"] for e in h.events(closed.message_id)} == {0}
        finally:
            h.drop_table(runs)
