"""The store contract of crash-loop quarantine, run against every store (Memory, Redis as
deployed, PostgreSQL, MariaDB, SQLite, Django's connection): take-overs from dead owners are
counted in the record and answered by the take-over itself, and a quarantined record is
never claimed, marked or taken over until an operator's release deletes it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from taskonce.errors import LeaseLost
from taskonce.stores import ClaimOutcome, Status, Store
from taskonce.stores.base import State
from tests.helpers import (
    DJANGO_KINDS,
    REDIS_DEPLOYMENTS,
    STORE_KINDS,
    drop_store,
    make_store,
    wait_for,
)

LONG, DAY = 60.0, 86400.0
WORKER_A, WORKER_B, WORKER_C = "host-a/1/10/100", "host-b/2/20/200", "host-c/3/30/300"


@pytest.fixture(params=[*STORE_KINDS, *REDIS_DEPLOYMENTS, *DJANGO_KINDS])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        drop_store(s)


def new_key() -> str:
    return f"q:{uuid.uuid4()}"


def crashes(store: Store, key: str) -> int:
    record = store.get(key)
    assert record is not None
    return record.crashes


def test_take_overs_are_counted_in_the_record_and_answered(store: Store) -> None:
    key = new_key()
    assert store.claim(key, "A", LONG, DAY, "fp", WORKER_A).crashes == 0
    assert crashes(store, key) == 0
    assert store.take_over(key, "A", "B", LONG, DAY, WORKER_B) == 1
    assert crashes(store, key) == 1
    store.renew(key, "B", LONG)  # a renewal keeps the count
    assert store.take_over(key, "B", "C", 0.3, DAY, WORKER_C) == 2
    found = store.claim(key, "D", LONG, DAY, "fp", WORKER_A)
    assert found.outcome is ClaimOutcome.EXISTS and found.record is not None
    assert found.record.crashes == 2
    wait_for(lambda: store.get(key).lease_remaining == 0, timeout=10, what="the lease to end")  # type: ignore[union-attr]
    taken = store.claim(key, "D", LONG, DAY, "fp", WORKER_A)  # an expired lease: counted too
    assert (taken.outcome, taken.crashes) == (ClaimOutcome.TAKEN_OVER, 3)
    record = store.get(key)
    assert record is not None and (record.owner, record.worker, record.crashes) == (
        "D",
        WORKER_A,
        3,
    )
    store.complete(key, "D", DAY, None)  # a completion forgets it
    assert crashes(store, key) == 0


def test_a_release_forgets_the_count(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, None, WORKER_A)
    assert store.take_over(key, "A", "B", LONG, DAY, WORKER_B) == 1
    store.release(key, "B")
    assert store.claim(key, "C", LONG, DAY, None, WORKER_C).outcome is ClaimOutcome.CLAIMED
    assert crashes(store, key) == 0
    assert store.take_over(key, "C", "D", LONG, DAY, WORKER_A) == 1


def test_quarantine_keeps_the_key_out_of_reach_until_an_operator_releases_it(
    store: Store,
) -> None:
    key, other = new_key(), new_key()
    store.claim(key, "A", 0.3, DAY, "fp", WORKER_A)
    before = store.get(key)
    assert before is not None
    assert store.take_over(key, "A", "B", 0.3, DAY, WORKER_B) == 1
    with pytest.raises(LeaseLost):
        store.quarantine(key, "A", DAY)  # fenced: only the claim's owner
    store.quarantine(key, "B", DAY)
    record = store.get(key)
    assert record is not None
    assert (record.status, record.state, record.owner, record.worker) == (
        Status.QUARANTINED,
        State.QUARANTINED,
        None,
        None,
    )
    assert (record.fingerprint, record.crashes, record.lease_remaining) == ("fp", 1, 0)
    assert not record.marked and not record.sends_pending
    assert record.created_at == pytest.approx(before.created_at, abs=0.01)
    assert record.expires_at == pytest.approx(time.time() + DAY, abs=30)
    time.sleep(0.4)  # past the claim's lease: a quarantined record has none to run out
    found = store.claim(key, "C", LONG, DAY, "fp", WORKER_C)
    assert found.outcome is ClaimOutcome.EXISTS and found.record is not None
    assert found.record.status is Status.QUARANTINED and found.record.crashes == 1
    assert store.mark(key, DAY, "fp", None) is False
    assert store.take_over(key, "B", "C", LONG, DAY, WORKER_C) == 0
    for write in (
        lambda: store.complete(key, "B", DAY, None),
        lambda: store.renew(key, "B", LONG),
        lambda: store.release(key, "B"),
        lambda: store.quarantine(key, "B", DAY),
    ):
        with pytest.raises(LeaseLost):
            write()
    store.mark(other, DAY, None, None)
    stats = store.stats()
    assert (stats["keys"], stats["in_progress"], stats["completed"]) == (2, 0, 1)
    assert stats["quarantined"] == 1
    assert store.have_records([key]) == [True]
    assert [r.state for r in store.records(key)] == [State.QUARANTINED]
    store.release(key, None)  # the operator re-arms it
    assert store.get(key) is None
    claim = store.claim(key, "C", LONG, DAY, "fp", WORKER_C)
    assert (claim.outcome, claim.crashes) == (ClaimOutcome.CLAIMED, 0)


def test_a_quarantined_record_expires_after_keep_for(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, None, WORKER_A)
    store.quarantine(key, "A", 0.5)
    assert store.get(key) is not None
    wait_for(lambda: store.get(key) is None, timeout=10, what="the quarantine to expire")
    assert store.claim(key, "B", LONG, DAY, None, WORKER_B).outcome is ClaimOutcome.CLAIMED


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_table_of_the_previous_version_gains_the_crashes_column(kind: str, tmp_path: Any) -> None:
    """A keys table made before quarantine existed gets its column on first use, and works."""
    import sqlalchemy as sa

    import taskonce

    first = make_store(kind, tmp_path)
    try:
        url, table = first.engine.url, first._table_label  # type: ignore[attr-defined]
        first.get("q:warm")  # the table made
        with first.engine.begin() as connection:  # type: ignore[attr-defined]
            connection.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN crashes")
        store = taskonce.open_store(url.render_as_string(hide_password=False), table=table)
        try:
            store.claim("q:a", "A", LONG, DAY, None, WORKER_A)
            assert store.take_over("q:a", "A", "B", LONG, DAY, WORKER_B) == 1
            store.quarantine("q:a", "B", DAY)
            assert store.get("q:a").status is Status.QUARANTINED  # type: ignore[union-attr]
            columns = [c["name"] for c in sa.inspect(store.engine).get_columns(table)]  # type: ignore[attr-defined]
            assert "crashes" in columns
        finally:
            store.close()
    finally:
        drop_store(first)
