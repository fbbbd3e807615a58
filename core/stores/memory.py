"""MemoryStore: a thread-safe store inside one process, for unit tests and the embedded demo.

It is not shared between processes: a forked child starts with a copy of the parent's records
and its own lock. Use Redis or SQL wherever more than one process consumes a queue.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from taskonce.errors import ConfigError, LeaseLost
from taskonce.stores.base import (
    LIVENESS_RETENTION,
    Awaiting,
    Claim,
    ClaimOutcome,
    DueForRelay,
    ReceiptLease,
    Record,
    Seen,
    SendLease,
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
    sends: tuple[str, ...] = ()  # pending deferred sends
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
            if not entry.sends:  # pending sends stay for the relay (purge keeps them too)
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
            sends_pending=bool(entry.sends),
            sends=entry.sends,
            receipts=entry.receipts,
            crashes=entry.crashes,
        )

    def _owned(self, key: str, owner: str, now: float, operation: str) -> _Entry:
        entry = self._live(key, now)
        if entry is None or entry.status is not Status.IN_PROGRESS or entry.owner != owner:
            raise LeaseLost(key, operation)
        return entry

    def claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None = None,
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

    def take_over(
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

    def quarantine(self, key: str, owner: str, keep_for: float) -> None:
        with self._lock:
            now = self._clock()
            entry = self._owned(key, owner, now, "quarantine")
            entry.status = Status.QUARANTINED
            entry.owner = entry.worker = None
            entry.lease_until = 0.0
            entry.expires_at = now + keep_for

    def beat(self, worker: str, ttl: float) -> None:
        with self._lock:
            now = self._clock()
            self._beats[worker] = (now, now + ttl)

    def seen(self, worker: str) -> Seen | None:
        with self._lock:
            now = self._clock()
            beat = self._beats.get(worker)
            if beat is None or beat[1] + LIVENESS_RETENTION <= now:
                return None
            return Seen(ago=max(0.0, now - beat[0]), remaining=max(0.0, beat[1] - now))

    def complete(
        self,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str] = (),
        dispatch_lease: float = 0.0,
    ) -> None:
        with self._lock:
            now = self._clock()
            entry = self._owned(key, owner, now, "complete")
            entry.status = Status.COMPLETED
            entry.owner = None
            entry.worker = None
            entry.crashes = 0
            entry.result = result
            entry.expires_at = now + keep_for  # lease_until stays: the record was claimed
            if sends:
                _record_sends(entry, sends, owner, now, dispatch_lease)

    def release(self, key: str, owner: str | None) -> None:
        with self._lock:
            now = self._clock()
            if owner is not None:
                self._owned(key, owner, now, "release")
            self._entries.pop(key, None)

    def renew(self, key: str, owner: str, lease: float) -> None:
        with self._lock:
            now = self._clock()
            entry = self._owned(key, owner, now, "renew")
            entry.expires_at += max(0.0, now + lease - entry.lease_until)
            entry.lease_until = now + lease

    def mark(
        self,
        key: str,
        keep_for: float,
        fingerprint: str | None,
        result: str | None,
        sends: Sequence[str] = (),
        token: str = "",
        dispatch_lease: float = 0.0,
    ) -> bool:
        with self._lock:
            now = self._clock()
            if self._live(key, now) is not None:
                return False
            entry = self._entries[key] = _Entry(
                status=Status.COMPLETED,
                owner=None,
                fingerprint=fingerprint,
                result=result,
                created_at=now,
                expires_at=now + keep_for,
                lease_until=0.0,
            )
            if sends:
                _record_sends(entry, sends, token, now, dispatch_lease)
            return True

    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        with self._lock:
            now = self._clock()
            entry = self._entries.get(key)
            if entry is None or not entry.sends or entry.sends_at > now - older_than:
                return SendLease()
            if entry.sends_lease > now and entry.sends_token != token:
                return SendLease(retry_after=entry.sends_lease - now)
            entry.sends_token = token
            entry.sends_lease = now + lease
            return SendLease(entry.sends)

    def dispatched(self, key: str, token: str, awaiting: Awaiting | None = None) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.sends or entry.sends_token != token:
                return False
            entry.sends = ()
            entry.sends_at = 0.0
            _await(entry, awaiting, self._clock())
            return True

    def take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
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

    def settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.receipts is None or entry.sends_token != token:
                return False
            _await(entry, awaiting, self._clock())
            return True

    def have_records(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            now = self._clock()
            return [self._live(key, now) is not None for key in keys]

    def due_for_relay(self, older_than: float = 0.0, limit: int = 100) -> DueForRelay:
        with self._lock:
            now = self._clock()
            due = [
                (e.receipts_due, k)
                for k, e in self._entries.items()
                if e.receipts_due is not None and e.receipts_due <= now
            ]
            pending = self._pending(now - older_than, limit)
        return DueForRelay(pending, [k for _, k in sorted(due)[:limit]])

    def pending_sends(self, older_than: float = 0.0, limit: int = 100) -> list[str]:
        with self._lock:
            return self._pending(self._clock() - older_than, limit)

    def _pending(self, recorded_by: float, limit: int) -> list[str]:
        found = [
            (e.sends_at, k)
            for k, e in self._entries.items()
            if e.sends and e.sends_at <= recorded_by
        ]
        return [k for _, k in sorted(found)[:limit]]

    def get(self, key: str) -> Record | None:
        with self._lock:
            now = self._clock()
            entry = self._live(key, now)
            return None if entry is None else self._record(key, entry, now)

    def purge(self, batch: int = 1000) -> int:
        if batch < 1:
            raise ConfigError(f"purge batch={batch!r} is not valid; it must be at least 1")
        deleted = 0
        while True:
            with self._lock:
                now = self._clock()
                # A record whose sends are pending is kept until the relay publishes them.
                expired = [
                    k for k, e in self._entries.items() if e.expires_at <= now and not e.sends
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

    def stats(self) -> Mapping[str, int]:
        with self._lock:
            now = self._clock()
            entries = list(self._entries.values())
        live = [e for e in entries if e.expires_at > now]
        in_progress = sum(1 for e in live if e.status is Status.IN_PROGRESS)
        quarantined = sum(1 for e in live if e.status is Status.QUARANTINED)
        return {
            "keys": len(live),
            "in_progress": in_progress,
            "completed": len(live) - in_progress - quarantined,
            "quarantined": quarantined,
            "expired": len(entries) - len(live),
            "sends_pending": sum(1 for e in entries if e.sends),
            "receipts_awaited": sum(1 for e in live if e.receipts_due is not None),
        }

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        with self._lock:
            now = self._clock()
            found = [
                self._record(key, entry, now)
                for key, entry in self._entries.items()
                if key.startswith(key_prefix) and entry.expires_at > now
            ]
        return iter(found)

    def keys_ending(self, suffix: str, limit: int = 5) -> list[str]:
        with self._lock:
            now = self._clock()
            found = (
                key
                for key, entry in self._entries.items()
                if key.endswith(suffix) and entry.expires_at > now
            )
            return list(itertools.islice(found, max(limit, 0)))

    def close(self) -> None:
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


def _record_sends(
    entry: _Entry, sends: Sequence[str], token: str, now: float, dispatch_lease: float
) -> None:
    entry.sends = tuple(sends)
    entry.sends_token = token
    entry.sends_at = now
    entry.sends_lease = now + dispatch_lease
