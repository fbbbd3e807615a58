"""The Redis store's hot path: a record's expiry is the key's own, and the connection the store
keeps for its script calls recovers from a restart of Redis as the pool's connections do.

Each test starts its own redis-server and stops only that one, by its pid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from taskonce.errors import StoreUnavailable
from taskonce.stores.base import ClaimOutcome, Status
from taskonce.stores.redis import RedisStore
from tests.helpers import RedisServer

LEASE = 60.0
KEEP = 3600.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore(server.url, prefix="hot", socket_timeout=2.0)
    try:
        yield store
    finally:
        store.close()


def pttl_s(server: RedisServer, key: str) -> float:
    client = redis.Redis.from_url(server.url)
    try:
        return int(client.pttl(f"hot:{key}")) / 1000.0
    finally:
        client.close()


def test_a_records_expiry_is_the_keys_own_through_claim_renew_and_complete(
    server: RedisServer, store: RedisStore
) -> None:
    assert store.claim("k", "me", LEASE, KEEP, "fp", "w").outcome is ClaimOutcome.CLAIMED
    ttl = pttl_s(server, "k")
    assert LEASE + KEEP - 60 < ttl <= LEASE + KEEP
    record = store.get("k")
    assert record is not None and record.status is Status.IN_PROGRESS
    assert abs(record.expires_at - (time.time() + ttl)) < 60
    assert LEASE - 60 < record.lease_remaining <= LEASE

    store.renew("k", "me", 2 * LEASE)  # the expiry moves as far as the lease's end
    assert LEASE + KEEP + LEASE - 60 < pttl_s(server, "k") <= 2 * LEASE + KEEP
    store.renew("k", "me", LEASE / 2)  # a shorter lease leaves the expiry where it was
    assert LEASE + KEEP + LEASE - 60 < pttl_s(server, "k") <= 2 * LEASE + KEEP
    record = store.get("k")
    assert record is not None and record.lease_remaining <= LEASE / 2

    store.complete("k", "me", KEEP, None)
    assert KEEP - 60 < pttl_s(server, "k") <= KEEP
    record = store.get("k")
    assert record is not None and record.status is Status.COMPLETED
    assert record.owner is None and record.worker is None and not record.marked
    assert abs(record.expires_at - (time.time() + KEEP)) < 60

    assert store.mark("m", KEEP, None, '"r"')
    assert KEEP - 60 < pttl_s(server, "m") <= KEEP
    marked = store.get("m")
    assert marked is not None and marked.marked and marked.result == '"r"'
    listed = {r.key: r for r in store.records()}
    assert set(listed) == {"k", "m"}
    assert abs(listed["m"].expires_at - marked.expires_at) < 60


def test_a_record_past_its_expiry_is_absent_to_every_script(
    server: RedisServer, store: RedisStore
) -> None:
    assert store.mark("gone", 0.05, "fp", None)
    client = redis.Redis.from_url(server.url)
    try:
        deadline = time.monotonic() + 30
        while client.exists("hot:gone") and time.monotonic() < deadline:
            time.sleep(0.05)  # Redis expires the key itself; wait until it has
        assert not client.exists("hot:gone")
    finally:
        client.close()
    assert store.get("gone") is None
    assert store.claim("gone", "me", LEASE, KEEP, "other", "w").outcome is ClaimOutcome.CLAIMED


def test_a_redis_restart_between_calls_is_not_seen_by_the_next_call(
    server: RedisServer, store: RedisStore
) -> None:
    assert store.claim("a", "me", LEASE, KEEP, None).outcome is ClaimOutcome.CLAIMED
    server.stop()
    server.start()  # same port, empty: the kept connection's socket is dead
    # The store's client retries once after a connection error: the call reconnects.
    assert store.claim("b", "me", LEASE, KEEP, None).outcome is ClaimOutcome.CLAIMED
    store.complete("b", "me", KEEP, None)
    assert store.get("b") is not None


def test_redis_down_is_store_unavailable_and_the_store_recovers(
    server: RedisServer, store: RedisStore
) -> None:
    assert store.claim("a", "me", LEASE, KEEP, None).outcome is ClaimOutcome.CLAIMED
    server.stop()
    with pytest.raises(StoreUnavailable):
        store.claim("b", "me", LEASE, KEEP, None)
    with pytest.raises(StoreUnavailable):
        store.get("b")
    server.start()
    assert store.claim("b", "me", LEASE, KEEP, None).outcome is ClaimOutcome.CLAIMED


def test_a_flushed_script_cache_is_reloaded_on_the_kept_connection(
    server: RedisServer, store: RedisStore
) -> None:
    assert store.claim("a", "me", LEASE, KEEP, None).outcome is ClaimOutcome.CLAIMED
    client = redis.Redis.from_url(server.url)
    try:
        client.script_flush()
    finally:
        client.close()
    store.complete("a", "me", KEEP, None)
    record = store.get("a")
    assert record is not None and record.status is Status.COMPLETED
