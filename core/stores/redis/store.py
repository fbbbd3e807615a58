"""RedisStore: claims and marks in Redis, one round trip per operation.

Each record is one Redis string at ``f"{prefix}:{key}"`` holding the packed record of
:mod:`.layout` (kind, times as offsets before the key's expiry, packed fingerprint, owner,
worker, result, pending sends). A completed eager record with its fingerprint is a string of
26 bytes on the default key names. A worker's liveness record is the hash
``f"{prefix}:~live:{worker}"`` with ``seen`` (last write, ms) and ``until`` (alive until, ms),
kept by Redis for a while after it lapses.

A new claim is one plain ``SET key <claim> NX PX <lease + keep>`` from the client: the packed
claim carries its lease end and creation as offsets before the expiry that the server sets by
its own clock, so nothing in it comes from the worker's clock. Only a claim that finds a record
(``SET`` answers nil) goes on to the ``claim`` script, for the takeover of an expired claim,
the payload check and the record found. A lazy mark without sends is likewise a plain ``SET …
NX PX``. Every other write is a script that reads the record, checks the owner token (or the
dispatch token) first (fencing) and writes it whole with a new ``PX``.

Records with pending sends are also listed in one sorted set, ``f"{prefix}!sends"`` (score: when
they were recorded), for the relay, and records awaiting receipts in ``f"{prefix}!receipts"``
(score: when they are due; :mod:`.receipts`). The scripts that write sends or receipts touch
these too (their names are arguments), in the same atomic step as the record. On Redis Cluster
(``redis+cluster://``) the records and their indexes are spread over buckets with hash tags
(:mod:`.names`); the relay reads the buckets' indexes in one pipeline per node.

A record's expiry is the key's own (set with ``PX``, relative to the Redis server's clock); a
record past it is absent for every script, and a read reports it as ``expires_at`` (``now`` +
``PTTL``). Leases and retention are judged by the Redis server's clock, never by a worker's:
a script tells whether a lease ran out from ``PTTL`` alone, and reads ``TIME`` where a time
leaves the server. Every script touches the one key it is given in ``KEYS`` and, for the
hand-off and the receipts, that key's indexes, in the same hash slot, so the store works on
Redis Cluster and with replicas (effects replication). Redis deletes expired records itself,
which is why :meth:`RedisStore.purge` only sweeps the indexes.

The package's other modules: :mod:`.layout` (the record), :mod:`.scripts` (the Lua scripts),
:mod:`.connecting` (URLs, Sentinel, Cluster, TLS; fork safety of the clients), :mod:`.trips`
(the transport: round trips shared by a process's threads), :mod:`.receipts` (the receipts
part of the contract).
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
    Awaiting,
    Claim,
    ClaimOutcome,
    Record,
    Seen,
    SendLease,
    Status,
    Store,
)
from taskonce.stores.options import own_value
from taskonce.stores.redis import layout
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
from taskonce.stores.redis.layout import Fields, packed_fp, safe
from taskonce.stores.redis.names import Names, glob_escape
from taskonce.stores.redis.receipts import RedisReceipts
from taskonce.stores.redis.scripts import Scripts
from taskonce.stores.redis.trips import Command, OneTrip, SharedTrips
from taskonce.stores.redis.wire import cannot_answer, ms, text

logger = logging.getLogger("taskonce.stores.redis")

#: a new claim or a lazy mark without sends: the client's own ``SET … NX PX``
SET = Command("SET")

T = TypeVar("T")


class RedisStore(RedisReceipts, Store):
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
        """Every index of the store: sends and receipts, of every bucket."""
        return [name for _, *indexes in self._names.buckets() for name in indexes]

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

    def _run(self, operation: str, script: Script | Command, key: str, args: Sequence[Any]) -> Any:
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

    def _record(self, key: str, reply: Sequence[Any]) -> Record | None:
        """The one translation of a stored record into a :class:`Record`: from the scripts'
        ``{now, pttl, record}`` reply (a scan builds the same); None when it is no record of
        this layout (a foreign key under the prefix)."""
        fields = layout.parse(reply[2])
        if fields is None:
            return None
        return _as_record(key, int(reply[0]), int(reply[1]), fields)

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

        A new key costs one plain ``SET … NX PX`` (the packed claim, :mod:`.layout`); a key
        with a record, a second round trip: the ``claim`` script, which takes an expired claim
        over or answers with the record found.
        """
        ttl, keep = ms(lease) + ms(keep_for), ms(keep_for)
        who, fp, wk = safe(owner), packed_fp(fingerprint), safe(worker)
        record = layout.claim_record(who, ttl, keep, fp, wk)
        if self._run("claim", SET, key, (record, "NX", "PX", ttl)):
            return Claim(ClaimOutcome.CLAIMED)
        reply = self._run("claim", self._scripts.claim, key, (who, ttl, keep, fp, wk))
        if isinstance(reply, list):
            found = self._record(key, reply)
            if found is None:  # as a script's WRONGTYPE would be: this call is wrong
                raise redis.exceptions.ResponseError(
                    f"Redis store {self._url}: key {key!r} holds a value that is not a taskonce "
                    "record (another program's key under this store's prefix?)"
                )
            return Claim(ClaimOutcome.EXISTS, found)
        if int(reply) == 1:
            return Claim(ClaimOutcome.CLAIMED)
        return Claim(ClaimOutcome.TAKEN_OVER, crashes=int(reply) - 1)

    def take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        """Hand ``old_owner``'s live claim to ``owner`` (one EVALSHA, fenced by the old token)."""
        args = (safe(old_owner), safe(owner), ms(lease), ms(keep_for), safe(worker))
        return int(self._run("take_over", self._scripts.take_over, key, args))

    def quarantine(self, key: str, owner: str, keep_for: float) -> None:
        """Turn ``owner``'s claim into a quarantined record (one EVALSHA, fenced)."""
        if not int(
            self._run("quarantine", self._scripts.quarantine, key, (safe(owner), ms(keep_for)))
        ):
            raise LeaseLost(key, "quarantine")

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
        keep = ms(keep_for)
        script = self._scripts.complete
        args: tuple[Any, ...] = (safe(owner), keep, f"{keep:x}")
        if sends:
            script = self._scripts.complete_sends
            index = self._names.index_of(key)
            args = (*args, index, json.dumps(list(sends)), key, ms(dispatch_lease))
        if result is not None:
            args = (*args, result)
        if not int(self._run("complete", script, key, args)):
            raise LeaseLost(key, "complete")

    def release(self, key: str, owner: str | None) -> None:
        """Delete ``owner``'s claim (fenced), or with ``owner=None`` whatever is recorded."""
        if owner is None:  # its pending sends go with it
            args = (self._names.index_of(key), key, self._names.receipts_of(key))
            self._run("release", self._scripts.forget, key, args)
            return
        if not int(self._run("release", self._scripts.release, key, (safe(owner),))):
            raise LeaseLost(key, "release")

    def renew(self, key: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s lease to ``lease`` seconds from now by the Redis clock, pushing the
        key's expiry out by as much; :class:`LeaseLost` if the claim is no longer ``owner``'s."""
        if not int(self._run("renew", self._scripts.renew, key, (safe(owner), ms(lease)))):
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
        keep, fp = ms(keep_for), packed_fp(fingerprint)
        if not sends:  # one plain SET … NX PX: nil when a live record exists
            record = layout.mark_record(keep, fp, result)
            return bool(self._run("mark", SET, key, (record, "NX", "PX", keep)))
        record = layout.sending_record(
            layout.MARKED_SENDING,
            keep,
            fp,
            safe(token),
            ms(dispatch_lease),
            json.dumps(list(sends)),
            result,
        )
        args = (record, keep, self._names.index_of(key), key)
        return bool(int(self._run("mark", self._scripts.mark_sends, key, args)))

    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        """Take the dispatch lease of ``key``'s pending sends (one script, Redis clock)."""
        index = self._names.index_of(key)
        args = (safe(token), ms(lease), round(older_than * 1000), index, key)
        reply = self._run("take_sends", self._scripts.take_sends, key, args)
        if isinstance(reply, list):
            return SendLease(retry_after=int(reply[0]) / 1000.0)
        found = text(reply) if not isinstance(reply, int) else None
        return SendLease(tuple(json.loads(found))) if found else SendLease()

    def dispatched(self, key: str, token: str, awaiting: Awaiting | None = None) -> bool:
        """Clear ``key``'s pending sends if ``token`` still holds them, with ``awaiting`` in the
        same script (:mod:`.receipts`)."""
        if awaiting is not None:
            return self._dispatched_awaiting(key, token, awaiting)
        return bool(
            int(
                self._run(
                    "dispatched",
                    self._scripts.dispatched,
                    key,
                    (safe(token), self._names.index_of(key), key),
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
        for index in self._names.indexes():
            pipe.zrangebyscore(index, "-inf", cutoff, start=0, num=limit, withscores=True)
        found: list[tuple[float, str]] = []
        for reply in pipe.execute():
            found += [(float(score), text(name) or "") for name, score in reply]
        return [name for _, name in sorted(found)[:limit]]

    def get(self, key: str) -> Record | None:
        """The live record of ``key`` with ``lease_remaining`` by the Redis clock, or None."""
        reply = self._run("get", self._scripts.get, key, ())
        return None if reply is None else self._record(key, reply)  # a foreign key: None

    def stats(self) -> Mapping[str, int]:
        """Counts of this prefix's records, by ``SCAN MATCH prefix:*`` (several round trips;
        for the CLI and monitoring, not hot paths). ``expired`` is always 0: Redis drops
        expired keys itself. On a cluster, every master is scanned."""
        pattern = self._pattern()

        def count() -> dict[str, int]:
            counts = {"in_progress": 0, "completed": 0, "quarantined": 0}
            batch: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._count_batch(batch, counts)
                    batch = []
            self._count_batch(batch, counts)
            return {
                "keys": sum(counts.values()),
                **counts,
                "expired": 0,
                "sends_pending": self._sends_pending(),
                "receipts_awaited": self._awaited(),
            }

        return self._call("stats", None, count)

    def _sends_pending(self) -> int:
        pipe = self._client.pipeline()
        for index in self._names.indexes():
            pipe.zcard(index)
        return sum(int(n) for n in pipe.execute())

    def _count_batch(self, names: list[Any], counts: dict[str, int]) -> None:
        if not names:
            return
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        for value in pipe.execute(raise_on_error=False):
            kind = None if isinstance(value, Exception) else layout.kind_of(value)
            if kind == layout.CLAIM:
                counts["in_progress"] += 1
            elif kind == layout.QUARANTINED:
                counts["quarantined"] += 1
            elif kind is not None:  # else a foreign key under our prefix
                counts["completed"] += 1

    def records(self, key_prefix: str = "") -> Iterator[Record]:
        """The live records of this prefix whose key starts with ``key_prefix``: ``SCAN MATCH``
        (every master, on a cluster) and one pipelined ``GET`` and ``PTTL`` per batch of 1000
        keys, judged by the Redis clock."""
        pattern = self._pattern(key_prefix)

        def batches() -> Iterator[list[Record]]:
            names: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                names.append(name)
                if len(names) >= 1000:
                    yield self._records_of(names, key_prefix)
                    names = []
            yield self._records_of(names, key_prefix)

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
            return [record.key for record in self._records_of(names, "")]

        return self._call("keys_ending", None, find)

    def _records_of(self, names: list[Any], key_prefix: str) -> list[Record]:
        if not names:
            return []
        pipe = self._client.pipeline(transaction=False)
        if self._cluster:
            # A keyless command has no node in a cluster pipeline: the clock is read first.
            seconds, micros = self._client.time()
        else:
            pipe.time()
        for name in names:
            pipe.get(name)
            pipe.pttl(name)  # the record's expiry is the key's own
        replies = pipe.execute(raise_on_error=False)
        if not self._cluster:
            (seconds, micros), *replies = replies
        now = int(seconds) * 1000 + int(micros) // 1000
        found = []
        for i, name in enumerate(names):
            value, ttl = replies[2 * i], replies[2 * i + 1]
            if isinstance(value, Exception) or isinstance(ttl, Exception) or int(ttl) < 0:
                continue  # a foreign key, gone meanwhile (-2), or without expiry (-1)
            key = self._names.key_of(text(name) or "")
            if not key.startswith(key_prefix):
                continue
            record = self._record(key, (now, ttl, value))
            if record is not None:  # else a foreign string under our prefix
                found.append(record)
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


def _as_record(key: str, now: int, pttl: int, fields: Fields) -> Record:
    """A parsed record as the contract's :class:`Record`, its times made absolute by the Redis
    clock's ``now`` and the key's ``pttl`` (the layout keeps them as offsets before the
    expiry)."""
    expires = now + pttl
    claimed = fields.kind == layout.CLAIM
    status = Status.QUARANTINED if fields.kind == layout.QUARANTINED else Status.COMPLETED
    return Record(
        key=key,
        status=Status.IN_PROGRESS if claimed else status,
        owner=fields.owner,
        fingerprint=fields.fingerprint,
        result=fields.result,
        created_at=(expires - fields.created) / 1000.0,
        expires_at=expires / 1000.0,
        lease_remaining=max(0, pttl - fields.lease) / 1000.0 if claimed else 0.0,
        worker=fields.worker,
        marked=fields.kind in (layout.MARKED, layout.MARKED_SENDING, layout.MARKED_AWAITING),
        sends_pending=fields.kind in (layout.SENDING, layout.MARKED_SENDING),
        sends=fields.sends,
        receipts=fields.receipts,
        crashes=fields.crashes,
    )


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
