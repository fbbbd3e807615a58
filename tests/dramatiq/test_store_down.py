"""The store goes down under a running worker: fail_closed does not run and does not lose the
message (it runs once the store is back); fail_open runs it and emits ``store_error``. A store
that does not answer when the worker starts stops the worker (exit 78) before it consumes.

The store is a ``redis-server`` of this test on a free port, stopped (SIGKILL) and restarted
by its pid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from taskonce.dramatiq_ext.middleware import EXIT_CONFIG
from tests.dramatiq.conftest import REDIS_REDIS, Worker, harness_for
from tests.helpers import RedisServer, free_port


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()  # fails in CI, skips locally, without redis-server
    try:
        yield server
    finally:
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


def test_worker_refuses_to_start_when_its_store_does_not_answer(
    pg_engine: sa.Engine, tmp_path: Path
) -> None:
    """A wrong port in the store URL: each worker process waits start_timeout, then ends with
    EX_CONFIG in one line, and the dramatiq command exits with it; the message waiting in the
    broker runs once a worker with the right URL starts."""
    wrong = f"redis://127.0.0.1:{free_port()}/0"
    with harness_for(REDIS_REDIS, tmp_path, pg_engine, "store_down", start=False) as h:
        runs = h.new_runs_table()
        try:
            waiting = h.send("record", runs)
            bad = Worker(
                dataclasses.replace(h.config, store=wrong, start_timeout=2),
                tmp_path / "wrong-url.log",
            ).start()
            try:
                h.wait(lambda: not bad.alive, timeout=60, what="the worker to refuse to start")
                output = bad.output()
                assert bad.proc is not None and bad.proc.returncode == EXIT_CONFIG, output
                refusal = [line for line in output.splitlines() if "does not start" in line]
                assert len(refusal) == 1, output
                assert "could not be reached within 2 s" in refusal[0]
                assert "Connection refused" in refusal[0]
                # the one line: no outage warning before it (the store never answered)
                assert "stopped answering" not in output and "unreachable" not in output
                assert "Traceback" not in output
            finally:
                bad.kill()
            assert h.runs(runs, waiting.message_id) == 0
            h.start_worker()
            h.wait(lambda: h.runs(runs, waiting.message_id) == 1, what="the message to run")
            assert h.event_names(waiting.message_id) == ["claimed", "completed"]
        finally:
            h.drop_table(runs)
