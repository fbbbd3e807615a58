"""A transactional actor whose commit the database refuses on its account, on a real worker
(PostgreSQL store): a unique constraint ``DEFERRABLE INITIALLY DEFERRED`` accepts the actor's
insert and refuses it at COMMIT. That is the actor's failure, decided in the core
(:func:`taskonce.action.after` answers ``RAISE``): Dramatiq's failure path as if the actor had
raised the ``IntegrityError`` (``Retries`` with the actor's ``max_retries``; spent: failed and
dead-lettered, never backed off and redelivered), the claim released once (``claimed,
released``, never ``lease_lost``), nothing committed. The same message sent again once the
conflicting row is gone runs and commits exactly once.

``tests/celery/test_refused_commit.py`` shows the same on Celery.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from dramatiq import Message

from tests.dramatiq.conftest import RABBIT_PG, REDIS_PG, Harness

SQL = [RABBIT_PG, REDIS_PG]


def stacks(which: list[Any]) -> Any:
    return pytest.mark.parametrize("shared", which, indirect=True, ids=lambda s: str(s.name))


def refuse_at_commit(h: Harness, effects: str, message: Message[Any]) -> None:
    """Make ``effects`` refuse a second row of a message id at COMMIT, and commit one of
    ``message``'s (``amount`` 1)."""
    with h.engine.connect() as conn:  # autocommit
        conn.execute(
            sa.text(
                f"ALTER TABLE {effects} ADD CONSTRAINT {effects}_once UNIQUE (message_id) "
                "DEFERRABLE INITIALLY DEFERRED"
            )
        )
        conn.execute(
            sa.text(f"INSERT INTO {effects} (message_id, amount) VALUES (:m, 1)"),
            {"m": message.message_id},
        )


def rows(h: Harness, effects: str) -> list[tuple[str, int]]:
    with h.engine.connect() as conn:
        query = sa.text(f"SELECT message_id, amount FROM {effects} ORDER BY id")
        return [(m, a) for m, a in conn.execute(query)]


def ends(h: Harness, message: Message[Any]) -> list[str]:
    """How Dramatiq ended each delivery of ``message``: ``ack`` or ``nack`` (dead-lettered)."""
    return [a["what"] for a in h.acks(message.message_id)]


@stacks(SQL)
def test_a_refused_commit_fails_the_message_releases_once_and_runs_again_once(
    shared: Harness, runs_table: str, effects_table: str
) -> None:
    h = shared
    message = h.app.actors["txn_charge"].message_with_options(
        args=(runs_table, effects_table, 10), max_retries=0
    )
    refuse_at_commit(h, effects_table, message)
    h.enqueue(message)
    # The ack log is written after every after_* hook: the delivery's events are all in.
    h.wait(lambda: ends(h, message), what="the delivery to end")
    assert ends(h, message) == ["nack"]  # max_retries=0: failed, dead-lettered, no back-off
    assert h.event_names(message.message_id) == ["claimed", "released"]  # no lease_lost
    assert h.runs(runs_table, message.message_id) == 1
    assert rows(h, effects_table) == [(message.message_id, 1)]  # nothing of the run committed

    with h.engine.connect() as conn:  # the cause is gone
        conn.execute(sa.text(f"DELETE FROM {effects_table}"))
    h.enqueue(message)
    h.wait(lambda: len(ends(h, message)) >= 2, what="the second delivery to end")
    assert ends(h, message) == ["nack", "ack"]
    assert h.event_names(message.message_id) == ["claimed", "released", "claimed", "completed"]
    assert h.runs(runs_table, message.message_id) == 2
    assert rows(h, effects_table) == [(message.message_id, 10)]  # committed exactly once


@stacks(SQL)
def test_a_refused_commit_is_retried_by_retries_with_the_actors_max_retries(
    shared: Harness, runs_table: str, effects_table: str
) -> None:
    """``max_retries=1``: Dramatiq's ``Retries`` retries the refused commit once (its own
    backoff, ``options["retries"]`` counted), as an exception the actor raised; then the
    message is failed."""
    h = shared
    message = h.app.actors["txn_charge"].message_with_options(
        args=(runs_table, effects_table, 10), max_retries=1
    )
    refuse_at_commit(h, effects_table, message)
    h.enqueue(message)
    h.wait(lambda: "nack" in ends(h, message), what="the retried message to be failed")
    assert ends(h, message) == ["ack", "nack"]  # retried by Retries, then failed
    names = h.event_names(message.message_id)
    assert names == ["claimed", "released", "claimed", "released"]
    attempts = [row["attempt"] for row in h.run_rows(runs_table)]
    assert attempts == [0, 1]
    assert rows(h, effects_table) == [(message.message_id, 1)]
