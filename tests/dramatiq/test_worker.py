"""Must-show behaviour through one real ``dramatiq`` worker per stack (shared by this module).

Each test sends its own messages, counts runs in a PostgreSQL table of its own, and reads the
worker's taskonce events (JSONL) and ack log for its message ids only.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from dramatiq import Message

from tests.dramatiq.conftest import RABBIT_PG, RABBIT_REDIS, REDIS_PG, REDIS_REDIS, Harness
from tests.helpers import event_time as at

ALL = [REDIS_REDIS, RABBIT_PG, REDIS_PG, RABBIT_REDIS]
TWO = [REDIS_REDIS, RABBIT_PG]
SQL = [RABBIT_PG, REDIS_PG]


def ids(stack: Any) -> str:
    return str(stack.name)


def stacks(which: list[Any]) -> Any:
    return pytest.mark.parametrize("shared", which, indirect=True, ids=ids)


def done(h: Harness, message: Message[Any], deliveries: int) -> bool:
    """Dramatiq has acked or nacked ``deliveries`` deliveries of ``message``, plus one for each
    copy the guard deferred (each deferral acknowledges one delivery and enqueues one more)."""
    deferred = len(h.events(message.message_id, "in_progress_deferred"))
    return len(h.acks(message.message_id)) >= deliveries + deferred


@stacks(ALL)
def test_duplicate_on_the_wire_runs_once(shared: Harness, runs_table: str) -> None:
    h = shared
    message = h.send("record", runs_table)
    for _ in range(4):
        h.enqueue(message)
    h.wait(lambda: done(h, message, 5), what="5 deliveries acknowledged")
    assert h.runs(runs_table) == 1
    events = h.events(message.message_id)
    names = [e["event"] for e in events]
    assert names.count("claimed") == 1
    assert names.count("completed") == 1
    assert names.count("duplicate_skipped") == 4
    assert {e["framework"] for e in events} == {"dramatiq"}
    assert {e["queue"] for e in events} == {h.config.queue("main")}
    assert {e["key"] for e in events} == {f"{h.config.queue('main')}:{message.message_id}"}
    deferred = names.count("in_progress_deferred")
    assert len(h.acks(message.message_id, "ack")) == 5 + deferred


@stacks(TWO)
def test_retries_fail_twice_then_succeed(shared: Harness, runs_table: str) -> None:
    h = shared
    message = h.send("flaky", runs_table, 2)
    h.wait(lambda: h.event_names(message.message_id).count("completed") == 1, what="completion")
    h.wait(lambda: done(h, message, 3), what="3 deliveries acknowledged")
    assert h.runs(runs_table) == 3
    events = h.events(message.message_id)
    assert [(e["event"], e["attempt"]) for e in events] == [
        ("claimed", 0),
        ("released", 0),
        ("claimed", 1),
        ("released", 1),
        ("claimed", 2),
        ("completed", 2),
    ]
    assert [row["attempt"] for row in h.run_rows(runs_table)] == [0, 1, 2]


@stacks(TWO)
def test_concurrent_duplicate_is_deferred_then_skipped(shared: Harness, runs_table: str) -> None:
    h = shared
    message = h.send("slow", runs_table, 3.0)
    h.wait(lambda: h.runs(runs_table) == 1, what="the first run to start")
    h.enqueue(message)  # while the first delivery is running
    h.wait(lambda: "duplicate_skipped" in h.event_names(message.message_id), timeout=20)
    h.wait(lambda: done(h, message, 2))
    names = h.event_names(message.message_id)
    assert names.count("in_progress_deferred") >= 1
    assert names.count("duplicate_skipped") == 1
    assert names.count("completed") == 1
    assert h.runs(runs_table) == 1
    # Deferred by the lease's remaining time (lease 2 s, renewed), never by Retries:
    deferred = h.events(message.message_id, "in_progress_deferred")
    assert {e["attempt"] for e in deferred} == {0}


@stacks(TWO)
def test_concurrent_duplicate_of_a_short_run_is_skipped_soon_after_it_completed(
    shared: Harness, runs_table: str
) -> None:
    """The same message enqueued again while a 0.5 s first run (default lease, 300 s) still
    runs: the copy is deferred, comes back and is skipped within 4 s of the first run's
    completion; before, it was re-delivered only after the owner's liveness window (~11 s)."""
    h = shared
    message = h.send("short", runs_table, 0.5)
    h.wait(lambda: h.runs(runs_table) == 1, what="the first run to start")
    h.enqueue(message)  # while the first delivery is running
    mid = message.message_id
    h.wait(lambda: h.events(mid, "in_progress_deferred"), timeout=10, what="a deferral")
    completed = h.wait(lambda: h.events(mid, "completed"), what="the first run's end")[0]
    # the deadline: 4 s after the completion, and a little for the event to reach the file
    skipped = h.wait(
        lambda: h.events(mid, "duplicate_skipped"),
        timeout=max(0.0, at(completed) + 4.0 - time.time()) + 0.5,
        what="the copy to be skipped within 4 s of the completion",
    )[0]
    assert at(skipped) - at(completed) <= 4.0
    h.wait(lambda: done(h, message, 2), what="both deliveries acknowledged")
    assert h.runs(runs_table) == 1
    assert h.event_names(mid).count("claimed") == 1


@stacks(TWO)
def test_results_duplicate_keeps_the_first_result(shared: Harness, runs_table: str) -> None:
    h = shared
    assert h.app.results is not None
    message = h.send("record", runs_table)
    first = h.app.results.get_result(message, block=True, timeout=20_000)
    assert isinstance(first, str) and len(first) == 32
    h.enqueue(message)
    h.wait(lambda: "duplicate_skipped" in h.event_names(message.message_id))
    h.wait(lambda: done(h, message, 2), what="the duplicate to be acknowledged")
    assert h.app.results.get_result(message) == first
    assert h.runs(runs_table) == 1


@stacks(TWO)
def test_per_queue_lazy_policy(shared: Harness, runs_table: str) -> None:
    h = shared
    message = h.send("lazy_record", runs_table)
    h.wait(lambda: done(h, message, 1))
    h.enqueue(message)
    h.wait(lambda: done(h, message, 2))
    events = h.events(message.message_id)
    assert [e["event"] for e in events] == ["marked", "duplicate_skipped"]
    assert {e["mode"] for e in events} == {"lazy"}
    assert h.runs(runs_table) == 1


@stacks(TWO)
def test_per_actor_policy_and_opt_out(shared: Harness, runs_table: str) -> None:
    h = shared
    lazy = h.send("per_actor", runs_table)  # main queue is eager; this actor says lazy
    h.wait(lambda: done(h, lazy, 1))
    h.enqueue(lazy)
    unguarded = h.send("not_guarded", runs_table)  # idempotency=False
    h.enqueue(unguarded)
    h.wait(lambda: done(h, lazy, 2) and done(h, unguarded, 2))
    assert [e["event"] for e in h.events(lazy.message_id)] == ["marked", "duplicate_skipped"]
    assert {e["mode"] for e in h.events(lazy.message_id)} == {"lazy"}
    assert {e["lease_s"] for e in h.events(lazy.message_id)} == {h.config.lease}
    assert h.runs(runs_table, lazy.message_id) == 1
    assert h.runs(runs_table, unguarded.message_id) == 2
    assert h.events(unguarded.message_id) == []


@stacks(SQL)
def test_transactional_effect_once_and_rolled_back_on_failure(
    shared: Harness, runs_table: str, effects_table: str
) -> None:
    h = shared
    charge = h.send("txn_charge", runs_table, effects_table, 10)
    for _ in range(2):
        h.enqueue(charge)
    # Writes its effect, then fails once: the failed attempt's effect rolls back with it.
    retried = h.send("txn_charge", runs_table, effects_table, 20, 1)
    h.wait(lambda: done(h, charge, 3) and done(h, retried, 2))
    assert h.runs(runs_table, charge.message_id) == 1
    assert h.runs(runs_table, retried.message_id) == 2
    with h.engine.connect() as conn:
        import sqlalchemy as sa

        rows = conn.execute(sa.text(f"SELECT message_id, amount FROM {effects_table}")).all()
    assert sorted((m, a) for m, a in rows) == sorted(
        [(charge.message_id, 10), (retried.message_id, 20)]
    )
    assert h.event_names(charge.message_id).count("duplicate_skipped") == 2


@stacks(TWO)
def test_async_actor_is_guarded(shared: Harness, runs_table: str) -> None:
    h = shared
    message = h.send("async_record", runs_table)
    for _ in range(2):
        h.enqueue(message)
    h.wait(lambda: done(h, message, 3))
    assert h.runs(runs_table) == 1
    names = h.event_names(message.message_id)
    assert names.count("completed") == 1
    assert names.count("duplicate_skipped") == 2


@stacks(SQL)
def test_async_actor_sees_the_transactional_session(
    shared: Harness, runs_table: str, effects_table: str
) -> None:
    h = shared
    message = h.send("async_txn", runs_table, effects_table, 7)
    h.enqueue(message)
    h.wait(lambda: done(h, message, 2))
    assert h.runs(runs_table) == 1
    assert h.effects(effects_table) == 1
    assert "completed" in h.event_names(message.message_id)


@stacks(TWO)
def test_empty_message_id_is_dead_lettered_not_run(shared: Harness, runs_table: str) -> None:
    h = shared
    good = h.app.actors["record"].message(runs_table)
    bad = good.copy(message_id="")
    h.enqueue(bad)
    h.wait(lambda: h.acks("", "nack"), what="the empty-id message to be dead-lettered")
    assert h.runs(runs_table) == 0
    assert h.events("") == []  # no usable key: nothing to record
    # The log names the id it could not use, quoted: not a blank between two spaces.
    assert "message '' dead-lettered, not run: message id '' is missing or empty" in (
        h.workers[0].output()
    )


@stacks(TWO)
def test_payload_mismatch_is_dead_lettered(shared: Harness, runs_table: str) -> None:
    h = shared
    first = h.send("record", runs_table, 1)
    assert h.app.results is not None
    token = h.app.results.get_result(first, block=True, timeout=20_000)
    h.wait(lambda: done(h, first, 1))
    reused = first.copy(args=(runs_table, 2))  # same message id, different arguments
    h.enqueue(reused)
    h.wait(lambda: h.acks(first.message_id, "nack"), what="the mismatch to be dead-lettered")
    assert h.runs(runs_table) == 1
    names = h.event_names(first.message_id)
    assert names == ["claimed", "completed", "payload_mismatch"]
    # The dead-lettered mismatch did not replace the first run's result with its exception.
    assert h.app.results.get_result(first) == token
