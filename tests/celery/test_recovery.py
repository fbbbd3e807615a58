"""A Celery worker dies (or stops) mid-task, with the default policy (lease 300 s): the claim of
the dead owner is taken over in seconds, not after the lease.

Each test runs its own worker (prefork, ``acks_late``, ``reject_on_worker_lost``) and measures
on the events' timestamps, against the moment the test killed the owner or the new worker was
ready. ``BODY`` is the task's own run time on its second delivery.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskonce.worker import ENV_VAR, LIVENESS_WINDOW
from tests.celery.conftest import Stack, Table, Worker, start_stack, stop_stack
from tests.helpers import event_time as at
from tests.helpers import wait_for

BODY = 2.0
#: Recovery bound on one host: the body, plus this much.
SAME_HOST_SLACK = 5.0
#: Recovery bound across hosts: the body, plus the liveness window's documented ceiling.
OTHER_HOST_SLACK = 15.0
#: Celery's prefork parent may notice a SIGKILLed pool process only on its pool maintenance
#: timer (every 5 s, ``celery.concurrency.asynpool``), and requeues its message only then.
CELERY_NOTICE = 5.0
STORES = [pytest.param("redis", id="redis-store"), pytest.param("postgresql", id="pg-store")]


def child_exit_noticed(stack: Stack, pid: int) -> float:
    """When the worker's parent logged that pool process ``pid`` exited (its local clock)."""
    pattern = re.compile(
        rf"^\[(?P<ts>[0-9-]+ [0-9:]+),(?P<ms>\d+): ERROR/MainProcess\] Process .* pid:{pid} exited"
    )
    for line in stack.worker.log().splitlines():
        match = pattern.match(line)
        if match:
            stamp = datetime.datetime.strptime(match["ts"], "%Y-%m-%d %H:%M:%S")
            return stamp.timestamp() + int(match["ms"]) / 1000
    raise AssertionError(f"the worker never logged the exit of pool process {pid}")


def only(stack: Stack, task_id: str, name: str) -> dict[str, Any]:
    found = [e for e in stack.events(task_id) if e["event"] == name]
    assert len(found) == 1, (
        f"expected one {name}, got {[e['event'] for e in stack.events(task_id)]}"
    )
    return found[0]


@pytest.fixture
def stacks(tmp_path: Path) -> Iterator[list[Stack]]:
    started: list[Stack] = []
    yield started
    for stack in started:
        stop_stack(stack)


def default_stack(stacks: list[Stack], tmp: Path, broker: str, store: str) -> Stack:
    """A worker whose guarded queues use the Policy's default lease (300 s)."""
    stack = start_stack(tmp, broker, store, extra_env={"TO_LEASE": "default"})
    stacks.append(stack)
    return stack


def first_run_pid(runs: Table, label: str) -> int:
    wait_for(lambda: runs.count(label) == 1, timeout=30, what="the first run to start")
    return int(runs.rows(label)[0][4])


def replace_worker(stack: Stack, tmp: Path, env: dict[str, str] | None = None) -> float:
    """SIGKILL the whole worker (parent and pool), start a new one on the same queues; the
    time the new one was ready."""
    old = stack.worker
    assert old.process is not None
    os.killpg(old.process.pid, signal.SIGKILL)
    old.process.wait(timeout=10)
    directory = tmp / f"worker-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    stack.worker = Worker(directory, {**old.env, **(env or {})}, old.queues).start()
    return time.time()


@pytest.mark.parametrize("store", STORES)
def test_killed_pool_process_is_recovered_within_body_plus_5s(
    stacks: list[Stack], tmp_path: Path, runs: Table, store: str
) -> None:
    """The pool process running the task is SIGKILLed; the parent requeues the message and
    the other pool process takes the dead child's claim over at once (``owner_dead``): the
    task completes within the body + 5 s of the parent noticing the death (which Celery itself
    may take up to 5 s to do)."""
    stack = default_stack(stacks, tmp_path, "redis", store)
    task_id = str(uuid.uuid4())
    stack.send(
        "t.record", (runs.name, "victim"), "eager", task_id=task_id,
        kwargs={"sleep": BODY, "hang_first": True},
    )  # fmt: skip
    child = first_run_pid(runs, "victim")
    killed = time.time()
    os.kill(child, signal.SIGKILL)

    wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=60, what="the completion")
    taken = only(stack, task_id, "lease_taken_over")
    assert taken["reason"] == "owner_dead"
    noticed = child_exit_noticed(stack, child)
    done = at(only(stack, task_id, "completed"))
    assert at(taken) - noticed <= 1.0  # taken over as soon as Celery gave the message back
    assert done - noticed <= BODY + SAME_HOST_SLACK
    assert done - killed <= BODY + SAME_HOST_SLACK + CELERY_NOTICE
    assert runs.count("victim") == 2
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "victim"


@pytest.mark.parametrize("store", STORES)
def test_killed_worker_on_rabbitmq_is_recovered_within_body_plus_5s_after_restart(
    stacks: list[Stack], tmp_path: Path, runs: Table, store: str
) -> None:
    """The whole worker is SIGKILLed; RabbitMQ requeues the message when its connection
    drops; the new worker on the same host sees the owner's process gone."""
    stack = default_stack(stacks, tmp_path, "rabbitmq", store)
    task_id = str(uuid.uuid4())
    stack.send(
        "t.record", (runs.name, "whole"), "eager", task_id=task_id,
        kwargs={"sleep": BODY, "hang_first": True},
    )  # fmt: skip
    first_run_pid(runs, "whole")
    ready = replace_worker(stack, tmp_path)

    wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=60, what="the completion")
    assert only(stack, task_id, "lease_taken_over")["reason"] == "owner_dead"
    assert at(only(stack, task_id, "completed")) - ready <= BODY + SAME_HOST_SLACK
    assert runs.count("whole") == 2


@pytest.mark.parametrize("store", STORES)
def test_killed_worker_replaced_on_another_host_is_recovered_after_the_liveness_window(
    stacks: list[Stack], tmp_path: Path, runs: Table, store: str
) -> None:
    """The new worker acts as another host (its own ``TASKONCE_WORKER_ID``): it cannot look
    at the dead owner's process, so it waits for the owner's liveness record to lapse."""
    stack = default_stack(stacks, tmp_path, "rabbitmq", store)
    task_id = str(uuid.uuid4())
    stack.send(
        "t.record", (runs.name, "remote"), "eager", task_id=task_id,
        kwargs={"sleep": BODY, "hang_first": True},
    )  # fmt: skip
    first_run_pid(runs, "remote")
    killed = time.time()
    ready = replace_worker(stack, tmp_path, {ENV_VAR: f"other-host-{uuid.uuid4().hex[:6]}"})

    wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=90, what="the completion")
    taken = only(stack, task_id, "lease_taken_over")
    assert taken["reason"] == "owner_silent"
    assert taken["recovery_s"] >= LIVENESS_WINDOW  # silent for at least a whole window
    assert stack.count(task_id, "in_progress_deferred") >= 1  # it waited, not the lease
    done = at(only(stack, task_id, "completed"))
    assert done - ready <= BODY + OTHER_HOST_SLACK
    assert done - killed <= BODY + OTHER_HOST_SLACK + (ready - killed)
    assert runs.count("remote") == 2


@pytest.mark.sql_store_only
def test_stopped_owner_keeps_its_claim_while_alive_then_loses_it(
    stacks: list[Stack], tmp_path: Path, runs: Table, effects: Table
) -> None:
    """A SIGSTOPped pool process (a long pause): a duplicate published meanwhile is deferred
    while the owner's liveness holds, takes the claim over once it lapses and commits the
    effect; on SIGCONT the paused run's completion is refused (LeaseLost) and its
    transaction rolls back: one completion, one committed effect."""
    stack = default_stack(stacks, tmp_path, "redis", "postgresql")
    task_id = str(uuid.uuid4())
    args = (runs.name, effects.name, "paused")
    stack.send("t.effect", args, "tx", task_id=task_id, kwargs={"sleep_first": 8.0})
    child = first_run_pid(runs, "paused")
    os.kill(child, signal.SIGSTOP)
    stopped = time.time()
    try:
        # the same message on the wire again (same id, same arguments)
        stack.send("t.effect", args, "tx", task_id=task_id, kwargs={"sleep_first": 8.0})
        wait_for(
            lambda: stack.count(task_id, "in_progress_deferred") >= 1,
            timeout=30,
            what="the duplicate to be deferred",
        )
        assert stack.count(task_id, "lease_taken_over") == 0
        wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=60, what="the takeover")
        taken = only(stack, task_id, "lease_taken_over")
        assert taken["reason"] == "owner_silent"
        assert taken["recovery_s"] >= LIVENESS_WINDOW
        deferred = [e for e in stack.events(task_id) if e["event"] == "in_progress_deferred"]
        assert at(deferred[0]) < at(taken)
        # the owner's last liveness write came at most one interval before the stop
        assert at(taken) - stopped >= LIVENESS_WINDOW - 4.0 - 0.5
    finally:
        os.kill(child, signal.SIGCONT)
    wait_for(lambda: stack.count(task_id, "lease_lost") == 1, timeout=30, what="the refusal")
    assert stack.count(task_id, "completed") == 1
    assert effects.count("paused") == 1  # the paused run's insert never committed
    assert runs.count("paused") == 2
