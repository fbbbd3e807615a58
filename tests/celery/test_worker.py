"""Guarded Celery tasks through a real prefork worker, on each broker × store combination.

Every test publishes with its own task ids and counts runs in its own PostgreSQL table.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from typing import Any

import pytest
from celery import chain

from tests.celery.conftest import Stack, Table
from tests.helpers import event_time as at
from tests.helpers import wait_for


def new_id() -> str:
    return str(uuid.uuid4())


def test_duplicate_on_the_wire_runs_once(stack: Stack, runs: Table) -> None:
    """The same task id published five times: one run, four duplicate_skipped."""
    task_id = new_id()
    for _ in range(5):
        stack.send("t.record", (runs.name, "dup5"), "eager", task_id=task_id)

    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") >= 4,
        timeout=30,
        what="four duplicate_skipped events",
    )
    assert runs.count("dup5") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "completed") == 1
    assert stack.count(task_id, "duplicate_skipped") == 4
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "dup5"

    for event in stack.events(task_id):
        assert event["framework"] == "celery"
        assert event["task"] == "t.record"
        assert event["queue"] == stack.q("eager")
        assert event["key"] == f"{stack.q('eager')}:{task_id}"
        assert event["attempt"] == 0
        host, pid = event["worker"].rsplit(":", 1)
        assert host == socket.gethostname()
        assert int(pid) != os.getpid()  # a worker child, not this process


def test_concurrent_duplicate_of_a_short_run_is_skipped_soon_after_it_completed(
    stack: Stack, runs: Table
) -> None:
    """The same task id published again while a 0.5 s first run (default lease, 300 s) still
    runs: the copy is deferred, comes back and is skipped within 4 s of the first run's
    completion; before, it was re-delivered only after the owner's liveness window (~11 s)."""
    task_id = new_id()
    args = (runs.name, "short")
    stack.send("t.record_default_lease", args, "eager", task_id=task_id, kwargs={"sleep": 0.5})
    wait_for(lambda: runs.count("short") == 1, timeout=30, what="the first run to start")
    stack.send("t.record_default_lease", args, "eager", task_id=task_id, kwargs={"sleep": 0.5})

    def first(name: str) -> dict[str, Any] | None:
        return next((e for e in stack.events(task_id) if e["event"] == name), None)

    wait_for(lambda: first("in_progress_deferred"), timeout=10, what="the copy to be deferred")
    completed = wait_for(lambda: first("completed"), timeout=20, what="the first run's end")
    # the deadline: 4 s after the completion, and a little for the event to reach the file
    skipped = wait_for(
        lambda: first("duplicate_skipped"),
        timeout=max(0.0, at(completed) + 4.0 - time.time()) + 0.5,
        what="the copy to be skipped within 4 s of the completion",
    )
    assert at(skipped) - at(completed) <= 4.0
    assert runs.count("short") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "short"
    # the copy came back while the first still ran (0.25 s, then as long as it had run): each
    # deferral after the first is a re-check of the same copy (header taskonce_deferred)
    reasons = [e["reason"] for e in stack.events(task_id) if e["event"] == "in_progress_deferred"]
    assert len(reasons) >= 2 and reasons == [None] + ["recheck"] * (len(reasons) - 1), reasons


def test_self_retry_three_runs_one_completion(stack: Stack, runs: Table) -> None:
    """self.retry(countdown=0) twice, then success: three runs, one completion, the result
    intact; each retry found the claim released (never deferred)."""
    task_id = new_id()
    stack.send("t.flaky", (runs.name, "retry", 2), "eager", task_id=task_id)

    result = stack.app.AsyncResult(task_id).get(timeout=30)
    assert result == {"label": "retry", "attempts": 3}
    wait_for(lambda: stack.count(task_id, "completed") == 1, what="the completion event")
    assert runs.count("retry") == 3
    assert [r[3] for r in runs.rows("retry")] == [0, 1, 2]  # request.retries of each run
    assert stack.count(task_id, "claimed") == 3
    assert stack.count(task_id, "released") == 2
    assert stack.count(task_id, "in_progress_deferred") == 0
    assert sorted(e["attempt"] for e in stack.events(task_id) if e["event"] == "claimed") == [
        0,
        1,
        2,
    ]

    # A late duplicate of the finished task is skipped and the stored result is untouched.
    stack.send("t.flaky", (runs.name, "retry", 2), "eager", task_id=task_id)
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") == 1, what="the duplicate skip")
    assert runs.count("retry") == 3
    assert stack.app.AsyncResult(task_id).get(timeout=10) == {"label": "retry", "attempts": 3}


def test_autoretry_for_three_runs_one_completion(stack: Stack, runs: Table) -> None:
    """autoretry_for=(ValueError,) retries through the same released claim."""
    task_id = new_id()
    stack.send("t.auto", (runs.name, "auto", 2), "eager", task_id=task_id)

    assert stack.app.AsyncResult(task_id).get(timeout=30) == {"label": "auto", "attempts": 3}
    wait_for(lambda: stack.count(task_id, "completed") == 1, what="the completion event")
    assert runs.count("auto") == 3
    assert stack.count(task_id, "released") == 2
    assert stack.count(task_id, "in_progress_deferred") == 0


def test_chain_with_duplicated_first_step_runs_next_step_once(stack: Stack, runs: Table) -> None:
    """chain(a | b) where a's message is on the wire twice: b (a plain task) runs once."""
    a_id, b_id = new_id(), new_id()
    signature = chain(
        stack.app.signature(
            "t.chain_a", args=(runs.name, "chain"), task_id=a_id, queue=stack.q("eager")
        ),
        stack.app.signature("t.chain_b", args=(runs.name,), task_id=b_id, queue=stack.q("plain")),
    )
    signature.apply_async()
    signature.apply_async()  # the same ids again: a duplicate of a's message

    wait_for(
        lambda: stack.count(a_id, "duplicate_skipped") == 1, timeout=30, what="a's duplicate skip"
    )
    assert stack.app.AsyncResult(b_id).get(timeout=20) == "chain-a-b"
    assert runs.count("chain") == 1  # a
    assert runs.count("chain-a") == 1  # b
    assert stack.count(a_id, "completed") == 1


def test_lazy_queue_marks_after_success(stack: Stack, runs: Table) -> None:
    """On the lazy queue: a failing attempt stores nothing, success marks, duplicates skip."""
    task_id = new_id()
    stack.send("t.flaky", (runs.name, "lazy", 1), "lazy", task_id=task_id)
    assert stack.app.AsyncResult(task_id).get(timeout=30) == {"label": "lazy", "attempts": 2}
    wait_for(lambda: stack.count(task_id, "marked") == 1, what="the mark")

    for _ in range(2):
        stack.send("t.flaky", (runs.name, "lazy", 1), "lazy", task_id=task_id)
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") == 2, timeout=20, what="two skips")
    assert runs.count("lazy") == 2  # the failed attempt and the successful one
    events = stack.events(task_id)
    assert {e["mode"] for e in events} == {"lazy"}
    assert {e["event"] for e in events} == {"marked", "duplicate_skipped"}  # no claims in lazy mode


def test_per_queue_policies_and_task_override(stack: Stack, runs: Table) -> None:
    """Each queue's policy applies to what arrives on it; the task's idempotency option wins
    over the queue's."""
    ids = {name: new_id() for name in ("eager", "lazy", "off", "override")}
    stack.send("t.record", (runs.name, "q-eager"), "eager", task_id=ids["eager"])
    stack.send("t.record", (runs.name, "q-lazy"), "lazy", task_id=ids["lazy"])
    stack.send("t.override", (runs.name, "q-override"), "lazy", task_id=ids["override"])
    for _ in range(2):  # guard disabled on this queue: both copies run
        stack.send("t.record", (runs.name, "q-off"), "off", task_id=ids["off"])

    wait_for(lambda: runs.count("q-off") == 2, timeout=20, what="both unguarded runs")
    wait_for(lambda: stack.count(ids["eager"], "completed") == 1, what="eager completion")
    wait_for(lambda: stack.count(ids["lazy"], "marked") == 1, what="lazy mark")
    wait_for(lambda: stack.count(ids["override"], "completed") == 1, what="override completion")

    assert {e["mode"] for e in stack.events(ids["eager"])} == {"eager"}
    assert {e["mode"] for e in stack.events(ids["lazy"])} == {"lazy"}
    override = stack.events(ids["override"])
    assert {e["mode"] for e in override} == {"eager"}  # the task option, over the lazy queue
    assert {e["queue"] for e in override} == {stack.q("lazy")}
    assert stack.events(ids["off"]) == []
    assert runs.count("q-eager") == runs.count("q-lazy") == runs.count("q-override") == 1


@pytest.mark.sql_store_only
def test_transactional_queue_one_committed_effect(
    stack: Stack, runs: Table, effects: Table
) -> None:
    """Transactional mode (PostgreSQL store): the effect row commits with the mark. An
    attempt that retries rolls its row back; duplicates add nothing."""
    task_id = new_id()
    stack.send(
        "t.effect",
        (runs.name, effects.name, "tx"),
        "tx",
        task_id=task_id,
        kwargs={"fail_first": True},
    )
    assert stack.app.AsyncResult(task_id).get(timeout=30) == "tx"
    for _ in range(3):
        stack.send(
            "t.effect",
            (runs.name, effects.name, "tx"),
            "tx",
            task_id=task_id,
            kwargs={"fail_first": True},
        )
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") == 3, timeout=20, what="three skips")

    assert runs.count("tx") == 2  # the attempt that retried, and the one that committed
    assert effects.count("tx") == 1  # the first attempt's insert was rolled back
    assert stack.count(task_id, "released") == 1
    assert stack.count(task_id, "completed") == 1


def test_worker_child_killed_mid_task_is_taken_over_and_runs_again(
    stack: Stack, runs: Table, effects: Table
) -> None:
    """acks_late + reject_on_worker_lost: SIGKILL the pool process running the task. The
    message comes back, finds the dead child's claim, takes it over at once (the child's
    process is gone from this host) and runs once more; on the PostgreSQL store in
    transactional mode exactly one effect commits."""
    task_id = new_id()
    if stack.store == "postgresql":
        stack.send(
            "t.effect",
            (runs.name, effects.name, "crash"),
            "tx",
            task_id=task_id,
            kwargs={"hang_first": True},
        )
    else:
        stack.send(
            "t.record", (runs.name, "crash"), "eager", task_id=task_id, kwargs={"hang_first": True}
        )

    first = wait_for(lambda: runs.rows("crash"), timeout=20, what="the first run to start")
    child = first[0][4]
    os.kill(child, signal.SIGKILL)

    wait_for(
        lambda: stack.count(task_id, "completed") == 1, timeout=30, what="the re-run to complete"
    )
    rows = runs.rows("crash")
    assert len(rows) == 2 and rows[1][4] != child
    events = [e for e in stack.events(task_id) if e["event"] != "lease_renewed"]
    names = [e["event"] for e in events]
    assert names.count("claimed") == 1
    assert names.count("lease_taken_over") == 1  # the dead child's claim
    # The broker's requeue after WorkerLostError is the next delivery: it takes the claim over
    # at once (owner_dead), or — if it came back after the 3 s lease — as an expired lease.
    requeued = events[names.index("claimed") + 1]
    assert requeued["event"] == "lease_taken_over"
    assert requeued["reason"] in ("owner_dead", "lease_expired")
    assert requeued["redelivered"] is True
    assert stack.worker.alive()
    if stack.store == "postgresql":
        assert effects.count("crash") == 1  # the killed run's insert never committed


def test_message_without_a_task_id_is_rejected_not_run(stack: Stack, runs: Table) -> None:
    """A raw message with no ``id`` header (and one with an empty id) is rejected without
    running; the worker keeps consuming (Celery alone would restart its consumer in a loop
    and stop)."""
    from kombu import Queue

    queue = stack.q("eager")
    with stack.app.connection_for_write() as conn:
        producer = conn.Producer(serializer="json")
        body = [
            [runs.name, "no-id"],
            {},
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
        ]
        for headers in (
            {"lang": "py", "task": "t.record"},
            {"lang": "py", "task": "t.record", "id": ""},
        ):
            producer.publish(
                body, exchange="", routing_key=queue, headers=headers, declare=[Queue(queue)]
            )
    follow_up = new_id()
    stack.send("t.record", (runs.name, "after-no-id"), "eager", task_id=follow_up)

    wait_for(lambda: runs.count("after-no-id") == 1, timeout=20, what="the next task to run")
    wait_for(
        lambda: stack.worker.log().count("without a task id") >= 2, what="both rejections logged"
    )
    assert runs.count("no-id") == 0
    assert stack.worker.alive()


def test_same_id_with_other_arguments_is_refused_not_run(stack: Stack, runs: Table) -> None:
    """A message reusing a handled task id with different arguments: payload_mismatch, the
    handler does not run, the message is rejected without requeue (dead-lettered), and the
    result backend keeps the first run's SUCCESS and result (docs/celery.md, "Bad input")."""
    task_id = new_id()
    stack.send("t.record", (runs.name, "first"), "eager", task_id=task_id)
    wait_for(lambda: stack.count(task_id, "completed") == 1, what="the first run")
    stack.send("t.record", (runs.name, "second"), "eager", task_id=task_id)
    wait_for(lambda: stack.count(task_id, "payload_mismatch") == 1, what="the mismatch")
    wait_for(
        lambda: "refused, not run: payload mismatch" in stack.worker.log(), what="the log line"
    )
    assert runs.count("first") == 1
    assert runs.count("second") == 0
    follow_up = new_id()  # the worker (and its main process) keeps going
    stack.send("t.record", (runs.name, "after-mismatch"), "eager", task_id=follow_up)
    wait_for(lambda: runs.count("after-mismatch") == 1, timeout=20, what="the next task to run")
    wait_for(lambda: stack.count(follow_up, "completed") == 1, what="the follow-up's completion")
    assert stack.worker.alive()
    # Celery's main process records FAILURE for a message rejected without requeue; its result
    # backends ignore any write after a SUCCESS, so the first run's result stays. (Nothing read
    # the result before this line, so the publisher's backend has nothing cached.)
    kept = stack.app.AsyncResult(task_id)
    assert (kept.state, kept.result) == ("SUCCESS", "first")


def test_task_with_acks_late_off_is_named_once_at_worker_start(stack: Stack, runs: Table) -> None:
    """``t.noack`` turns ``acks_late`` off: one warning line at the worker's start names it and
    what it loses; running it adds none (the worker logged it before consuming)."""
    lines = [
        line
        for line in stack.worker.log().splitlines()
        if "guarded task t.noack has acks_late=False" in line
    ]
    assert len(lines) == 1, stack.worker.log()
    assert "WARNING" in lines[0] and "lost and never runs again" in lines[0]
    # the guarded tasks that keep the defaults are not named
    assert "guarded task t.record " not in stack.worker.log()
    assert "guarded task t.bare " not in stack.worker.log()
    task_id = new_id()
    stack.send("t.noack", (runs.name, "noack"), "eager", task_id=task_id)
    wait_for(lambda: stack.count(task_id, "completed") == 1, what="the completion")
    assert stack.worker.log().count("guarded task t.noack has acks_late=False") == 1


def test_bare_guarded_task_killed_mid_body_runs_again_once(stack: Stack, runs: Table) -> None:
    """``@app.task(base=IdempotentTask)`` and nothing else: the class's own ``acks_late`` and
    ``reject_on_worker_lost`` keep the message of a pool process SIGKILLed mid-body. Celery
    gives it back, the guard takes the dead run's claim over, and it finishes exactly once."""
    task_id, options = new_id(), {"kwargs": {"hang_first": True}}
    stack.send("t.bare", (runs.name, "bare"), "eager", task_id=task_id, **options)
    first = wait_for(lambda: runs.rows("bare"), timeout=20, what="the first run to start")
    child = first[0][4]
    os.kill(child, signal.SIGKILL)

    wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=30, what="the run again")
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "bare"
    rows = runs.rows("bare")
    assert len(rows) == 2 and rows[1][4] != child
    names = [e["event"] for e in stack.events(task_id) if e["event"] != "lease_renewed"]
    assert names.count("claimed") == 1
    assert names.count("lease_taken_over") == 1
    assert names.count("completed") == 1
    # A copy sent again is a duplicate: the run stays the only one.
    stack.send("t.bare", (runs.name, "bare"), "eager", task_id=task_id, **options)
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") == 1, what="the copy's skip")
    assert runs.count("bare") == 2
    assert stack.worker.alive()
