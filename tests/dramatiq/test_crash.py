"""A worker process SIGKILLed mid-actor: the message comes back and runs once more (the dead
owner's claim is taken over); in transactional mode on PostgreSQL exactly one effect is
committed. The timing with the default lease is in test_recovery.py.

RabbitMQ redelivers the unacknowledged message as soon as the dead worker's connection closes
(``redelivered=True``). The Redis broker has no connection to lose: a worker's fetched
messages sit in its ``__acks__`` set, and a live worker's queue maintenance moves them back once
the dead worker's heartbeat is older than ``heartbeat_timeout`` (3 s here, with maintenance on
every command so the test does not wait for the 1-in-1000 default).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.dramatiq.conftest import RABBIT_PG, REDIS_PG, REDIS_REDIS, Stack, harness_for
from tests.helpers import wait_for


@pytest.mark.parametrize(
    ("stack", "actor"),
    [(RABBIT_PG, "txn_crash"), (REDIS_PG, "txn_crash"), (REDIS_REDIS, "crash")],
    ids=["rabbitmq/postgresql-transactional", "redis/postgresql-transactional", "redis/redis"],
)
def test_sigkill_mid_actor_runs_once_more_after_the_lease(
    stack: Stack, actor: str, pg_engine: sa.Engine, tmp_path: Path
) -> None:
    with harness_for(
        stack, tmp_path, pg_engine, "crash", heartbeat_timeout=3000, maintenance_chance=1_000_000
    ) as h:
        runs = h.new_runs_table()
        effects = h.new_effects_table()
        try:
            args = (runs, effects, 5) if actor == "txn_crash" else (runs,)
            message = h.send(actor, *args)
            h.wait(lambda: h.runs(runs) == 1, what="the first run to start")
            child = h.run_rows(runs)[0]["pid"]
            os.kill(child, signal.SIGKILL)  # the worker process running the actor
            first = h.workers[0]
            wait_for(lambda: not first.alive, timeout=15, what="the dramatiq parent to exit")
            first.kill()

            h.start_worker()
            h.wait(
                lambda: "completed" in h.event_names(message.message_id),
                timeout=40,
                what="the redelivered message to complete",
            )
            events = h.events(message.message_id)
            names = [e["event"] for e in events]
            assert h.runs(runs) == 2
            assert names.count("claimed") == 1
            assert names.count("lease_taken_over") == 1
            assert names.count("completed") == 1
            assert names.index("claimed") < names.index("lease_taken_over")
            rows = h.run_rows(runs)
            assert rows[0]["pid"] == child and rows[1]["pid"] != child
            if stack.broker == "rabbitmq":
                assert any(e["redelivered"] is True for e in events)
            if actor == "txn_crash":
                assert h.effects(effects) == 1  # the killed run's transaction never committed
        finally:
            h.drop_table(runs)
            h.drop_table(effects)
