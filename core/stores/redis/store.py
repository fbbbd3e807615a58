"""RedisStore: claims and marks in Redis, one Lua script (one round trip) per operation.

Each record is one Redis hash at ``f"{prefix}:{key}"`` with the fields

=========  ==================================================================================
``st``     status: ``"i"`` (in progress, a claim) or ``"c"`` (completed, a mark)
``ow``     owner token of a claim (absent on marks)
``fp``     payload fingerprint (absent when None)
``rs``     the handler's JSON result (absent when None)
``ca``     created at, milliseconds since the epoch by the Redis clock
``lu``     lease until, ms (claims; kept by a completion, so only a lazy mark lacks it)
``wk``     the claim owner's worker identity (claims only; absent when not given)
``sd``     deferred sends still to publish: a JSON array of the sends' JSON texts (status
           ``"p"``: completed, sends pending; back to ``"c"`` once they are published)
``sk``     their dispatch token; ``sa`` when they were recorded, ``sl`` a dispatcher's lease
=========  ==================================================================================

(the status codes: :class:`~taskonce.stores.redis.wire.Code`). A worker's liveness record is
the hash ``f"{prefix}:~live:{worker}"`` with ``seen`` (last write, ms) and ``until`` (alive
until, ms), kept by Redis for a while after it lapses.

Records with pending sends are also listed in one sorted set, ``f"{prefix}!sends"`` (score: when
they were recorded), for the relay. The scripts that write sends touch it too (its name is an
argument), in the same atomic step as the record. On Redis Cluster (``redis+cluster://``) the
records and their indexes are spread over buckets with hash tags (:mod:`.names`); the relay
reads the buckets' indexes in one pipeline per node.

A record's expiry is the key's own (set with ``PEXPIRE``, relative to the Redis server's
clock); a record past it is absent for every script, and a read reports it as ``expires_at``
(``now`` + ``PTTL``). Records written before 0.1.0 by a layout that also kept it in an ``ex``
field are read the same way (the field is ignored). Every decision is taken inside a Lua
script (:mod:`.scripts`), and a script that writes a time into a record (a claim's lease end, a
mark's creation) reads the clock with ``redis.call('TIME')``, so leases and retention are
judged by the Redis server's clock, never by a worker's. Every script touches the one key it is
given in ``KEYS`` and, for the hand-off, that key's sends index, in the same hash slot, so the
store works on Redis Cluster and with replicas (effects replication).
Redis deletes expired records itself, which is why :meth:`RedisStore.purge` has nothing to do.

The package's other modules: :mod:`.connecting` (URLs, Sentinel, Cluster, TLS; fork safety of
the clients), :mod:`.trips` (the transport: round trips shared by a process's threads).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import redis
import redis.cluster
from redis.commands.core import Script

from taskonce.errors import ConfigError, LeaseLost, StoreUnavailable
from taskonce.stores.base import (
    LIVENESS_RETENTION,
    Claim,
    ClaimOutcome,
    Record,
    Seen,
    SendLease,
    Store,
)
from taskonce.stores.options import own_value
from taskonce.stores.redis.connecting import (
    DEFAULT_URL,
    SCHEMES,
    describe_client,
    open_client,
    replicas,
    safe_url,
    take_own_options,
    track_cluster,
)
from taskonce.stores.redis.names import Names, glob_escape
from taskonce.stores.redis.scripts import Scripts
from taskonce.stores.redis.trips import OneTrip, SharedTrips
from taskonce.stores.redis.wire import CODES, Code, cannot_answer, ms, optional, text

logger = logging.getLogger("taskonce.stores.redis")

T = TypeVar("T")


class RedisStore(Store):
    """Claims and marks in Redis: one server, a Sentinel-managed master or a Redis Cluster.
    Every script touches one record and, for the hand-off, its sends index in the same hash
    slot, so the scripts run on a cluster.

    :param url: ``redis://[[user]:password@]host:port/db``, ``rediss://…`` (TLS),
        ``unix:///path/to/redis.sock?db=0``,
        ``redis+sentinel://[[user]:password@]host:port[,host:port…]/service_name[/db]`` or
        ``redis+cluster://[[user]:password@]host:port[,host:port…]``. Query options: ``prefix``
        and ``min_replicas`` (taskonce's own, as the arguments below) and redis-py's connection
        options (``socket_timeout``, ``ssl_ca_certs``, …), which go to redis-py; any other name
        is a :class:`~taskonce.errors.ConfigError`. Ignored when ``client`` is given.
    :param prefix: namespace of this store's keys: a record lives at ``f"{prefix}:{key}"``
        (on a cluster at ``f"{{{prefix}/{n}}}:{key}"``, see the module's documentation).
        Non-empty, without whitespace. Default ``"taskonce"``; also ``?prefix=`` in the URL.
    :param client: an existing :class:`redis.Redis` to use instead of opening one from ``url``
        (its own timeouts and retry policy apply; :meth:`close` leaves it open).
    :param socket_timeout: seconds to wait for a connection or a reply before the operation
        fails with :class:`~taskonce.errors.StoreUnavailable`. Default 5. A call queued behind
        another thread's round trip waits for that one first, so it can take up to about
        twice as long to fail.
    :param min_replicas: after each write, wait (Redis ``WAIT``, up to half of
        ``socket_timeout``) until this many replicas have it; a write fewer replicas
        acknowledged raises :class:`~taskonce.errors.StoreUnavailable` (the master has it; a
        failover could lose it). Default 0: off. Also ``?min_replicas=`` in the URL. Not on
        Redis Cluster.

    The client this store opens retries a command once, at once, after a connection error (a
    pooled connection that a Redis restart closed) but never after a timeout: a command that
    timed out may have run, and running a claim twice would make it look taken.
    """

    schemes = SCHEMES

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str | None = None,
        client: redis.Redis | None = None,
        socket_timeout: float = 5.0,
        min_replicas: int | None = None,
    ) -> None:
        url_prefix = url_replicas = None
        if client is None and isinstance(url, str):
            url, url_prefix, url_replicas = take_own_options(url)
        prefix = own_value("RedisStore", "prefix", url_prefix, prefix, "taskonce")
        _check_options(prefix, socket_timeout)
        wanted = replicas(url_replicas, min_replicas)
        self._prefix = prefix
        self._owns_client = client is None
        if client is None:
            self._url = safe_url(url) if isinstance(url, str) else "<not a URL>"
            self._client = open_client(url, self._url, float(socket_timeout))
        else:
            self._url = describe_client(client)
            self._client = client
        self._scripts = Scripts.register(self._client)
        self._cluster = isinstance(self._client, redis.cluster.RedisCluster)
        self._trips: SharedTrips | OneTrip = self._open_trips(wanted, socket_timeout)
        self._names = Names(prefix, self._cluster)  # after _open_trips checked the prefix
        logger.debug("opened %s", self.describe())

    def _open_trips(self, wanted: int, socket_timeout: float) -> SharedTrips | OneTrip:
        """The transport: every call on its own on a cluster, else shared round trips (with a
        ``WAIT`` for ``wanted`` replicas after the writes)."""
        if self._cluster:
            if "{" in self._prefix or "}" in self._prefix:
                raise ConfigError(
                    f"RedisStore prefix {self._prefix!r}: on Redis Cluster the store adds its own "
                    "hash tags to the prefix; give it without braces"
                )
            if wanted:
                raise ConfigError(
                    "RedisStore min_replicas is not available on Redis Cluster (a WAIT would "
                    "have to follow each write on its own node's connection)"
                )
            track_cluster(self._client)
            return OneTrip(self._client)
        wait = (wanted, max(1, round(socket_timeout * 500))) if wanted else None
        # The line keeps one of the pool's connections: not where a pool of one or two
        # (``?max_connections=``) would leave the store's other commands none.
        own = self._owns_client and getattr(self._client.connection_pool, "max_connections", 0) > 2
        return SharedTrips(self._client, wait, self._scripts.reads(), own_connection=own)

    # -- a public handle for tools and benchmarks -------------------------------------------

    @property
    def client(self) -> redis.Redis:
        """The redis-py client this store sends its commands through (a
        :class:`redis.cluster.RedisCluster` on a cluster): for tools and benchmarks that need
        the same server and connection pool. The store's own records are written only by its
        scripts; do not change them through the client."""
        return self._client

    # -- plumbing ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._names.record(key)

    def _indexes(self) -> list[str]:
        return self._names.indexes()

    def _pattern(self, key_prefix: str = "") -> str:
        """The SCAN pattern of this store's records whose key starts with ``key_prefix``."""
        return self._names.pattern(key_prefix)

    def _unavailable(self, operation: str, key: str | None, exc: BaseException) -> NoReturn:
        where = f" of key {key!r}" if key is not None else ""
        logger.debug("%s%s failed on %s: %s", operation, where, self._url, type(exc).__name__)
        raise StoreUnavailable(
            f"Redis store {self._url} did not answer {operation}{where}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc

    def _call(self, operation: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run one round trip, turning "Redis cannot answer" into StoreUnavailable."""
        try:
            return fn()
        except Exception as exc:
            if cannot_answer(exc):
                self._unavailable(operation, key, exc)
            raise

    def _run(self, operation: str, script: Script, key: str, args: Sequence[Any]) -> Any:
        # EVALSHA straight on the client (redis-py's Script.__call__ costs a measurable share
        # of a round trip), shared with other threads' calls when they coincide.
        call = self._trips.run(script, self._names.record(key), args)
        exc = call.error
        if exc is None:
            return call.reply
        # A failed shared round trip hands the same exception to every caller: each raises its
        # own StoreUnavailable *from* it instead of re-raising the one object in many threads.
        if cannot_answer(exc):
            self._unavailable(operation, key, exc)
        raise exc

    def _record(self, key: str, reply: Sequence[Any]) -> Record:
        """The one translation of a stored record into a :class:`Record`: from the scripts'
        ``{now, st, ow, fp, rs, ca, lu, ex[, wk[, sd]]}`` reply (a scan builds the same)."""
        now = int(reply[0])
        code = CODES[text(reply[1]) or ""]
        sends = text(reply[9]) if len(reply) > 9 else None
        lease_until = int(text(reply[6]) or 0)
        remaining = 0.0
        if code is Code.CLAIMED:
            remaining = max(0, lease_until - now) / 1000.0
        return Record(
            key=key,
            status=code.status,
            owner=text(reply[2]),
            fingerprint=text(reply[3]),
            result=text(reply[4]),
            created_at=int(text(reply[5]) or 0) / 1000.0,
            expires_at=int(text(reply[7]) or 0) / 1000.0,
            lease_remaining=remaining,
            worker=text(reply[8]) if len(reply) > 8 else None,
            marked=code is not Code.CLAIMED and not lease_until,  # a completion keeps 'lu'
            sends_pending=code is Code.SENDING,
            sends=tuple(json.loads(sends)) if sends else (),
        )

    # -- the Store contract ----------------------------------------------------------------------

    def claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None = None,
    ) -> Claim:
        """Atomically take ``key`` for ``owner`` (see
        :meth:`~taskonce.stores.base.StoreKeys.claim`).

        One EVALSHA; a fresh claim or a takeover answers with a single integer, only "exists"
        carries the record found.
        """
        args = (owner, ms(lease), ms(keep_for), *optional(fingerprint), worker or "")
        reply = self._run("claim", self._scripts.claim, key, args)
        if isinstance(reply, list):
            return Claim(ClaimOutcome.EXISTS, self._record(key, reply))
        return Claim(ClaimOutcome.CLAIMED if int(reply) == 1 else ClaimOutcome.TAKEN_OVER)

    def take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> bool:
        """Hand ``old_owner``'s live claim to ``owner`` (one EVALSHA, fenced by the old token)."""
        args = (old_owner, owner, ms(lease), ms(keep_for), worker)
        return bool(int(self._run("take_over", self._scripts.take_over, key, args)))

    def beat(self, worker: str, ttl: float) -> None:
        """Write ``worker``'s liveness record (one EVALSHA, judged by the Redis clock)."""
        args = (ms(ttl), ms(LIVENESS_RETENTION))
        self._run("beat", self._scripts.beat, self._names.live_key(worker), args)

    def seen(self, worker: str) -> Seen | None:
        """``worker``'s liveness record by the Redis clock, or None."""
        reply = self._run("seen", self._scripts.seen, self._names.live_key(worker), ())
        if reply is None:
            return None
        now, seen, until = (int(text(item) or 0) for item in reply)
        return Seen(ago=max(0, now - seen) / 1000.0, remaining=max(0, until - now) / 1000.0)

    def complete(
        self,
        key: str,
        owner: str,
        keep_for: float,
        result: str | None,
        sends: Sequence[str] = (),
        dispatch_lease: float = 0.0,
    ) -> None:
        """Turn ``owner``'s claim into a mark kept ``keep_for`` seconds, with ``sends`` pending
        (same script); :class:`LeaseLost` if the claim is no longer ``owner``'s."""
        args: tuple[Any, ...] = (owner, ms(keep_for), *optional(result))
        script = self._scripts.complete
        if sends:
            script = self._scripts.complete_sends
            args = (
                *args,
                self._names.index_of(key),
                json.dumps(list(sends)),
                key,
                ms(dispatch_lease),
            )
        if not int(self._run("complete", script, key, args)):
            raise LeaseLost(key, "complete")

    def release(self, key: str, owner: str | None) -> None:
        """Delete ``owner``'s claim (fenced), or with ``owner=None`` whatever is recorded."""
        if owner is None:  # its pending sends go with it
            self._run("release", self._scripts.forget, key, (self._names.index_of(key), key))
            return
        if not int(self._run("release", self._scripts.release, key, (owner,))):
            raise LeaseLost(key, "release")

    def renew(self, key: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s lease to ``lease`` seconds from now by the Redis clock, pushing the
        key's expiry out by as much; :class:`LeaseLost` if the claim is no longer ``owner``'s."""
        if not int(self._run("renew", self._scripts.renew, key, (owner, ms(lease)))):
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
        """Record ``key`` as handled for ``keep_for`` seconds, with ``sends`` pending (same
        script); False when a live record exists."""
        args: tuple[Any, ...] = (ms(keep_for), *optional(fingerprint), *optional(result))
        script = self._scripts.mark
        if sends:
            script = self._scripts.mark_sends
            args = (
                *args,
                self._names.index_of(key),
                json.dumps(list(sends)),
                key,
                token,
                ms(dispatch_lease),
            )
        return bool(int(self._run("mark", script, key, args)))

    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        """Take the dispatch lease of ``key``'s pending sends (one script, Redis clock)."""
        args = (token, ms(lease), round(older_than * 1000), self._names.index_of(key), key)
        reply = self._run("take_sends", self._scripts.take_sends, key, args)
        if isinstance(reply, list):
            return SendLease(retry_after=int(reply[0]) / 1000.0)
        found = text(reply) if not isinstance(reply, int) else None
        return SendLease(tuple(json.loads(found))) if found else SendLease()

    def dispatched(self, key: str, token: str) -> bool:
        """Clear ``key``'s pending sends if ``token`` still holds them (one script)."""
        return bool(
            int(
                self._run(
                    "dispatched",
                    self._scripts.dispatched,
                    key,
                    (token, self._names.index_of(key), key),
                )
            )
        )

    def pending_sends(self, older_than: float = 0.0, limit: int = 100) -> list[str]:
        """Keys with sends pending for at least ``older_than`` s, from the index (one script)."""
        if self._cluster:
            return self._call(
                "pending_sends", None, lambda: self._pending_in_buckets(older_than, limit)
            )
        index = self._names.indexes()[0]  # one server: one index
        call = self._trips.run(self._scripts.pending, index, (round(older_than * 1000), limit))
        if call.error is not None:
            if cannot_answer(call.error):
                self._unavailable("pending_sends", None, call.error)
            raise call.error
        return [text(name) or "" for name in call.reply]

    def _pending_in_buckets(self, older_than: float, limit: int) -> list[str]:
        """Every bucket's oldest ``limit``, in one pipeline (one round trip per node), merged.
        redis-py refuses scripts in a cluster pipeline, so the cut-off is taken from one node's
        clock first (``TIME``), then each index is read with a plain ``ZRANGEBYSCORE``; the
        relay's minimum age is a coarse filter, which the masters' synchronised clocks keep."""
        seconds, micros = self._client.time()
        cutoff = int(seconds) * 1000 + int(micros) // 1000 - round(older_than * 1000)
        pipe = self._client.pipeline()
        for index in self._indexes():
            pipe.zrangebyscore(index, "-inf", cutoff, start=0, num=limit, withscores=True)
        found: list[tuple[float, str]] = []
        for reply in pipe.execute():
            found += [(float(score), text(name) or "") for name, score in reply]
        return [name for _, name in sorted(found)[:limit]]

    def get(self, key: str) -> Record | None:
        """The live record of ``key`` with ``lease_remaining`` by the Redis clock, or None."""
        reply = self._run("get", self._scripts.get, key, ())
        return None if reply is None else self._record(key, reply)

    def purge(self, batch: int = 1000) -> int:
        """Always 0: every record carries a Redis expiry (at its ``expires_at``),
        so Redis deletes expired records itself, and every script also treats a record whose
        ``expires_at`` has passed as absent. There is never anything left for a purge."""
        return 0

    def stats(self) -> Mapping[str, int]:
        """Counts of this prefix's records, by ``SCAN MATCH prefix:*`` (several round trips;
        for the CLI and monitoring, not hot paths). ``expired`` is always 0: Redis drops
        expired keys itself. On a cluster, every master is scanned."""
        pattern = self._pattern()

        def count() -> dict[str, int]:
            counts = {"in_progress": 0, "completed": 0}
            batch: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._count_batch(batch, counts)
                    batch = []
            self._count_batch(batch, counts)
            return {
                "keys": counts["in_progress"] + counts["completed"],
                "in_progress": counts["in_progress"],
                "completed": counts["completed"],
                "expired": 0,
                "sends_pending": self._sends_pending(),
            }

        return self._call("stats", None, count)

    def _sends_pending(self) -> int:
        pipe = self._client.pipeline()
        for index in self._indexes():
            pipe.zcard(index)
        return sum(int(n) for n in pipe.execute())

    def _count_batch(self, names: list[Any], counts: dict[str, int]) -> None:
        if not names:
            return
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hget(name, "st")
        for status in pipe.execute(raise_on_error=False):
            if isinstance(status, Exception):  # a foreign, non-hash key under our prefix
                continue
            code = Code.of(status)
            if code is Code.CLAIMED:
                counts["in_progress"] += 1
            elif code is not None:
                counts["completed"] += 1

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        """The live records of this prefix whose key starts with ``key_prefix``: ``SCAN MATCH``
        (every master, on a cluster) and one pipelined ``HMGET`` per batch of 1000 keys, judged
        by the Redis clock."""
        pattern = self._pattern(key_prefix)
        fields = ("st", "ow", "fp", "rs", "ca", "lu")

        def batches() -> Iterator[list[Record]]:
            names: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                names.append(name)
                if len(names) >= 1000:
                    yield self._records_of(names, fields, key_prefix)
                    names = []
            yield self._records_of(names, fields, key_prefix)

        found = self._call("records", None, lambda: [r for b in batches() for r in b])
        return iter(found)

    def keys_ending(self, suffix: str, limit: int = 5) -> list[str]:
        """At most ``limit`` live keys of this prefix ending with ``suffix``: ``SCAN MATCH``
        (every master, on a cluster) until ``limit`` names match, then their records' check."""
        pattern = self._pattern() + glob_escape(suffix)

        def find() -> list[str]:
            names: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                names.append(name)
                if len(names) >= limit:
                    break
            records = self._records_of(names, ("st", "ow", "fp", "rs", "ca", "lu"), "")
            return [record.key for record in records]

        return self._call("keys_ending", None, find)

    def _records_of(
        self, names: list[Any], fields: tuple[str, ...], key_prefix: str
    ) -> list[Record]:
        if not names:
            return []
        pipe = self._client.pipeline(transaction=False)
        if self._cluster:
            # A keyless command has no node in a cluster pipeline: the clock is read first.
            seconds, micros = self._client.time()
        else:
            pipe.time()
        for name in names:
            pipe.hmget(name, fields)
            pipe.pttl(name)  # the record's expiry is the key's own
        replies = pipe.execute(raise_on_error=False)
        if not self._cluster:
            (seconds, micros), *replies = replies
        now = int(seconds) * 1000 + int(micros) // 1000
        found = []
        for i, name in enumerate(names):
            values, ttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(values, Exception) or Code.of(values[0]) is None:
                continue  # gone meanwhile, or a foreign key under our prefix
            if isinstance(ttl, Exception) or int(ttl) < 0:
                continue  # expired meanwhile (-2), or not a record of this store (-1)
            key = self._names.key_of(text(name) or "")
            if key.startswith(key_prefix):
                found.append(self._record(key, [now, *values, str(now + int(ttl))]))
        return found

    def close(self) -> None:
        """Disconnect the connection pool this store opened (a caller's ``client`` is left
        open: its owner closes it). A closed store reconnects if it is used again."""
        if self._owns_client:
            self._client.close()  # from_url: auto_close_connection_pool disconnects the pool
        logger.debug("closed %s", self.describe())

    def describe(self) -> str:
        """``RedisStore <url without password> prefix=<prefix>``."""
        return f"RedisStore {self._url} prefix={self._prefix}"


def _check_options(prefix: object, socket_timeout: object) -> None:
    """:class:`ConfigError` for a prefix or a socket timeout that cannot work."""
    if not isinstance(prefix, str) or not prefix or any(c.isspace() for c in prefix):
        raise ConfigError(
            f"RedisStore prefix must be a non-empty string without whitespace, got {prefix!r}"
        )
    if (
        isinstance(socket_timeout, bool)
        or not isinstance(socket_timeout, (int, float))
        or not socket_timeout > 0
        or socket_timeout == float("inf")
    ):
        raise ConfigError(
            f"RedisStore socket_timeout must be a positive number of seconds, "
            f"got {socket_timeout!r}"
        )


__all__ = ["RedisStore"]
