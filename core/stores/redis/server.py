"""What the Redis store's parts share of one deployment: the client, the scripts, where keys
live (:mod:`.names`), the transport (:mod:`.trips`) and how a round trip that Redis could not
answer is reported. :class:`~taskonce.stores.redis.store.RedisStore` and its receipts part
(:mod:`.receipts`) each hold the one :class:`Server` of the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import redis
import redis.cluster
from redis.commands.core import Script

from taskonce.errors import StoreUnavailable
from taskonce.stores.redis.names import Names
from taskonce.stores.redis.scripts import Scripts
from taskonce.stores.redis.trips import Command, OneTrip, SharedTrips
from taskonce.stores.redis.wire import cannot_answer

logger = logging.getLogger("taskonce.stores.redis")

T = TypeVar("T")


class Server:
    """One Redis deployment as the store's parts reach it.

    :param client: the redis-py client (a :class:`redis.cluster.RedisCluster` on a cluster).
    :param url: the deployment in messages (no password).
    :param scripts: the store's Lua scripts, registered on ``client``.
    :param names: where the store's keys and indexes live.
    :param trips: the transport the scripts run through.
    """

    def __init__(
        self,
        client: redis.Redis,
        url: str,
        scripts: Scripts,
        names: Names,
        trips: SharedTrips | OneTrip,
    ) -> None:
        self.client = client
        self.url = url
        self.scripts = scripts
        self.names = names
        self.trips = trips
        self.cluster = isinstance(client, redis.cluster.RedisCluster)

    def unavailable(self, operation: str, key: str | None, exc: BaseException) -> NoReturn:
        """Raise :class:`StoreUnavailable` for ``operation`` (of ``key``), from ``exc``."""
        where = f" of key {key!r}" if key is not None else ""
        logger.debug("%s%s failed on %s: %s", operation, where, self.url, type(exc).__name__)
        raise StoreUnavailable(
            f"Redis store {self.url} did not answer {operation}{where}: {type(exc).__name__}: {exc}"
        ) from exc

    def call(self, operation: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run one round trip of the client's own, turning "Redis cannot answer" into
        :class:`StoreUnavailable`."""
        try:
            return fn()
        except Exception as exc:
            if cannot_answer(exc):
                self.unavailable(operation, key, exc)
            raise

    def run(self, operation: str, script: Script | Command, key: str, args: Sequence[Any]) -> Any:
        """Run ``script`` on the record of ``key``: EVALSHA straight on the client (redis-py's
        ``Script.__call__`` costs a measurable share of a round trip), shared with other
        threads' calls when they coincide."""
        call = self.trips.run(script, self.names.record(key), args)
        if call.error is None:
            return call.reply
        self._failed(operation, key, call.error)

    def run_on(
        self,
        operation: str,
        script: Script | Command,
        name: str,
        args: Sequence[Any],
    ) -> Any:
        """Run ``script`` on the Redis key ``name`` itself (an index)."""
        call = self.trips.run(script, name, args)
        if call.error is None:
            return call.reply
        self._failed(operation, None, call.error)

    def _failed(self, operation: str, key: str | None, exc: BaseException) -> NoReturn:
        # A failed shared round trip hands the same exception to every caller: each raises its
        # own StoreUnavailable *from* it instead of re-raising the one object in many threads.
        if cannot_answer(exc):
            self.unavailable(operation, key, exc)
        raise exc


__all__ = ["Server"]
