"""Crash-loop quarantine on a real Celery worker (prefork, ``acks_late`` and
``reject_on_worker_lost``, Redis broker, Redis store, the default ``crash_limit`` of 3): a task
that SIGKILLs its own pool process on every run runs at most ``crash_limit + 1`` times, is then
quarantined (its state ``FAILURE`` with a ``Quarantined`` error, the message rejected without
requeue) and never runs again; a copy sent again by hand is acknowledged and not run; after
``taskonce release KEY`` (the command, in a subprocess) it runs. The same task without taskonce
loops for as long as the worker lives (the control).

Each run is counted in PostgreSQL before the task kills itself.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.result import AsyncResult

from taskonce import Policy
from tests.celery.conftest import Stack, Table, start_stack, stop_stack
from tests.helpers import wait_for

CRASH_LIMIT = Policy().crash_limit
#: Celery's prefork parent notices a killed pool process on its maintenance timer (every 5 s)
#: and requeues its message then: the bound of one crash's round.
CELERY_NOTICE = 5.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("celery-quarantine"), "redis", "redis")
    try:
        yield running
    finally:
        stop_stack(running)


def release(stack: Stack, key: str) -> str:
    """``taskonce release KEY --store URL`` in a subprocess, as an operator runs it."""
    url = f"{stack.store_url}?prefix={stack.store_ns}"
    command = [str(Path(sys.executable).parent / "taskonce"), "release", key, "--store", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_task_that_kills_its_worker_every_time_is_quarantined_until_released(
    stack: Stack, runs: Table, tmp_path: Path
) -> None:
    task_id, heal = str(uuid.uuid4()), tmp_path / "heal"
    args = (runs.name, "loop", str(heal))
    stack.send("t.crash", args, "eager", task_id=task_id)
    wait_for(
        lambda: stack.count(task_id, "quarantined") == 1,
        timeout=(CRASH_LIMIT + 2) * (CELERY_NOTICE + 5),
        what="the key to be quarantined",
    )
    assert runs.count("loop") == CRASH_LIMIT + 1
    [event] = [e for e in stack.events(task_id) if e["event"] == "quarantined"]
    assert event["count"] == CRASH_LIMIT + 1
    key = event["key"]
    assert stack.count(task_id, "lease_taken_over") == CRASH_LIMIT
    result = AsyncResult(task_id, app=stack.app)
    wait_for(lambda: result.state == "FAILURE", timeout=20, what="the FAILURE state")
    # taskonce stores FAILURE with Quarantined; Celery 5.6+ then records the rejection itself
    # from the main process (a Reject whose text is the Quarantined error's), usually after it.
    error = result.result
    if type(error).__name__ == "Reject":
        assert f"Quarantined: key {key!r} quarantined" in str(error), error
    else:
        assert type(error).__name__ == "Quarantined", error
        assert error.count == CRASH_LIMIT + 1
    # Rejected without requeue: nothing comes back (a redelivery would come within a notice)
    wait_for(lambda: "Quarantined" in stack.worker.log(), timeout=20, what="the refusal in the log")
    time.sleep(CELERY_NOTICE + 2)
    assert runs.count("loop") == CRASH_LIMIT + 1
    assert stack.count(task_id, "quarantined") == 1

    stack.send("t.crash", args, "eager", task_id=task_id)  # a copy, by hand
    wait_for(
        lambda: any(
            e["event"] == "duplicate_skipped" and e["reason"] == "quarantined"
            for e in stack.events(task_id)
        ),
        timeout=30,
        what="the copy to be skipped",
    )
    assert runs.count("loop") == CRASH_LIMIT + 1

    assert key in release(stack, key)
    heal.touch()  # the bug is fixed: the next run completes
    stack.send("t.crash", args, "eager", task_id=task_id)
    wait_for(
        lambda: stack.count(task_id, "completed") == 1, timeout=30, what="the released key's run"
    )
    assert runs.count("loop") == CRASH_LIMIT + 2
    # Celery's result backend caches a ready result (the FAILURE above) per process: ask the
    # backend itself, not its cache
    wait_for(
        lambda: stack.app.backend.get_task_meta(task_id, cache=False)["status"] == "SUCCESS",
        timeout=20,
        what="the SUCCESS state",
    )


def test_the_same_task_without_taskonce_loops(stack: Stack, runs: Table) -> None:
    task_id = str(uuid.uuid4())
    stack.send("t.crash_unguarded", (runs.name, "control"), "plain", task_id=task_id)
    # More runs than the guarded task's bound, within as long as the guarded one took to be
    # quarantined, and it would go on: the module's fixture stops the worker.
    wait_for(
        lambda: runs.count("control") > CRASH_LIMIT + 2,
        timeout=(CRASH_LIMIT + 4) * (CELERY_NOTICE + 5),
        what="the unguarded task to loop",
    )
