"""A Dramatiq worker process SIGKILLed mid-actor, with the default policy (lease 300 s): the
worker is restarted as a supervisor would, and the redelivered message takes the dead owner's
claim over in seconds — at once on the same host, after the liveness window from another.

RabbitMQ redelivers the unacknowledged message as soon as the dead worker's connection
closes. Timing is measured on the events' timestamps from the moment the restarted worker was
ready; ``BODY`` is the actor's own run time on its second delivery.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from taskonce.worker import ENV_VAR, LIVENESS_WINDOW
from tests.dramatiq.conftest import RABBIT_PG, RABBIT_REDIS, Harness, Stack, harness_for
from tests.helpers import event_time, wait_for

BODY = 2.0
SAME_HOST_SLACK = 5.0
#: Across hosts: the body plus the liveness window's documented ceiling.
OTHER_HOST_SLACK = 15.0
STACKS = [
    pytest.param(RABBIT_REDIS, id="rabbitmq/redis-store"),
    pytest.param(RABBIT_PG, id="rabbitmq/pg-store"),
]


def kill_and_restart(h: Harness, runs: str, env: dict[str, str] | None = None) -> tuple[str, float]:
    """Send ``crash_then``, SIGKILL the worker process running it, restart the worker; the
    message id and when the new worker was ready."""
    message = h.send("crash_then", runs, BODY)
    h.wait(lambda: h.runs(runs) == 1, what="the first run to start")
    os.kill(h.run_rows(runs)[0]["pid"], signal.SIGKILL)
    first = h.workers[0]
    wait_for(lambda: not first.alive, timeout=15, what="the dramatiq parent to exit")
    first.kill()
    h.start_worker(env=env)
    return message.message_id, time.time()


def one(h: Harness, message_id: str, name: str) -> dict[str, object]:
    found = h.events(message_id, name)
    assert len(found) == 1, h.event_names(message_id)
    return found[0]


@pytest.mark.parametrize("stack", STACKS)
def test_killed_process_is_recovered_within_body_plus_5s_after_restart(
    stack: Stack, pg_engine: sa.Engine, tmp_path: Path
) -> None:
    with harness_for(stack, tmp_path, pg_engine, "crash", lease=None) as h:
        runs = h.new_runs_table()
        try:
            message_id, ready = kill_and_restart(h, runs)
            h.wait(lambda: "completed" in h.event_names(message_id), timeout=40, what="completion")
            taken = one(h, message_id, "lease_taken_over")
            assert taken["reason"] == "owner_dead"
            assert event_time(one(h, message_id, "completed")) - ready <= BODY + SAME_HOST_SLACK
            assert h.runs(runs) == 2
        finally:
            h.drop_table(runs)


@pytest.mark.parametrize("stack", STACKS)
def test_killed_process_restarted_on_another_host_is_recovered_after_the_liveness_window(
    stack: Stack, pg_engine: sa.Engine, tmp_path: Path
) -> None:
    """The restarted worker acts as another host (its own ``TASKONCE_WORKER_ID``): it defers
    the message until the dead owner's liveness record lapses, then takes it over."""
    with harness_for(stack, tmp_path, pg_engine, "crash", lease=None) as h:
        runs = h.new_runs_table()
        try:
            other = {ENV_VAR: f"other-host-{uuid.uuid4().hex[:6]}"}
            message_id, ready = kill_and_restart(h, runs, other)
            h.wait(lambda: "completed" in h.event_names(message_id), timeout=60, what="completion")
            taken = one(h, message_id, "lease_taken_over")
            assert taken["reason"] == "owner_silent"
            assert float(str(taken["recovery_s"])) >= LIVENESS_WINDOW
            assert h.events(message_id, "in_progress_deferred")
            assert event_time(one(h, message_id, "completed")) - ready <= BODY + OTHER_HOST_SLACK
            assert h.runs(runs) == 2
        finally:
            h.drop_table(runs)
