"""The store contract's receipts part on the SQL stores (PostgreSQL, MariaDB, SQLite) and on
Django's connections to them: the ``receipts`` column (its due time in ``sends_at``) written by
``dispatched(awaiting=)``, the relay's lease on them, their write-back, the one-statement
``due_for_relay`` on the one ``sends_at`` index, and the table of an earlier version gaining
the column."""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import taskonce
from taskonce.stores import Status, Store
from taskonce.stores.base import Awaiting, ClaimOutcome
from tests.helpers import (
    DJANGO_KINDS,
    MARIADB_URL,
    POSTGRES_URL,
    drop_store,
    make_store,
    require_service,
    wait_for,
)

SQL_KINDS = ["postgresql", "mariadb", "sqlite"]


@pytest.fixture(params=[*SQL_KINDS, *DJANGO_KINDS])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    """Every SQL store: SQLAlchemy's engines and Django's connections."""
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        drop_store(s)


SEND = '{"id":"a","framework":"python","body":{"x":"été"}}'
ENTRIES = json.dumps([{"send": SEND, "key": "child:a", "at": 0.0}], separators=(",", ":"))


def sent(store: Store, key: str, token: str = "t1", keep_for: float = 600) -> None:
    """``key`` marked with one pending send whose dispatch token is ``token``."""
    assert store.mark(key, keep_for, None, None, (SEND,), token=token, dispatch_lease=30)


def awaiting(store: Store, key: str, due: float | None, hold: float = 600) -> None:
    """``key`` marked and its send published, awaiting its receipt ``due`` seconds from now."""
    sent(store, key)
    assert store.dispatched(key, "t1", Awaiting(ENTRIES, due, hold))


def test_dispatched_with_awaiting_keeps_the_entries_and_lets_the_lease_go(store: Store) -> None:
    sent(store, "q:a")
    assert not store.dispatched("q:a", "other", Awaiting(ENTRIES, 0.0, 600))  # fenced
    assert store.dispatched("q:a", "t1", Awaiting(ENTRIES, 0.0, 600))
    assert not store.dispatched("q:a", "t1", Awaiting(ENTRIES, 0.0, 600))  # once
    record = store.get("q:a")
    assert record is not None and record.status is Status.COMPLETED
    assert not record.sends_pending and record.sends == ()
    assert record.receipts == ENTRIES
    # its due time is in sends_at, yet it has no sends pending to anything that means those
    assert store.due_for_relay().sends == [] and store.due_for_relay().sends == []
    assert store.stats()["sends_pending"] == 0 and store.stats()["receipts_awaited"] == 1
    assert store.take_sends("q:a", "t2", 30).sends == ()
    assert not store.dispatched("q:a", "t1")
    # the lease was let go: any relay may take the receipts (due at once)
    assert store.take_receipts("q:a", "r1", 30).entries == ENTRIES
    assert store.take_sends("q:a", "r1", 30).sends == ()  # the relay's token: still no sends
    assert not store.dispatched("q:a", "r1")


def test_pending_sends_are_not_receipts(store: Store) -> None:
    """A record with sends pending has a sends_at too: no half of the relay's work but the
    sends' sees it, and purge keeps it even once expired."""
    sent(store, "q:a", keep_for=0.3)
    assert store.take_receipts("q:a", "t1", 30).entries is None
    assert not store.settle_receipts("q:a", "t1", None)
    assert not store.settle_receipts("q:a", "t1", Awaiting(ENTRIES, 0.0, 600))
    assert store.due_for_relay() == taskonce.stores.base.DueForRelay(["q:a"], [])
    assert store.stats()["receipts_awaited"] == 0
    time.sleep(0.5)
    assert store.purge() == 0
    assert store.due_for_relay().sends == ["q:a"]


def test_an_awaiting_record_that_expired_is_purged(store: Store) -> None:
    """Its expiry was extended by its hold; once past that it goes as any expired record."""
    sent(store, "q:a", keep_for=0.2)
    assert store.dispatched("q:a", "t1", Awaiting(ENTRIES, 60.0, 0.3))
    time.sleep(0.6)
    assert store.purge() == 1
    assert store.due_for_relay() == taskonce.stores.base.DueForRelay([], [])


def test_dispatched_without_awaiting_keeps_no_receipts(store: Store) -> None:
    sent(store, "q:a")
    assert store.dispatched("q:a", "t1")
    record = store.get("q:a")
    assert record is not None and record.receipts is None
    assert store.due_for_relay() == taskonce.stores.base.DueForRelay([], [])
    assert store.stats()["receipts_awaited"] == 0


def test_due_for_relay_shows_receipts_only_once_due(store: Store) -> None:
    awaiting(store, "q:later", 1.5)
    assert store.due_for_relay().receipts == []
    assert store.take_receipts("q:later", "r1", 30).entries is None  # not due: nothing
    wait_for(lambda: store.due_for_relay().receipts == ["q:later"], timeout=10, what="due")
    assert store.take_receipts("q:later", "r1", 30).entries == ENTRIES


def test_due_for_relay_lists_both_halves_oldest_first_within_the_limit(store: Store) -> None:
    for name in ("s1", "s2", "s3"):
        sent(store, f"q:{name}")
        time.sleep(0.02)  # distinct sends_at
    assert store.dispatched("q:s3", "t1")  # published, nothing awaited
    for name, due in (("r2", -2.0), ("r1", -3.0), ("r3", -1.0), ("later", 60.0)):
        awaiting(store, f"q:{name}", due)
    due = store.due_for_relay()
    assert due.sends == store.due_for_relay().sends == ["q:s1", "q:s2"]
    assert due.receipts == ["q:r1", "q:r2", "q:r3"]  # earliest due first; q:later not yet
    limited = store.due_for_relay(limit=1)
    assert limited.sends == store.due_for_relay(limit=1).sends == ["q:s1"]
    assert limited.receipts == ["q:r1"]
    # older_than applies to the sends only, as pending_sends
    old = store.due_for_relay(older_than=3600)
    assert old.sends == store.due_for_relay(older_than=3600).sends == []
    assert old.receipts == ["q:r1", "q:r2", "q:r3"]
    assert store.stats()["receipts_awaited"] == 4
    assert store.stats()["sends_pending"] == 2


def test_take_receipts_is_a_lease_fenced_by_its_token(store: Store) -> None:
    awaiting(store, "q:a", -1.0)
    taken = store.take_receipts("q:a", "r1", 30)
    assert taken.entries == ENTRIES and taken.retry_after == 0
    assert 0.9 <= taken.late < 30  # due a second ago
    held = store.take_receipts("q:a", "r2", 30)
    assert held.entries is None and 25 < held.retry_after <= 30
    assert store.take_receipts("q:a", "r1", 30).entries == ENTRIES  # the holder renews it
    assert not store.settle_receipts("q:a", "r2", None)  # not r2's
    assert store.take_receipts("q:a", "r1", 0).entries == ENTRIES  # lease 0: let go
    assert store.take_receipts("q:a", "r2", 30).entries == ENTRIES
    assert store.take_receipts("q:nothing", "r1", 30).entries is None


def test_settle_none_clears_the_receipts(store: Store) -> None:
    awaiting(store, "q:a", 0.0)
    assert store.take_receipts("q:a", "r1", 30).entries == ENTRIES
    assert store.settle_receipts("q:a", "r1", None)
    assert not store.settle_receipts("q:a", "r1", None)  # once: the token went with them
    record = store.get("q:a")
    assert record is not None and record.receipts is None
    assert store.due_for_relay().receipts == []
    assert store.stats()["receipts_awaited"] == 0
    assert store.take_receipts("q:a", "r1", 30).entries is None


def test_settle_with_a_new_due_time_writes_the_entries_back(store: Store) -> None:
    awaiting(store, "q:a", 0.0)
    assert store.take_receipts("q:a", "r1", 300).entries == ENTRIES
    again = json.dumps([{"send": SEND, "key": "child:a", "at": 0.0, "tries": 1}])
    assert store.settle_receipts("q:a", "r1", Awaiting(again, 1.0, 600))
    record = store.get("q:a")
    assert record is not None and record.receipts == again
    assert store.due_for_relay().receipts == []  # not due for a second
    wait_for(lambda: store.due_for_relay().receipts == ["q:a"], timeout=10, what="due again")
    assert store.take_receipts("q:a", "r2", 30).entries == again  # r1's lease was let go


def test_settle_without_a_due_time_keeps_the_entries_out_of_the_index(store: Store) -> None:
    awaiting(store, "q:a", 0.0)
    assert store.take_receipts("q:a", "r1", 30).entries == ENTRIES
    given_up = json.dumps([{"send": SEND, "key": "child:a", "at": 0, "unconfirmed": True}])
    assert store.settle_receipts("q:a", "r1", Awaiting(given_up, None, 0.0))
    record = store.get("q:a")
    assert record is not None and record.receipts == given_up  # kept for taskonce inspect
    assert store.due_for_relay() == taskonce.stores.base.DueForRelay([], [])
    assert store.stats()["receipts_awaited"] == 0 and store.stats()["sends_pending"] == 0
    assert store.take_receipts("q:a", "r1", 30).entries is None
    assert store.take_sends("q:a", "r1", 30).sends == ()
    assert [r.receipts for r in store.records("q:")] == [given_up]


def test_hold_keeps_the_record_past_its_keep_for_and_purge_spares_it(store: Store) -> None:
    sent(store, "q:a", keep_for=1)
    before = store.get("q:a")
    assert before is not None
    assert store.dispatched("q:a", "t1", Awaiting(ENTRIES, 60.0, 5.0))
    record = store.get("q:a")
    assert record is not None and record.expires_at >= before.expires_at + 3.5
    time.sleep(2)
    assert store.purge() == 0
    assert store.get("q:a") is not None
    assert store.have_records(["q:a"]) == [True]
    # a shorter hold never shortens a longer expiry
    assert store.take_receipts("q:a", "r1", 30).entries is None  # not due for a minute
    sent(store, "q:b", keep_for=600)
    assert store.dispatched("q:b", "t1", Awaiting(ENTRIES, 0.0, 5.0))
    kept = store.get("q:b")
    assert kept is not None and kept.expires_at > time.time() + 500


def test_have_records_answers_in_order_for_every_kind_of_record(store: Store) -> None:
    store.claim("q:claimed", "o1", 60, 600, None)
    store.claim("q:completed", "o2", 60, 600, None)
    store.complete("q:completed", "o2", 600, None)
    store.mark("q:marked", 600, None, None)
    store.mark("q:expired", 0.5, None, None)
    awaiting(store, "q:awaiting", 60.0)
    time.sleep(0.7)
    keys = ["q:absent", "q:marked", "q:expired", "q:claimed", "q:completed", "q:awaiting"]
    assert store.have_records(keys) == [False, True, False, True, True, True]
    assert store.have_records(["q:marked", "q:marked", "Q:MARKED"]) == [True, True, False]
    assert store.have_records([]) == []
    many = [f"q:n{i}" for i in range(300)] + ["q:claimed"]
    assert store.have_records(many) == [False] * 300 + [True]


def test_a_duplicate_delivery_of_an_awaiting_record_is_still_skipped(store: Store) -> None:
    store.claim("q:a", "o1", 60, 600, None)
    store.complete("q:a", "o1", 600, None, (SEND,), dispatch_lease=30)
    assert store.dispatched("q:a", "o1", Awaiting(ENTRIES, 60.0, 600))
    claim = store.claim("q:a", "o2", 60, 600, None)
    assert claim.outcome is ClaimOutcome.EXISTS
    assert claim.record is not None and claim.record.status is Status.COMPLETED
    assert not store.mark("q:a", 600, None, None)


def test_an_expired_awaiting_record_replaced_by_a_new_one_awaits_nothing(store: Store) -> None:
    sent(store, "q:a", keep_for=0.3)
    assert store.dispatched("q:a", "t1", Awaiting(ENTRIES, 0.0, 0.3))
    sent(store, "q:b", keep_for=0.3)
    assert store.dispatched("q:b", "t1", Awaiting(ENTRIES, 0.0, 0.3))
    time.sleep(0.6)
    assert store.claim("q:a", "o1", 60, 600, None).outcome is ClaimOutcome.CLAIMED
    assert store.mark("q:b", 600, None, None)
    for key in ("q:a", "q:b"):
        record = store.get(key)
        assert record is not None and record.receipts is None
    assert store.due_for_relay().receipts == []
    assert store.stats()["receipts_awaited"] == 0


def test_one_relay_index_serves_sends_and_receipts(store: Store) -> None:
    """No index of the receipts' own: their due time is ``sends_at``, under its index."""
    if type(store).__name__ == "DjangoStore":
        from django.db import connections

        wrapper = connections[store.alias]  # type: ignore[attr-defined]
        with wrapper.cursor() as cursor:
            indexes = wrapper.introspection.get_constraints(cursor, "taskonce_keys")
        columns = {name: info["columns"] for name, info in indexes.items() if info["index"]}
    else:
        store.create_tables()  # type: ignore[attr-defined]  # made on first use otherwise
        table = store._table  # type: ignore[attr-defined]
        found = sa.inspect(store.engine).get_indexes(table.name)  # type: ignore[attr-defined]
        columns = {index["name"]: index["column_names"] for index in found}
    assert ["sends_at"] in columns.values()
    assert not [c for c in columns.values() if "receipts" in c or "receipts_at" in c]


# 50,000 records: every tenth awaits receipts due in an hour or more, every tenth (+1) gave
# them up (receipts kept, sends_at NULL), every tenth (+2) has sends pending recorded in an hour
# (a clock ahead: not due), the rest are plain completions with nothing for the relay.
_ROWS = (
    "SELECT {key}, CASE WHEN g % 10 = 2 THEN 'sending' ELSE 'completed' END, 0, 0, 1e10, "
    "CASE WHEN g % 10 IN (0, 1) THEN '[]' END, CASE WHEN g % 10 = 2 THEN '[]' END, "
    "CASE WHEN g % 10 IN (0, 2) THEN {now} + 3600 + g END"
)
_SERIES = {
    "postgresql": "FROM generate_series(1, 50000) AS g",
    "mariadb": "FROM (SELECT seq AS g FROM seq_1_to_50000) AS s",
    "sqlite": "FROM s",
}
_NOW = {
    "postgresql": "extract(epoch from now())",
    "mariadb": "UNIX_TIMESTAMP()",
    "sqlite": "CAST(strftime('%s', 'now') AS REAL)",
}


def _fill(store: Any, kind: str) -> None:
    """The 50,000 records above in ``store``'s table, its statistics up to date."""
    table = store._table_label
    key = "CONCAT('q:', g)" if kind == "mariadb" else "'q:' || g"
    rows = _ROWS.format(key=key, now=_NOW[kind])
    if kind == "sqlite":
        rows = (
            "WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < 50000) "
            + rows
        )
    insert = (
        f"INSERT INTO {table} ({'`key`' if kind == 'mariadb' else 'key'}, status, created_at, "
        f"lease_until, expires_at, receipts, sends, sends_at) {rows} {_SERIES[kind]}"
    )
    with store.engine.begin() as connection:
        # a driver with pyformat placeholders reads % in the text
        connection.exec_driver_sql(insert.replace("%", "%%") if kind != "sqlite" else insert)
        connection.exec_driver_sql(f"ANALYZE {'TABLE ' if kind == 'mariadb' else ''}{table}")


def _plan(store: Any, kind: str) -> str:
    """The database's plan of ``due_for_relay``'s one statement, as text."""
    compiled = store._sql.due_for_relay.compile(store.engine)
    params = compiled.construct_params({"p_age": 0.0, "p_limit": 100})
    explain = "EXPLAIN QUERY PLAN" if kind == "sqlite" else "EXPLAIN"
    with store.engine.connect() as connection:
        cursor = connection.connection.driver_connection.cursor()
        if compiled.positiontup is not None:  # SQLite's qmark placeholders
            cursor.execute(f"{explain} {compiled}", [params[n] for n in compiled.positiontup])
        else:  # psycopg's and PyMySQL's named ones
            cursor.execute(f"{explain} {compiled}", params)
        rows = cursor.fetchall()
    if kind == "mariadb":
        names = [d[0] for d in cursor.description]
        return "\n".join(str(dict(zip(names, row, strict=True))) for row in rows)
    return "\n".join(str(row[-1] if kind == "sqlite" else row[0]) for row in rows)


@pytest.mark.parametrize("kind", SQL_KINDS)
def test_both_halves_are_index_range_scans_of_sends_at(kind: str) -> None:
    """Many records with nothing due (receipts due later, given up, sends recorded 'later',
    plain completions): each half of the relay's one statement reads the ``sends_at`` index up
    to now (PostgreSQL: its clock read once), never every record."""
    url = {"postgresql": POSTGRES_URL, "mariadb": MARIADB_URL}.get(kind)
    if url is None:
        url = f"sqlite:///{tempfile.mkdtemp()}/plan.db"
    else:
        require_service(kind)
    store: Any = taskonce.open_store(url, table=f"t_{uuid.uuid4().hex[:10]}")
    try:
        store.create_tables()
        _fill(store, kind)
        table = store._table_label
        index = f"ix_{table}_sends_at"
        plan = _plan(store, kind)
        if kind == "postgresql":
            assert plan.count(f"Index Scan using {index}") == 2, plan
            assert plan.count("Index Cond: (sends_at <=") == 2, plan
            assert f"Seq Scan on {table}" not in plan, plan
        elif kind == "mariadb":
            scans = [line for line in plan.splitlines() if f"'table': '{table}'" in line]
            assert len(scans) == 2, plan
            for line in scans:
                assert f"'key': '{index}'" in line and "'type': 'range'" in line, plan
        else:
            assert plan.count(f"USING INDEX {index} (sends_at<?)") == 2, plan
            assert f"SCAN {table}" not in plan, plan
        assert store.due_for_relay() == taskonce.stores.base.DueForRelay([], [])
        assert store.stats()["receipts_awaited"] == 5000
        assert store.stats()["sends_pending"] == 5000
    finally:
        drop_store(store)


def test_a_table_of_the_previous_version_gains_the_receipts_column(tmp_path: Any) -> None:
    """A keys table made before receipts existed gets the one column on first use (no index:
    the due time is ``sends_at``), and works."""
    url = f"sqlite:///{tmp_path}/old.db"
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.exec_driver_sql(
            "CREATE TABLE taskonce_keys (key VARCHAR(255) PRIMARY KEY, status VARCHAR(16) NOT "
            "NULL, owner VARCHAR(64), fingerprint VARCHAR(64), result TEXT, created_at FLOAT "
            "NOT NULL, lease_until FLOAT NOT NULL, expires_at FLOAT NOT NULL, worker "
            "VARCHAR(255), sends TEXT, sends_token VARCHAR(64), sends_at FLOAT, sends_lease "
            "FLOAT)"
        )
        connection.exec_driver_sql(
            "CREATE INDEX ix_taskonce_keys_sends_at ON taskonce_keys (sends_at)"
        )
    engine.dispose()
    store = taskonce.open_store(url)
    try:
        awaiting(store, "q:a", 0.0)
        assert store.due_for_relay().receipts == ["q:a"]
        inspector = sa.inspect(store.engine)  # type: ignore[attr-defined]
        columns = [c["name"] for c in inspector.get_columns("taskonce_keys")]
        # and the columns of versions since (crash-loop quarantine's crashes)
        assert columns[-2:] == ["receipts", "crashes"] and "receipts_at" not in columns
        indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes("taskonce_keys")}
        assert indexes == {"ix_taskonce_keys_sends_at": ["sends_at"]}
    finally:
        store.close()
