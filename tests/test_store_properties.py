"""Property test of the store contract, against every store: random sequences of claim,
complete, release, renew, mark, take_over (counting take-overs), quarantine and get, of the hand-off's sends recorded with
complete/mark, take_sends and dispatched, and of the receipts awaited after a dispatch
(take_receipts, settle_receipts, have_records, due_for_relay), compared with a plain model of
the contract (including the claim owner's worker identity)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from taskonce.errors import LeaseLost
from taskonce.stores import Awaiting, ClaimOutcome, Status
from tests.helpers import DJANGO_KINDS, REDIS_DEPLOYMENTS, STORE_KINDS, drop_store, make_store

KEYS = st.sampled_from(("q:a", "q:b", "other:a"))
OWNERS = st.sampled_from(("o1", "o2", "o3"))
WORKERS = st.sampled_from((None, "h/1/10/100", "h/1/11/100"))
FINGERPRINTS = st.sampled_from((None, "f1", "f2"))
RESULTS = st.sampled_from((None, "1", '{"x":[1,2]}', '"\\u00e9t\\u00e9"'))
SENDS = st.sampled_from(((), ('{"id":"a"}',), ('{"id":"b"}', '{"id":"c","body":{"x":"é"}}')))
TOKENS = st.sampled_from(("o1", "o2", "t1", "t2"))
LEASE, KEEP = 600.0, 3600.0  # nothing expires during one example: expiry has its own tests
#: what a dispatch or a relay's look leaves awaiting: entries, due now (0) or later (600), or
#: given up (None: kept, out of the index); None clears them
AWAITING = st.sampled_from(
    (None, ('[{"e":1}]', 0.0), ('[{"e":2,"x":"é|"}]', 600.0), ('[{"e":3}]', None))
)
KEYS_ALL = ("q:a", "q:b", "other:a")


def machine_for(kind: str) -> type[RuleBasedStateMachine]:
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tmp = tempfile.TemporaryDirectory()
            self.store = make_store(kind, self.tmp.name)
            # the model: key -> (status, owner, fingerprint, result)
            self.model: dict[str, tuple[Status, str | None, str | None, str | None]] = {}
            self.workers: dict[str, str | None] = {}  # key -> the claim's worker identity
            self.crashes: dict[str, int] = {}  # key -> take-overs from dead owners
            # the hand-off's model: key -> [pending sends, dispatch token, leased]
            self.sends: dict[str, list[Any]] = {}
            # the receipts' model: key -> [entries, due (0 now, 600 later, None given up),
            # lease token, leased]
            self.receipts: dict[str, list[Any]] = {}

        def fenced(self, key: str, owner: str) -> bool:
            entry = self.model.get(key)
            return entry is not None and entry[0] is Status.IN_PROGRESS and entry[1] == owner

        @rule(key=KEYS, owner=OWNERS, fp=FINGERPRINTS, worker=WORKERS)
        def claim(self, key: str, owner: str, fp: str | None, worker: str | None) -> None:
            claim = self.store.claim(key, owner, LEASE, KEEP, fp, worker)
            if key in self.model:
                assert claim.outcome is ClaimOutcome.EXISTS
                assert claim.record is not None
                status, holder, recorded_fp, result = self.model[key]
                assert (claim.record.status, claim.record.owner) == (status, holder)
                assert (claim.record.fingerprint, claim.record.result) == (recorded_fp, result)
                assert claim.record.worker == self.workers.get(key)
                assert claim.record.crashes == self.crashes.get(key, 0)
            else:
                assert claim.outcome is ClaimOutcome.CLAIMED
                self.model[key] = (Status.IN_PROGRESS, owner, fp, None)
                self.workers[key] = worker
                self.crashes[key] = 0

        @rule(key=KEYS, old=OWNERS, owner=OWNERS, worker=WORKERS.filter(bool))
        def take_over(self, key: str, old: str, owner: str, worker: str) -> None:
            expected = self.fenced(key, old)
            count = self.crashes.get(key, 0) + 1 if expected else 0
            assert self.store.take_over(key, old, owner, LEASE, KEEP, worker) == count
            if expected:
                _, _, fp, result = self.model[key]
                self.model[key] = (Status.IN_PROGRESS, owner, fp, result)
                self.workers[key] = worker
                self.crashes[key] = count

        @rule(key=KEYS, owner=OWNERS)
        def quarantine(self, key: str, owner: str) -> None:
            expected = self.fenced(key, owner)
            try:
                self.store.quarantine(key, owner, KEEP)
            except LeaseLost:
                assert not expected, "quarantine refused for the owner"
                return
            assert expected, "quarantine accepted from a non-owner"
            _, _, fp, result = self.model[key]
            self.model[key] = (Status.QUARANTINED, None, fp, result)
            self.workers[key] = None

        @rule(key=KEYS, owner=OWNERS, result=RESULTS, sends=SENDS)
        def complete(self, key: str, owner: str, result: str | None, sends: Any) -> None:
            expected = self.fenced(key, owner)
            try:
                self.store.complete(key, owner, KEEP, result, sends)
            except LeaseLost:
                assert not expected, "complete refused for the owner"
                return
            assert expected, "complete accepted from a non-owner"
            self.model[key] = (Status.COMPLETED, None, self.model[key][2], result)
            self.workers[key] = None
            self.crashes[key] = 0
            if sends:
                self.sends[key] = [sends, owner, False]

        @rule(key=KEYS, token=TOKENS)
        def take_sends(self, key: str, token: str) -> None:
            lease = self.store.take_sends(key, token, LEASE)
            pending = self.sends.get(key)
            if pending is None:
                assert lease.sends == () and lease.retry_after == 0
            elif pending[2] and pending[1] != token:  # leased elsewhere (its holder may retake)
                assert lease.sends == () and 0 < lease.retry_after <= LEASE
            else:
                assert lease.sends == pending[0] and lease.retry_after == 0
                pending[1:] = [token, True]

        @rule(
            key=KEYS,
            token=TOKENS,
            awaiting=AWAITING.filter(lambda a: a is None or a[1] is not None),
        )
        def dispatched(self, key: str, token: str, awaiting: Any) -> None:
            pending = self.sends.get(key)
            expected = pending is not None and pending[1] == token
            after = None if awaiting is None else Awaiting(awaiting[0], awaiting[1], KEEP)
            assert self.store.dispatched(key, token, after) is expected
            if expected:
                del self.sends[key]
                if awaiting is not None:
                    self.receipts[key] = [awaiting[0], awaiting[1], None, False]

        @rule(key=KEYS, token=TOKENS)
        def take_receipts(self, key: str, token: str) -> None:
            lease = self.store.take_receipts(key, token, LEASE)
            awaited = self.receipts.get(key)
            if awaited is None or awaited[1] != 0.0:  # none, not due, or given up
                assert lease.entries is None and lease.retry_after == 0
            elif awaited[3] and awaited[2] != token:  # leased by another relay
                assert lease.entries is None and 0 < lease.retry_after <= LEASE
            else:
                assert lease.entries == awaited[0] and lease.retry_after == 0
                assert 0 <= lease.late < 60
                awaited[2:] = [token, True]

        @rule(key=KEYS, token=TOKENS, awaiting=AWAITING)
        def settle_receipts(self, key: str, token: str, awaiting: Any) -> None:
            awaited = self.receipts.get(key)
            expected = awaited is not None and awaited[3] and awaited[2] == token
            after = None if awaiting is None else Awaiting(awaiting[0], awaiting[1], KEEP)
            assert self.store.settle_receipts(key, token, after) is expected
            if expected:
                if awaiting is None:
                    del self.receipts[key]
                else:
                    self.receipts[key] = [awaiting[0], awaiting[1], None, False]

        @rule(key=KEYS, owner=st.one_of(st.none(), OWNERS))
        def release(self, key: str, owner: str | None) -> None:
            expected = owner is None or self.fenced(key, owner)
            try:
                self.store.release(key, owner)
            except LeaseLost:
                assert not expected, "release refused"
                return
            assert expected, "release accepted from a non-owner"
            self.model.pop(key, None)
            self.workers.pop(key, None)
            self.crashes.pop(key, None)
            self.sends.pop(key, None)
            self.receipts.pop(key, None)

        @rule(key=KEYS, owner=OWNERS)
        def renew(self, key: str, owner: str) -> None:
            expected = self.fenced(key, owner)
            try:
                self.store.renew(key, owner, LEASE)
            except LeaseLost:
                assert not expected, "renew refused for the owner"
                return
            assert expected, "renew accepted from a non-owner"

        @rule(key=KEYS, fp=FINGERPRINTS, result=RESULTS, sends=SENDS, token=TOKENS)
        def mark(
            self, key: str, fp: str | None, result: str | None, sends: Any, token: str
        ) -> None:
            wrote = self.store.mark(key, KEEP, fp, result, sends, token)
            assert wrote is (key not in self.model)
            if wrote:
                self.model[key] = (Status.COMPLETED, None, fp, result)
                self.workers[key] = None
                self.crashes[key] = 0
                if sends:
                    self.sends[key] = [sends, token, False]

        @invariant()
        def records_match_the_model(self) -> None:
            for key in ("q:a", "q:b", "other:a"):
                record = self.store.get(key)
                entry = self.model.get(key)
                if entry is None:
                    assert record is None
                    continue
                assert record is not None
                assert (record.status, record.owner, record.fingerprint, record.result) == entry
                assert record.worker == self.workers.get(key)
                assert record.crashes == self.crashes.get(key, 0)
                assert (record.state == "quarantined") is (entry[0] is Status.QUARANTINED)
                pending = self.sends.get(key)
                assert record.sends == (pending[0] if pending else ())
                assert record.sends_pending is (pending is not None)
                awaited = self.receipts.get(key)
                assert record.receipts == (awaited[0] if awaited else None)
                if record.status is Status.IN_PROGRESS:
                    assert 0 < record.lease_remaining <= LEASE
                else:
                    assert record.lease_remaining == 0

        @invariant()
        def stats_match_the_model(self) -> None:
            stats = self.store.stats()
            in_progress = sum(1 for e in self.model.values() if e[0] is Status.IN_PROGRESS)
            assert (stats["keys"], stats["in_progress"]) == (len(self.model), in_progress)
            quarantined = sum(1 for e in self.model.values() if e[0] is Status.QUARANTINED)
            assert stats["quarantined"] == quarantined
            assert stats["completed"] == len(self.model) - in_progress - quarantined
            assert stats["sends_pending"] == len(self.sends)
            assert sorted(self.store.due_for_relay(0.0, 10).sends) == sorted(self.sends)
            awaited = [k for k, r in self.receipts.items() if r[1] is not None]
            assert stats["receipts_awaited"] == len(awaited)
            due = self.store.due_for_relay(0.0, 10)
            assert sorted(due.sends) == sorted(self.sends)
            assert sorted(due.receipts) == sorted(k for k in awaited if self.receipts[k][1] == 0)
            assert self.store.have_records(KEYS_ALL) == [k in self.model for k in KEYS_ALL]

        def teardown(self) -> None:
            drop_store(self.store)
            self.tmp.cleanup()

    StoreMachine.__name__ = f"StoreMachine_{kind}"
    return StoreMachine


EXAMPLES = {"memory": 150, "redis": 25, "postgresql": 25, "mariadb": 25, "sqlite": 25}
EXAMPLES.update({"redis-cluster": 8, "redis-sentinel": 15})
EXAMPLES.update(dict.fromkeys(DJANGO_KINDS, 15))


@pytest.mark.parametrize("kind", [*STORE_KINDS, *REDIS_DEPLOYMENTS, *DJANGO_KINDS])
def test_store_follows_the_contract(kind: str) -> None:
    machine: Any = machine_for(kind)
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES[kind],
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase("runTest").runTest()
