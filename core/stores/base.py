"""The store contract: what every store (memory, Redis, SQL) implements.

A record is one key's state. A *claim* (status ``IN_PROGRESS``) carries an owner token and a
lease judged by the store's own clock; a *mark* (status ``COMPLETED``) says the key was handled
and is kept until ``expires_at``. Every write after a claim names the owner token and is refused
with :class:`~taskonce.errors.LeaseLost` when the token no longer matches (fencing).

Times in records are seconds since the epoch *by the store's clock*; ``lease_remaining`` is
computed by the store at read time so callers never compare their own clock with the store's.

A claim also records its owner's *worker identity* (:mod:`taskonce.worker`), and each worker
process keeps a short-lived *liveness record* in the store (:meth:`StoreLiveness.beat`), so a claim
whose owner is known dead can be taken over (:meth:`StoreKeys.take_over`) before its lease runs out.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.orm import Session

#: Keys longer than this are refused (an index on a VARCHAR(255) column and readable logs).
MAX_KEY_LENGTH = 255
#: Worker identities longer than this are refused (they fit a VARCHAR(255) column).
MAX_WORKER_LENGTH = 255
#: Seconds a lapsed liveness record is kept, so a takeover can tell how long its owner was
#: silent; after that the store may forget it.
LIVENESS_RETENTION = 3600.0


class StrEnum(str, enum.Enum):
    """A ``str`` enum whose members are their values wherever text is: formatted, hashed,
    compared and written to JSON, a member is exactly its value (Python 3.10's stand-in for
    :class:`enum.StrEnum`). Stores' stored states and :attr:`Record.state` are these, so what
    they write and print stays byte-for-byte the same."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)

    def __hash__(self) -> int:
        return str.__hash__(self)


class Status(str, enum.Enum):
    """The state of a key in a store: a claim, a handled key, or a quarantined key (its
    owners died ``crash_limit`` times running it). (Each store keeps its own spelling of it,
    with another value for a handled key whose sends are pending, and turns it into this in
    one place.)"""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    QUARANTINED = "quarantined"


class State(StrEnum):
    """A record in the docs' words (:attr:`Record.state`)."""

    #: a claim: the key is being processed (eager)
    CLAIMED = "claimed"
    #: an eager claim that was completed
    COMPLETED = "completed"
    #: a lazy mark: the key was handled, never claimed
    MARKED = "marked"
    #: a key whose owners died too often: not run again until released
    QUARANTINED = "quarantined"


class ClaimOutcome(str, enum.Enum):
    """What :meth:`StoreKeys.claim` did."""

    CLAIMED = "claimed"  # nothing (live) was recorded; the key is now ours
    TAKEN_OVER = "taken_over"  # an expired claim of another owner is now ours (crashes + 1)
    EXISTS = "exists"  # a live claim, a mark, or a record with another fingerprint; see record


@dataclasses.dataclass(frozen=True)
class Record:
    """One key's state as the store holds it."""

    key: str
    status: Status
    owner: str | None
    fingerprint: str | None
    result: str | None  # JSON text, when the policy stores results
    created_at: float  # first claim or mark, store clock
    expires_at: float  # when the store may forget the record
    lease_remaining: float  # seconds left on a claim's lease (0 for marks and expired leases)
    worker: str | None = None  # the claim owner's worker identity (None on marks, old claims)
    # A completed record written by a lazy mark (the key was never claimed), as opposed to an
    # eager claim that was completed; stores tell them apart by the lease a completion keeps.
    marked: bool = False

    @property
    def state(self) -> State:
        """The record in the docs' words: ``claimed``, ``completed`` (eager), ``marked``
        (lazy) or ``quarantined``."""
        if self.status is Status.IN_PROGRESS:
            return State.CLAIMED
        if self.status is Status.QUARANTINED:
            return State.QUARANTINED
        return State.MARKED if self.marked else State.COMPLETED

    #: a handled record whose deferred sends are not all published yet (the hand-off)
    sends_pending: bool = False
    #: those sends (JSON texts, in send order) when the read returns them (``get`` does)
    sends: tuple[str, ...] = ()
    #: sends published and awaiting their receipts, or given up on (:mod:`taskonce.receipts`'s
    #: JSON text), when the read returns them (``get`` does)
    receipts: str | None = None
    #: how many times a claim of this key was taken over from a dead, silent or expired owner
    #: (claims and quarantined records keep it; a completion or a release forgets it)
    crashes: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["state"] = self.state
        return data


@dataclasses.dataclass(frozen=True)
class Seen:
    """A worker's liveness record as :meth:`StoreLiveness.seen` reads it, by the store's clock."""

    ago: float  # seconds since the worker's last liveness write
    remaining: float  # seconds until the record lapses; 0 once it has (the worker is silent)


@dataclasses.dataclass(frozen=True)
class SendLease:
    """The answer of :meth:`StoreSends.take_sends`."""

    sends: tuple[str, ...] = ()
    #: > 0 when another dispatcher holds the lease: seconds until it runs out
    retry_after: float = 0.0


@dataclasses.dataclass(frozen=True)
class Awaiting:
    """Published sends awaiting their receipts, as a record keeps them
    (:meth:`StoreSends.dispatched`, :meth:`StoreReceipts.settle_receipts`).

    :param entries: what awaits, as :mod:`taskonce.receipts` writes it (JSON text; the store
        keeps it as it is).
    :param due: seconds from now (store clock) until the relay should look at them; None when
        none is awaited any more (only given-up ones are kept, for ``taskonce inspect``): the
        record leaves the receipts index.
    :param keep_at_least: keep the record at least this many seconds from now (a record whose expiry
        is later keeps it).
    """

    entries: str
    due: float | None
    keep_at_least: float


@dataclasses.dataclass(frozen=True)
class ReceiptLease:
    """The answer of :meth:`StoreReceipts.take_receipts`."""

    #: the awaiting entries (:attr:`Awaiting.entries`), None when there was nothing due to take
    entries: str | None = None
    #: seconds the record is past its due time (store clock), when taken
    late: float = 0.0
    #: > 0 when another relay holds them: seconds until its lease runs out
    retry_after: float = 0.0


@dataclasses.dataclass(frozen=True)
class DueForRelay:
    """The answer of :meth:`StoreReceipts.due_for_relay`: the relay's work, oldest first."""

    #: keys whose sends have been pending at least ``older_than`` seconds
    sends: list[str]
    #: keys whose awaited receipts are due to be looked for
    receipts: list[str]


@dataclasses.dataclass(frozen=True)
class Claim:
    """The answer of :meth:`StoreKeys.claim`: what happened, and the record found when it exists."""

    outcome: ClaimOutcome
    record: Record | None = None
    #: ``TAKEN_OVER``: the key's take-overs from dead, silent or expired owners, this one too
    crashes: int = 0


class StoreKeys(abc.ABC):
    """The keys part of the store contract: claims and marks, fenced by the owner token."""

    @abc.abstractmethod
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

    @abc.abstractmethod
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

    @abc.abstractmethod
    def quarantine(self, key: str, owner: str, keep_for: float) -> None:
        """Turn ``owner``'s claim into a quarantined record kept ``keep_for`` seconds (its
        fingerprint, ``created_at`` and take-over count kept): a claim that would not be run,
        because its owners died too often. :class:`LeaseLost` if the claim is no longer
        ``owner``'s. Only an operator's :meth:`release` (``owner=None``) removes it early."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    def release(self, key: str, owner: str | None) -> None:
        """Delete ``owner``'s claim so a retry can claim again; :class:`LeaseLost` if it is no
        longer ``owner``'s. ``owner=None`` is an operator's release: it deletes whatever is
        recorded and never raises."""

    @abc.abstractmethod
    def renew(self, key: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s lease to ``lease`` seconds from now; :class:`LeaseLost` if the
        claim is no longer ``owner``'s."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    def get(self, key: str) -> Record | None:
        """The live record of ``key``, or None (expired marks count as absent)."""


class StoreLiveness(abc.ABC):
    """The liveness part of the store contract: each worker process's record of being alive,
    so a claim whose owner is known dead is taken over before its lease runs out."""

    @abc.abstractmethod
    def beat(self, worker: str, ttl: float) -> None:
        """Write ``worker``'s liveness record: seen now, alive for ``ttl`` seconds (store
        clock). The record is kept a while after it lapses so :meth:`seen` can tell how long a
        silent worker has been silent."""

    @abc.abstractmethod
    def seen(self, worker: str) -> Seen | None:
        """``worker``'s liveness record, or None when it has none (never written, or forgotten
        long after it lapsed)."""


class StoreSends(abc.ABC):
    """The hand-off part of the store contract: sends recorded with the outcome
    (:meth:`StoreKeys.complete`, :meth:`StoreKeys.mark`), then taken, published and cleared."""

    @abc.abstractmethod
    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        """Take the dispatch lease of ``key``'s pending sends for ``lease`` seconds under
        ``token``, if they were recorded at least ``older_than`` seconds ago and no other
        dispatcher holds a live lease. Returns the sends (empty when none are pending or the
        lease is held elsewhere, then with ``retry_after`` = the lease's remaining time).
        The lease's holder may take it again: to renew it, or with ``lease=0`` to let it go."""

    @abc.abstractmethod
    def dispatched(self, key: str, token: str, awaiting: Awaiting | None = None) -> bool:
        """Record ``key``'s pending sends as published (fenced: only while ``token`` is still
        their dispatch token). True when this call cleared them.

        With ``awaiting``, in the same atomic write, the record keeps those entries and joins
        the receipts index, due ``awaiting.due`` seconds from now, its dispatch lease let go,
        and is kept at least ``awaiting.keep_at_least`` seconds (:class:`StoreReceipts`)."""

    @abc.abstractmethod
    def pending_sends(self, older_than: float = 0.0, limit: int = 100) -> list[str]:
        """Keys whose sends have been pending for at least ``older_than`` seconds, oldest
        first, at most ``limit`` (candidates for the relay)."""


class StoreReceipts(abc.ABC):
    """The receipts part of the store contract: published sends whose receivers are guarded on
    this store wait, in their sender's record, for the receiver's record of their key
    (:mod:`taskonce.receipts`). A record awaits receipts or has sends pending, never both; the
    two share its dispatch token and lease. Records that await receipts are found by an index
    ordered by due time, never by a scan."""

    @abc.abstractmethod
    def take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
        """Take ``key``'s awaiting entries for ``lease`` seconds under ``token`` if they are
        due (store clock) and no other relay holds a live lease: the entries and how late they
        are. Nothing (``entries`` None) when none are awaited, they are not due yet, or they
        were given up on; with ``retry_after`` when another relay holds them."""

    @abc.abstractmethod
    def settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """Write back what still awaits (fenced by ``token``): ``awaiting``'s entries, due
        ``awaiting.due`` seconds from now (or out of the index when None), the lease let go,
        the record kept at least ``awaiting.keep_at_least`` seconds; None clears them (every receipt
        came). True when written."""

    @abc.abstractmethod
    def have_records(self, keys: Sequence[str]) -> list[bool]:
        """For each of ``keys``, whether a live record of it exists (claimed, completed or
        marked): the receipts. One round trip."""

    @abc.abstractmethod
    def due_for_relay(self, older_than: float = 0.0, limit: int = 100) -> DueForRelay:
        """The relay's work in one round trip: at most ``limit`` keys whose sends have been
        pending at least ``older_than`` seconds (as :meth:`StoreSends.pending_sends`) and at
        most ``limit`` whose receipts are due, each oldest (earliest due) first."""


class StoreOperations(abc.ABC):
    """The operations part of the store contract: maintenance, monitoring and the CLI's scans,
    closing, and a description for logs."""

    @abc.abstractmethod
    def purge(self, batch: int = 1000) -> int:
        """Delete expired records in batches of at most ``batch``; the number deleted."""

    @abc.abstractmethod
    def stats(self) -> Mapping[str, int]:
        """Counts of live records: ``keys``, ``in_progress``, ``completed``, ``quarantined``,
        ``expired``, ``sends_pending``: records whose deferred sends are not all published, and
        ``receipts_awaited``: records with published sends whose receipts are awaited."""

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        """The live records whose key starts with ``key_prefix``, in no particular order
        (a scan for the CLI and monitoring, not for hot paths)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its records")

    def keys_ending(self, suffix: str, limit: int = 5) -> list[str]:
        """At most ``limit`` keys of live records that end with ``suffix``, in no particular
        order: the CLI's suggestions when a key has no record (``:<id>`` finds a message id on
        every queue). A scan like :meth:`records`, not for hot paths; stores override it with
        one that stops at ``limit``."""
        found: list[str] = []
        for record in self.records():
            if len(found) >= limit:
                break
            if record.key.endswith(suffix):
                found.append(record.key)
        return found

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; the store is not used afterwards."""

    def describe(self) -> str:
        """A one-line description for logs and the CLI, never containing a password."""
        return type(self).__name__

    def check_ready(self) -> None:
        """At a worker's start, once the store answers: :class:`ConfigError` when it is not set
        up for taskonce in a way no wait can mend (a Django database not migrated)."""
        return  # every store but Django's is ready once it answers


class Store(StoreKeys, StoreLiveness, StoreSends, StoreReceipts, StoreOperations):
    """A place to record claims and marks. Implementations: memory, Redis, SQL.

    The contract in five parts: :class:`StoreKeys` (claim, take_over, quarantine, complete,
    release, renew, mark, get), :class:`StoreLiveness` (beat, seen), :class:`StoreSends`
    (take_sends, dispatched, pending_sends), :class:`StoreReceipts` (take_receipts,
    settle_receipts, have_records, due_for_relay) and :class:`StoreOperations` (purge, stats,
    records, keys_ending, close, describe). Stores that can write inside the caller's database
    transaction also implement :class:`TransactionalStore`.

    Stores are opened in a parent process and used in forked children (Celery prefork,
    Dramatiq worker processes): no connection, pool or lock may cross a fork.
    """

    #: URL schemes this store accepts in :func:`taskonce.open_store`.
    schemes: tuple[str, ...] = ()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransactionalStore(Store):
    """A store that can write its records inside the caller's database transaction: the
    transactional mode (the mark commits with the handler's writes) and the producer outbox
    (sends commit with the application's rows). The guard and the outbox check for it with
    ``isinstance``. Implementations: the SQL store."""

    @abc.abstractmethod
    def open_session(self) -> Session:
        """A session on the store's database, its transaction begun: the handler writes through
        it and :meth:`complete_in` / :meth:`mark_in` add the record; the caller commits."""

    @abc.abstractmethod
    def complete_in(
        self,
        session: Session,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str] = (),
        dispatch_lease: float = 0.0,
    ) -> None:
        """:meth:`StoreKeys.complete`, written through ``session``'s transaction (not committed)."""

    @abc.abstractmethod
    def mark_in(
        self,
        session: Session,
        key: str,
        keep_for: float,
        fingerprint: str | None,
        result: str | None,
        sends: Sequence[str] = (),
        token: str = "",
        dispatch_lease: float = 0.0,
    ) -> bool:
        """:meth:`StoreKeys.mark`, written through ``session``'s transaction (not committed)."""

    @abc.abstractmethod
    def check_shared(self, bind: Engine | Connection, in_transaction: bool = False) -> None:
        """:class:`~taskonce.errors.ConfigError` unless ``bind`` reaches this store's
        database."""

    @abc.abstractmethod
    def record_sends_in(
        self,
        connection: Connection,
        key: str,
        sends: Sequence[str],
        token: str,
        keep_for: float,
        dispatch_lease: float,
    ) -> None:
        """Write a record ``key`` holding ``sends`` through ``connection``'s transaction (not
        committed): the producer outbox's rows."""
