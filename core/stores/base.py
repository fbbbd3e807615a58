"""The store contract: what every store (memory, Redis, SQL, Django's) offers, in two layers.

A record is one key's state. A *claim* (status ``IN_PROGRESS``) carries an owner token and a
lease judged by the store's own clock; a *mark* (status ``COMPLETED``) says the key was handled
and is kept until ``expires_at``. Every write after a claim names the owner token and is refused
with :class:`~taskonce.errors.LeaseLost` when the token no longer matches (fencing).

Times in records are seconds since the epoch *by the store's clock*; ``lease_remaining`` is
computed by the store at read time so callers never compare their own clock with the store's.

A claim also records its owner's *worker identity* (:mod:`taskonce.worker`), and each worker
process keeps a short-lived *liveness record* in the store (:meth:`StoreLiveness.beat`), so a claim
whose owner is known dead can be taken over (:meth:`StoreKeys.take_over`) before its lease runs out.

**The two layers.** The public methods are written here, once, for every store: they check
their arguments (:mod:`.arguments`: the same limits and the same error text on every store),
encode the sends they record and decode those they hand back, turn a refused fenced write into
:class:`~taskonce.errors.LeaseLost`, filter liveness records by :data:`LIVENESS_RETENTION` and
build the counts and scans the CLI reads. Each store implements the ``_primitive`` methods
below them: each is **one atomic step on its server, judged by the server's clock** (one Lua
script, one statement or an optimistic retry of one, one critical section under a lock).
The rules that keep the layers honest:

- A public method never reads before a write: whatever a write depends on is decided inside
  the primitive's one atomic step, never by a read the wrapper made before it (which another
  worker could make stale).
- :class:`~taskonce.errors.LeaseLost` comes only from a primitive's answer (a fenced write
  that answers False), never from a read.
- ``complete`` raises where ``mark`` answers False: a completion whose claim is gone lost its
  lease; a mark that finds a live record found a concurrent duplicate, which is an answer.
- A primitive gets its arguments checked: it never validates them again (it may convert them
  to its server's units).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from taskonce.errors import LeaseLost
from taskonce.stores import arguments as check
from taskonce.stores.answers import (
    LIVENESS_RETENTION,
    MAX_KEY_LENGTH,
    MAX_TOKEN_LENGTH,
    MAX_WORKER_LENGTH,
    Awaiting,
    Claim,
    ClaimOutcome,
    Completion,
    DueForRelay,
    Marking,
    ReceiptLease,
    Record,
    Seen,
    SendLease,
    State,
    Status,
    StrEnum,
)

if TYPE_CHECKING:
    pass


class StoreKeys(abc.ABC):
    """The keys part of the store contract: claims and marks, fenced by the owner token."""

    def claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None = None,
    ) -> Claim:
        """Atomically take ``key`` for ``owner`` (of worker identity ``worker``) for ``lease``
        seconds.

        Claims when nothing live is recorded (an expired mark counts as nothing); takes over a
        claim whose lease has run out, unless its fingerprint differs from ``fingerprint`` (both
        set), counting the take-over in the record (:attr:`Claim.crashes`). Otherwise
        changes nothing and returns the record found (a quarantined record is never claimed).
        The claim record lives for ``lease + keep_for`` so a dead worker's claim stays visible.
        """
        return self._claim(
            check.check_key(key),
            check.check_token("owner", owner),
            check.check_seconds("lease", lease),
            check.check_seconds("keep_for", keep_for),
            check.check_fingerprint(fingerprint),
            check.check_worker(worker, optional=True),
        )

    def take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        """Hand ``old_owner``'s live claim of ``key`` to ``owner`` (of worker identity
        ``worker``) for ``lease`` seconds, whatever its lease says (its owner is known dead),
        and count the take-over in the record (:attr:`Record.crashes`).

        Fenced: the key's take-overs so far, this one included (at least 1), only if the claim
        was still ``old_owner``'s; otherwise 0 and nothing changes (someone else took it over,
        completed or released it first). The fingerprint and ``created_at`` are kept; the
        record lives ``lease + keep_for`` from now.
        """
        return self._take_over(
            check.check_key(key),
            check.check_token("old_owner", old_owner),
            check.check_token("owner", owner),
            check.check_seconds("lease", lease),
            check.check_seconds("keep_for", keep_for),
            str(check.check_worker(worker)),
        )

    def quarantine(self, key: str, owner: str, keep_for: float) -> None:
        """Turn ``owner``'s claim into a quarantined record kept ``keep_for`` seconds (its
        fingerprint, ``created_at`` and take-over count kept): a claim that would not be run,
        because its owners died too often. :class:`LeaseLost` if the claim is no longer
        ``owner``'s. Only an operator's :meth:`release` (``owner=None``) removes it early."""
        args = (
            check.check_key(key),
            check.check_token("owner", owner),
            check.check_seconds("keep_for", keep_for),
        )
        if not self._quarantine(*args):
            raise LeaseLost(key, "quarantine")

    def complete(
        self,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str] = (),
        dispatch_lease: float = 0.0,
    ) -> None:
        """Turn ``owner``'s claim into a mark kept ``keep_for`` seconds; :class:`LeaseLost` if
        the claim is no longer ``owner``'s.

        ``sends`` (JSON texts) are recorded with the mark in the same atomic write, pending,
        with ``owner`` as their dispatch token (see :meth:`dispatched`), which holds their
        dispatch lease for ``dispatch_lease`` seconds: a redelivery that arrives while the
        recorder publishes them waits instead of publishing them a second time."""
        if not self._complete(
            check.completion(key, owner, keep_for, result, sends, dispatch_lease)
        ):
            raise LeaseLost(key, "complete")

    def release(self, key: str, owner: str | None) -> None:
        """Delete ``owner``'s claim so a retry can claim again; :class:`LeaseLost` if it is no
        longer ``owner``'s. ``owner=None`` is an operator's release: it deletes whatever is
        recorded (pending sends and awaited receipts with it) and never raises."""
        check.check_key(key)
        if owner is None:
            self._forget(key)
        elif not self._release(key, check.check_token("owner", owner)):
            raise LeaseLost(key, "release")

    def renew(self, key: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s lease to ``lease`` seconds from now; :class:`LeaseLost` if the
        claim is no longer ``owner``'s."""
        args = (
            check.check_key(key),
            check.check_token("owner", owner),
            check.check_seconds("lease", lease),
        )
        if not self._renew(*args):
            raise LeaseLost(key, "renew")

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
        """Record ``key`` as handled for ``keep_for`` seconds (lazy mode).

        True when this call wrote the mark; False when a live record already existed (a
        concurrent duplicate ran too), in which case nothing changes. ``sends`` are recorded
        with the mark in the same atomic write, pending, with ``token`` as dispatch token
        holding their dispatch lease for ``dispatch_lease`` seconds (as in :meth:`complete`).
        """
        return self._mark(
            check.marking(key, keep_for, fingerprint, result, sends, token, dispatch_lease)
        )

    def get(self, key: str) -> Record | None:
        """The live record of ``key``, or None (expired marks count as absent)."""
        return self._get(check.check_key(key))

    # -- the primitives: one atomic step each, judged by the server's clock ------------------

    @abc.abstractmethod
    def _claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None,
    ) -> Claim:
        """:meth:`claim`: insert if absent, else take over an expired claim of the same
        payload, else answer with the record found."""

    @abc.abstractmethod
    def _take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        """:meth:`take_over`, fenced by ``old_owner``: the take-over count, or 0."""

    @abc.abstractmethod
    def _quarantine(self, key: str, owner: str, keep_for: float) -> bool:
        """:meth:`quarantine`, fenced by ``owner``: False when the claim is not ``owner``'s."""

    @abc.abstractmethod
    def _complete(self, done: Completion) -> bool:
        """:meth:`complete` with ``sends`` encoded (:func:`encode_sends`), fenced by ``owner``:
        False when the claim is not ``owner``'s."""

    @abc.abstractmethod
    def _release(self, key: str, owner: str) -> bool:
        """Delete ``owner``'s claim, fenced: False when the claim is not ``owner``'s."""

    @abc.abstractmethod
    def _forget(self, key: str) -> None:
        """Delete whatever ``key`` records, unfenced (an operator's release), with its entries
        in any index."""

    @abc.abstractmethod
    def _renew(self, key: str, owner: str, lease: float) -> bool:
        """:meth:`renew`, fenced by ``owner``: False when the claim is not ``owner``'s."""

    @abc.abstractmethod
    def _mark(self, mark: Marking) -> bool:
        """:meth:`mark` with ``sends`` encoded: False when a live record exists."""

    @abc.abstractmethod
    def _get(self, key: str) -> Record | None:
        """:meth:`get`."""


class StoreLiveness(abc.ABC):
    """The liveness part of the store contract: each worker process's record of being alive,
    so a claim whose owner is known dead is taken over before its lease runs out."""

    def beat(self, worker: str, ttl: float) -> None:
        """Write ``worker``'s liveness record: seen now, alive for ``ttl`` seconds (store
        clock). The record is kept a while after it lapses so :meth:`seen` can tell how long a
        silent worker has been silent."""
        self._beat(str(check.check_worker(worker)), check.check_seconds("ttl", ttl))

    def seen(self, worker: str) -> Seen | None:
        """``worker``'s liveness record, or None when it has none (never written, or forgotten
        :data:`LIVENESS_RETENTION` seconds after it lapsed)."""
        found = self._seen(str(check.check_worker(worker)))
        if found is None:
            return None
        ago, remaining = found
        if remaining + LIVENESS_RETENTION <= 0:
            return None
        return Seen(ago=max(0.0, ago), remaining=max(0.0, remaining))

    @abc.abstractmethod
    def _beat(self, worker: str, ttl: float) -> None:
        """:meth:`beat`: the record kept at least :data:`LIVENESS_RETENTION` after it lapses."""

    @abc.abstractmethod
    def _seen(self, worker: str) -> tuple[float, float] | None:
        """``worker``'s record as (seconds since its last write, seconds until it lapses,
        negative once it has), or None when there is none."""


class StoreSends(abc.ABC):
    """The hand-off part of the store contract: sends recorded with the outcome
    (:meth:`StoreKeys.complete`, :meth:`StoreKeys.mark`), then taken, published and cleared."""

    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        """Take the dispatch lease of ``key``'s pending sends for ``lease`` seconds under
        ``token``, if they were recorded at least ``older_than`` seconds ago and no other
        dispatcher holds a live lease. Returns the sends (empty when none are pending or the
        lease is held elsewhere, then with ``retry_after`` = the lease's remaining time).
        The lease's holder may take it again: to renew it, or with ``lease=0`` to let it go."""
        sends, retry_after = self._take_sends(
            check.check_key(key),
            check.check_token("token", token),
            check.check_seconds("lease", lease, zero=True),
            check.check_seconds("older_than", older_than, zero=True),
        )
        if sends:
            return SendLease(tuple(json.loads(sends)))
        return SendLease(retry_after=max(0.0, retry_after))

    def dispatched(self, key: str, token: str, awaiting: Awaiting | None = None) -> bool:
        """Record ``key``'s pending sends as published (fenced: only while ``token`` is still
        their dispatch token). True when this call cleared them.

        With ``awaiting``, in the same atomic write, the record keeps those entries and joins
        the receipts index, due ``awaiting.due`` seconds from now, its dispatch lease let go,
        and is kept at least ``awaiting.keep_at_least`` seconds (:class:`StoreReceipts`)."""
        return self._dispatched(
            check.check_key(key), check.check_token("token", token), check.check_awaiting(awaiting)
        )

    @abc.abstractmethod
    def _take_sends(
        self, key: str, token: str, lease: float, older_than: float
    ) -> tuple[str | None, float]:
        """:meth:`take_sends`: the sends' JSON array text when taken, else None and the
        seconds the other holder's lease has left (0 when none are pending)."""

    @abc.abstractmethod
    def _dispatched(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """:meth:`dispatched`, fenced by ``token``."""


class StoreReceipts(abc.ABC):
    """The receipts part of the store contract: published sends whose receivers are guarded on
    this store wait, in their sender's record, for the receiver's record of their key
    (:mod:`taskonce.receipts`). A record awaits receipts or has sends pending, never both; the
    two share its dispatch token and lease. Records that await receipts are found by an index
    ordered by due time, never by a scan."""

    def take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
        """Take ``key``'s awaiting entries for ``lease`` seconds under ``token`` if they are
        due (store clock) and no other relay holds a live lease: the entries and how late they
        are. Nothing (``entries`` None) when none are awaited, they are not due yet, or they
        were given up on; with ``retry_after`` when another relay holds them."""
        return self._take_receipts(
            check.check_key(key),
            check.check_token("token", token),
            check.check_seconds("lease", lease, zero=True),
        )

    def settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """Write back what still awaits (fenced by ``token``): ``awaiting``'s entries, due
        ``awaiting.due`` seconds from now (or out of the index when None), the lease let go,
        the record kept at least ``awaiting.keep_at_least`` seconds; None clears them (every receipt
        came). True when written."""
        return self._settle_receipts(
            check.check_key(key), check.check_token("token", token), check.check_awaiting(awaiting)
        )

    def have_records(self, keys: Sequence[str]) -> list[bool]:
        """For each of ``keys``, whether a live record of it exists (claimed, completed or
        marked): the receipts. One round trip."""
        wanted = check.check_keys(keys)
        if not wanted:
            return []
        found = self._live_keys(list(dict.fromkeys(wanted)))
        return [key in found for key in wanted]

    def due_for_relay(self, older_than: float = 0.0, limit: int = 100) -> DueForRelay:
        """The relay's work in one round trip: at most ``limit`` keys whose sends have been
        pending at least ``older_than`` seconds and at most ``limit`` whose receipts are due,
        each oldest (earliest due) first."""
        return self._due_for_relay(
            check.check_seconds("older_than", older_than, zero=True),
            check.check_limit("limit", limit),
        )

    @abc.abstractmethod
    def _take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
        """:meth:`take_receipts`."""

    @abc.abstractmethod
    def _settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """:meth:`settle_receipts`, fenced by ``token``."""

    @abc.abstractmethod
    def _live_keys(self, keys: list[str]) -> set[str]:
        """Which of ``keys`` (distinct) have a live record, in one round trip."""

    @abc.abstractmethod
    def _due_for_relay(self, older_than: float, limit: int) -> DueForRelay:
        """:meth:`due_for_relay`."""


#: the counts of :meth:`StoreOperations.stats`, each 0 to begin with
STATS = (
    "keys",
    "in_progress",
    "completed",
    "quarantined",
    "expired",
    "sends_pending",
    "receipts_awaited",
)


class StoreOperations(abc.ABC):
    """The operations part of the store contract: maintenance, monitoring and the CLI's scans,
    closing, and a description for logs."""

    def purge(self, batch: int = 1000) -> int:
        """Delete expired records in batches of at most ``batch``; the number deleted."""
        return self._purge(check.check_limit("purge(batch=…)", batch))

    def stats(self) -> Mapping[str, int]:
        """Counts of live records: ``keys``, ``in_progress``, ``completed``, ``quarantined``,
        ``expired`` (records past their expiry that :meth:`purge` would delete),
        ``sends_pending``: records whose deferred sends are not all published, and
        ``receipts_awaited``: records with published sends whose receipts are awaited.

        One scan of the records (:meth:`records`: for the CLI and monitoring, not hot paths)."""
        counts = dict.fromkeys(STATS, 0)
        for record in self._records("", "", None):
            counts["keys"] += 1
            counts[record.status.value] += 1
            counts["sends_pending"] += record.sends_pending
            counts["receipts_awaited"] += record.receipts_awaited
        # records past their expiry, kept for their pending sends, count as pending too
        counts["expired"], expired_sending = self._expired()
        counts["sends_pending"] += expired_sending
        return counts

    def expired(self) -> int:
        """How many records are past their expiry and still held: what :meth:`purge` would
        delete (0 where the server deletes expired records itself). One query, no scan."""
        return self._expired()[0]

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        """The live records whose key starts with ``key_prefix``, in no particular order
        (a scan for the CLI and monitoring, not for hot paths)."""
        return iter(self._records(check.check_text("key_prefix", key_prefix), "", None))

    def keys_ending(self, suffix: str, limit: int = 5) -> list[str]:
        """At most ``limit`` keys of live records that end with ``suffix``, in no particular
        order: the CLI's suggestions when a key has no record (``:<id>`` finds a message id on
        every queue). A scan like :meth:`records`, not for hot paths."""
        ending = check.check_text("suffix", suffix)
        wanted = check.check_limit("limit", limit, minimum=0)
        if not wanted:
            return []
        return [record.key for record in self._records("", ending, wanted)]

    def close(self) -> None:
        """Release connections; the store is not used afterwards."""
        self._close()

    def describe(self) -> str:
        """A one-line description for logs and the CLI, never containing a password."""
        return type(self).__name__

    def check_ready(self) -> None:
        """At a worker's start, once the store answers: :class:`ConfigError` when it is not set
        up for taskonce in a way no wait can mend (a Django database not migrated)."""
        return  # every store but Django's is ready once it answers

    @abc.abstractmethod
    def _purge(self, batch: int) -> int:
        """:meth:`purge`: expired records deleted (a record with sends pending is kept), and
        liveness records forgotten :data:`LIVENESS_RETENTION` after they lapsed."""

    @abc.abstractmethod
    def _records(self, key_prefix: str, key_suffix: str, limit: int | None) -> list[Record]:
        """The live records whose key starts with ``key_prefix`` and ends with
        ``key_suffix``, at most ``limit`` of them (None: all)."""

    @abc.abstractmethod
    def _expired(self) -> tuple[int, int]:
        """How many records are past their expiry and still held, and how many of those are
        kept for their pending sends (0, 0 where the server deletes expired records itself)."""

    @abc.abstractmethod
    def _close(self) -> None:
        """:meth:`close`."""


class Store(StoreKeys, StoreLiveness, StoreSends, StoreReceipts, StoreOperations):
    """A place to record claims and marks. Implementations: memory, Redis, SQL, Django's.

    The contract in five parts: :class:`StoreKeys` (claim, take_over, quarantine, complete,
    release, renew, mark, get), :class:`StoreLiveness` (beat, seen), :class:`StoreSends`
    (take_sends, dispatched), :class:`StoreReceipts` (take_receipts, settle_receipts,
    have_records, due_for_relay) and :class:`StoreOperations` (purge, stats, records,
    keys_ending, close, describe). Each part's public methods are written once, over its
    ``_primitive`` methods (the module's documentation). Stores that can write inside the
    caller's database transaction also implement :class:`TransactionalStore`.

    Stores are opened in a parent process and used in forked children (Celery prefork,
    Dramatiq worker processes): no connection, pool or lock may cross a fork.
    """

    #: URL schemes this store accepts in :func:`taskonce.open_store`.
    schemes: tuple[str, ...] = ()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "LIVENESS_RETENTION",
    "MAX_KEY_LENGTH",
    "MAX_TOKEN_LENGTH",
    "MAX_WORKER_LENGTH",
    "STATS",
    "Awaiting",
    "Claim",
    "ClaimOutcome",
    "Completion",
    "DueForRelay",
    "Marking",
    "ReceiptLease",
    "Record",
    "Seen",
    "SendLease",
    "State",
    "Status",
    "Store",
    "StoreKeys",
    "StoreLiveness",
    "StoreOperations",
    "StoreReceipts",
    "StoreSends",
    "StrEnum",
]
