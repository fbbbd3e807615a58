"""The store contract's receipts part, on every store: published sends kept awaiting their
receipts (``dispatched`` with ``awaiting``), the receipts index (``due_for_relay``), the relay's
lease (``take_receipts``), its write-back (``settle_receipts``), the receipts themselves
(``have_records``), and what the rest of the contract does with a record that awaits
(duplicates skipped, ``stats``, release, purge). A property test compares random sequences of
the hand-off's and the receipts' writes with a plain model of the contract."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from taskonce.errors import InvalidInput, LeaseLost
from taskonce.stores import Awaiting, ClaimOutcome, ReceiptLease, SendLease, Status, Store
from taskonce.stores.base import State
from tests.helpers import (
    DJANGO_KINDS,
    REDIS_DEPLOYMENTS,
    STORE_KINDS,
    drop_store,
    make_store,
    wait_for,
)

ALL_KINDS = [*STORE_KINDS, *REDIS_DEPLOYMENTS, *DJANGO_KINDS]


@pytest.fixture(params=ALL_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    """Every store, and Redis as deployed (a cluster, a Sentinel-managed master)."""
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        drop_store(s)


SENDS = ('{"id":"a","framework":"python","body":{"x":"été"}}',)
DAY = 86400.0
LONG = 600.0


def entries(*keys: str) -> str:
    """Receipt entries as :mod:`taskonce.receipts` writes them (the store keeps them as text)."""
    return json.dumps([{"send": SENDS[0], "key": key, "at": 0} for key in keys])


def awaiting(due: float | None, *keys: str, hold: float = 600.0) -> Awaiting:
    return Awaiting(entries(*keys or ("child:1",)), due, hold)


def published(store: Store, key: str, lazy: bool = False, keep_for: float = DAY) -> None:
    """A record of ``key`` with pending sends, their dispatch token ``t``."""
    if lazy:
        assert store.mark(key, keep_for, "fp", '{"r":"x|y"}', SENDS, "t")
    else:
        store.claim(key, "t", LONG, keep_for, "fp")
        store.complete(key, "t", keep_for, '{"r":"x|y"}', SENDS)


def test_dispatched_with_awaiting_keeps_the_entries_until_due(store: Store) -> None:
    published(store, "q:eager")
    published(store, "q:lazy", lazy=True)
    written = time.monotonic()
    assert store.dispatched("q:eager", "t", awaiting(1.0, "child:1"))
    assert store.dispatched("q:lazy", "t", awaiting(1.0, "child:2"))
    not_due = store.due_for_relay(0.0, 10).receipts, store.take_receipts("q:eager", "r", 30)
    if time.monotonic() - written < 0.9:  # a loaded machine may have taken longer than that
        assert not_due == ([], ReceiptLease())
    for key, state, child in (
        ("q:eager", State.COMPLETED, "child:1"),
        ("q:lazy", State.MARKED, "child:2"),
    ):
        record = store.get(key)
        assert record is not None and record.status is Status.COMPLETED
        assert record.state is state
        assert record.receipts == entries(child)
        assert not record.sends_pending and record.sends == ()
        assert (record.fingerprint, record.result) == ("fp", '{"r":"x|y"}')
    assert store.due_for_relay().sends == []
    wait_for(lambda: len(store.due_for_relay(0.0, 10).receipts) == 2, timeout=10, what="due")
    assert sorted(store.due_for_relay(0.0, 10).receipts) == ["q:eager", "q:lazy"]
    assert store.due_for_relay(0.0, 10).sends == []
    assert store.stats()["receipts_awaited"] == 2
    assert store.stats()["sends_pending"] == 0


def test_dispatched_with_awaiting_is_fenced_by_the_dispatch_token(store: Store) -> None:
    published(store, "q:k")
    assert not store.dispatched("q:k", "intruder", awaiting(0))
    record = store.get("q:k")
    assert record is not None and record.sends_pending and record.receipts is None
    assert store.due_for_relay(0.0, 10).receipts == []
    assert store.dispatched("q:k", "t", awaiting(0))
    assert not store.dispatched("q:k", "t", awaiting(0))  # once
    assert not store.dispatched("q:k", "t")
    assert store.due_for_relay(0.0, 10).receipts == ["q:k"]
    # a record without sends awaits nothing
    store.mark("q:plain", DAY, None, None)
    assert not store.dispatched("q:plain", "t", awaiting(0))
    with pytest.raises(InvalidInput, match="token '' must be a non-empty string"):
        store.dispatched("q:plain", "", awaiting(0))  # no token is ever empty
    assert store.take_receipts("q:plain", "relay", 30) == ReceiptLease()


def test_take_receipts_leases_them_to_one_relay(store: Store) -> None:
    published(store, "q:k")
    store.dispatched("q:k", "t", awaiting(0))
    taken = store.take_receipts("q:k", "relay-1", 1.0)
    assert taken.entries == entries("child:1") and taken.retry_after == 0
    assert 0 <= taken.late < 5
    other = store.take_receipts("q:k", "relay-2", 30)
    assert other.entries is None and 0 < other.retry_after <= 1.0
    again = store.take_receipts("q:k", "relay-1", 1.0)  # its holder may take them again
    assert again.entries == entries("child:1")
    assert not store.settle_receipts("q:k", "relay-2", None)  # fenced
    # relay-1 dies: once its lease ran out (store clock), relay-2 takes them over
    wait_for(
        lambda: store.take_receipts("q:k", "relay-2", 30).entries, timeout=10, what="the lease"
    )
    assert not store.settle_receipts("q:k", "relay-1", None)
    assert store.settle_receipts("q:k", "relay-2", None)
    assert not store.settle_receipts("q:k", "relay-2", None)  # once


def test_take_receipts_tells_how_late_they_are(store: Store) -> None:
    published(store, "q:k")
    store.dispatched("q:k", "t", awaiting(0.2))
    time.sleep(0.7)
    taken = store.take_receipts("q:k", "relay", 30)
    assert taken.entries is not None and 0.4 <= taken.late < 10


def test_settle_with_none_clears_them(store: Store) -> None:
    published(store, "q:k", lazy=True)
    store.dispatched("q:k", "t", awaiting(0))
    assert store.take_receipts("q:k", "relay", 30).entries is not None
    assert store.settle_receipts("q:k", "relay", None)
    record = store.get("q:k")
    assert record is not None and record.receipts is None and record.state is State.MARKED
    assert record.result == '{"r":"x|y"}' and not record.sends_pending
    assert store.due_for_relay(0.0, 10).receipts == []
    assert store.stats()["receipts_awaited"] == 0
    assert store.take_receipts("q:k", "relay", 30) == ReceiptLease()
    assert not store.settle_receipts("q:k", "relay", awaiting(0))  # nothing awaits any more


def test_settle_with_a_new_due_time_puts_them_back(store: Store) -> None:
    published(store, "q:k")
    store.dispatched("q:k", "t", awaiting(0, "child:1", "child:2"))
    assert store.take_receipts("q:k", "relay", 30).entries == entries("child:1", "child:2")
    written = time.monotonic()
    assert store.settle_receipts("q:k", "relay", awaiting(1.0, "child:2"))
    not_due = store.due_for_relay(0.0, 10).receipts, store.take_receipts("q:k", "relay-2", 30)
    if time.monotonic() - written < 0.9:  # a loaded machine may have taken longer than that
        assert not_due == ([], ReceiptLease())
    record = store.get("q:k")
    assert record is not None and record.receipts == entries("child:2")
    # the lease was let go: another relay takes them as soon as they are due
    wait_for(lambda: store.due_for_relay(0.0, 10).receipts, timeout=10, what="the new due")
    taken = store.take_receipts("q:k", "relay-2", 30)
    assert taken.entries == entries("child:2") and taken.retry_after == 0


def test_given_up_entries_are_kept_for_inspect_out_of_the_index(store: Store) -> None:
    published(store, "q:k")
    store.dispatched("q:k", "t", awaiting(0))
    store.take_receipts("q:k", "relay", 30)
    gave_up = entries("child:lost")
    assert store.settle_receipts("q:k", "relay", Awaiting(gave_up, None, 0.0))
    record = store.get("q:k")
    assert record is not None and record.receipts == gave_up
    assert record.status is Status.COMPLETED and not record.sends_pending
    assert store.due_for_relay(0.0, 10).receipts == []
    assert store.stats()["receipts_awaited"] == 0
    assert store.take_receipts("q:k", "relay-2", 30) == ReceiptLease()
    [found] = [r for r in store.records("q:") if r.key == "q:k"]
    assert found.receipts == gave_up


def test_hold_keeps_the_record_past_its_keep_for(store: Store) -> None:
    published(store, "q:dispatched", keep_for=1.0)
    published(store, "q:settled", lazy=True, keep_for=1.0)
    started = time.monotonic()
    store.dispatched("q:dispatched", "t", awaiting(30, hold=5.0))
    store.dispatched("q:settled", "t", awaiting(0, hold=0.0))  # a hold shorter: kept as it was
    store.take_receipts("q:settled", "relay", 30)
    store.settle_receipts("q:settled", "relay", awaiting(30, hold=5.0))
    record = store.get("q:dispatched")
    assert record is not None and 3.0 < record.expires_at - time.time() <= 5.5
    wait_for(lambda: time.monotonic() > started + 2.0, timeout=10, what="keep_for to pass")
    for key in ("q:dispatched", "q:settled"):
        record = store.get(key)
        assert record is not None and record.receipts == entries("child:1"), key
    assert store.claim("q:dispatched", "dup", LONG, DAY, "fp").outcome is ClaimOutcome.EXISTS


def test_a_hold_never_shortens_the_record(store: Store) -> None:
    published(store, "q:k")
    before = store.get("q:k")
    store.dispatched("q:k", "t", awaiting(0, hold=1.0))
    after = store.get("q:k")
    assert before is not None and after is not None
    assert after.expires_at >= before.expires_at - 0.01
    assert abs(after.created_at - before.created_at) < 0.01


def test_have_records_are_the_receipts(store: Store) -> None:
    store.claim("r:claimed", "A", LONG, DAY, None)
    store.claim("r:completed", "A", LONG, DAY, None)
    store.complete("r:completed", "A", DAY, None)
    store.mark("r:marked", DAY, None, None)
    published(store, "r:awaiting")
    store.dispatched("r:awaiting", "t", awaiting(30))
    store.mark("r:expired", 0.2, None, None)
    wait_for(lambda: store.get("r:expired") is None, timeout=10, what="the mark to expire")
    keys = ["r:claimed", "r:completed", "r:marked", "r:awaiting", "r:absent", "r:expired"]
    assert store.have_records(keys) == [True, True, True, True, False, False]
    assert store.have_records([]) == []
    assert store.have_records(["r:absent", "r:marked"]) == [False, True]


def test_stats_count_records_awaiting_receipts(store: Store) -> None:
    published(store, "q:a")
    published(store, "q:b", lazy=True)
    published(store, "q:pending")
    store.mark("q:plain", DAY, None, None)
    store.dispatched("q:a", "t", awaiting(30))
    store.dispatched("q:b", "t", awaiting(0))
    stats = store.stats()
    assert stats["receipts_awaited"] == 2 and stats["sends_pending"] == 1
    assert (stats["keys"], stats["completed"], stats["in_progress"]) == (4, 4, 0)


def test_an_operators_release_takes_the_record_out_of_the_index(store: Store) -> None:
    published(store, "q:k")
    store.dispatched("q:k", "t", awaiting(0))
    store.release("q:k", None)
    assert store.get("q:k") is None
    assert store.due_for_relay(0.0, 10).receipts == []
    assert store.stats()["receipts_awaited"] == 0
    assert store.take_receipts("q:k", "relay", 30) == ReceiptLease()
    assert store.have_records(["q:k"]) == [False]


def test_purge_takes_expired_records_out_of_the_index(store: Store) -> None:
    """A record that expired while awaiting (its due time after its hold) is out of the
    relay's sight and the counts once purged."""
    published(store, "q:gone", keep_for=0.2)
    published(store, "q:kept")
    store.dispatched("q:gone", "t", awaiting(0.5, hold=0.3))
    store.dispatched("q:kept", "t", awaiting(0.5))
    wait_for(lambda: store.get("q:gone") is None, timeout=10, what="the record to expire")
    store.purge()
    assert store.stats()["receipts_awaited"] == 1
    due = wait_for(lambda: store.due_for_relay(0.0, 10).receipts, timeout=10, what="due")
    assert due == ["q:kept"]


def test_a_duplicate_of_an_awaiting_record_is_skipped(store: Store) -> None:
    published(store, "q:eager")
    published(store, "q:lazy", lazy=True)
    store.dispatched("q:eager", "t", awaiting(0))
    store.dispatched("q:lazy", "t", awaiting(0))
    for key, state in (("q:eager", State.COMPLETED), ("q:lazy", State.MARKED)):
        claim = store.claim(key, "dup", LONG, DAY, "fp")
        assert claim.outcome is ClaimOutcome.EXISTS and claim.record is not None
        assert claim.record.state is state and claim.record.receipts == entries("child:1")
        assert store.claim(key, "dup", LONG, DAY, "other-fp").outcome is ClaimOutcome.EXISTS
        assert store.mark(key, DAY, "fp", None) is False
        assert store.mark(key, DAY, "fp", None, SENDS, "dup") is False
        with pytest.raises(LeaseLost):
            store.complete(key, "t", DAY, None)
        with pytest.raises(LeaseLost):
            store.renew(key, "t", LONG)
        with pytest.raises(LeaseLost):
            store.release(key, "t")
        assert not store.take_over(key, "t", "dup", LONG, DAY, "w")
        assert store.take_sends(key, "dup", 30) == SendLease()
        record = store.get(key)
        assert record is not None and record.receipts == entries("child:1")
    assert sorted(store.due_for_relay(0.0, 10).receipts) == ["q:eager", "q:lazy"]


def test_due_for_relay_lists_both_oldest_first(store: Store) -> None:
    for name in ("q:1", "q:2", "q:3"):
        published(store, name)
        store.dispatched(name, "t", awaiting(0))
        time.sleep(0.01)
    published(store, "q:later")
    store.dispatched("q:later", "t", awaiting(3600))
    for name in ("q:s1", "q:s2"):
        store.mark(name, DAY, None, None, SENDS, "t")
        time.sleep(0.01)
    due = store.due_for_relay(0.0, 10)
    assert due.receipts == ["q:1", "q:2", "q:3"] and due.sends == ["q:s1", "q:s2"]
    due = store.due_for_relay(0.0, 2)
    assert due.receipts == ["q:1", "q:2"] and due.sends == ["q:s1", "q:s2"]
    due = store.due_for_relay(3600, 10)
    assert due.receipts == ["q:1", "q:2", "q:3"] and due.sends == []
    # a settled record goes to the back of the line
    store.take_receipts("q:1", "relay", 30)
    store.settle_receipts("q:1", "relay", awaiting(0))
    assert store.due_for_relay(0.0, 10).receipts == ["q:2", "q:3", "q:1"]


def test_texts_that_hold_the_separator_survive(store: Store) -> None:
    key, token = "q:a|b", "tok|en"
    big = json.dumps([{"send": "é|" * 50_000, "key": "c|1", "at": 0}])
    store.mark(key, DAY, "fp|1", '{"r":"|"}', SENDS, "disp|atcher")
    assert store.dispatched(key, "disp|atcher", Awaiting(big, 0, 600))
    taken = store.take_receipts(key, token, 30)
    assert taken.entries == big
    assert store.take_receipts(key, "tok", 30).retry_after > 0
    assert store.settle_receipts(key, token, Awaiting(big + " ", 0, 600))
    record = store.get(key)
    assert record is not None and record.receipts == big + " "
    assert (record.fingerprint, record.result) == ("fp|1", '{"r":"|"}')
    assert store.take_receipts(key, token, 30).entries == big + " "
    assert store.settle_receipts(key, token, None)
    record = store.get(key)
    assert record is not None and record.receipts is None and record.result == '{"r":"|"}'


# -- the property test --------------------------------------------------------------------------

KEYS = st.sampled_from(("q:a", "q:b", "other:a"))
TOKENS = st.sampled_from(("t1", "t2", "r1", "r2"))
# due 0 is due at once and 3600 never within an example: the model needs no clock
DUES = st.sampled_from((0.0, 3600.0, None))
ENTRIES = st.sampled_from((entries("c:1"), entries("c:1", "c:2"), '[{"send":"é|","key":"x"}]'))
KEEP = 3600.0


class _Awaits:
    """The model of a record's awaited receipts."""

    def __init__(self, text: str, due: float | None) -> None:
        self.text, self.due, self.token, self.leased = text, due, "", False


def receipts_machine_for(kind: str) -> type[RuleBasedStateMachine]:
    class ReceiptsMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tmp = tempfile.TemporaryDirectory()
            self.store = make_store(kind, self.tmp.name)
            self.lazy: dict[str, bool] = {}  # the records: key -> marked lazily
            self.pending: dict[str, list[Any]] = {}  # key -> [dispatch token, leased]
            self.awaits: dict[str, _Awaits] = {}

        @rule(key=KEYS, token=TOKENS, lazy=st.booleans())
        def record_sends(self, key: str, token: str, lazy: bool) -> None:
            if lazy:
                wrote = self.store.mark(key, KEEP, None, None, SENDS, token)
                assert wrote is (key not in self.lazy)
            else:
                claim = self.store.claim(key, token, LONG, KEEP, None)
                if key in self.lazy:
                    assert claim.outcome is ClaimOutcome.EXISTS
                    return
                self.store.complete(key, token, KEEP, None, SENDS)
                wrote = True
            if wrote:
                self.lazy[key] = lazy
                self.pending[key] = [token, False]

        @rule(key=KEYS, token=TOKENS)
        def take_sends(self, key: str, token: str) -> None:
            lease = self.store.take_sends(key, token, LONG)
            pending = self.pending.get(key)
            if pending is None:
                assert lease == SendLease()
            elif pending[1] and pending[0] != token:
                assert lease.sends == () and 0 < lease.retry_after <= LONG
            else:
                assert lease.sends == SENDS
                self.pending[key] = [token, True]

        @rule(key=KEYS, token=TOKENS, wait=st.booleans(), due=DUES, text=ENTRIES)
        def dispatched(
            self, key: str, token: str, wait: bool, due: float | None, text: str
        ) -> None:
            pending = self.pending.get(key)
            expected = pending is not None and pending[0] == token
            waits = Awaiting(text, due, LONG) if wait else None
            assert self.store.dispatched(key, token, waits) is expected
            if expected:
                del self.pending[key]
                if waits is not None:
                    self.awaits[key] = _Awaits(text, waits.due)

        @rule(key=KEYS, token=TOKENS)
        def take_receipts(self, key: str, token: str) -> None:
            lease = self.store.take_receipts(key, token, LONG)
            awaits = self.awaits.get(key)
            if awaits is None or awaits.due != 0.0:
                assert lease == ReceiptLease()
            elif awaits.leased and awaits.token != token:
                assert lease.entries is None and 0 < lease.retry_after <= LONG
            else:
                assert lease.entries == awaits.text and lease.retry_after == 0
                awaits.token, awaits.leased = token, True

        @rule(key=KEYS, token=TOKENS, settle=st.booleans(), due=DUES, text=ENTRIES)
        def settle_receipts(
            self, key: str, token: str, settle: bool, due: float | None, text: str
        ) -> None:
            awaits = self.awaits.get(key)
            expected = awaits is not None and awaits.token == token
            waits = Awaiting(text, due, LONG) if settle else None
            assert self.store.settle_receipts(key, token, waits) is expected
            if expected:
                if waits is None:
                    del self.awaits[key]
                else:
                    self.awaits[key] = _Awaits(text, due)

        @rule(key=KEYS)
        def operators_release(self, key: str) -> None:
            self.store.release(key, None)
            self.lazy.pop(key, None)
            self.pending.pop(key, None)
            self.awaits.pop(key, None)

        @invariant()
        def records_match_the_model(self) -> None:
            keys = ("q:a", "q:b", "other:a")
            assert self.store.have_records(keys) == [k in self.lazy for k in keys]
            for key in keys:
                record = self.store.get(key)
                if key not in self.lazy:
                    assert record is None
                    continue
                assert record is not None
                assert record.state is (State.MARKED if self.lazy[key] else State.COMPLETED)
                assert record.sends_pending is (key in self.pending)
                awaits = self.awaits.get(key)
                assert record.receipts == (None if awaits is None else awaits.text)

        @invariant()
        def the_relay_sees_what_the_model_says(self) -> None:
            due = self.store.due_for_relay(0.0, 10)
            assert sorted(due.receipts) == sorted(k for k, a in self.awaits.items() if a.due == 0.0)
            assert sorted(due.sends) == sorted(self.pending)
            stats = self.store.stats()
            awaited = sum(1 for a in self.awaits.values() if a.due is not None)
            assert (stats["receipts_awaited"], stats["sends_pending"]) == (
                awaited,
                len(self.pending),
            )

        def teardown(self) -> None:
            drop_store(self.store)
            self.tmp.cleanup()

    ReceiptsMachine.__name__ = f"ReceiptsMachine_{kind}"
    return ReceiptsMachine


EXAMPLES = dict.fromkeys(ALL_KINDS, 15)
EXAMPLES.update({"memory": 150, "redis": 30, "redis-cluster": 8})


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_receipts_follow_the_contract(kind: str) -> None:
    machine: Any = receipts_machine_for(kind)
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES[kind],
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase("runTest").runTest()
