"""What a store answers with: a key's :class:`Record`, the outcome of a claim, a worker's
liveness, the leases of the hand-off and the receipts, the relay's work; and the limits every
store keeps (:mod:`taskonce.stores.base` checks them once, for every store)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

#: Keys longer than this are refused (an index on a VARCHAR(255) column and readable logs).
MAX_KEY_LENGTH = 255
#: Owner tokens, dispatch tokens and fingerprints longer than this are refused (a VARCHAR(64)
#: column; a token is 32 hex digits, a fingerprint a SHA-256 in hex).
MAX_TOKEN_LENGTH = 64
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
    """What :meth:`~taskonce.stores.base.StoreKeys.claim` did."""

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
    #: whether the relay still looks for those receipts (False once the rest were given up on:
    #: the entries are kept for ``taskonce inspect``, out of the receipts index)
    receipts_awaited: bool = False
    #: how many times a claim of this key was taken over from a dead, silent or expired owner
    #: (claims and quarantined records keep it; a completion or a release forgets it)
    crashes: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["state"] = self.state
        return data


@dataclasses.dataclass(frozen=True)
class Completion:
    """A completion's arguments, checked, its sends encoded: what :meth:`Store.complete` and
    ``complete_in`` hand their primitive. ``owner`` fences the write and is the sends' dispatch
    token."""

    key: str
    owner: str
    keep_for: float
    result: str | None
    sends: str | None
    dispatch_lease: float


@dataclasses.dataclass(frozen=True)
class Marking:
    """A mark's arguments, checked, its sends encoded: what :meth:`Store.mark` and ``mark_in``
    hand their primitive. ``token`` is the sends' dispatch token ("" without sends)."""

    key: str
    keep_for: float
    fingerprint: str | None
    result: str | None
    sends: str | None
    token: str
    dispatch_lease: float


@dataclasses.dataclass(frozen=True)
class Seen:
    """A worker's liveness record as :meth:`~taskonce.stores.base.StoreLiveness.seen` reads
    it, by the store's clock."""

    ago: float  # seconds since the worker's last liveness write
    remaining: float  # seconds until the record lapses; 0 once it has (the worker is silent)


@dataclasses.dataclass(frozen=True)
class SendLease:
    """The answer of :meth:`~taskonce.stores.base.StoreSends.take_sends`."""

    sends: tuple[str, ...] = ()
    #: > 0 when another dispatcher holds the lease: seconds until it runs out
    retry_after: float = 0.0


@dataclasses.dataclass(frozen=True)
class Awaiting:
    """Published sends awaiting their receipts, as a record keeps them
    (:meth:`~taskonce.stores.base.StoreSends.dispatched`,
    :meth:`~taskonce.stores.base.StoreReceipts.settle_receipts`).

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
    """The answer of :meth:`~taskonce.stores.base.StoreReceipts.take_receipts`."""

    #: the awaiting entries (:attr:`Awaiting.entries`), None when there was nothing due to take
    entries: str | None = None
    #: seconds the record is past its due time (store clock), when taken
    late: float = 0.0
    #: > 0 when another relay holds them: seconds until its lease runs out
    retry_after: float = 0.0


@dataclasses.dataclass(frozen=True)
class DueForRelay:
    """The answer of :meth:`~taskonce.stores.base.StoreReceipts.due_for_relay`: the relay's
    work, oldest first."""

    #: keys whose sends have been pending at least ``older_than`` seconds
    sends: list[str]
    #: keys whose awaited receipts are due to be looked for
    receipts: list[str]


@dataclasses.dataclass(frozen=True)
class Claim:
    """The answer of :meth:`~taskonce.stores.base.StoreKeys.claim`: what happened, and the
    record found when it exists."""

    outcome: ClaimOutcome
    record: Record | None = None
    #: ``TAKEN_OVER``: the key's take-overs from dead, silent or expired owners, this one too
    crashes: int = 0


__all__ = [
    "LIVENESS_RETENTION",
    "MAX_KEY_LENGTH",
    "MAX_TOKEN_LENGTH",
    "MAX_WORKER_LENGTH",
    "Awaiting",
    "Claim",
    "ClaimOutcome",
    "DueForRelay",
    "ReceiptLease",
    "Record",
    "Seen",
    "SendLease",
    "State",
    "Status",
    "StrEnum",
]
