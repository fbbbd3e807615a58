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

import logging
from collections.abc import Sequence
from typing import Any

import redis
import redis.cluster

from taskonce.errors import ConfigError
from taskonce.stores.base import (
    LIVENESS_RETENTION,
    Awaiting,
    Claim,
    ClaimOutcome,
    Completion,
    DueForRelay,
    Marking,
    ReceiptLease,
    Record,
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
from taskonce.stores.redis.server import Server
from taskonce.stores.redis.trips import Command, OneTrip, SharedTrips
from taskonce.stores.redis.wire import ms, text

logger = logging.getLogger("taskonce.stores.redis")

#: a new claim or a lazy mark without sends: the client's own ``SET … NX PX``
SET = Command("SET")


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
        trips = self._open_trips(wanted, socket_timeout)
        self._names = Names(prefix, self._cluster)  # after _open_trips checked the prefix
        self._server = Server(self._client, self._url, self._scripts, self._names, trips)
        self._receipts = RedisReceipts(self._server)
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

    @property
    def _trips(self) -> SharedTrips | OneTrip:
        """The transport (tests watch its queue; a benchmark swaps it for a recorder)."""
        return self._server.trips

    @_trips.setter
    def _trips(self, trips: SharedTrips | OneTrip) -> None:
        self._server.trips = trips

    def _key(self, key: str) -> str:
        return self._names.record(key)

    def _indexes(self) -> list[str]:
        """Every index of the store: sends and receipts, of every bucket."""
        return [name for _, *indexes in self._names.buckets() for name in indexes]

    def _pattern(self, key_prefix: str = "") -> str:
        """The SCAN pattern of this store's records whose key starts with ``key_prefix``."""
        return self._names.pattern(key_prefix)

    def _record(self, key: str, reply: Sequence[Any]) -> Record | None:
        """The one translation of a stored record into a :class:`Record`: from the scripts'
        ``{now, pttl, record}`` reply (a scan builds the same); None when it is no record of
        this layout (a foreign key under the prefix)."""
        fields = layout.parse(reply[2])
        if fields is None:
            return None
        return _as_record(key, int(reply[0]), int(reply[1]), fields)

    # -- the Store contract's primitives ---------------------------------------------------------

    def _claim(
        self,
        key: str,
        owner: str,
        lease: float,
        keep_for: float,
        fingerprint: str | None,
        worker: str | None,
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
        if self._server.run("claim", SET, key, (record, "NX", "PX", ttl)):
            return Claim(ClaimOutcome.CLAIMED)
        reply = self._server.run("claim", self._scripts.claim, key, (who, ttl, keep, fp, wk))
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

    def _take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> int:
        """Hand ``old_owner``'s live claim to ``owner`` (one EVALSHA, fenced by the old token)."""
        args = (safe(old_owner), safe(owner), ms(lease), ms(keep_for), safe(worker))
        return int(self._server.run("take_over", self._scripts.take_over, key, args))

    def _quarantine(self, key: str, owner: str, keep_for: float) -> bool:
        """Turn ``owner``'s claim into a quarantined record (one EVALSHA, fenced)."""
        args = (safe(owner), ms(keep_for))
        return bool(int(self._server.run("quarantine", self._scripts.quarantine, key, args)))

    def _beat(self, worker: str, ttl: float) -> None:
        """Write ``worker``'s liveness record (one EVALSHA, judged by the Redis clock)."""
        args = (ms(ttl), ms(LIVENESS_RETENTION))
        self._server.run("beat", self._scripts.beat, self._names.live_key(worker), args)

    def _seen(self, worker: str) -> tuple[float, float] | None:
        """``worker``'s liveness record by the Redis clock, or None."""
        reply = self._server.run("seen", self._scripts.seen, self._names.live_key(worker), ())
        if reply is None:
            return None
        now, seen, until = (int(text(item) or 0) for item in reply)
        return (now - seen) / 1000.0, (until - now) / 1000.0

    def _complete(self, done: Completion) -> bool:
        """Turn ``owner``'s claim into a mark kept ``keep_for`` seconds, with ``sends`` pending
        (same script); False if the claim is no longer ``owner``'s."""
        key, keep = done.key, ms(done.keep_for)
        script = self._scripts.complete
        args: tuple[Any, ...] = (safe(done.owner), keep, f"{keep:x}")
        if done.sends:
            script = self._scripts.complete_sends
            index = self._names.index_of(key)
            args = (*args, index, done.sends, key, ms(done.dispatch_lease))
        if done.result is not None:
            args = (*args, done.result)
        return bool(int(self._server.run("complete", script, key, args)))

    def _release(self, key: str, owner: str) -> bool:
        """Delete ``owner``'s claim (one EVALSHA, fenced)."""
        return bool(int(self._server.run("release", self._scripts.release, key, (safe(owner),))))

    def _forget(self, key: str) -> None:
        """Delete whatever is recorded, its pending sends and awaited receipts with it."""
        args = (self._names.index_of(key), key, self._names.receipts_of(key))
        self._server.run("release", self._scripts.forget, key, args)

    def _renew(self, key: str, owner: str, lease: float) -> bool:
        """Extend ``owner``'s lease to ``lease`` seconds from now by the Redis clock, pushing the
        key's expiry out by as much; False if the claim is no longer ``owner``'s."""
        return bool(
            int(self._server.run("renew", self._scripts.renew, key, (safe(owner), ms(lease))))
        )

    def _mark(self, mark: Marking) -> bool:
        """Record ``key`` as handled for ``keep_for`` seconds, with ``sends`` pending (same
        script); False when a live record exists."""
        key, keep, fp = mark.key, ms(mark.keep_for), packed_fp(mark.fingerprint)
        if not mark.sends:  # one plain SET … NX PX: nil when a live record exists
            record = layout.mark_record(keep, fp, mark.result)
            return bool(self._server.run("mark", SET, key, (record, "NX", "PX", keep)))
        record = layout.sending_record(
            layout.MARKED_SENDING,
            keep,
            fp,
            safe(mark.token),
            ms(mark.dispatch_lease),
            mark.sends,
            mark.result,
        )
        args = (record, keep, self._names.index_of(key), key)
        return bool(int(self._server.run("mark", self._scripts.mark_sends, key, args)))

    def _take_sends(
        self, key: str, token: str, lease: float, older_than: float
    ) -> tuple[str | None, float]:
        """Take the dispatch lease of ``key``'s pending sends (one script, Redis clock)."""
        index = self._names.index_of(key)
        args = (safe(token), ms(lease), round(older_than * 1000), index, key)
        reply = self._server.run("take_sends", self._scripts.take_sends, key, args)
        if isinstance(reply, list):
            return None, int(reply[0]) / 1000.0
        return (None if isinstance(reply, int) else text(reply)), 0.0

    def _dispatched(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        """Clear ``key``'s pending sends if ``token`` still holds them, with ``awaiting`` in the
        same script (:mod:`.receipts`)."""
        if awaiting is not None:
            return self._receipts.dispatched(key, token, awaiting)
        return bool(
            int(
                self._server.run(
                    "dispatched",
                    self._scripts.dispatched,
                    key,
                    (safe(token), self._names.index_of(key), key),
                )
            )
        )

    def _get(self, key: str) -> Record | None:
        """The live record of ``key`` with ``lease_remaining`` by the Redis clock, or None."""
        reply = self._server.run("get", self._scripts.get, key, ())
        return None if reply is None else self._record(key, reply)  # a foreign key: None

    # the receipts part (:mod:`.receipts`)

    def _take_receipts(self, key: str, token: str, lease: float) -> ReceiptLease:
        return self._receipts.take(key, token, lease)

    def _settle_receipts(self, key: str, token: str, awaiting: Awaiting | None) -> bool:
        return self._receipts.settle(key, token, awaiting)

    def _live_keys(self, keys: list[str]) -> set[str]:
        return self._receipts.live_keys(keys)

    def _due_for_relay(self, older_than: float, limit: int) -> DueForRelay:
        return self._receipts.due_for_relay(older_than, limit)

    # operations

    def _purge(self, batch: int) -> int:
        """Always 0: every record carries a Redis expiry (at its ``expires_at``), so Redis
        deletes expired records itself, and every script treats a record past it as absent.
        What Redis leaves behind is the index entries of records that expired with sends
        pending or receipts awaited: those are swept here (not counted: they are not
        records)."""
        self._receipts.sweep(batch)
        return 0

    def _expired(self) -> tuple[int, int]:
        return 0, 0  # Redis drops expired keys itself

    def _records(self, key_prefix: str, key_suffix: str, limit: int | None) -> list[Record]:
        """The live records of this prefix whose key starts with ``key_prefix`` and ends with
        ``key_suffix``: ``SCAN MATCH`` (every master, on a cluster) until ``limit`` names match,
        and one pipelined ``GET`` and ``PTTL`` per batch of 1000 names, judged by the Redis
        clock."""
        pattern = self._pattern(key_prefix) + glob_escape(key_suffix)

        def scan() -> list[Record]:
            found: list[Record] = []
            names: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                names.append(name)
                if limit is not None and len(names) >= limit:
                    break
                if len(names) >= 1000:
                    found += self._records_of(names, key_prefix)
                    names = []
            return found + self._records_of(names, key_prefix)

        return self._server.call("records", None, scan)

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

    def _close(self) -> None:
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
        receipts_awaited=fields.receipts is not None and fields.due is not None,
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
