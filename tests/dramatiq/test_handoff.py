"""The hand-off through real ``dramatiq`` workers: what a guarded actor sends leaves once.

Actors count their runs in PostgreSQL tables of the test (one row per run, under the running
message's id). A worker process that must die does it to itself (SIGKILL) at the n-th enqueue
of its hand-off, i.e. after the outcome is recorded (``arm_kill`` in the test app), or in the
middle of its body; Dramatiq's parent process then exits and the test starts a new worker, to
which the broker hands the unacknowledged message again (RabbitMQ at once, Redis once the dead
worker's heartbeat is 3 s old).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from dramatiq import Message, group, pipeline

from taskonce.handoff import derive_id
from tests.dramatiq.conftest import (
    RABBIT_PG,
    RABBIT_REDIS,
    REDIS_PG,
    REDIS_REDIS,
    Harness,
    Stack,
    harness_for,
)
from tests.helpers import wait_for


def ids(stack: Any) -> str:
    return str(stack.name)


@pytest.fixture
def crash_harness(
    request: pytest.FixtureRequest, pg_engine: sa.Engine, tmp_path: Path
) -> Iterator[Harness]:
    """A worker of its own (it will die), with tables for the parent's and children's runs."""
    stack: Stack = request.param
    with harness_for(
        stack, tmp_path, pg_engine, "crash", heartbeat_timeout=3000, maintenance_chance=1_000_000
    ) as h:
        yield h


@pytest.fixture
def tables(crash_harness: Harness) -> Iterator[tuple[str, str]]:
    h = crash_harness
    parent, children = h.new_runs_table(), h.new_runs_table()
    yield parent, children
    h.drop_table(parent)
    h.drop_table(children)


def crash_stacks(which: list[Stack]) -> Any:
    return pytest.mark.parametrize("crash_harness", which, indirect=True, ids=ids)


def restart_after_death(h: Harness, ready: bool = True) -> None:
    """Wait for the worker to die (it kills itself), then start a fresh one; ``ready=False``
    when the fresh one is itself meant to die soon (its readiness pings could come too late)."""
    first = h.workers[-1]
    wait_for(lambda: not first.alive, timeout=60, what="the worker to die and its parent exit")
    first.kill()
    h.start_worker(ready=ready)


def per_message(h: Harness, table: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in h.run_rows(table):
        counts[row["message_id"]] = counts.get(row["message_id"], 0) + 1
    return counts


def child_ids(h: Harness, parent: Message[Any], count: int) -> list[str]:
    key = f"{h.config.queue('main')}:{parent.message_id}"
    return [derive_id(key, i) for i in range(count)]


def runs_expected(h: Harness, ids: list[str]) -> dict[str, int]:
    """One run per child, two for a child the dying worker had already started: its threads
    may take the first children off the broker before the kill at a later enqueue; such a
    child's claim is taken over from the dead owner (``lease_taken_over``) and it runs again —
    its run, written outside a transaction, is at least once, as documented."""
    return {i: 2 if "lease_taken_over" in h.event_names(i) else 1 for i in ids}


def wait_runs(h: Harness, table: str, count: int, timeout: float = 40) -> None:
    h.wait(lambda: h.runs(table) >= count, timeout=timeout, what=f"{count} runs in {table}")


@crash_stacks([RABBIT_REDIS, REDIS_PG])
def test_crash_after_the_record_before_the_hand_off(
    crash_harness: Harness, tables: tuple[str, str]
) -> None:
    """Killed at the first enqueue after the record (a child, before the on_success callback):
    the redelivery is skipped and enqueues the pending sends; each runs once."""
    h = crash_harness
    parent_table, children = tables
    parent = h.app.actors["sender"].send_with_options(
        args=(parent_table, children, 2), kwargs={"kill_at": 1}, on_success="on_done"
    )
    restart_after_death(h)

    wait_runs(h, children, 3)
    h.wait(lambda: "duplicate_skipped" in h.event_names(parent.message_id), what="the skip")
    names = h.event_names(parent.message_id)
    assert h.runs(parent_table) == 1
    assert names.count("completed") == 1
    assert names.count("sends_dispatched") == 0  # the killed process enqueued nothing
    counts = per_message(h, children)
    assert sorted(counts.values()) == [1, 1, 1]
    assert set(child_ids(h, parent, 2)) < set(counts)  # the children under derived ids


@crash_stacks([REDIS_REDIS])
def test_crash_mid_dispatch_two_of_three_out(
    crash_harness: Harness, tables: tuple[str, str]
) -> None:
    """Killed at the third enqueue: all three are enqueued again under the same ids; the
    first two copies are skipped by the children's own guard."""
    h = crash_harness
    parent_table, children = tables
    parent = h.app.actors["sender"].send(parent_table, children, 3, 3)
    restart_after_death(h)

    wait_runs(h, children, 3)
    ids = child_ids(h, parent, 3)
    h.wait(
        lambda: all("duplicate_skipped" in h.event_names(i) for i in ids[:2]),
        what="the second copies of the first two children to be skipped",
    )
    assert per_message(h, children) == runs_expected(h, ids)
    assert h.runs(parent_table) == 1


@crash_stacks([RABBIT_PG])
def test_send_then_crash_in_the_body_runs_the_body_again(
    crash_harness: Harness, tables: tuple[str, str]
) -> None:
    h = crash_harness
    parent_table, children = tables
    parent = h.app.actors["sender"].send_with_options(
        args=(parent_table, children, 2), kwargs={"die_in_body": True}
    )
    restart_after_death(h)

    h.wait(lambda: "completed" in h.event_names(parent.message_id), timeout=40, what="re-run")
    wait_runs(h, children, 2)
    assert h.runs(parent_table) == 2
    assert per_message(h, children) == dict.fromkeys(child_ids(h, parent, 2), 1)


@crash_stacks([RABBIT_REDIS])
def test_pipeline_of_three_with_a_kill_at_each_hand_off(
    crash_harness: Harness, tables: tuple[str, str]
) -> None:
    h = crash_harness
    steps_table, _ = tables
    step = h.app.actors["pipe_step"]
    pipe = pipeline([step.message(steps_table, 1), step.message(steps_table, 1),
                     step.message(steps_table, 0)])  # fmt: skip
    pipe.run()
    for _ in range(2):  # each of the first two steps dies enqueueing the next
        restart_after_death(h, ready=False)
    wait_runs(h, steps_table, 3, timeout=60)
    step_ids = [m.message_id for m in pipe.messages]
    h.wait(
        lambda: all("duplicate_skipped" in h.event_names(i) for i in step_ids[:2]),
        what="the first two steps' redeliveries to be skipped",
    )
    assert per_message(h, steps_table) == dict.fromkeys(step_ids, 1)


@crash_stacks([REDIS_PG])
def test_async_actor_sends_are_captured_and_survive_a_crash(
    crash_harness: Harness, tables: tuple[str, str]
) -> None:
    h = crash_harness
    parent_table, children = tables
    parent = h.app.actors["async_sender"].send(parent_table, children, 2, 2)
    restart_after_death(h)

    wait_runs(h, children, 2)
    h.wait(lambda: "duplicate_skipped" in h.event_names(parent.message_id), what="the skip")
    assert h.runs(parent_table) == 1
    assert per_message(h, children) == dict.fromkeys(child_ids(h, parent, 2), 1)


def group_with_callback(h: Harness, members: str, callbacks: str, kill_at: int) -> tuple[Any, str]:
    """Runs a group of three ``member`` messages with a ``child`` completion callback; the group
    and the callback's message id."""
    member = h.app.actors["member"]
    callback = h.app.actors["child"].message(callbacks, "group-done")
    g = group([member.message(members, kill_at) for _ in range(3)], broker=h.app.broker)
    g.add_completion_callback(callback)
    g.run()
    return g, callback.message_id


def the_last_member(h: Harness, g: Any) -> str:
    """The member whose run recorded the completion callback as its send (exactly one)."""
    ids = [m.message_id for m in g.children]
    last = [i for i in ids if "sends_deferred" in h.event_names(i)]
    assert len(last) == 1, {i: h.event_names(i) for i in ids}
    counts = [e["count"] for e in h.events(last[0]) if e["event"] == "sends_deferred"]
    assert counts == [1]
    return last[0]


@crash_stacks([RABBIT_REDIS])
def test_group_completion_callback_survives_a_crash_after_the_record(
    crash_harness: Harness, tables: tuple[str, str]
) -> None:
    """Every member arms a kill at its first enqueue after its record; only the member that
    completes the group enqueues anything — the completion callback, captured with its outcome
    — and dies there. Its redelivery is skipped and enqueues the callback from the record: it
    runs once. (Before the capture, GroupCallbacks enqueued it after the record, and the
    skipped redelivery lost it.)"""
    h = crash_harness
    members, callbacks = tables
    g, callback_id = group_with_callback(h, members, callbacks, kill_at=1)
    restart_after_death(h)

    wait_runs(h, callbacks, 1, timeout=60)
    last = the_last_member(h, g)
    h.wait(lambda: "duplicate_skipped" in h.event_names(last), what="the last member's skip")
    canary(h, callbacks)
    counts = per_message(h, callbacks)
    assert counts[callback_id] == 1
    assert per_message(h, members)[last] == 1
    assert "sends_dispatched" not in h.event_names(last)  # the killed process enqueued nothing


# -- without a crash: one worker per stack for the module ------------------------------------


def stacks(which: list[Stack]) -> Any:
    return pytest.mark.parametrize("shared", which, indirect=True, ids=ids)


@pytest.fixture
def children_table(shared: Harness) -> Iterator[str]:
    name = shared.new_runs_table()
    yield name
    shared.drop_table(name)


def canary(h: Harness, children: str) -> None:
    """A message sent after the test's: once it ran, anything sent before it would have."""
    message = h.app.actors["child"].send(children, "canary")
    h.wait(lambda: h.runs(children, message.message_id) == 1, what="the canary")


@stacks([RABBIT_REDIS, REDIS_PG])
def test_send_then_permanent_failure_sends_nothing(
    shared: Harness, runs_table: str, children_table: str
) -> None:
    h = shared
    parent = h.app.actors["sender"].send_with_options(
        args=(runs_table, children_table, 2), kwargs={"fail_for_good": True}, max_retries=0
    )
    h.wait(lambda: "sends_discarded" in h.event_names(parent.message_id), what="the discard")
    canary(h, children_table)
    assert h.runs(children_table) == 1  # the canary only
    assert h.runs(runs_table) == 1


@stacks([RABBIT_REDIS, REDIS_PG])
def test_retries_fail_twice_then_succeed_sends_once(
    shared: Harness, runs_table: str, children_table: str
) -> None:
    h = shared
    parent = h.app.actors["sender"].send_with_options(
        args=(runs_table, children_table, 2), kwargs={"fails": 2}, on_success="on_done"
    )
    h.wait(lambda: "completed" in h.event_names(parent.message_id), what="the third run")
    wait_runs(h, children_table, 3)
    canary(h, children_table)
    names = h.event_names(parent.message_id)
    assert h.runs(runs_table) == 3
    assert names.count("sends_discarded") == 2
    assert names.count("sends_dispatched") == 1
    counts = per_message(h, children_table)
    assert sorted(counts.values()) == [1, 1, 1, 1]  # two children, the callback, the canary


@stacks([REDIS_REDIS])
def test_a_send_json_cannot_store_fails_with_a_clear_error(
    shared: Harness, runs_table: str, children_table: str
) -> None:
    h = shared
    parent = h.app.actors["sender"].send_with_options(
        args=(runs_table, children_table, 1), kwargs={"odd_argument": True}, max_retries=0
    )
    h.wait(lambda: "sends_discarded" in h.event_names(parent.message_id), what="the discard")
    canary(h, children_table)
    assert h.runs(children_table) == 1  # the canary only: the good send was discarded too
    log = h.workers[0].output()
    assert "SendRefused" in log
    assert "'child'" in log and "args[1]" in log and "set" in log


@stacks([RABBIT_REDIS, REDIS_PG])
def test_group_completion_callback_is_sent_with_the_last_members_outcome(
    shared: Harness, runs_table: str, children_table: str
) -> None:
    """A group of three with a completion callback: the callback runs once, and it is a send of
    the member that completed the group (``sends_deferred`` then ``sends_dispatched``, one
    message), not of the others."""
    h = shared
    g, callback_id = group_with_callback(h, runs_table, children_table, kill_at=0)

    wait_runs(h, children_table, 1)
    last = the_last_member(h, g)
    h.wait(lambda: "sends_dispatched" in h.event_names(last), what="the dispatch")
    canary(h, children_table)
    assert per_message(h, children_table)[callback_id] == 1
    assert h.runs(children_table) == 2  # the callback and the canary
    names = h.event_names(last)
    assert names.index("sends_deferred") < names.index("sends_dispatched")
    for other in {m.message_id for m in g.children} - {last}:
        assert "sends_deferred" not in h.event_names(other)
