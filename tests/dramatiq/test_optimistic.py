"""Optimistic transactional mode (``check_first=False``, set as the actor's ``idempotency``
option) through real ``dramatiq`` workers on the PostgreSQL-store stacks: duplicates on the
wire, a SIGKILL mid-actor, two deliveries at once. Every duplicate runs its actor; exactly one
effect commits.
The two-at-once test also runs with the look-up before the actor (``check_first=True``):
both copies pass it, and the one that marks second is rolled back the same way."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from dramatiq import Message

from tests.dramatiq.conftest import RABBIT_PG, REDIS_PG, Harness, harness_for
from tests.helpers import wait_for

SQL = [RABBIT_PG, REDIS_PG]


def stacks(which: list[Any]) -> Any:
    return pytest.mark.parametrize("shared", which, indirect=True, ids=lambda s: str(s.name))


def effects_of(h: Harness, table: str) -> list[tuple[str, int]]:
    with h.engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT message_id, amount FROM {table}")).all()
    return sorted((m, a) for m, a in rows)


def finished(h: Harness, message: Message[Any], deliveries: int) -> bool:
    return len(h.acks(message.message_id)) >= deliveries


@stacks(SQL)
def test_duplicates_on_the_wire_run_and_roll_back(
    shared: Harness, runs_table: str, effects_table: str
) -> None:
    """The same message three times: three runs, one committed row, two duplicate_skipped
    (reason rolled_back), all acknowledged. The same id with other arguments: its row rolled
    back, payload_mismatch, dead-lettered (nack)."""
    h = shared
    message = h.send("opt_charge", runs_table, effects_table, 10)
    for _ in range(2):
        h.enqueue(message)
    h.wait(lambda: finished(h, message, 3), timeout=30, what="three deliveries acknowledged")
    assert h.runs(runs_table, message.message_id) == 3  # no look-up before the actor
    assert effects_of(h, effects_table) == [(message.message_id, 10)]
    events = h.events(message.message_id)
    assert sorted(e["event"] for e in events) == ["duplicate_skipped"] * 2 + ["marked"]
    assert {e["reason"] for e in events if e["event"] == "duplicate_skipped"} == {"rolled_back"}
    assert len(h.acks(message.message_id, "ack")) == 3

    other = message.copy(args=(runs_table, effects_table, 99))  # same id, other arguments
    h.enqueue(other)
    h.wait(lambda: h.acks(message.message_id, "nack"), what="the mismatch to be dead-lettered")
    assert h.runs(runs_table, message.message_id) == 4
    assert effects_of(h, effects_table) == [(message.message_id, 10)]
    assert h.event_names(message.message_id).count("payload_mismatch") == 1


@stacks(SQL)
@pytest.mark.parametrize("actor", ["opt_charge", "checked_charge"])
def test_two_deliveries_at_once_commit_one_row(
    shared: Harness, runs_table: str, effects_table: str, actor: str
) -> None:
    """Two copies in the worker's two threads at once: the first holds its uncommitted row
    until the second has committed its own (it fails if that never happens), then meets the
    key at its mark and rolls back: a duplicate, skipped. With the look-up before the actor
    (``checked_charge``) too: both copies pass it, and the loser left no effect, so it is no
    ``concurrent_duplicate``."""
    h = shared
    message = h.app.actors[actor].message(runs_table, effects_table, 5, wait_other=True)
    h.enqueue(message)
    h.enqueue(message)
    h.wait(lambda: finished(h, message, 2), timeout=40, what="both deliveries acknowledged")
    assert h.runs(runs_table, message.message_id) == 2
    assert effects_of(h, effects_table) == [(message.message_id, 5)]
    assert sorted(h.event_names(message.message_id)) == ["duplicate_skipped", "marked"]
    skipped = [e for e in h.events(message.message_id) if e["event"] == "duplicate_skipped"]
    assert skipped[0]["reason"] == "rolled_back"
    # Both acknowledged: the copy that started first saw the other's row committed while its
    # own was not (it raises otherwise, and would be dead-lettered), so both ran at once.
    assert len(h.acks(message.message_id, "ack")) == 2


@pytest.mark.parametrize("stack", [RABBIT_PG], ids=["rabbitmq/postgresql"])
def test_sigkill_mid_actor_runs_again_and_commits_once(
    stack: Any, pg_engine: sa.Engine, tmp_path: Path
) -> None:
    """SIGKILL the worker process in the actor: nothing was looked up or written before it; the
    redelivery (RabbitMQ: as soon as the dead worker's connection closes) runs the actor again
    and commits one row."""
    with harness_for(stack, tmp_path, pg_engine, "crash") as h:
        runs = h.new_runs_table()
        effects = h.new_effects_table()
        try:
            message = h.app.actors["opt_charge"].send(runs, effects, 5, hang_first=True)
            h.wait(lambda: h.runs(runs) == 1, what="the first run to start")
            child = h.run_rows(runs)[0]["pid"]
            os.kill(child, signal.SIGKILL)
            first = h.workers[0]
            wait_for(lambda: not first.alive, timeout=15, what="the dramatiq parent to exit")
            first.kill()

            h.start_worker()
            h.wait(
                lambda: "marked" in h.event_names(message.message_id),
                timeout=40,
                what="the redelivered message to commit",
            )
            assert h.runs(runs) == 2
            assert h.run_rows(runs)[1]["pid"] != child
            assert effects_of(h, effects) == [(message.message_id, 5)]
            events = h.events(message.message_id)
            assert [e["event"] for e in events] == ["marked"]
            assert events[0]["redelivered"] is True
        finally:
            h.drop_table(runs)
            h.drop_table(effects)
