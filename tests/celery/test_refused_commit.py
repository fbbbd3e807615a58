"""A transactional task whose commit the database refuses on its account, on a real worker
(PostgreSQL store): a unique constraint ``DEFERRABLE INITIALLY DEFERRED`` accepts the task's
insert and refuses it at COMMIT. That is the task's failure, decided in the core
(:func:`taskonce.action.after` answers ``RAISE``): Celery's failure path as if the body had
raised the ``IntegrityError`` (``FAILURE``; the task's ``autoretry_for`` applies), the claim
released once (``claimed, released``, never ``lease_lost``), nothing committed. The same task
id sent again once the conflicting row is gone runs and commits exactly once.

``tests/dramatiq/test_refused_commit.py`` shows the same on Dramatiq.
"""

from __future__ import annotations

import uuid

import pytest

from tests.celery.conftest import Stack, Table
from tests.helpers import wait_for

pytestmark = pytest.mark.sql_store_only


def new_id() -> str:
    return f"refused-{uuid.uuid4()}"


def refuse_at_commit(effects: Table, label: str) -> None:
    """Make ``effects`` refuse a second row of a label at COMMIT, and commit one of ``label``."""
    effects.conn.execute(
        f"ALTER TABLE {effects.name} ADD CONSTRAINT {effects.name}_once UNIQUE (label) "
        "DEFERRABLE INITIALLY DEFERRED"
    )
    effects.conn.execute(f"INSERT INTO {effects.name} (label) VALUES (%s)", (label,))


def names(stack: Stack, task_id: str) -> list[str]:
    return [e["event"] for e in stack.events(task_id)]


def test_a_refused_commit_fails_the_task_releases_once_and_runs_again_once(
    stack: Stack, runs: Table, effects: Table
) -> None:
    refuse_at_commit(effects, "clash")
    before = effects.rows("clash")
    task_id = new_id()
    stack.send("t.effect", (runs.name, effects.name, "clash"), "tx", task_id=task_id)
    result = stack.app.AsyncResult(task_id)
    # The task's events are written before its state is stored: FAILURE means they are all in.
    wait_for(lambda: result.state == "FAILURE", timeout=30, what="the task's FAILURE")
    assert "IntegrityError" in str(result.traceback)
    assert f"{effects.name}_once" in str(result.traceback)
    assert names(stack, task_id) == ["claimed", "released"]  # released once; no lease_lost
    assert runs.count("clash") == 1  # no retry: t.effect has no autoretry_for
    assert effects.rows("clash") == before  # nothing of the run committed

    effects.conn.execute(f"DELETE FROM {effects.name}")  # the cause is gone
    stack.send("t.effect", (runs.name, effects.name, "clash"), "tx", task_id=task_id)
    # A fresh AsyncResult: one that saw FAILURE keeps it (Celery caches a ready state).
    result = wait_for(
        lambda: (r := stack.app.AsyncResult(task_id)).state == "SUCCESS" and r,
        timeout=30,
        what="the second run's SUCCESS",
    )
    assert result.get(timeout=5) == "clash"
    wait_for(lambda: len(stack.events(task_id)) >= 4, what="the second run's events")
    assert names(stack, task_id) == ["claimed", "released", "claimed", "completed"]
    assert runs.count("clash") == 2
    assert effects.count("clash") == 1  # committed exactly once


def test_a_refused_commit_is_retried_by_the_tasks_autoretry_for(
    stack: Stack, runs: Table, effects: Table
) -> None:
    """``autoretry_for=(IntegrityError,)``, ``max_retries=1``: the refused commit is retried
    once, as the same error raised by the body would be, then the task fails."""
    refuse_at_commit(effects, "again")
    task_id = new_id()
    stack.send("t.effect_autoretry", (runs.name, effects.name, "again"), "tx", task_id=task_id)
    result = stack.app.AsyncResult(task_id)
    wait_for(lambda: result.state == "FAILURE", timeout=30, what="the task's FAILURE")
    assert "IntegrityError" in str(result.traceback)
    assert names(stack, task_id) == ["claimed", "released", "claimed", "released"]
    assert [row[3] for row in runs.rows("again")] == [0, 1]  # request.retries of each run
    assert effects.count("again") == 1  # the row committed before the task; none of its own
