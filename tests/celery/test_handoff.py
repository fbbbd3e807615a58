"""The hand-off through real Celery prefork workers: what a guarded task sends leaves once.

Each test's bodies count their runs in a PostgreSQL table of the test. A pool process that
must die does it to itself (SIGKILL) at the n-th publish of its hand-off, i.e. after its
outcome is recorded (``arm_kill`` in the app under test), or in the middle of its body. The
stacks cover both brokers and both stores without running every test on all four pairs:
RabbitMQ with the Redis store, Redis with the PostgreSQL store. Their workers sweep the relay
every 2 s.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain

from taskonce.guard import RECORDER_LEASE
from taskonce.handoff import derive_id
from tests.celery.conftest import Stack, Table, start_stack, stop_stack
from tests.helpers import wait_for

RELAY_EVERY = 2.0


@pytest.fixture(
    scope="module",
    params=[("rabbitmq", "redis"), ("redis", "postgresql")],
    ids=["rabbitmq-broker/redis-store", "redis-broker/pg-store"],
)
def hstack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    broker, store = request.param
    tmp = tmp_path_factory.mktemp(f"celery-handoff-{broker}-{store}")
    running = start_stack(tmp, broker, store, extra_env={"TO_RELAY_EVERY": str(RELAY_EVERY)})
    try:
        yield running
    finally:
        stop_stack(running)


def new_id() -> str:
    return str(uuid.uuid4())


def child_ids(stack: Stack, parent_id: str, count: int, queue: str = "eager") -> list[str]:
    """The ids the hand-off gives a parent's sends made without a task id."""
    return [derive_id(f"{stack.q(queue)}:{parent_id}", i) for i in range(count)]


def settle(stack: Stack, runs: Table, expected: dict[str, int], timeout: float = 60) -> None:
    """Wait until each label has run as often as expected, then check no label ran more."""
    wait_for(
        lambda: all(runs.count(label) >= n for label, n in expected.items()),
        timeout=timeout,
        interval=0.1,
        what=f"runs {expected}",
    )
    assert {label: runs.count(label) for label in expected} == expected


def came_back(stack: Stack, task_id: str) -> None:
    """Wait for the killed delivery's message to come back and be skipped (not run)."""
    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") >= 1,
        timeout=30,
        what=f"the redelivery of {task_id} to be skipped",
    )


def send(stack: Stack, runs: Table, label: str, children: list[str], **kwargs: Any) -> str:
    task_id = new_id()
    stack.send("t.sender", (runs.name, label, children), "eager", task_id=task_id, kwargs=kwargs)
    return task_id


def test_crash_after_the_record_before_the_hand_off(hstack: Stack, runs: Table) -> None:
    """The pool process dies at the first publish after the outcome is recorded (the deferred
    send, before its link and chain step): the redelivery is not run again, it publishes the
    pending sends; the child, the link and the chain step each run once."""
    stack = hstack
    parent_id, next_id = new_id(), new_id()
    signature = chain(
        stack.app.signature(
            "t.sender",
            args=(runs.name, "crash-parent", ["crash-child"]),
            kwargs={"kill_at": 1},
            task_id=parent_id,
            queue=stack.q("eager"),
            link=stack.app.signature(
                "t.record", args=(runs.name, "crash-link"), immutable=True, queue=stack.q("eager")
            ),
        ),
        stack.app.signature(
            "t.step", args=(runs.name, "crash-next"), task_id=next_id, queue=stack.q("eager")
        ),
    )
    signature.apply_async()

    assert stack.app.AsyncResult(next_id).get(timeout=60) == "crash-parent>crash-next"
    settle(stack, runs, {"crash-parent": 1, "crash-child": 1, "crash-link": 1, "crash-next": 1})
    came_back(stack, parent_id)
    names = [e["event"] for e in stack.events(parent_id)]
    assert names.count("claimed") == 1
    assert names.count("completed") == 1
    assert names.count("sends_deferred") == 1
    assert names.count("sends_dispatched") == 0  # the killed process published nothing
    for child in child_ids(stack, parent_id, 1):
        assert stack.count(child, "claimed") == 1


def test_crash_mid_dispatch_two_of_three_out(hstack: Stack, runs: Table) -> None:
    """Killed at the third publish: two children were out; all three are published again (same
    ids), the copies of the first two are skipped by their own guard: each runs once."""
    stack = hstack
    labels = ["mid-0", "mid-1", "mid-2"]
    parent_id = send(stack, runs, "mid-parent", labels, kill_at=3)

    settle(stack, runs, {"mid-parent": 1, **dict.fromkeys(labels, 1)})
    ids = child_ids(stack, parent_id, 3)
    wait_for(
        lambda: all(stack.count(i, "duplicate_skipped") >= 1 for i in ids[:2]),
        timeout=30,
        what="the second copies of the first two children to be skipped",
    )
    assert [stack.count(i, "claimed") for i in ids] == [1, 1, 1]
    came_back(stack, parent_id)
    assert runs.count("mid-parent") == 1


def test_send_then_crash_in_the_body_runs_the_body_again(hstack: Stack, runs: Table) -> None:
    """The body sends two children and dies before returning: nothing was published; the
    redelivery runs the body again and its sends leave once."""
    stack = hstack
    parent_id = send(stack, runs, "body-parent", ["body-0", "body-1"], die_in_body=True)

    settle(stack, runs, {"body-parent": 2, "body-0": 1, "body-1": 1})
    assert stack.app.AsyncResult(parent_id).get(timeout=30) == "body-parent"
    for child in child_ids(stack, parent_id, 2):
        assert stack.count(child, "claimed") == 1


def test_send_then_permanent_failure_sends_nothing(hstack: Stack, runs: Table) -> None:
    """The body sends, then fails for good: its sends are discarded, no child ever runs."""
    stack = hstack
    parent_id = send(stack, runs, "fail-parent", ["ghost-0", "ghost-1"], fail_for_good=True)

    with pytest.raises(RuntimeError, match="fails for good"):
        stack.app.AsyncResult(parent_id).get(timeout=30)
    wait_for(lambda: stack.count(parent_id, "sends_discarded") == 1, what="sends_discarded")
    # A canary sent after the failure runs on the same queue: the ghosts would have run first.
    canary = new_id()
    stack.send("t.record", (runs.name, "canary"), "eager", task_id=canary)
    stack.app.AsyncResult(canary).get(timeout=30)
    assert runs.count("ghost-0") == 0
    assert runs.count("ghost-1") == 0
    assert [e["count"] for e in stack.events(parent_id) if e["event"] == "sends_discarded"] == [2]


def test_autoretry_fails_twice_then_succeeds_sends_once(hstack: Stack, runs: Table) -> None:
    """autoretry_for: two failed runs (their sends discarded), a third that succeeds: each
    child runs once."""
    stack = hstack
    parent_id = send(stack, runs, "retry-parent", ["retry-0", "retry-1"], fails=2)

    assert stack.app.AsyncResult(parent_id).get(timeout=60) == "retry-parent"
    settle(stack, runs, {"retry-parent": 3, "retry-0": 1, "retry-1": 1})
    names = [e["event"] for e in stack.events(parent_id)]
    assert names.count("sends_discarded") == 2
    assert names.count("released") == 2
    assert names.count("sends_dispatched") == 1


def test_early_ack_task_killed_after_the_record_relay_dispatches(
    hstack: Stack, runs: Table
) -> None:
    """No acks_late: the message is gone when the process dies in the hand-off; the worker's
    relay publishes the pending send within its interval."""
    stack = hstack
    parent_id = new_id()
    stack.send("t.early_sender", (runs.name, "early", "early-child"), "eager", task_id=parent_id)

    wait_for(lambda: stack.count(parent_id, "sends_deferred") == 1, timeout=30, what="record")
    # The dead recorder's lease runs out (RECORDER_LEASE), then older_than = every: the sweep
    # after the next one at the latest picks it up.
    settle(
        stack, runs, {"early": 1, "early-child": 1}, timeout=RECORDER_LEASE + 3 * RELAY_EVERY + 30
    )
    names = [e["event"] for e in stack.events(parent_id)]
    assert "sends_dispatched" not in names  # not the killed process: the relay
    assert "duplicate_skipped" not in names  # and nothing came back


def test_chain_of_three_with_a_kill_at_each_hand_off(hstack: Stack, runs: Table) -> None:
    """Each of the first two steps dies publishing the next one: every step runs once."""
    stack = hstack
    first, second, last = new_id(), new_id(), new_id()
    step = "t.step"
    queue = stack.q("eager")
    signature = chain(
        stack.app.signature(
            step, args=("go", runs.name, "c1"), kwargs={"kill_at": 1}, task_id=first, queue=queue
        ),
        stack.app.signature(
            step, args=(runs.name, "c2"), kwargs={"kill_at": 1}, task_id=second, queue=queue
        ),
        stack.app.signature(step, args=(runs.name, "c3"), task_id=last, queue=queue),
    )
    signature.apply_async()

    assert stack.app.AsyncResult(last).get(timeout=90) == "go>c1>c2>c3"
    settle(stack, runs, {"c1": 1, "c2": 1, "c3": 1})
    came_back(stack, first)
    came_back(stack, second)


@pytest.mark.sql_store_only
def test_transactional_killed_before_the_commit_leaves_nothing(
    hstack: Stack, runs: Table, effects: Table
) -> None:
    """The body writes a row through the guard's transaction and sends a child, then dies
    before the commit: neither the row, nor the record, nor the send exist; the re-run's row,
    record and send commit together, and the child runs once."""
    stack = hstack
    parent_id = new_id()
    stack.send("t.tx_sender", (runs.name, effects.name, "tx", "tx-child"), "tx", task_id=parent_id)

    assert stack.app.AsyncResult(parent_id).get(timeout=60) == "tx"
    settle(stack, runs, {"tx": 2, "tx-child": 1})
    assert effects.count("tx") == 1
    names = [e["event"] for e in stack.events(parent_id)]
    assert names.count("completed") == 1
    assert names.count("sends_deferred") == 1
    child = derive_id(f"{stack.q('tx')}:{parent_id}", 0)
    assert stack.count(child, "claimed") == 1


@pytest.mark.parametrize("kind", ["group", "chord"])
def test_group_and_chord_sent_from_a_body_mid_dispatch(
    hstack: Stack, runs: Table, kind: str
) -> None:
    """A group (or a chord's header) of three sent from a body, killed at the second publish:
    every header task once, the chord body once."""
    stack = hstack
    parent_id = new_id()
    stack.send(
        "t.canvas", (runs.name, kind, kind), "eager", task_id=parent_id, kwargs={"kill_at": 2}
    )
    expected = {kind: 1, **{f"{kind}-{i}": 1 for i in range(3)}}
    if kind == "chord":
        expected[f"{kind}-body"] = 1
    settle(stack, runs, expected, timeout=90)
    came_back(stack, parent_id)
    assert runs.count(kind) == 1


def test_a_send_json_cannot_store_fails_the_body_with_a_clear_error(
    hstack: Stack, runs: Table
) -> None:
    """A set as an argument: refused at the send call, naming the task and the argument; the
    body fails (retried by nothing), no child is published."""
    stack = hstack
    parent_id = send(stack, runs, "odd", ["odd-child"], odd_argument=True)

    with pytest.raises(Exception, match=r"'t\.record'.*args\[1\].*set") as info:
        stack.app.AsyncResult(parent_id).get(timeout=30)
    assert "t.sender" in str(info.value)
    wait_for(lambda: stack.count(parent_id, "released") == 1, what="the claim released")
    assert runs.count("odd-child") == 0
    assert stack.count(parent_id, "sends_discarded") == 1
