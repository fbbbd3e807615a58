"""The store contract, run against every store: Memory, Redis, PostgreSQL, MariaDB, SQLite."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from taskonce.errors import LeaseLost
from taskonce.stores import ClaimOutcome, Status, Store
from tests.helpers import (
    DJANGO_KINDS,
    REDIS_DEPLOYMENTS,
    STORE_KINDS,
    drop_store,
    make_store,
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


LONG = 60.0
DAY = 86400.0


def new_key() -> str:
    return f"q:{uuid.uuid4()}"


def wait_lease_expired(store: Store, key: str) -> None:
    wait_for(
        lambda: (r := store.get(key)) is not None and r.lease_remaining == 0,
        timeout=10,
        what=f"lease of {key} to run out by the store's clock",
    )


def test_claim_on_nothing_claims_and_records_owner(store: Store) -> None:
    key = new_key()
    assert store.claim(key, "A", LONG, DAY, "fp1").outcome is ClaimOutcome.CLAIMED
    record = store.get(key)
    assert record is not None
    assert record.status is Status.IN_PROGRESS
    assert record.owner == "A"
    assert record.fingerprint == "fp1"
    assert 50 < record.lease_remaining <= LONG
    assert record.expires_at > record.created_at + LONG


def test_second_claim_while_lease_alive_reports_the_claim(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, "fp1")
    claim = store.claim(key, "B", LONG, DAY, "fp1")
    assert claim.outcome is ClaimOutcome.EXISTS
    assert claim.record is not None
    assert claim.record.owner == "A"
    assert claim.record.status is Status.IN_PROGRESS
    assert claim.record.lease_remaining > 50
    assert store.get(key).owner == "A"  # type: ignore[union-attr]


def test_complete_turns_claim_into_mark_with_result(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, "fp1")
    store.complete(key, "A", DAY, '{"paid": 12}')
    record = store.get(key)
    assert record is not None
    assert record.status is Status.COMPLETED
    assert record.result == '{"paid": 12}'
    assert record.fingerprint == "fp1"
    assert record.lease_remaining == 0
    assert DAY - 60 < record.expires_at - time.time() < DAY + 60
    claim = store.claim(key, "B", LONG, DAY, "fp1")
    assert claim.outcome is ClaimOutcome.EXISTS
    assert claim.record is not None and claim.record.status is Status.COMPLETED


def test_fenced_writes_refuse_another_owner(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, None)
    with pytest.raises(LeaseLost, match="complete refused"):
        store.complete(key, "B", DAY, None)
    with pytest.raises(LeaseLost, match="release refused"):
        store.release(key, "B")
    with pytest.raises(LeaseLost, match="renew refused"):
        store.renew(key, "B", LONG)
    record = store.get(key)
    assert record is not None and record.owner == "A" and record.status is Status.IN_PROGRESS


def test_fenced_writes_on_a_missing_key_raise(store: Store) -> None:
    key = new_key()
    with pytest.raises(LeaseLost):
        store.complete(key, "A", DAY, None)
    with pytest.raises(LeaseLost):
        store.release(key, "A")
    with pytest.raises(LeaseLost):
        store.renew(key, "A", LONG)
    assert store.get(key) is None


def test_complete_twice_is_refused(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, None)
    store.complete(key, "A", DAY, None)
    with pytest.raises(LeaseLost):
        store.complete(key, "A", DAY, None)


def test_release_frees_the_key_for_a_retry(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, "fp")
    store.release(key, "A")
    assert store.get(key) is None
    assert store.claim(key, "B", LONG, DAY, "fp").outcome is ClaimOutcome.CLAIMED


def test_operator_release_deletes_any_record(store: Store) -> None:
    claimed, marked = new_key(), new_key()
    store.claim(claimed, "A", LONG, DAY, None)
    store.mark(marked, DAY, None, None)
    store.release(claimed, None)
    store.release(marked, None)
    store.release(new_key(), None)  # nothing there: no error
    assert store.get(claimed) is None
    assert store.get(marked) is None


def test_renew_extends_the_lease(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", 2.0, DAY, None)
    store.renew(key, "A", LONG)
    record = store.get(key)
    assert record is not None and record.lease_remaining > 50
    assert record.expires_at > time.time() + LONG


def test_expired_lease_is_taken_over_and_the_stale_owner_is_fenced(store: Store) -> None:
    key = new_key()
    assert store.claim(key, "A", 0.3, DAY, "fp").outcome is ClaimOutcome.CLAIMED
    wait_lease_expired(store, key)
    assert store.claim(key, "B", LONG, DAY, "fp").outcome is ClaimOutcome.TAKEN_OVER
    with pytest.raises(LeaseLost):
        store.complete(key, "A", DAY, None)
    with pytest.raises(LeaseLost):
        store.release(key, "A")
    with pytest.raises(LeaseLost):
        store.renew(key, "A", LONG)
    store.complete(key, "B", DAY, '"ok"')
    record = store.get(key)
    assert record is not None and record.status is Status.COMPLETED and record.result == '"ok"'


def test_expired_lease_with_another_fingerprint_is_not_taken_over(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", 0.3, DAY, "fp-one")
    wait_lease_expired(store, key)
    claim = store.claim(key, "B", LONG, DAY, "fp-two")
    assert claim.outcome is ClaimOutcome.EXISTS
    assert claim.record is not None and claim.record.fingerprint == "fp-one"
    assert store.get(key).owner == "A"  # type: ignore[union-attr]


def test_lease_is_judged_by_the_store_clock(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, None)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    claim = store.claim(key, "B", LONG, DAY, None)
    assert claim.outcome is ClaimOutcome.EXISTS
    assert claim.record is not None and claim.record.lease_remaining > 50


def test_mark_writes_once(store: Store) -> None:
    key = new_key()
    assert store.mark(key, DAY, "fp", "[1,2]") is True
    assert store.mark(key, DAY, "fp", None) is False
    record = store.get(key)
    assert record is not None
    assert record.status is Status.COMPLETED and record.result == "[1,2]" and record.owner is None
    assert store.claim(key, "A", LONG, DAY, "fp").outcome is ClaimOutcome.EXISTS


def test_mark_refuses_while_a_claim_is_live(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, None)
    assert store.mark(key, DAY, None, None) is False
    assert store.get(key).status is Status.IN_PROGRESS  # type: ignore[union-attr]


def test_expired_mark_counts_as_nothing(store: Store) -> None:
    key, other = new_key(), new_key()
    store.mark(key, 0.3, "fp", None)
    store.mark(other, 0.3, "fp", None)
    marked = time.monotonic()  # ``other`` expires by then + 0.3 s: it was written before
    wait_for(lambda: store.get(key) is None, timeout=10, what="mark to expire")
    # ``other`` is never read before its mark below; it was written a moment after ``key`` (a
    # moment that a loaded machine can stretch), so wait out its own expiry too.
    wait_for(lambda: time.monotonic() > marked + 0.35, timeout=10, what="other mark to expire")
    assert store.claim(key, "A", LONG, DAY, "other-fp").outcome is ClaimOutcome.CLAIMED
    assert store.mark(other, DAY, "fp", None) is True


def test_purge_deletes_expired_records_in_batches(store: Store) -> None:
    keep = new_key()
    store.mark(keep, DAY, None, None)
    expiring = [new_key() for _ in range(25)]
    for key in expiring:
        store.mark(key, 0.2, None, None)
    wait_for(lambda: all(store.get(k) is None for k in expiring), what="marks to expire")
    deleted = store.purge(batch=10)
    # Redis expires keys itself (deleted == 0); the others delete all 25 in three batches.
    assert deleted in (0, 25)
    stats = store.stats()
    assert stats["keys"] == 1 and stats["expired"] == 0
    assert store.get(keep) is not None


def test_stats_count_claims_and_marks(store: Store) -> None:
    for _ in range(3):
        store.claim(new_key(), "A", LONG, DAY, None)
    for _ in range(2):
        store.mark(new_key(), DAY, None, None)
    stats = store.stats()
    assert (stats["keys"], stats["in_progress"], stats["completed"]) == (5, 3, 2)


def test_records_tell_a_lazy_mark_from_an_eager_completion(store: Store) -> None:
    claimed, completed, marked = (f"st_{uuid.uuid4().hex[:8]}:{n}" for n in ("a", "b", "c"))
    store.claim(claimed, "A", LONG, DAY, None)
    store.claim(completed, "A", LONG, DAY, None)
    store.complete(completed, "A", DAY, None)
    store.mark(marked, DAY, None, None)
    states = {key: store.get(key).state for key in (claimed, completed, marked)}  # type: ignore[union-attr]
    assert states == {claimed: "claimed", completed: "completed", marked: "marked"}
    assert store.get(completed).as_dict()["state"] == "completed"  # type: ignore[union-attr]
    assert store.get(completed).lease_remaining == 0  # type: ignore[union-attr]


def test_records_lists_live_records_by_key_prefix(store: Store) -> None:
    queue = f"q%_{uuid.uuid4().hex[:8]}"  # LIKE / glob specials are literal
    store.claim(f"{queue}:1", "A", LONG, DAY, None)
    store.mark(f"{queue}:2", DAY, None, None)
    store.mark(f"{queue}x:3", DAY, None, None)
    store.mark(f"{queue}:gone", 0.01, None, None)
    wait_for(lambda: store.get(f"{queue}:gone") is None, what="the short mark to expire")
    found = {r.key: r.state for r in store.records(f"{queue}:")}
    assert found == {f"{queue}:1": "claimed", f"{queue}:2": "marked"}
    assert {f"{queue}:1", f"{queue}:2", f"{queue}x:3"} <= {r.key for r in store.records()}


def test_describe_names_the_store(store: Store) -> None:
    assert type(store).__name__.replace("Store", "") in store.describe()


@pytest.mark.parametrize("kind", ["redis", "postgresql", "mariadb", "sqlite", *REDIS_DEPLOYMENTS])
def test_store_opened_in_parent_works_in_forked_child(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = make_store(kind, tmp_path)
    try:
        parent_key, child_key = new_key(), new_key()
        store.claim(parent_key, "parent", LONG, DAY, None)  # the parent's pool holds a connection
        pid = os.fork()
        if pid == 0:  # child: use the inherited store, report through the exit code
            code = 1
            try:
                ok = store.claim(child_key, "child", LONG, DAY, None).outcome
                seen = store.get(parent_key)
                code = 0 if ok is ClaimOutcome.CLAIMED and seen and seen.owner == "parent" else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        record = store.get(child_key)  # the parent's connection still works after the fork
        assert record is not None and record.owner == "child"
    finally:
        drop_store(store)


# -- worker identity, liveness records and the fenced takeover ------------------------------

WORKER_A, WORKER_B = "host-a/4026531836/100/5000", "host-b/4026531836/200/6000"


def test_claim_records_the_owners_worker_identity_until_complete(store: Store) -> None:
    key = new_key()
    assert store.claim(key, "A", LONG, DAY, None, WORKER_A).outcome is ClaimOutcome.CLAIMED
    record = store.get(key)
    assert record is not None and record.worker == WORKER_A
    found = store.claim(key, "B", LONG, DAY, None, WORKER_B)
    assert found.outcome is ClaimOutcome.EXISTS
    assert found.record is not None and found.record.worker == WORKER_A
    store.complete(key, "A", DAY, None)
    mark = store.get(key)
    assert mark is not None and mark.worker is None


def test_take_over_hands_a_live_claim_on_and_fences_the_old_owner(store: Store) -> None:
    key = new_key()
    store.claim(key, "A", LONG, DAY, "fp1", WORKER_A)
    before = store.get(key)
    assert before is not None and before.lease_remaining > 50  # the lease is alive
    assert store.take_over(key, "A", "B", 30.0, DAY, WORKER_B) == 1
    after = store.get(key)
    assert after is not None
    assert (after.status, after.owner, after.worker) == (Status.IN_PROGRESS, "B", WORKER_B)
    assert after.fingerprint == "fp1"
    assert after.created_at == pytest.approx(before.created_at, abs=0.01)
    assert 25 < after.lease_remaining <= 30.0
    for write in (
        lambda: store.complete(key, "A", DAY, None),
        lambda: store.renew(key, "A", LONG),
        lambda: store.release(key, "A"),
    ):
        with pytest.raises(LeaseLost):
            write()
    # a second takeover naming the old owner loses: only one delivery wins
    assert store.take_over(key, "A", "C", LONG, DAY, WORKER_A) == 0
    store.complete(key, "B", DAY, '"ok"')
    done = store.get(key)
    assert done is not None and done.status is Status.COMPLETED and done.result == '"ok"'


def test_take_over_refuses_marks_missing_keys_and_other_owners(store: Store) -> None:
    marked, missing, claimed = new_key(), new_key(), new_key()
    store.mark(marked, DAY, None, None)
    store.claim(claimed, "A", LONG, DAY, None, WORKER_A)
    assert store.take_over(marked, "A", "B", LONG, DAY, WORKER_B) == 0
    assert store.take_over(missing, "A", "B", LONG, DAY, WORKER_B) == 0
    assert store.take_over(claimed, "X", "B", LONG, DAY, WORKER_B) == 0
    assert store.get(missing) is None
    record = store.get(claimed)
    assert record is not None and (record.owner, record.worker) == ("A", WORKER_A)


def test_liveness_record_lives_its_ttl_by_the_store_clock(store: Store) -> None:
    worker = f"host-{uuid.uuid4().hex[:8]}/1/1/1"
    assert store.seen(worker) is None
    store.beat(worker, 30.0)
    seen = store.seen(worker)
    assert seen is not None
    assert 0 <= seen.ago < 2 and 28 < seen.remaining <= 30.0
    store.beat(worker, 0.3)
    wait_for(
        lambda: (s := store.seen(worker)) is not None and s.remaining == 0,
        timeout=10,
        what="the liveness record to lapse by the store's clock",
    )
    lapsed = store.seen(worker)
    assert lapsed is not None and lapsed.ago >= 0.3  # still tells how long it has been silent
    store.beat(worker, 30.0)
    fresh = store.seen(worker)
    assert fresh is not None and fresh.remaining > 28 and fresh.ago < 2
    assert store.stats()["keys"] == 0  # liveness records are not keys
    store.purge()  # keeps a record that lapsed less than the retention ago
    assert store.seen(worker) is not None
