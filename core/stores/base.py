"""The store contract: what every store (memory, Redis, SQL) implements.

A record is one key's state. A *claim* (status ``IN_PROGRESS``) carries an owner token and a
lease judged by the store's own clock; a *mark* (status ``COMPLETED``) says the key was handled
and is kept until ``expires_at``. Every write after a claim names the owner token and is refused
with :class:`~taskonce.errors.LeaseLost` when the token no longer matches (fencing).

Times in records are seconds since the epoch *by the store's clock*; ``lease_remaining`` is
computed by the store at read time so callers never compare their own clock with the store's.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

#: Keys longer than this are refused (an index on a VARCHAR(255) column and readable logs).
MAX_KEY_LENGTH = 255


class Status(str, enum.Enum):
    """The state of a key in a store."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


class ClaimOutcome(str, enum.Enum):
    """What :meth:`Store.claim` did."""

    CLAIMED = "claimed"  # nothing (live) was recorded; the key is now ours
    TAKEN_OVER = "taken_over"  # an expired claim of another owner is now ours
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

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data


@dataclasses.dataclass(frozen=True)
class Claim:
    """The answer of :meth:`Store.claim`: what happened, and the record found when it exists."""

    outcome: ClaimOutcome
    record: Record | None = None


class Store(abc.ABC):
    """A place to record claims and marks. Implementations: memory, Redis, SQL.

    Stores are opened in a parent process and used in forked children (Celery prefork,
    Dramatiq worker processes): no connection, pool or lock may cross a fork.
    """

    #: URL schemes this store accepts in :func:`taskonce.open_store`.
    schemes: tuple[str, ...] = ()

    @abc.abstractmethod
    def claim(
        self, key: str, owner: str, lease: float, keep_for: float, fingerprint: str | None
    ) -> Claim:
        """Atomically take ``key`` for ``owner`` for ``lease`` seconds.

        Claims when nothing live is recorded (an expired mark counts as nothing); takes over a
        claim whose lease has run out, unless its fingerprint differs from ``fingerprint`` (both
        set). Otherwise changes nothing and returns the record found.
        The claim record lives for ``lease + keep_for`` so a dead worker's claim stays visible.
        """

    @abc.abstractmethod
    def complete(self, key: str, owner: str, keep_for: float, result: str | None) -> None:
        """Turn ``owner``'s claim into a mark kept ``keep_for`` seconds; :class:`LeaseLost` if
        the claim is no longer ``owner``'s."""

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
    def mark(self, key: str, keep_for: float, fingerprint: str | None, result: str | None) -> bool:
        """Record ``key`` as handled for ``keep_for`` seconds (lazy mode).

        True when this call wrote the mark; False when a live record already existed (a
        concurrent duplicate ran too), in which case nothing changes.
        """

    @abc.abstractmethod
    def get(self, key: str) -> Record | None:
        """The live record of ``key``, or None (expired marks count as absent)."""

    @abc.abstractmethod
    def purge(self, batch: int = 1000) -> int:
        """Delete expired records in batches of at most ``batch``; the number deleted."""

    @abc.abstractmethod
    def stats(self) -> Mapping[str, int]:
        """Counts of live records: ``keys``, ``in_progress``, ``completed``, ``expired``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; the store is not used afterwards."""

    def describe(self) -> str:
        """A one-line description for logs and the CLI, never containing a password."""
        return type(self).__name__

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
