"""The hand-off of what Celery publishes *around* a guarded body, through real prefork workers:
a chord's body (published by the result backend when the last header task finishes) and the
sends a task made before ``self.replace(sig)``.

The stacks, helpers and crash mechanics are those of ``test_handoff.py``: bodies count their runs
in a PostgreSQL table of the test, and a pool process that must die SIGKILLs itself at the n-th
publish after arming (``arm_kill`` in the app under test).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import chord

from taskonce import replace
from taskonce.handoff import derive_id, id_base
from tests.celery.conftest import Stack, Table
from tests.celery.test_handoff import hstack, new_id, settle
from tests.helpers import wait_for

__all__ = ["hstack"]  # the module-scoped stacks of test_handoff.py, one pair for this module


def chord_of_parts(
    stack: Stack, runs: Table, label: str, body_id: str, **part: Any
) -> tuple[list[str], Any, Any]:
    """A chord of three ``t.part`` header tasks into ``t.step`` under ``body_id``; the header
    ids, the body's AsyncResult (its ``parent``: the header's GroupResult) and its signature."""
    queue = stack.q("eager")
    header_ids = [new_id() for _ in range(3)]
    header = [
        stack.app.signature(
            "t.part",
            args=(runs.name, f"{label}-{i}"),
            kwargs=part,
            task_id=task_id,
            queue=queue,
            immutable=True,
        )
        for i, task_id in enumerate(header_ids)
    ]
    body = stack.app.signature(
        "t.step", args=(runs.name, f"{label}-body"), task_id=body_id, queue=queue
    )
    result = chord(header, app=stack.app)(body)
    assert result.id == body_id  # the chord keeps the body's frozen id
    return header_ids, result, body


def the_last_header(stack: Stack, header_ids: list[str]) -> str:
    """The header task whose run recorded the chord body as its send (exactly one)."""
    last = [i for i in header_ids if stack.count(i, "sends_deferred")]
    assert len(last) == 1, [stack.events(i) for i in header_ids]
    assert [e["count"] for e in stack.events(last[0]) if e["event"] == "sends_deferred"] == [1]
    return last[0]


def test_chord_body_is_a_send_of_the_last_header_task_and_survives_a_crash(
    hstack: Stack, runs: Table
) -> None:
    """Every header task arms a kill at its first publish after its record; only the one that
    completes the chord publishes anything — the body, captured — and dies there. The body is
    published from the record (by the redelivery, or by the relay: the header's result was
    stored before the kill, so Celery acknowledges its message as "succeeded before the worker
    was lost"): it runs once, under the id the chord froze for it. (Before the capture the
    tracer published the body after the record, and the chord was left without it.)"""
    stack = hstack
    body_id = new_id()
    header_ids, result, _ = chord_of_parts(stack, runs, "ck", body_id, kill_at=1)

    assert result.get(timeout=90).endswith(">ck-body")
    settle(stack, runs, {"ck-0": 1, "ck-1": 1, "ck-2": 1, "ck-body": 1})
    last = the_last_header(stack, header_ids)
    names = [e["event"] for e in stack.events(last)]
    assert names.count("completed") == 1
    assert names.count("sends_dispatched") == 0  # the killed process published nothing
    assert stack.count(body_id, "claimed") == 1
    for other in set(header_ids) - {last}:
        assert stack.count(other, "sends_deferred") == 0


def test_chord_header_duplicates_on_the_wire_do_not_run_the_body_again(
    hstack: Stack, runs: Table
) -> None:
    """After the chord ran, a copy of each header task's message (same id, group, index and
    chord body) arrives: each is skipped, the body is neither reported nor run again."""
    stack = hstack
    body_id = new_id()
    header_ids, result, body = chord_of_parts(stack, runs, "cd", body_id)
    result.get(timeout=60)
    settle(stack, runs, {"cd-0": 1, "cd-1": 1, "cd-2": 1, "cd-body": 1})
    last = the_last_header(stack, header_ids)
    assert stack.count(last, "sends_dispatched") == 1

    group_id = result.parent.id
    for i, task_id in enumerate(header_ids):
        stack.app.send_task(
            "t.part", args=(runs.name, f"cd-{i}"), task_id=task_id, queue=stack.q("eager"),
            group_id=group_id, group_index=i, chord=body,
        )  # fmt: skip
    wait_for(
        lambda: all(stack.count(i, "duplicate_skipped") >= 1 for i in header_ids),
        timeout=30,
        what="the header copies to be skipped",
    )
    canary = new_id()
    stack.send("t.record", (runs.name, "cd-canary"), "eager", task_id=canary)
    stack.app.AsyncResult(canary).get(timeout=30)
    assert runs.count("cd-body") == 1
    assert stack.count(body_id, "claimed") == 1
    assert {label: runs.count(label) for label in ("cd-0", "cd-1", "cd-2")} == dict.fromkeys(
        ("cd-0", "cd-1", "cd-2"), 1
    )


def test_chord_header_tasks_failing_and_retrying_publish_the_body_after_their_success(
    hstack: Stack, runs: Table
) -> None:
    """Each header task fails once (``self.retry``) before it succeeds: the failed attempts
    report nothing to the chord and send nothing; the body is published once, by the last
    success, and runs after every header task's successful run began."""
    stack = hstack
    body_id = new_id()
    header_ids, result, _ = chord_of_parts(stack, runs, "cf", body_id, fail_first=True)

    assert result.get(timeout=90).endswith(">cf-body")
    settle(stack, runs, {"cf-0": 2, "cf-1": 2, "cf-2": 2, "cf-body": 1})
    the_last_header(stack, header_ids)
    for task_id in header_ids:
        names = [e["event"] for e in stack.events(task_id)]
        assert names.count("released") == 1  # the failed attempt
        assert names.count("completed") == 1
    body_at = runs.rows("cf-body")[0][5]
    successes = [max(row[5] for row in runs.rows(f"cf-{i}")) for i in range(3)]
    assert all(body_at > at for at in successes)
    assert stack.count(body_id, "claimed") == 1


# -- sends made before self.replace() -----------------------------------------------------------


def replace_ids(stack: Stack, task_id: str) -> tuple[list[str], list[str]]:
    """The ids of the replaced run's two sends and of its replacement's two."""
    key = f"{stack.q('eager')}:{task_id}"
    before = [derive_id(key, i) for i in range(2)]
    after = [derive_id(id_base(key, 1), i) for i in range(2)]
    return before, after


def send_replacer(stack: Stack, runs: Table, label: str, **kwargs: Any) -> str:
    task_id = new_id()
    children = [f"{label}-0", f"{label}-1"]
    then = [f"{label}-next-0", f"{label}-next-1"]
    stack.send(
        "t.replacer", (runs.name, label, children, f"{label}-next", then), "eager",
        task_id=task_id, kwargs=kwargs,
    )  # fmt: skip
    return task_id


def test_sends_before_replace_leave_once_the_replacement_is_out(hstack: Stack, runs: Table) -> None:
    """The task sends two children, then replaces itself with a task (same id, same key) that
    sends two of its own: all four run once, under four ids — the replaced run's derived from
    the key, the replacement's from the key and its replace depth."""
    stack = hstack
    task_id = send_replacer(stack, runs, "rp")

    assert stack.app.AsyncResult(task_id).get(timeout=60) == "rp-next"
    settle(stack, runs, {"rp": 1, "rp-0": 1, "rp-1": 1, "rp-next": 1, "rp-next-0": 1,
                         "rp-next-1": 1})  # fmt: skip
    before, after = replace_ids(stack, task_id)
    assert len(set(before + after)) == 4
    for child in before + after:
        wait_for(lambda c=child: stack.count(c, "completed") == 1, what=f"{child} completed")
        assert stack.count(child, "claimed") == 1
    names = [e["event"] for e in stack.events(task_id)]
    assert names.count("sends_deferred") == 2  # at the replace, and the replacement's own
    assert names.count("sends_dispatched") == 2
    assert names.count("sends_discarded") == 0


def test_sends_before_a_failure_before_replace_are_discarded(hstack: Stack, runs: Table) -> None:
    """The task sends two children, then fails before it replaces itself: nothing leaves."""
    stack = hstack
    task_id = send_replacer(stack, runs, "rf", fail_before=True)

    with pytest.raises(RuntimeError, match="before replace"):
        stack.app.AsyncResult(task_id).get(timeout=30)
    wait_for(lambda: stack.count(task_id, "sends_discarded") == 1, what="sends_discarded")
    canary = new_id()
    stack.send("t.record", (runs.name, "rf-canary"), "eager", task_id=canary)
    stack.app.AsyncResult(canary).get(timeout=30)
    assert runs.count("rf-0") == runs.count("rf-1") == runs.count("rf-next") == 0


@pytest.mark.parametrize("kill_at", [1, 2], ids=["at-the-replacement", "at-the-first-send"])
def test_replace_killed_midway_sends_each_once(hstack: Stack, runs: Table, kill_at: int) -> None:
    """The pool process dies after the sends were recorded at the replace: before the
    replacement is published (the message comes back, runs again and replaces again; the
    record stands, its sends leave once) or after it, before the sends are published (the
    replacement runs; the recorded sends are published by the relay)."""
    stack = hstack
    label = f"rk{kill_at}"
    task_id = send_replacer(stack, runs, label, kill_at=kill_at)

    assert stack.app.AsyncResult(task_id).get(timeout=90) == f"{label}-next"
    settle(
        stack, runs,
        {label: 3 - kill_at, f"{label}-0": 1, f"{label}-1": 1, f"{label}-next": 1,
         f"{label}-next-0": 1, f"{label}-next-1": 1},
        timeout=60,
    )  # fmt: skip
    before, after = replace_ids(stack, task_id)
    for child in before + after:
        wait_for(lambda c=child: stack.count(c, "completed") == 1, what=f"{child} completed")
        assert stack.count(child, "claimed") == 1
    if kill_at == 2:  # the recorded sends were published by the relay, from their own record
        record = replace.record_key(f"{stack.q('eager')}:{task_id}")
        relayed = [e for e in stack.events() if e["key"] == record]
        assert [e["event"] for e in relayed] == ["sends_dispatched"]
        assert relayed[0]["count"] == 2
