"""Crash-loop quarantine on real Dramatiq workers (RabbitMQ broker, Redis store, the default
``crash_limit`` of 3): an actor that SIGKILLs its own worker process on every run runs at most
``crash_limit + 1`` times, is then quarantined (the message failed into the ``.XQ``
dead-letter queue) and never runs again; a copy enqueued again by hand (the same message id)
is acknowledged and not run; after ``taskonce release KEY`` (the command, in a subprocess) it
runs. The same actor without taskonce loops for as long as its workers are restarted (the
control).

A killed worker process takes its ``dramatiq`` parent down with it, so the test restarts the
worker as a process supervisor would; RabbitMQ redelivers the unacknowledged message as soon as
the dead worker's connection closes. Each run is counted in PostgreSQL before the kill.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from taskonce import Policy
from tests.dramatiq.conftest import RABBIT_REDIS, Harness, harness_for

CRASH_LIMIT = Policy().crash_limit


def supervise(h: Harness, until: Callable[[], Any], timeout: float, what: str) -> None:
    """Restart the worker whenever it is gone (a supervisor's job) until ``until()`` holds."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        if not h.workers or not h.workers[-1].alive:
            if h.workers:
                h.workers[-1].kill()  # the rest of its process group
            h.start_worker(ready=False)
        time.sleep(0.1)


def dead_lettered(h: Harness) -> int:
    """Messages in the main queue's dead-letter queue (``.XQ``)."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(h.config.broker))
    try:
        declared = connection.channel().queue_declare(
            queue=h.config.queue("main") + ".XQ", passive=True
        )
        return int(declared.method.message_count)
    finally:
        connection.close()


def release(h: Harness, key: str) -> str:
    """``taskonce release KEY --store URL`` in a subprocess, as an operator runs it."""
    url = f"{h.config.store}?prefix={h.config.store_prefix}"
    command = [str(Path(sys.executable).parent / "taskonce"), "release", key, "--store", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_actor_that_kills_its_worker_every_time_is_quarantined_until_released(
    pg_engine: sa.Engine, tmp_path: Path
) -> None:
    with harness_for(RABBIT_REDIS, tmp_path, pg_engine, "crash", start=False) as h:
        runs, heal = h.new_runs_table(), tmp_path / "heal"
        try:
            message = h.send("crash_loop", runs, str(heal))
            mid = message.message_id
            supervise(
                h,
                lambda: h.events(mid, "quarantined"),
                timeout=(CRASH_LIMIT + 2) * 20,
                what="the key to be quarantined",
            )
            assert h.runs(runs) == CRASH_LIMIT + 1
            [event] = h.events(mid, "quarantined")
            assert event["count"] == CRASH_LIMIT + 1
            key = event["key"]
            assert len(h.events(mid, "lease_taken_over")) == CRASH_LIMIT
            h.wait(lambda: dead_lettered(h) == 1, what="the message in the dead-letter queue")
            h.wait(lambda: h.acks(mid, "nack"), what="the message to be failed (nacked)")
            assert h.workers[-1].alive  # quarantined, not run: nothing killed it
            assert h.runs(runs) == CRASH_LIMIT + 1

            h.enqueue(message)  # a copy by hand, the same message id
            h.wait(
                lambda: [
                    e for e in h.events(mid, "duplicate_skipped") if e["reason"] == "quarantined"
                ],
                what="the copy to be skipped",
            )
            assert h.runs(runs) == CRASH_LIMIT + 1 and h.workers[-1].alive

            assert key in release(h, key)
            heal.touch()  # the bug is fixed: the next run completes
            h.enqueue(message)
            h.wait(lambda: h.events(mid, "completed"), timeout=30, what="the released run")
            assert h.runs(runs) == CRASH_LIMIT + 2
        finally:
            h.drop_table(runs)


def test_the_same_actor_without_taskonce_loops(pg_engine: sa.Engine, tmp_path: Path) -> None:
    with harness_for(RABBIT_REDIS, tmp_path, pg_engine, "crash", start=False) as h:
        runs = h.new_runs_table()
        try:
            h.send("crash_loop_unguarded", runs)
            supervise(
                h,
                lambda: h.runs(runs) > CRASH_LIMIT + 2,
                timeout=(CRASH_LIMIT + 4) * 20,
                what="the unguarded actor to loop",
            )
        finally:
            h.drop_table(runs)
