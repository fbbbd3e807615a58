"""Optimistic transactional mode (``check_first=False``, set as the task's ``idempotency``
option) through a real prefork worker on the PostgreSQL-store stacks: duplicates on the wire,
a SIGKILL mid-body, two deliveries at once. Every duplicate runs its body; exactly one effect
commits.
The two-at-once test also runs with the look-up before the task (``check_first=True``):
both copies pass it, and the one that marks second is rolled back the same way."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from tests.celery.conftest import Stack, Table
from tests.helpers import wait_for

pytestmark = pytest.mark.sql_store_only


def new_id() -> str:
    return str(uuid.uuid4())


def test_duplicates_on_the_wire_run_and_roll_back(
    stack: Stack, runs: Table, effects: Table
) -> None:
    """The same task id three times: three runs of the body, one committed row, two
    duplicate_skipped (reason rolled_back); the result is the first run's. The same id with
    other arguments is refused (payload_mismatch) and its row rolled back too."""
    task_id = new_id()
    for _ in range(3):
        stack.send("t.opt_effect", (runs.name, effects.name, "dup"), "tx", task_id=task_id)
    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") == 2,
        timeout=30,
        what="two duplicates rolled back",
    )
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "dup"
    assert runs.count("dup") == 3  # the body ran each time: no look-up before it
    assert effects.count("dup") == 1
    assert stack.count(task_id, "marked") == 1
    skipped = [e for e in stack.events(task_id) if e["event"] == "duplicate_skipped"]
    assert {e["reason"] for e in skipped} == {"rolled_back"}
    assert {e["mode"] for e in stack.events(task_id)} == {"lazy"}

    stack.send("t.opt_effect", (runs.name, effects.name, "other"), "tx", task_id=task_id)
    wait_for(lambda: stack.count(task_id, "payload_mismatch") == 1, what="the mismatch")
    wait_for(lambda: "refused, rolled back" in stack.worker.log(), what="the refusal logged")
    assert runs.count("other") == 1
    assert effects.count("other") == 0


def test_child_killed_mid_body_runs_again_and_commits_once(
    stack: Stack, runs: Table, effects: Table
) -> None:
    """SIGKILL the pool process in the body: nothing was looked up or written before it, the
    transaction dies with it, the broker's redelivery runs the body again and commits."""
    task_id = new_id()
    stack.send(
        "t.opt_effect",
        (runs.name, effects.name, "crash"),
        "tx",
        task_id=task_id,
        kwargs={"hang_first": True},
    )
    first = wait_for(lambda: runs.rows("crash"), timeout=20, what="the first run to start")
    child = first[0][4]
    os.kill(child, signal.SIGKILL)

    wait_for(lambda: stack.count(task_id, "marked") == 1, timeout=40, what="the re-run's mark")
    rows = runs.rows("crash")
    assert len(rows) == 2 and rows[1][4] != child
    assert effects.count("crash") == 1
    assert [e["event"] for e in stack.events(task_id)] == ["marked"]
    assert stack.events(task_id)[0]["redelivered"] is True
    assert stack.worker.alive()


@pytest.mark.parametrize("task", ["t.opt_effect", "t.txn_effect"])
def test_two_deliveries_at_once_commit_one_row(
    stack: Stack, runs: Table, effects: Table, task: str
) -> None:
    """Two copies in the two pool processes at once: one holds its uncommitted row until the
    other has committed its own (it fails if that never happens); then it meets the key at its
    mark and rolls back: a duplicate, skipped. With the look-up before the body
    (``t.txn_effect``) too: both copies pass it, and the loser left no effect, so it is no
    ``concurrent_duplicate``."""
    task_id = new_id()
    for _ in range(2):
        stack.send(
            task,
            (runs.name, effects.name, "both"),
            "tx",
            task_id=task_id,
            kwargs={"wait_other": True},
        )
    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") == 1,
        timeout=40,
        what="one of the two rolled back",
    )
    rows = runs.rows("both")
    assert len(rows) == 2 and rows[0][4] != rows[1][4]  # two pool processes
    assert effects.count("both") == 1
    assert sorted(e["event"] for e in stack.events(task_id)) == ["duplicate_skipped", "marked"]
    # Each pool process decided once: one committed, the other (the one that waited) rolled
    # back; both bodies were running at the same time.
    workers = {e["event"]: int(e["worker"].rsplit(":", 1)[1]) for e in stack.events(task_id)}
    assert sorted(workers.values()) == sorted(row[4] for row in rows)
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "both"
