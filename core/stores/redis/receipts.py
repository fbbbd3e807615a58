"""The Redis store's receipts part (:class:`~taskonce.stores.base.StoreReceipts`): records whose
published sends await their receipts (:mod:`taskonce.receipts`), the receipts index, and the
relay's one-round-trip look at both indexes.

A record that awaits receipts is of kind ``a`` (completed) or ``b`` (marked) in
:mod:`.layout`: the shape of a record with sends pending, holding the receipts' entries, their
due time and the relay's lease on them. Records due to be looked at are found by the receipts
index, a sorted set per bucket scored by due time (server ms) next to the sends index
(:mod:`.names`): every script that changes what a record awaits changes its index entry in the
same atomic step. Redis deletes an expired record, not its index entries: the relay's
``take_receipts`` drops the entry of a record it finds gone, and :meth:`RedisReceipts.sweep`
sweeps the indexes.

The store holds one :class:`RedisReceipts` beside it, over the same :class:`~.server.Server`:
the store's primitives of the receipts part (and of ``dispatched`` with receipts to await, and
of ``purge``) call this object's methods.
"""

from __future__ import annotations

from typing import Any

from taskonce.stores.base import Awaiting, DueForRelay, ReceiptLease
from taskonce.stores.redis.layout import safe
from taskonce.stores.redis.server import Server
from taskonce.stores.redis.wire import ms, text

#: the kinds each index lists (what a sweep keeps)
SENDS_KINDS, RECEIPTS_KINDS = "pq", "ab"


class RedisReceipts:
    """The receipts part of :class:`~taskonce.stores.redis.store.RedisStore`, and what it adds
    to ``dispatched`` and ``purge``: the store's primitives for them.

    :param server: the store's deployment.
    """

    def __init__(self, server: Server) -> None:
        self._server = server

    def take(self, key: str, token: str, lease: float) -> ReceiptLease:
        """Take ``key``'s awaited receipts for ``lease`` seconds if due (one script, the Redis
        clock); a record gone or not awaiting leaves the receipts index."""
        server = self._server
        args = (safe(token), ms(lease), server.names.receipts_of(key), key)
        reply = server.run("take_receipts", server.scripts.take_receipts, key, args)
        if not isinstance(reply, list):
            return ReceiptLease()
        if len(reply) == 1:
            return ReceiptLease(retry_after=int(reply[0]) / 1000.0)
        return ReceiptLease(text(reply[0]), late=int(reply[1]) / 1000.0)

    def settle(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """Write back what still awaits, fenced by ``token`` (one script)."""
        return self._settle("settle_receipts", RECEIPTS_KINDS, key, token, awaiting)

    def dispatched(self, key: str, token: str, awaiting: Awaiting) -> bool:
        """``dispatched`` with receipts to await: the sends cleared and the receipts written in
        one script (fenced by the dispatch token)."""
        return self._settle("dispatched", SENDS_KINDS, key, token, awaiting)

    def live_keys(self, keys: list[str]) -> set[str]:
        """Which of ``keys`` have a live record: one pipeline of ``EXISTS`` (one round trip
        per node on a cluster, where the keys live in different slots). A key's record,
        whatever its kind, is its receipt; Redis counts an expired one as absent."""
        server = self._server

        def exists() -> set[str]:
            pipe = server.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(server.names.record(key))
            return {key for key, found in zip(keys, pipe.execute(), strict=True) if int(found)}

        return server.call("have_records", None, exists)

    def due_for_relay(self, older_than: float, limit: int) -> DueForRelay:
        """The relay's work from both indexes: one script on one server; on a cluster, one
        pipeline per node after the clock is read."""
        server = self._server
        min_age = round(older_than * 1000)
        if server.cluster:
            return server.call("due_for_relay", None, lambda: self._due_in_buckets(min_age, limit))
        _, sends, receipts = server.names.buckets()[0]  # one server: one of each
        args = (receipts, min_age, limit)
        pending, due = server.run_on("due_for_relay", server.scripts.relay, sends, args)
        return DueForRelay([text(n) or "" for n in pending], [text(n) or "" for n in due])

    def sweep(self, batch: int) -> None:
        """Sweep the indexes of entries whose records Redis deleted (expired with sends pending
        or receipts awaited), ``batch`` entries per script."""
        server = self._server
        for records, sends, receipts in server.names.buckets():
            for index, kinds in ((sends, SENDS_KINDS), (receipts, RECEIPTS_KINDS)):
                start = 0
                while True:
                    args = (records, kinds, start, batch)
                    seen, removed = server.run_on("purge", server.scripts.sweep, index, args)
                    start += int(seen) - int(removed)
                    if int(seen) < batch:
                        break

    def _settle(
        self, operation: str, kinds: str, key: str, token: str, awaiting: Awaiting | None
    ) -> bool:
        """Run ``settle.lua`` on ``key``'s record of ``kinds``: ``awaiting`` written (or the
        receipts cleared), fenced by ``token``."""
        server = self._server
        names = server.names
        args: tuple[Any, ...] = (
            kinds,
            safe(token),
            names.index_of(key),
            names.receipts_of(key),
            key,
        )
        if awaiting is not None:
            due = "" if awaiting.due is None else ms(max(0.0, awaiting.due))
            args = (*args, awaiting.entries, due, ms(max(0.0, awaiting.keep_at_least)))
        return bool(int(server.run(operation, server.scripts.settle, key, args)))

    def _due_in_buckets(self, min_age: int, limit: int) -> DueForRelay:
        """Every bucket's oldest ``limit`` of each index, in one pipeline (one round trip per
        node), merged. redis-py refuses scripts in a cluster pipeline, so the clock is read
        from one node first (``TIME``); the masters' synchronised clocks keep the cut-offs
        close."""
        client = self._server.client
        seconds, micros = client.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        pipe = client.pipeline()
        for _, sends, receipts in self._server.names.buckets():
            pipe.zrangebyscore(sends, "-inf", now - min_age, start=0, num=limit, withscores=True)
            pipe.zrangebyscore(receipts, "-inf", now, start=0, num=limit, withscores=True)
        found: tuple[list[tuple[float, str]], list[tuple[float, str]]] = ([], [])
        for i, reply in enumerate(pipe.execute()):
            found[i % 2].extend((float(score), text(name) or "") for name, score in reply)
        pending, due = (sorted(items)[:limit] for items in found)
        return DueForRelay([name for _, name in pending], [name for _, name in due])


__all__ = ["RECEIPTS_KINDS", "SENDS_KINDS", "RedisReceipts"]
