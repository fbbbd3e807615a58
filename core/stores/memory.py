"""MemoryStore: a thread-safe store inside one process, for unit tests and the embedded demo.

It is not shared between processes: a forked child starts with a copy of the parent's records
and its own lock. Use Redis or SQL wherever more than one process consumes a queue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable

from taskonce.stores.base import (
    LIVENESS_RETENTION,
    Awaiting,
    Claim,
    ClaimOutcome,
    Completion,
    DueForRelay,
    Marking,
    ReceiptLease,
    Record,
    Status,
    Store,
)


@dataclasses.dataclass
class _Entry:
    status: Status
    owner: str | None
    fingerprint: str | None
    result: str | None
    created_at: float
    expires_at: float
    lease_until: float
    worker: str | None = None
    sends: str | None = None  # pending deferred sends (their JSON array)
    sends_token: str = ""
    sends_at: float = 0.0  # when they were recorded
    sends_lease: float = 0.0  # a dispatcher's lease on them (or on the receipts) runs until
    receipts: str | None = None  # published sends awaiting receipts (taskonce.receipts)
    receipts_due: float | None = None  # when the relay should look at them; None: given up
    crashes: int = 0  # take-overs from dead, silent or expired owners


class MemoryStore(Store):
    """Records in a dict guarded by a lock.

    :param clock: the store's clock, seconds since the epoch; default :func:`time.time`. Tests
        pass a fake clock to expire leases without waiting.
    """

    schemes = ("memory",)

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._beats: dict[str, tuple[float, float]] = {}  # worker -> (seen at, alive until)
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= now:
            if entry.sends is None:  # pending sends stay for the relay (purge keeps them too)
                del self._entries[key]
            return None
        return entry

    def _record(self, key: str, entry: _Entry, now: float) -> Record:
        remaining = 0.0
        if entry.status is Status.IN_PROGRESS:
            remaining = max(0.0, entry.lease_until - now)
        return Record(
            key=key,
            status=entry.status,
            owner=entry.owner,
            fingerprint=entry.fingerprint,
            result=entry.result,
            created_at=entry.created_at,
            expires_at=entry.expires_at,
            lease_remaining=remaining,
            worker=entry.worker,
            marked=entry.status is Status.COMPLETED and not entry.lease_until,
            sends_pending=entry.sends is not None,
            sends=tuple(json.loads(entry.sends)) if entry.sends else (),
            receipts=entry.receipts,
            receipts_awaited=entry.receipts_due is not None,
            crashes=entry.crashes,
        )

    def _owned(self, key: str, owner: str, now: float) -> _Entry | None:
        entry = self._live(key, now)
        if entry is None or entry.status is not Status.IN_PROGRESS or entry.owner != owner:
            return None
        return entry

    def _claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None,
    ) -> Claim:
        with self._lock:
            now = self._clock()
            entry = self._live(key, now)
            outcome = ClaimOutcome.CLAIMED
            if entry is not None:
                expired_claim = entry.status is Status.IN_PROGRESS and entry.lease_until <= now
                same_payload = (
                    entry.fingerprint is None
                    or fingerprint is None
                    or entry.fingerprint == fingerprint
                )
                if not (expired_claim and same_payload):
                    return Claim(ClaimOutcome.EXISTS, self._record(key, entry, now))
                outcome = ClaimOutcome.TAKEN_OVER
            crashes = 0 if entry is None else entry.crashes + 1
            self._entries[key] = _Entry(
                status=Status.IN_PROGRESS,
                owner=owner,
                fingerprint=fingerprint,
                result=None,
                created_at=now if entry is None else entry.created_at,
                expires_at=now + lease + keep_for,
                lease_until=now + lease,
                worker=worker,
                crashes=crashes,
            )
            return Claim(outcome, crashes=crashes)

    def _take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        with self._lock:
            now = self._clock()
            entry = self._live(key, now)
            if entry is None or entry.status is not Status.IN_PROGRESS or entry.owner != old_owner:
                return 0
            entry.owner = owner
            entry.worker = worker
            entry.lease_until = now + lease
            entry.expires_at = now + lease + keep_for
            entry.crashes += 1
            return entry.crashes

    def _quarantine(self, key: str, owner: str, keep_for: float) -> bool:
        with self._lock:
            now = self._clock()
            entry = self._owned(key, owner, now)
            if entry is None:
                return False
            entry.status = Status.QUARANTINED
            entry.owner = entry.worker = None
            entry.lease_until = 0.0
            entry.expires_at = now + keep_for
            return True

    def _beat(self, worker: str, ttl: float) -> None:
        with self._lock:
            now = self._clock()
            self._beats[worker] = (now, now + ttl)

    def _seen(self, worker: str) -> tuple[float, float] | None:
        with self._lock:
            now = self._clock()
            beat = self._beats.get(worker)
            return None if beat is None else (now - beat[0], beat[1] - now)

    def _complete(self, done: Completion) -> bool:
        with self._lock:
            now = self._clock()
            entry = self._owned(done.key, done.owner, now)
            if entry is None:
                return False
            entry.status = Status.COMPLETED
            entry.owner = None
            entry.worker = None
            entry.crashes = 0
            entry.result = done.result
            entry.expires_at = now + done.keep_for  # lease_until stays: the record was claimed
            if done.sends:
                _record_sends(entry, done.sends, done.owner, now, done.dispatch_lease)
            return True

    def _release(self, key: str, owner: str) -> bool:
        with self._lock:
            if self._owned(key, owner, self._clock()) is None:
                return False
            del self._entries[key]
            return True

    def _forget(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _renew(self, key: str, owner: str, lease: float) -> bool:
        with self._lock:
            now = self._clock()
            entry = self._owned(key, owner, now)
            if entry is None:
                return False
            entry.expires_at += max(0.0, now + lease - entry.lease_until)
            entry.lease_until = now + lease
            return True

    def _mark(self, mark: Marking) -> bool:
        with self._lock:
            now = self._clock()
            if self._live(mark.key, now) is not None:
                return False
            entry = self._entries[mark.key] = _Entry(
                status=Status.COMPLETED,
                owner=None,
                fingerprint=mark.fingerprint,
                result=mark.result,
                created_at=now,
                expires_at=now + mark.keep_for,
                lease_until=0.0,
            )
            if mark.sends:
                _record_sends(entry, mark.sends, mark.token, now, mark.dispatch_lease)
            return True

    def _take_sends(
        self, key: str, token: str, lease: float, older_than: float
    ) -> tuple[str | None, float]:
        with self._lock:
            now = self._clock()
            entry = self._entries.get(key)
            if entry is None or entry.sends is None or entry.sends_at > now - older_than:
                return None, 0.0
            if entry.sends_lease > now and entry.sends_token != token:
                return None, entry.sends_lease - now
            entry.sends_token = token
            entry.sends_lease = now + lease
            return entry.sends, 0.0

    def _dispatched(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.sends is None or entry.sends_token != token:
                return False
            entry.sends = None
            entry.sends_at = 0.0
            _await(entry, awaiting, self._clock())
            return True

    def _take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
        with self._lock:
            now = self._clock()
            entry = self._entries.get(key)
            if entry is None or entry.receipts is None or entry.receipts_due is None:
                return ReceiptLease()
            if entry.receipts_due > now:
                return ReceiptLease()
            if entry.sends_lease > now and entry.sends_token != token:
                return ReceiptLease(retry_after=entry.sends_lease - now)
            entry.sends_token = token
            entry.sends_lease = now + lease
            return ReceiptLease(entry.receipts, late=now - entry.receipts_due)

    def _settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.receipts is None or entry.sends_token != token:
                return False
            _await(entry, awaiting, self._clock())
            return True

    def _live_keys(self, keys: list[str]) -> set[str]:
        with self._lock:
            now = self._clock()
            return {key for key in keys if self._live(key, now) is not None}

    def _due_for_relay(self, older_than: float, limit: int) -> DueForRelay:
        with self._lock:
            now = self._clock()
            due = [
                (e.receipts_due, k)
                for k, e in self._entries.items()
                if e.receipts_due is not None and e.receipts_due <= now
            ]
            pending = [
                (e.sends_at, k)
                for k, e in self._entries.items()
                if e.sends is not None and e.sends_at <= now - older_than
            ]
        return DueForRelay(
            [k for _, k in sorted(pending)[:limit]], [k for _, k in sorted(due)[:limit]]
        )

    def _get(self, key: str) -> Record | None:
        with self._lock:
            now = self._clock()
            entry = self._live(key, now)
            return None if entry is None else self._record(key, entry, now)

    def _purge(self, batch: int) -> int:
        deleted = 0
        while True:
            with self._lock:
                now = self._clock()
                # A record whose sends are pending is kept until the relay publishes them.
                expired = [
                    k for k, e in self._entries.items() if e.expires_at <= now and e.sends is None
                ][:batch]
                for key in expired:
                    del self._entries[key]
                for worker in [
                    w for w, b in self._beats.items() if b[1] + LIVENESS_RETENTION <= now
                ]:
                    del self._beats[worker]
            deleted += len(expired)
            if len(expired) < batch:
                return deleted

    def _expired(self) -> tuple[int, int]:
        with self._lock:
            now = self._clock()
            expired = [e for e in self._entries.values() if e.expires_at <= now]
        return len(expired), sum(1 for e in expired if e.sends is not None)

    def _records(self, key_prefix: str, key_suffix: str, limit: int | None) -> list[Record]:
        with self._lock:
            now = self._clock()
            found = [
                self._record(key, entry, now)
                for key, entry in self._entries.items()
                if key.startswith(key_prefix)
                and key.endswith(key_suffix)
                and entry.expires_at > now
            ]
        return found[:limit]

    def _close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._beats.clear()

    def describe(self) -> str:
        return "MemoryStore (this process only)"


def _await(entry: _Entry, awaiting: Awaiting | None, now: float) -> None:
    """``awaiting`` (or nothing) as the entry's receipts; the dispatch lease let go."""
    entry.sends_token = ""
    entry.sends_lease = 0.0
    if awaiting is None:
        entry.receipts = entry.receipts_due = None
        return
    entry.receipts = awaiting.entries
    entry.receipts_due = None if awaiting.due is None else now + awaiting.due
    entry.expires_at = max(entry.expires_at, now + awaiting.keep_at_least)


def _record_sends(entry: _Entry, sends: str, token: str, now: float, dispatch_lease: float) -> None:
    entry.sends = sends
    entry.sends_token = token
    entry.sends_at = now
    entry.sends_lease = now + dispatch_lease
