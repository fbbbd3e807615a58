"""The Redis store's receipts part (:class:`~taskonce.stores.base.StoreReceipts`): records whose
published sends await their receipts (:mod:`taskonce.receipts`), the receipts index, and the
relay's one-round-trip look at both indexes.

A record that awaits receipts is of kind ``a`` (completed) or ``b`` (marked) in
:mod:`.layout`: the shape of a record with sends pending, holding the receipts' entries, their
due time and the relay's lease on them. Records due to be looked at are found by the receipts
index, a sorted set per bucket scored by due time (server ms) next to the sends index
(:mod:`.names`): every script that changes what a record awaits changes its index entry in the
same atomic step. Redis deletes an expired record, not its index entries: the relay's
``take_receipts`` drops the entry of a record it finds gone, and :meth:`RedisReceipts.purge`
sweeps the indexes.

A mixin of :class:`~taskonce.stores.redis.store.RedisStore` (kept apart so that neither module
grows past a reader's patience); its methods use the store's plumbing (:class:`_Host`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from redis.commands.core import Script

from taskonce.errors import ConfigError
from taskonce.stores.base import Awaiting, DueForRelay, ReceiptLease, StoreReceipts
from taskonce.stores.redis.layout import safe
from taskonce.stores.redis.names import Names
from taskonce.stores.redis.scripts import Scripts
from taskonce.stores.redis.trips import Command, OneTrip, SharedTrips
from taskonce.stores.redis.wire import cannot_answer, ms, text

T = TypeVar("T")

#: the kinds each index lists (what a sweep keeps)
SENDS_KINDS, RECEIPTS_KINDS = "pq", "ab"


class _Host(Protocol):
    """What the mixin uses of the store."""

    _names: Names
    _scripts: Scripts
    _client: Any
    _cluster: bool
    _trips: SharedTrips | OneTrip

    def _run(
        self, operation: str, script: Script | Command, key: str, args: Sequence[Any]
    ) -> Any: ...

    def _call(self, operation: str, key: str | None, fn: Callable[[], T]) -> T: ...

    def _unavailable(self, operation: str, key: str | None, exc: BaseException) -> Any: ...


class RedisReceipts(StoreReceipts):
    """The receipts part of :class:`~taskonce.stores.redis.store.RedisStore`, and what it adds
    to ``dispatched``, ``stats`` and ``purge``."""

    def take_receipts(self: _Host, key: str, token: str, lease: float) -> ReceiptLease:
        """Take ``key``'s awaited receipts for ``lease`` seconds if due (one script, the Redis
        clock); a record gone or not awaiting leaves the receipts index."""
        args = (safe(token), ms(lease), self._names.receipts_of(key), key)
        reply = self._run("take_receipts", self._scripts.take_receipts, key, args)
        if not isinstance(reply, list):
            return ReceiptLease()
        if len(reply) == 1:
            return ReceiptLease(retry_after=int(reply[0]) / 1000.0)
        return ReceiptLease(text(reply[0]), late=int(reply[1]) / 1000.0)

    def settle_receipts(self: _Host, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """Write back what still awaits, fenced by ``token`` (one script)."""
        return _settle(self, "settle_receipts", RECEIPTS_KINDS, key, token, awaiting)

    def have_records(self: _Host, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a live record: one pipeline of ``EXISTS`` (one round trip per
        node on a cluster, where the keys live in different slots). A key's record, whatever
        its kind, is its receipt; Redis counts an expired one as absent."""
        if not keys:
            return []

        def exists() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._names.record(key))
            return [bool(int(found)) for found in pipe.execute()]

        return self._call("have_records", None, exists)

    def due_for_relay(self: _Host, older_than: float = 0.0, limit: int = 100) -> DueForRelay:
        """The relay's work from both indexes: one script on one server; on a cluster, one
        pipeline per node after the clock is read (as ``pending_sends`` does there)."""
        min_age = round(older_than * 1000)
        if self._cluster:
            return self._call("due_for_relay", None, lambda: _due_in_buckets(self, min_age, limit))
        _, sends, receipts = self._names.buckets()[0]  # one server: one of each
        args = (receipts, min_age, limit)
        pending, due = _run_on(self, "due_for_relay", self._scripts.relay, sends, args)
        return DueForRelay([text(n) or "" for n in pending], [text(n) or "" for n in due])

    def purge(self: _Host, batch: int = 1000) -> int:
        """Always 0: every record carries a Redis expiry (at its ``expires_at``), so Redis
        deletes expired records itself, and every script treats a record past it as absent.
        What Redis leaves behind is the index entries of records that expired with sends
        pending or receipts awaited: those are swept here, ``batch`` entries per script (not
        counted: they are not records)."""
        if batch < 1:
            raise ConfigError(f"purge batch={batch!r} is not valid; it must be at least 1")
        for records, sends, receipts in self._names.buckets():
            for index, kinds in ((sends, SENDS_KINDS), (receipts, RECEIPTS_KINDS)):
                start = 0
                while True:
                    args = (records, kinds, start, batch)
                    seen, removed = _run_on(self, "purge", self._scripts.sweep, index, args)
                    start += int(seen) - int(removed)
                    if int(seen) < batch:
                        break
        return 0

    def _awaited(self: _Host) -> int:
        """How many records await receipts: the receipts indexes' sizes (one pipeline)."""
        pipe = self._client.pipeline()
        for _, _, receipts in self._names.buckets():
            pipe.zcard(receipts)
        return sum(int(n) for n in pipe.execute())

    def _dispatched_awaiting(self: _Host, key: str, token: str, awaiting: Awaiting) -> bool:
        """``dispatched`` with receipts to await: the sends cleared and the receipts written in
        one script (fenced by the dispatch token)."""
        return _settle(self, "dispatched", SENDS_KINDS, key, token, awaiting)


def _run_on(store: _Host, operation: str, script: Script, name: str, args: Sequence[Any]) -> Any:
    """Run ``script`` on the Redis key ``name`` itself (an index: ``_run`` takes a record's
    key), turning "Redis cannot answer" into StoreUnavailable."""
    call = store._trips.run(script, name, args)
    if call.error is not None:
        if cannot_answer(call.error):
            store._unavailable(operation, None, call.error)
        raise call.error
    return call.reply


def _settle(
    store: _Host,
    operation: str,
    kinds: str,
    key: str,
    token: str,
    awaiting: Awaiting | None,
) -> bool:
    """Run ``settle.lua`` on ``key``'s record of ``kinds``: ``awaiting`` written (or the
    receipts cleared), fenced by ``token``."""
    names = store._names
    args: tuple[Any, ...] = (kinds, safe(token), names.index_of(key), names.receipts_of(key), key)
    if awaiting is not None:
        due = "" if awaiting.due is None else ms(max(0.0, awaiting.due))
        args = (*args, awaiting.entries, due, ms(max(0.0, awaiting.keep_at_least)))
    return bool(int(store._run(operation, store._scripts.settle, key, args)))


def _due_in_buckets(store: _Host, min_age: int, limit: int) -> DueForRelay:
    """Every bucket's oldest ``limit`` of each index, in one pipeline (one round trip per
    node), merged. redis-py refuses scripts in a cluster pipeline, so the clock is read from
    one node first (``TIME``); the masters' synchronised clocks keep the cut-offs close."""
    seconds, micros = store._client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    pipe = store._client.pipeline()
    for _, sends, receipts in store._names.buckets():
        pipe.zrangebyscore(sends, "-inf", now - min_age, start=0, num=limit, withscores=True)
        pipe.zrangebyscore(receipts, "-inf", now, start=0, num=limit, withscores=True)
    replies = pipe.execute()
    found: tuple[list[tuple[float, str]], list[tuple[float, str]]] = ([], [])
    for i, reply in enumerate(replies):
        found[i % 2].extend((float(score), text(name) or "") for name, score in reply)
    pending, due = (sorted(items)[:limit] for items in found)
    return DueForRelay([name for _, name in pending], [name for _, name in due])


__all__ = ["RECEIPTS_KINDS", "SENDS_KINDS", "RedisReceipts"]
