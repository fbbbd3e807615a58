"""The store contract's hand-off part, on every store: sends recorded with complete/mark,
the dispatch lease, the fenced ``dispatched`` write, the relay's listing, purge."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import taskonce
from taskonce.errors import LeaseLost
from taskonce.stores import Status, Store
from tests.helpers import (
    DJANGO_KINDS,
    MARIADB_URL,
    POSTGRES_URL,
    REDIS_DEPLOYMENTS,
    STORE_KINDS,
    drop_store,
    make_store,
    require_service,
    wait_for,
)


@pytest.fixture(params=[*STORE_KINDS, *REDIS_DEPLOYMENTS, *DJANGO_KINDS])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    """Every store, and Redis as deployed (a cluster, a Sentinel-managed master)."""
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        drop_store(s)


SENDS = ('{"id":"a","framework":"python","body":{"x":"été"}}', '{"id":"b"}')


def test_complete_records_the_sends_with_the_mark(store: Store) -> None:
    store.claim("q:k", "o1", 60, 600, None)
    store.complete("q:k", "o1", 600, None, SENDS)
    record = store.get("q:k")
    assert record is not None and record.status is Status.COMPLETED
    assert record.sends_pending and record.sends == SENDS
    claim = store.claim("q:k", "o2", 60, 600, None)  # what a redelivery sees
    assert claim.record is not None and claim.record.sends_pending
    assert store.stats()["sends_pending"] == 1
    # the sends' dispatch token is the claim's owner token
    assert not store.dispatched("q:k", "o2")
    assert store.dispatched("q:k", "o1")
    assert not store.dispatched("q:k", "o1")  # once
    record = store.get("q:k")
    assert record is not None and not record.sends_pending and record.sends == ()
    assert record.status is Status.COMPLETED


def test_a_refused_write_records_no_sends(store: Store) -> None:
    store.claim("q:k", "o1", 60, 600, None)
    with pytest.raises(LeaseLost):
        store.complete("q:k", "intruder", 600, None, SENDS)
    assert store.due_for_relay().sends == []
    store.mark("q:m", 600, None, None)
    assert store.mark("q:m", 600, None, None, SENDS, "t") is False
    assert store.due_for_relay().sends == []


def test_dispatch_lease_fences_dispatchers(store: Store) -> None:
    assert store.mark("q:k", 600, None, None, SENDS, "worker") is True
    first = store.take_sends("q:k", "relay-1", 0.3)
    assert first.sends == SENDS and first.retry_after == 0
    second = store.take_sends("q:k", "relay-2", 0.3)
    assert second.sends == () and 0 < second.retry_after <= 0.3
    assert not store.dispatched("q:k", "worker")  # the lease moved the token on
    # relay-1 dies; once its lease ran out (store clock) relay-2 takes over
    wait_for(lambda: store.take_sends("q:k", "relay-2", 30).sends, timeout=10, what="lease")
    assert not store.dispatched("q:k", "relay-1")
    assert store.dispatched("q:k", "relay-2")
    assert store.take_sends("q:k", "relay-3", 30) == taskonce.stores.SendLease()


def test_the_recorder_holds_its_sends_while_it_publishes(store: Store) -> None:
    """complete/mark with a dispatch lease: a redelivery arriving between the record and the
    recorder's ``dispatched`` is told to wait, never handed the same sends to publish again."""
    store.claim("q:c", "owner", 60, 600, None)
    store.complete("q:c", "owner", 600, None, SENDS, 0.5)
    assert store.mark("q:m", 600, None, None, SENDS, "marker", 0.5) is True
    for key, recorder in (("q:c", "owner"), ("q:m", "marker")):
        waiting = store.take_sends(key, "redelivery", 30)
        assert waiting.sends == () and 0 < waiting.retry_after <= 0.5
        assert store.dispatched(key, recorder)  # the recorder still holds them
        assert store.take_sends(key, "redelivery", 30) == taskonce.stores.SendLease()
    # a recorder that died after the record: its hold runs out and a redelivery takes over
    store.mark("q:dead", 600, None, None, SENDS, "dead", 0.3)
    wait_for(lambda: store.take_sends("q:dead", "redelivery", 30).sends, timeout=10, what="hold")
    assert not store.dispatched("q:dead", "dead")
    assert store.dispatched("q:dead", "redelivery")


def test_relay_listing_oldest_first_and_by_age(store: Store) -> None:
    for name in ("q:a", "q:b", "q:c"):
        store.mark(name, 600, None, None, SENDS, "t")
        time.sleep(0.01)
    store.mark("q:none", 600, None, None)
    assert store.due_for_relay(0.0, 10).sends == ["q:a", "q:b", "q:c"]
    assert store.due_for_relay(0.0, 2).sends == ["q:a", "q:b"]
    assert store.due_for_relay(3600, 10).sends == []
    assert store.take_sends("q:a", "r", 30, older_than=3600).sends == ()  # too recent
    assert store.take_sends("q:a", "r", 30, older_than=0).sends == SENDS


def test_a_large_capture_is_stored_whole(store: Store) -> None:
    big = json.dumps({"id": "big", "framework": "python", "body": {"blob": "é" * 500_000}})
    store.mark("q:big", 600, None, None, (big,), "t")
    record = store.get("q:big")
    assert record is not None and record.sends == (big,)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_purge_keeps_expired_records_with_pending_sends(kind: str, tmp_path: Any) -> None:
    store: Store = (
        taskonce.MemoryStore()
        if kind == "memory"
        else taskonce.open_store(f"sqlite:///{tmp_path}/p.db")
    )
    store.mark("q:pending", 0.05, None, None, SENDS, "t")
    store.mark("q:plain", 0.05, None, None)
    wait_for(lambda: store.stats()["expired"] == 2, timeout=5, what="both to expire")
    assert store.expired() == 2  # what `taskonce stats` reads beside its scan
    assert store.purge() == 1
    assert store.expired() == 1  # the one kept for its pending sends
    assert store.due_for_relay().sends == ["q:pending"]
    assert store.get("q:pending") is None  # expired: a new delivery of the key may run
    lease = store.take_sends("q:pending", "relay", 30)
    assert lease.sends == SENDS and store.dispatched("q:pending", "relay")
    assert store.purge() == 1


@pytest.mark.parametrize("url", [POSTGRES_URL, MARIADB_URL, "sqlite"])
def test_a_table_made_before_the_hand_off_gets_its_columns(url: str, tmp_path: Any) -> None:
    if url == "sqlite":
        url = f"sqlite:///{tmp_path}/old.db"
    else:
        require_service("postgresql" if url.startswith("postgresql") else "mariadb")
    name = f"t_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(url)
    old = sa.Table(
        name,
        sa.MetaData(),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(64)),
        sa.Column("fingerprint", sa.String(64)),
        sa.Column("result", sa.Text()),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("lease_until", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
    )
    old.create(engine)
    engine.dispose()
    store = taskonce.open_store(url, table=name)
    try:
        store.claim("q:k", "o", 60, 600, None)
        store.complete("q:k", "o", 600, None, SENDS)
        record = store.get("q:k")
        assert record is not None and record.sends == SENDS
    finally:
        drop_store(store)
