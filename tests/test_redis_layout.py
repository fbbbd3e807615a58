"""The Redis store's packed record (taskonce.stores.redis.layout): what the layout must survive
beyond the store contract — texts that hold its separator, fingerprints of every shape, a
client that decodes replies, foreign keys under the prefix — and what it costs: a completed
eager record with the guard's fingerprint stays in Redis' smallest string class above the
floor's, and a new claim is one plain SET.

Each test starts its own redis-server and stops only that one, by its pid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from taskonce.errors import LeaseLost
from taskonce.keys import fingerprint
from taskonce.stores.base import Awaiting, ClaimOutcome, Status
from taskonce.stores.redis import RedisStore
from taskonce.stores.redis.layout import kind_of, packed_fp, parse, safe, unpacked_fp, unsafe
from tests.helpers import RedisServer

LEASE, KEEP = 300.0, 7 * 86400.0


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore(server.url, socket_timeout=2.0)
    try:
        yield store
    finally:
        store.close()


@pytest.mark.parametrize(
    "fp",
    [
        None,
        "",
        "f1",
        "ab" * 12,
        "ab" * 32,
        "AB12",
        "abc",
        "fp|1",
        "~x",
        "é|~",
        fingerprint("t", (), {}),
    ],
)
def test_every_fingerprint_comes_back_as_it_was_given(fp: str | None) -> None:
    packed = packed_fp(fp)
    assert "|" not in packed
    assert unpacked_fp(packed) == fp


@pytest.mark.parametrize("text", [None, "o1", "a|b", "~", "~x", "h/1/10/100", "é"])
def test_owner_and_worker_texts_come_back_as_they_were_given(text: str | None) -> None:
    assert "|" not in safe(text)
    assert unsafe(safe(text)) == text


def test_the_guards_fingerprint_packs_into_sixteen_characters() -> None:
    assert len(packed_fp(fingerprint("shop.charge", (1, "EUR"), {"a": 1}))) == 16


def test_texts_that_hold_the_separator_survive_every_script(store: RedisStore) -> None:
    key, owner, worker, fp = "q:a|b", "own|er", "host|1/2/3", "fp|x"
    assert store.claim(key, owner, LEASE, KEEP, fp, worker).outcome is ClaimOutcome.CLAIMED
    found = store.claim(key, "other", LEASE, KEEP, fp, "w").record
    assert found is not None and (found.owner, found.worker, found.fingerprint) == (
        owner,
        worker,
        fp,
    )
    store.renew(key, owner, 2 * LEASE)
    assert store.take_over(key, owner, "new|owner", LEASE, KEEP, "w|2")
    with pytest.raises(LeaseLost):
        store.complete(key, owner, KEEP, None)
    result, sends = '{"a":"x|y"}', ['{"id":"c|1","body":"é"}']
    store.complete(key, "new|owner", KEEP, result, sends, dispatch_lease=30)
    record = store.get(key)
    assert record is not None and record.status is Status.COMPLETED
    assert (record.result, record.sends, record.fingerprint) == (result, tuple(sends), fp)
    taken = store.take_sends(key, "tok|en", 60, 0)
    assert taken.retry_after > 0  # the recorder's lease still holds them
    assert store.take_sends(key, "new|owner", 60, 0).sends == tuple(sends)
    assert store.dispatched(key, "new|owner")
    record = store.get(key)
    assert record is not None and not record.sends_pending and record.result == result


def test_a_new_claim_is_one_plain_set_and_its_completion_one_script(
    store: RedisStore, client: redis.Redis
) -> None:
    store.claim("warm", "me", LEASE, KEEP, None)  # the scripts loaded, the connection open
    store.complete("warm", "me", KEEP, None)
    client.config_resetstat()
    store.claim("q:1", "me", LEASE, KEEP, fingerprint("t", (1,), {}), "host/1/2/3")
    store.complete("q:1", "me", KEEP, None)
    stats = client.info("commandstats")
    assert stats["cmdstat_set"]["calls"] == 2  # the claim's, and the one the script ran
    assert stats["cmdstat_evalsha"]["calls"] == 1
    names = {name.removeprefix("cmdstat_") for name in stats} - {"config|resetstat", "info"}
    assert names == {"set", "evalsha", "get", "pttl"}


def test_a_completed_record_with_the_guards_fingerprint_is_one_small_string(
    store: RedisStore, client: redis.Redis
) -> None:
    key = "default:0b7e4c52-2f0c-4a8e-9d0e-3c1f2b5a6d7e"
    store.claim(key, "0" * 32, LEASE, KEEP, fingerprint("shop.charge", (1,), {}), "h/1/2/3")
    store.complete(key, "0" * 32, KEEP, None)
    name = f"taskonce:{key}"
    assert client.type(name) == b"string" and client.object("encoding", name) == b"embstr"
    assert client.strlen(name) <= 28  # Redis' 48-byte class: 16 bytes above the floor's
    floor_name = "taskonce:default:5c2d9a1e-7b4f-4c3a-8e6d-1f0a9b8c7d6e"  # as long a name
    client.set(floor_name, "handled!", px=int(KEEP * 1000))
    floor = int(client.memory_usage(floor_name, samples=0))
    assert int(client.memory_usage(name, samples=0)) <= floor * 1.15


def test_created_at_is_the_first_claims_through_renew_take_over_and_completion(
    store: RedisStore,
) -> None:
    store.claim("k", "a", LEASE, KEEP, "f1", "w")
    first = store.get("k")
    assert first is not None and abs(first.created_at - time.time()) < 60
    time.sleep(0.05)
    store.renew("k", "a", 2 * LEASE)
    assert store.take_over("k", "a", "b", LEASE, KEEP, "w2")
    store.complete("k", "b", 2 * KEEP, None)
    done = store.get("k")
    assert done is not None and done.created_at == pytest.approx(first.created_at, abs=0.02)
    assert done.expires_at - time.time() == pytest.approx(2 * KEEP, abs=60)


def test_foreign_keys_under_the_prefix_are_left_out_of_scans(
    store: RedisStore, client: redis.Redis
) -> None:
    store.claim("q:mine", "me", LEASE, KEEP, None)
    client.set("taskonce:q:cat", "cat", px=60_000)  # a string that is no record
    client.set("taskonce:q:i", "i", px=60_000)
    client.hset("taskonce:q:hash", "st", "c")
    assert [r.key for r in store.records("q:")] == ["q:mine"]
    assert store.stats()["keys"] == 1
    assert store.keys_ending("cat") == []
    with pytest.raises(redis.exceptions.ResponseError):
        store.claim("q:cat", "me", LEASE, KEEP, None)
    assert parse(b"cat") is None and parse("i") is None and parse(None) is None


def test_a_client_that_decodes_replies_reads_every_record(server: RedisServer) -> None:
    client = redis.Redis.from_url(server.url, decode_responses=True)
    store = RedisStore(client=client, prefix="dec")
    try:
        store.claim("q:1", "me", LEASE, KEEP, fingerprint("t", (1,), {}), "w")
        store.complete("q:1", "me", KEEP, '"é"', ['{"id":"x"}'], dispatch_lease=1)
        store.mark("q:2", KEEP, "f1", None)
        found = store.claim("q:1", "other", LEASE, KEEP, None).record
        assert found is not None and found.result == '"é"' and found.sends_pending
        assert {r.key for r in store.records()} == {"q:1", "q:2"}
        assert store.take_sends("q:1", "me", 60, 0).sends == ('{"id":"x"}',)
        assert store.dispatched("q:1", "me", Awaiting('[{"key":"é"}]', 0, 60))
        assert store.due_for_relay().receipts == ["q:1"]
        assert store.take_receipts("q:1", "relay", 60).entries == '[{"key":"é"}]'
        assert store.have_records(["q:1", "q:3"]) == [True, False]
        assert store.purge() == 0 and store.stats()["receipts_awaited"] == 1
    finally:
        store.close()
        client.close()


def test_a_record_awaiting_receipts_keeps_the_layouts_shape(
    store: RedisStore, client: redis.Redis
) -> None:
    """Kinds ``a``/``b``: the shape of ``p``/``q`` with the due time where ``recorded`` was, the
    relay's token and lease let go when written, the entries length-prefixed; an empty due
    once they are given up on. The receipts index is scored by the due time (server ms)."""
    store.claim("q:e", "me", LEASE, KEEP, "f1")
    store.complete("q:e", "me", KEEP, '{"r":"|"}', ['{"id":"x"}'])
    store.mark("q:l", KEEP, None, None, ['{"id":"y"}'], "tok")
    entries = '[{"send":"|","key":"c:1"}]'
    assert store.dispatched("q:e", "me", Awaiting(entries, 10.0, 60.0))
    assert store.dispatched("q:l", "tok", Awaiting(entries, 10.0, 60.0))
    raw = client.get("taskonce:q:e")
    assert raw is not None and kind_of(raw) == "a" and kind_of(client.get("taskonce:q:l")) == "b"
    head = raw.split(b"|", 6)
    assert head[2] == b"" and int(head[5], 16) == len(entries)  # no token; the entries' size
    pttl = client.pttl("taskonce:q:e")
    assert int(head[3], 16) == pytest.approx(pttl - 10_000, abs=1_000)  # due: before expiry
    assert int(head[4], 16) >= pttl - 1_000  # the lease let go: it ended at the write
    fields = parse(raw)
    assert fields is not None and fields.receipts == entries and fields.result == '{"r":"|"}'
    assert fields.sends == () and fields.due == int(head[3], 16)
    seconds, micros = client.time()
    now = seconds * 1000 + micros // 1000
    assert client.zscore("taskonce!receipts", "q:e") == pytest.approx(now + 10_000, abs=1_000)
    assert client.zcard("taskonce!sends") == 0
    # given up on: kept for inspect with an empty due, out of the index
    due_now = b"%x" % (pttl + 60_000)  # due when PTTL <= due: a minute ago
    client.set("taskonce:q:e", b"|".join([*head[:3], due_now, *head[4:]]), keepttl=True)
    assert store.take_receipts("q:e", "relay", 60).entries == entries
    assert store.settle_receipts("q:e", "relay", Awaiting("[]", None, 0.0))
    raw = client.get("taskonce:q:e")
    fields = parse(raw)
    assert fields is not None and fields.due is None and fields.receipts == "[]"
    assert raw is not None and raw.split(b"|", 6)[3] == b""
    assert client.zscore("taskonce!receipts", "q:e") is None
    # the let-go token is empty, as in memory: the script clears it (the public method refuses
    # an empty token, which no caller has; the layout of the cleared record is the point here)
    assert store._settle_receipts("q:e", "", None)
    assert (
        client.get("taskonce:q:e")
        == b"c" + raw[1:].split(b"|", 2)[0] + b"|" + raw.split(b"|", 2)[1] + b'|{"r":"|"}'
    )


def test_a_hold_moves_every_offset_with_the_expiry(store: RedisStore) -> None:
    store.claim("q:k", "me", LEASE, 60.0, "f1")
    store.complete("q:k", "me", 60.0, None, ['{"id":"x"}'])
    before = store.get("q:k")
    assert store.dispatched("q:k", "me", Awaiting("[]", 30.0, 3600.0))
    after = store.get("q:k")
    assert before is not None and after is not None
    assert after.created_at == pytest.approx(before.created_at, abs=0.02)
    assert after.expires_at - time.time() == pytest.approx(3600, abs=5)
    assert store.take_receipts("q:k", "relay", 60).entries is None  # due in 30 s, not 3570
