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

A worker's liveness record is the hash ``f"{prefix}:~live:{worker}"`` with ``seen`` (last
write, ms) and ``until`` (alive until, ms), kept by Redis for a while after it lapses.

Records with pending sends are also listed in one sorted set, ``f"{prefix}!sends"`` (score: when
they were recorded), for the relay. The scripts that write sends touch it too (its name is an
argument), in the same atomic step as the record.

On Redis Cluster (``redis+cluster://``) every key one script touches must hash to one slot, and
the record and the sends index are touched together. One index for the whole store would put
every record in its slot (one node doing all the work: no cluster at all), and moving the index
writes out of the scripts would let a crash between the two writes lose a record from the relay's
sight. So the store is cut into ``_CLUSTER_BUCKETS`` buckets, each with its own hash tag and its
own index: a record lives at ``f"{{{prefix}/{n}}}:{key}"`` and its bucket's index at
``f"{{{prefix}/{n}}}!sends"``, where the bucket is ``crc32(key) % _CLUSTER_BUCKETS`` and ``n``
is picked so that the buckets' slots are spread evenly over the 16384 slots (so over the
masters). A record and its index always move together in a resharding. The relay reads the
buckets' indexes in one pipeline per node.

A record's expiry is the key's own (set with ``PEXPIRE``, relative to the Redis server's
clock); a record past it is absent for every script, and a read reports it as ``expires_at``
(``now`` + ``PTTL``). Records written before 0.1.0 by a layout that also kept it in an ``ex``
field are read the same way (the field is ignored). Every decision is taken inside a Lua
script, and a script that writes a time into a record (a claim's lease end, a mark's creation)
reads the clock with ``redis.call('TIME')``, so leases and retention are judged by the Redis
server's clock, never by a worker's. Every script touches the one key it is given in ``KEYS``
and, for the hand-off, that key's sends index, in the same hash slot, so the store works on
Redis Cluster and with replicas (effects replication).
Redis deletes expired records itself, which is why :meth:`RedisStore.purge` has nothing to do.

Fork safety: redis-py's ``ConnectionPool`` remembers the pid that created it and, on every
``get_connection``/``release``/``disconnect``, ``ConnectionPool._checkpid()`` compares it with
``os.getpid()``; in a forked child it calls ``reset()`` and opens fresh sockets, and
``Connection.disconnect()`` only shuts a socket down in the process that opened it (checked in
the installed redis-py 8.1 source, ``redis/connection.py``). A store opened in a Celery or
Dramatiq parent therefore works in every child without sharing a socket. The registered
``Script`` objects hold only the script text and its SHA1, so they are fine across a fork.
The queue of callers that share a round trip (:class:`_SharedTrips`) is rebuilt in a forked
child before any of its threads runs (``os.register_at_fork``).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar, cast
from urllib.parse import parse_qsl, urlencode

try:
    import redis
    import redis.cluster
    import redis.connection
    import redis.exceptions
    import redis.sentinel
    from redis.backoff import NoBackoff
    from redis.commands.core import Script
    from redis.retry import Retry
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the Redis store needs redis-py, which is not installed ({_exc}): "
        "pip install 'taskonce[redis]'",
        name=_exc.name,
    ) from _exc

try:  # the redis extra installs it (redis[hiredis]); redis-py works without it
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - depends on the installation
    _hiredis = None  # type: ignore[assignment]

from taskonce.errors import ConfigError, LeaseLost, StoreUnavailable
from taskonce.stores import redact
from taskonce.stores.base import (
    LIVENESS_RETENTION,
    Claim,
    ClaimOutcome,
    Record,
    Seen,
    SendLease,
    Status,
    Store,
)
from taskonce.stores.options import check_names, own_value, single_values

logger = logging.getLogger(__name__)

_PACK_COMMAND: Callable[[tuple[Any, ...]], bytes] | None = getattr(_hiredis, "pack_command", None)

T = TypeVar("T")

_DEFAULT_URL = "redis://127.0.0.1:6379/0"

# Errors that mean "Redis cannot answer right now" rather than "this call is wrong". Connection
# errors include timeouts of the connect, authentication failures, BusyLoadingError and
# MaxConnectionsError; the response errors are a read-only replica after a failover, a full
# memory, and a cluster that is reconfiguring.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ChildDeadlockedError,
)

# Shared head of every script: Redis < 5 needs effects replication switched on before a script
# may write after the non-deterministic TIME; later versions always do it (no-op).
_HEAD = """
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
"""
# ``now``: the Redis server's clock in milliseconds. Read only by the scripts that write a time
# into a record (a claim's lease end, a mark's creation): an expiry is set relative to the
# server's clock (PEXPIRE), and a record past its expiry is absent for every script.
_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
_PROLOGUE = _HEAD + _CLOCK

# KEYS[1] record; ARGV owner, lease_ms, keep_ms, has_fp ("1"/"0"), fp, worker ("" = none).
# Reply: 1 claimed, 2 taken over, or {now, st, ow, fp, rs, ca, lu, ex, wk} for "exists".
_CLAIM = (
    _HEAD
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'wk')
"""
    + _CLOCK
    + """
local outcome = 1
local created = now
if h[1] then
  local expired_claim = h[1] == 'i' and tonumber(h[6]) <= now
  local same_payload = (not h[3]) or ARGV[4] ~= '1' or h[3] == ARGV[5]
  if not (expired_claim and same_payload) then
    local ex = ms(now + redis.call('PTTL', KEYS[1]))
    return {now, h[1], h[2], h[3], h[4], h[5], h[6], ex, h[7]}
  end
  outcome = 2
  created = tonumber(h[5])
  redis.call('DEL', KEYS[1])
end
local lease = tonumber(ARGV[2])
local f = {'st', 'i', 'ow', ARGV[1], 'ca', ms(created), 'lu', ms(now + lease)}
if ARGV[4] == '1' then f[#f + 1] = 'fp'; f[#f + 1] = ARGV[5] end
if ARGV[6] ~= '' then f[#f + 1] = 'wk'; f[#f + 1] = ARGV[6] end
redis.call('HSET', KEYS[1], unpack(f))
redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[3]))
return outcome
"""
)

# KEYS[1] record; ARGV old owner, new owner, lease_ms, keep_ms, worker. Reply 1 taken over, 0
# the live record is not old owner's claim (nothing changed).
_TAKE_OVER = (
    _HEAD
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
"""
    + _CLOCK
    + """
redis.call('HSET', KEYS[1], 'ow', ARGV[2], 'wk', ARGV[5], 'lu', ms(now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[4]))
return 1
"""
)

# KEYS[1] liveness record; ARGV ttl_ms, retention_ms. Reply 1.
_BEAT = (
    _PROLOGUE
    + """
local alive_until = now + tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'seen', ms(now), 'until', ms(alive_until))
redis.call('PEXPIREAT', KEYS[1], ms(alive_until + tonumber(ARGV[2])))
return 1
"""
)

# KEYS[1] liveness record. Reply nil when absent, else {now, seen, until}.
_SEEN = (
    _PROLOGUE
    + """
local h = redis.call('HMGET', KEYS[1], 'seen', 'until')
if not h[1] then return false end
return {now, h[1], h[2]}
"""
)

# Fencing shared by complete, release and renew: the live record must be a claim of ARGV[1].
# (Like the memory store, a claim whose lease ran out but was not taken over is still owned.)
_OWNED = """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
"""

# KEYS[1] record; ARGV owner, keep_ms, has_result ("1"/"0"), result. Reply 1 done, 0 not owner.
# The record's expiry moves to keep_ms from now by the server's clock: no TIME needed.
_COMPLETE_BODY = """
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], 'ow', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'c', 'rs', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'ow', 'rs', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'c')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_COMPLETE = _HEAD + _OWNED + _COMPLETE_BODY

# The hand-off variants, used only when the handler sent something (a task that sends nothing
# runs the plain scripts, with not one argument more). Extra ARGV: index, sends JSON, member
# (the key without prefix), for marks the dispatch token, then the recorder's dispatch lease
# (ms): the recorder holds the sends while it publishes them, so a redelivery waits.
_COMPLETE_SENDS = (
    _HEAD
    + _OWNED
    + _CLOCK
    + _COMPLETE_BODY.replace(
        "'st', 'c'",
        "'st', 'p', 'sd', ARGV[6], 'sk', ARGV[1], 'sa', ms(now), 'sl', ms(now + tonumber(ARGV[8]))",
    ).replace("return 1\n", "redis.call('ZADD', ARGV[5], now, ARGV[7])\nreturn 1\n")
)

# KEYS[1] record; ARGV token, lease_ms, min_age_ms, index, member. Reply: 0 nothing to take
# (none pending, or too young), {ms} another dispatcher's lease has ms left, or the sends JSON.
# The lease's own holder may take it again: to renew it, or with lease 0 to let it go.
_TAKE_SENDS = (
    _PROLOGUE
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'sa', 'sl', 'sd', 'sk')
if h[1] ~= 'p' then redis.call('ZREM', ARGV[4], ARGV[5]) return 0 end
if tonumber(h[2]) > now - tonumber(ARGV[3]) then return 0 end
if h[3] and tonumber(h[3]) > now and h[5] ~= ARGV[1] then return {tonumber(h[3]) - now} end
redis.call('HSET', KEYS[1], 'sk', ARGV[1], 'sl', ms(now + tonumber(ARGV[2])))
return h[4]
"""
)

# KEYS[1] record; ARGV token, index, member. Reply 1 cleared, 0 not this token's (fenced).
_DISPATCHED = """
local h = redis.call('HMGET', KEYS[1], 'st', 'sk')
if h[1] ~= 'p' or h[2] ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'sd', 'sk', 'sa', 'sl')
redis.call('HSET', KEYS[1], 'st', 'c')
redis.call('ZREM', ARGV[2], ARGV[3])
return 1
"""

# KEYS[1] the index; ARGV min_age_ms, limit. Reply: members recorded at least min_age ago.
_PENDING = (
    _PROLOGUE
    + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]),
                  'LIMIT', 0, tonumber(ARGV[2]))
"""
)

# KEYS[1] record; ARGV index, member. An operator's release: the record and its pending sends.
_FORGET = """
redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[1], ARGV[2])
return 1
"""

# KEYS[1] record; ARGV owner. Reply 1 deleted, 0 not owner.
_RELEASE = (
    _HEAD
    + _OWNED
    + """
redis.call('DEL', KEYS[1])
return 1
"""
)

# KEYS[1] record; ARGV owner, lease_ms. The expiry moves by as much as the lease end moves
# forward, so a renewed claim still outlives its lease by keep_for. Reply 1 renewed, 0 not owner.
_RENEW = (
    _HEAD
    + _OWNED
    + _CLOCK
    + """
local lease_until = now + tonumber(ARGV[2])
local expires = now + redis.call('PTTL', KEYS[1]) + math.max(0, lease_until - tonumber(h[3]))
redis.call('HSET', KEYS[1], 'lu', ms(lease_until))
redis.call('PEXPIREAT', KEYS[1], ms(expires))
return 1
"""
)

# KEYS[1] record; ARGV keep_ms, has_fp, fp, has_result, result. Reply 1 written, 0 a live
# record exists (nothing changed).
_MARK_BODY = """
local f = {'st', 'c', 'ca', ms(now)}
if ARGV[2] == '1' then f[#f + 1] = 'fp'; f[#f + 1] = ARGV[3] end
if ARGV[4] == '1' then f[#f + 1] = 'rs'; f[#f + 1] = ARGV[5] end
redis.call('HSET', KEYS[1], unpack(f))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
_MARK_FREE = """
if redis.call('HGET', KEYS[1], 'st') then return 0 end
"""
_MARK = _HEAD + _MARK_FREE + _CLOCK + _MARK_BODY
_MARK_SENDS = (
    _HEAD
    + _MARK_FREE
    + _CLOCK
    + _MARK_BODY.replace(
        "'st', 'c', 'ca', ms(now)",
        "'st', 'p', 'ca', ms(now), 'sd', ARGV[7], 'sk', ARGV[9], 'sa', ms(now),"
        " 'sl', ms(now + tonumber(ARGV[10]))",
    ).replace("return 1\n", "redis.call('ZADD', ARGV[6], now, ARGV[8])\nreturn 1\n")
)

# KEYS[1] record. Reply: nil when absent (a record past its expiry is), else {now, st, ow, fp,
# rs, ca, lu, ex, wk, sd}. Nothing recorded (a lazy first delivery) costs one HMGET.
_GET = (
    _HEAD
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'wk', 'sd')
if not h[1] then return false end
"""
    + _CLOCK
    + """
local ex = ms(now + redis.call('PTTL', KEYS[1]))
return {now, h[1], h[2], h[3], h[4], h[5], h[6], ex, h[7], h[8]}
"""
)


def _cannot_answer(exc: BaseException) -> bool:
    """Whether ``exc`` means "Redis cannot answer right now" (a script that runs too long
    elsewhere blocks the server: ``BUSY Redis is busy …``)."""
    return isinstance(exc, _UNAVAILABLE) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and str(exc).startswith(("BUSY", "LOADING", "MASTERDOWN"))
    )


_STATUS = {"i": Status.IN_PROGRESS, "c": Status.COMPLETED, "p": Status.COMPLETED}
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def _text(value: Any) -> str | None:
    """A reply item as text (clients may or may not decode responses)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return str(value)


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds; a positive duration never rounds down to zero."""
    value = round(float(seconds) * 1000)
    if value <= 0 < seconds:
        return 1
    return value


def _optional(value: str | None) -> tuple[str, str]:
    """An optional string as the (present flag, value) pair the scripts take."""
    return ("0", "") if value is None else ("1", value)


def _safe_url(url: str) -> str:
    """``url`` without secrets: :func:`taskonce.stores.redact` for the user-info part, plus a
    ``password`` query parameter (``unix:///run/redis.sock?password=…``) masked too."""
    redacted: str = redact(url)
    head, mark, tail = redacted.partition("?")
    query, hash_mark, fragment = tail.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not mark or not any(name.lower() == "password" for name, _ in pairs):
        return redacted
    masked = [(name, "***" if name.lower() == "password" else val) for name, val in pairs]
    # Rebuilt by hand: urlunsplit would turn "unix:///path" into "unix:/path".
    return f"{head}?{urlencode(masked, safe='*/')}{hash_mark}{fragment}"


class _Call:
    """One caller's script and, once its round trip is back, its reply or error."""

    __slots__ = (
        "answered",
        "args",
        "batch",
        "error",
        "handed",
        "leads",
        "name",
        "ready",
        "released",
        "reply",
        "script",
        "successor",
    )

    def __init__(self, script: Script, name: str, args: Sequence[Any]) -> None:
        self.script = script
        self.name = name
        self.args = args
        self.reply: Any = None
        self.error: BaseException | None = None
        self.answered = False
        # A plain lock used as a one-shot signal: cheaper than threading.Event, which builds a
        # Condition per instance and takes two locks to wait.
        self.ready = threading.Lock()
        self.ready.acquire()
        self.released = False
        self.leads = False  # this caller's thread sends ``batch``
        self.batch: list[_Call] = []
        self.handed = False  # the sender's duty for ``batch`` is done
        self.successor: _Call | None = None  # whom this sender gave the queue to

    def answer(self, reply: Any = None, error: BaseException | None = None) -> None:
        self.reply, self.error, self.answered = reply, error, True


class _SharedTrips:
    """Lets the threads of one process share Redis round trips (group commit).

    A caller that finds no round trip in flight sends its script at once, as a plain EVALSHA.
    Callers that arrive while one is in flight queue up; when it is back, the sender hands the
    whole queue to the first of them, which sends it as one pipeline (no MULTI) and hands every
    caller its own reply or error. Each script still runs atomically on its own key, so results
    are those of some order of the calls, as they would be without sharing; only the system
    calls and the client's per-command work are shared. Dramatiq's 8 worker threads, Celery's
    threads pool and the lease heartbeat call the store at the same moments; on a machine where
    a round trip is mostly system-call time this more than halves the store's CPU per
    operation (``bench/store_threads.py``, docs/performance.md).

    Worker threads get exceptions thrown into them at any moment (Dramatiq's ``TimeLimit`` and
    ``Shutdown``, a signal handler in the main thread): a caller interrupted while it waits
    leaves the queue, and one interrupted while it holds the duty to send passes that duty on
    and answers the calls it could not send with a connection error (an ambiguous outcome,
    like a timeout: :class:`~taskonce.errors.StoreUnavailable` for their callers). Nothing
    waits for a thread that stopped. Only the sender's own thread sees its interruption.
    """

    def __init__(
        self,
        client: redis.Redis,
        wait: tuple[int, int] | None = None,
        reads: frozenset[str] = frozenset(),
        own_connection: bool = False,
    ) -> None:
        self._client = client
        # ``min_replicas``: (replicas, timeout ms) for a WAIT after the writes of each round
        # trip, on the same connection (WAIT counts that connection's writes); ``reads`` are
        # the SHA1s of the scripts that write nothing.
        self._wait = wait
        self._reads = reads
        # A lone call goes down a connection this line keeps (see _send_own) instead of
        # through redis-py's command path; only for a client the store opened itself.
        self._own_connection = own_connection
        self._reset()
        _FORKED.add(self)

    def _reset(self) -> None:
        # After a fork the parent's threads do not exist in the child: no queue, no sender,
        # and the parent's connection is not this process's to use (the pool opens new ones).
        self._lock = threading.Lock()
        self._queued: list[_Call] = []
        self._busy = False
        self._conn: Any = None
        self._pack: Callable[[Any, tuple[Any, ...]], list[bytes]] = _redis_py_pack

    def run(self, script: Script, name: str, args: Sequence[Any]) -> _Call:
        """Run ``script`` on key ``name``; the returned call holds its reply or its error."""
        call = _Call(script, name, args)
        try:
            with self._lock:
                if self._busy:
                    self._queued.append(call)
                else:
                    self._busy = call.leads = True
                    call.batch = [call]
            if not call.leads:
                call.ready.acquire()  # released with the answer, or to make this call lead
            if call.leads:
                if self._queued:  # read without the lock: one that misses it rides the next trip
                    with self._lock:
                        # Those that queued while this thread woke up go along too: otherwise
                        # two threads would take strict turns, one call per round trip.
                        call.batch += self._queued
                        self._queued = []
                self._send(call.batch)
                self._hand_over(call)
        except BaseException:
            while True:  # a second exception thrown in here must not leave the duty undone
                try:
                    self._abandon(call)
                    break
                except BaseException:  # noqa: S112 - the first one is raised below
                    continue
            raise
        return call

    def _send(self, batch: list[_Call], loaded: bool = False) -> None:
        waits = self._wait is not None and any(c.script.sha not in self._reads for c in batch)
        if len(batch) == 1 and not waits:
            self._send_one(batch[0])
            return
        if self._own_connection and not waits:
            self._send_own_batch(batch)
            return
        pipe = self._client.pipeline(transaction=False)
        for call in batch:
            pipe.evalsha(call.script.sha, 1, call.name, *call.args)
        if waits:
            assert self._wait is not None
            pipe.wait(*self._wait)
        try:
            replies = pipe.execute(raise_on_error=False)
            acked = replies.pop() if waits else None
            if isinstance(acked, Exception):
                raise acked
        except (redis.exceptions.DataError, UnicodeError):
            # An argument redis-py cannot encode fails the pipeline before anything is sent:
            # send each call alone, so only the bad one fails.
            for call in batch:
                if waits and len(batch) > 1:
                    self._send([call])
                else:
                    self._send_one(call)
            return
        except Exception as exc:  # the whole round trip failed
            for call in batch:
                call.answer(error=exc if call is batch[0] or _cannot_answer(exc) else _shared(exc))
            return
        if acked is not None:
            self._answer_replicated(batch, replies, int(acked), loaded)
            return
        self._answer(batch, replies)

    def _answer(self, batch: list[_Call], replies: list[Any]) -> None:
        """Answer each call of a round trip with its own reply; a call whose script the server
        no longer has (after a restart or SCRIPT FLUSH) is sent again alone, which loads it."""
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                self._send_one(call)
            elif isinstance(reply, BaseException):
                call.answer(error=reply)
            else:
                call.answer(reply)

    def _answer_replicated(
        self, batch: list[_Call], replies: list[Any], acked: int, loaded: bool
    ) -> None:
        """Answer a batch sent with a WAIT: a write that fewer than ``min_replicas`` replicas
        acknowledged is :class:`NotReplicated` (its caller gets StoreUnavailable)."""
        assert self._wait is not None
        wanted, timeout_ms = self._wait
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError) and not loaded:
                self._client.script_load(call.script.script)  # after a restart or SCRIPT FLUSH
                self._send([call], loaded=True)
            elif isinstance(reply, BaseException):
                call.answer(error=reply)
            elif acked < wanted and call.script.sha not in self._reads:
                call.answer(error=NotReplicated(acked, wanted, timeout_ms))
            else:
                call.answer(reply)

    def _send_one(self, call: _Call) -> None:
        if self._own_connection:
            self._send_own(call)
            return
        try:
            try:
                reply = self._client.evalsha(call.script.sha, 1, call.name, *call.args)
            except redis.exceptions.NoScriptError:
                reply = call.script(keys=[call.name], args=list(call.args))
        except Exception as exc:
            call.answer(error=exc)
        else:
            call.answer(reply)

    def _send_own(self, call: _Call) -> None:
        """Send one EVALSHA down the connection this line keeps from the pool.

        Only the current sender of this line uses it, so it needs no pool checkout per call:
        redis-py's command path (pool checkout and return, each with a pid check, a lock, a
        poll of the socket and observability counters; the retry wrapper; the response
        callbacks) costs about as much client CPU as the round trip's own system calls
        (``bench/guard_cpu.py``, docs/performance.md). What it keeps: the connection's own retry
        policy (the store's client retries once after a connection error, never after a
        timeout), the script loaded again after a ``NoScriptError``, and a connection that
        failed in any other way goes back to the pool disconnected (a Sentinel pool then finds
        the current master for the next one). The EVALSHA reply has no response callback in
        redis-py, so the parser's reply is the reply."""
        conn = self._conn
        try:
            if conn is None:
                conn = self._conn = self._client.connection_pool.get_connection()
                self._pack = _fast_packer(conn)
            packed = self._pack(conn, ("EVALSHA", call.script.sha, 1, call.name, *call.args))

            def attempt() -> Any:
                conn.send_packed_command(packed)
                return conn.read_response()

            reply = conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        except redis.exceptions.NoScriptError:
            try:  # Script.__call__ loads it (after a restart or SCRIPT FLUSH)
                reply = call.script(keys=[call.name], args=list(call.args))
            except Exception as exc:
                call.answer(error=exc)
                return
        except BaseException as exc:
            self._drop_connection()
            if not isinstance(exc, Exception):
                raise  # an interruption: the caller's handler answers the call
            call.answer(error=exc)
            return
        call.answer(reply)

    def _send_own_batch(self, batch: list[_Call]) -> None:
        """Send a shared round trip down the kept connection: every call's EVALSHA in one
        write, then their replies read in order (what redis-py's pipeline does, without its
        command path per call). A call whose arguments cannot be encoded fails alone; the
        round trip is retried as the connection's retry policy says, like a pipeline."""
        conn = self._conn
        sendable: list[_Call] = []
        try:
            if conn is None:
                conn = self._conn = self._client.connection_pool.get_connection()
                self._pack = _fast_packer(conn)
            packed: list[bytes] = []
            for call in batch:
                try:
                    packed += self._pack(
                        conn, ("EVALSHA", call.script.sha, 1, call.name, *call.args)
                    )
                except (redis.exceptions.DataError, UnicodeError) as exc:
                    call.answer(error=exc)
                    continue
                sendable.append(call)
            if not sendable:
                return

            def attempt() -> list[Any]:
                conn.send_packed_command(packed)
                replies: list[Any] = []
                for _ in sendable:
                    try:
                        replies.append(conn.read_response())
                    except redis.exceptions.ResponseError as exc:  # this call's own error
                        replies.append(exc)
                return replies

            replies = conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        except BaseException as exc:
            self._drop_connection()
            if not isinstance(exc, Exception):
                raise  # an interruption: the sender's handler answers the calls
            for call in sendable:
                call.answer(
                    error=exc if call is sendable[0] or _cannot_answer(exc) else _shared(exc)
                )
            return
        if any(_cannot_answer(reply) for reply in replies if isinstance(reply, BaseException)):
            self._drop_connection()  # e.g. a master demoted by a failover: find the new one
        self._answer(sendable, replies)

    def _drop_connection(self) -> None:
        """Give the kept connection back to the pool, disconnected: after an error its state
        (a reply half read, a demoted master) is unknown."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.disconnect()
        finally:
            self._client.connection_pool.release(conn)

    def _hand_over(self, sender: _Call) -> None:
        """The sender's last step: wake every caller of its batch (one not answered gets a
        connection error) and give the queue to the next sender, or mark the line idle. All
        under the lock, so an interruption cannot leave half of it done."""
        with self._lock:
            if sender.handed:
                return
            for call in sender.batch:
                if not call.answered:
                    call.answer(error=_interrupted())
                if call is not sender:
                    _release(call)
            successor = sender.successor
            if successor is None and self._queued:
                # Plain stores, no call between them: an exception thrown into this thread
                # cannot land in the middle (CPython checks for one only at calls and loops).
                successor = self._queued[0]
                successor.batch = self._queued
                successor.leads = True
                self._queued = []
                sender.successor = successor
            if successor is not None:
                _release(successor)
            else:
                self._busy = False
            sender.handed = True
            # The batch holds the sender itself: dropping it frees every call by reference
            # counting, rather than leaving a cycle per round trip to the garbage collector.
            sender.batch = []

    def _abandon(self, call: _Call) -> None:
        """``call``'s thread was interrupted: leave the queue, or finish the sender's duty."""
        with self._lock:
            if call in self._queued:
                self._queued.remove(call)
                return
            leads = call.leads
        if leads:
            self._hand_over(call)


def _redis_py_pack(conn: Any, command: tuple[Any, ...]) -> list[bytes]:
    packed: list[bytes] = conn.pack_command(*command)
    return packed


def _hiredis_pack(_conn: Any, command: tuple[Any, ...]) -> list[bytes]:
    assert _PACK_COMMAND is not None  # _fast_packer chose this packer
    try:
        return [_PACK_COMMAND(command)]
    except TypeError as exc:  # what redis-py's own packer turns it into
        raise redis.exceptions.DataError(str(exc)) from None


def _fast_packer(conn: Any) -> Callable[[Any, tuple[Any, ...]], list[bytes]]:
    """How to pack commands for ``conn``: hiredis' ``pack_command`` straight away where it
    encodes text as the connection would (UTF-8, strict), else redis-py's packer, which does
    the same through several Python calls per argument (about 11 µs against 2 µs for a
    claim's ten)."""
    encoder = getattr(conn, "encoder", None)
    utf8 = (
        encoder is not None
        and str(encoder.encoding).lower().replace("-", "").replace("_", "") == "utf8"
        and encoder.encoding_errors == "strict"
    )
    return _hiredis_pack if _PACK_COMMAND is not None and utf8 else _redis_py_pack


class _OneTrip:
    """What a cluster client uses instead of :class:`_SharedTrips`: every call is its own
    EVALSHA. Sharing a round trip needs one connection that every queued script can go down;
    on a cluster the scripts of one batch belong to different nodes, and redis-py's cluster
    pipeline would split the batch per node and send the parts one node after another, with
    its own retry and redirection handling for a partly failed batch (a MOVED during a
    resharding re-sends commands, which for a claim could make it look taken by itself). The
    cost is the system-call time that sharing saves when several threads of one process call
    at the same moment: about a quarter of the throughput with 8 threads, nothing with one
    (``bench/cluster_trips.py``, docs/performance.md)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def run(self, script: Script, name: str, args: Sequence[Any]) -> _Call:
        call = _Call(script, name, args)
        try:
            try:
                reply = self._client.evalsha(script.sha, 1, name, *args)
            except redis.exceptions.NoScriptError:
                reply = script(keys=[name], args=list(args))
        except Exception as exc:
            call.answer(error=exc)
        else:
            call.answer(reply)
        return call


class NotReplicated(redis.exceptions.ConnectionError):
    """A write the master applied but fewer replicas than ``min_replicas`` acknowledged in
    time: a failover now could lose it, so its caller is told the store did not answer."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int) -> None:
        super().__init__(
            f"written on the master but acknowledged by {acked} replica(s) within {timeout_ms} "
            f"ms, fewer than min_replicas={wanted}; a failover could lose it (does the master "
            f"have {wanted} connected replica(s)?)"
        )


def _release(call: _Call) -> None:
    if not call.released:
        call.released = True
        call.ready.release()


def _interrupted() -> redis.exceptions.ConnectionError:
    return redis.exceptions.ConnectionError(
        "the thread sending this shared round trip was interrupted; the script may or may not "
        "have run"
    )


def _shared(exc: Exception) -> Exception:
    """A caller's own error for a shared round trip that failed with ``exc`` (one exception
    object must not be raised in several threads)."""
    error = RuntimeError(f"the shared round trip failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


# Every live _SharedTrips, emptied in a forked child before any of its threads runs: a queued
# call or a busy flag of the parent's threads must not survive there.
_FORKED: weakref.WeakSet[_SharedTrips] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for trips in list(_FORKED):
        trips._reset()
        _unlock_pool(trips._client)
    for client in list(_CLUSTER_CLIENTS):
        _unlock_cluster(client)


def _unlock_pool(client: Any) -> None:
    """Give a forked child's copy of redis-py's pool fresh locks.

    A thread of the parent (the liveness writer, a heartbeat, a Dramatiq worker thread) may hold
    the pool's ``_lock`` or ``_fork_lock`` at the moment another thread forks; that thread does
    not exist in the child, so the copied lock is never released and the child's first command
    (its ``reset()`` after the pid check takes ``_lock``) would wait for ever. Nothing else in
    the child can hold them yet: this runs before any of its threads."""
    pool = getattr(client, "connection_pool", None)
    for name in ("_lock", "_fork_lock"):
        old = getattr(pool, name, None)
        if old is not None and hasattr(old, "acquire"):
            setattr(
                pool, name, threading.RLock() if "RLock" in type(old).__name__ else threading.Lock()
            )


# Cluster clients this module opened or was given, for the same treatment after a fork.
_CLUSTER_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def _unlock_cluster(client: Any) -> None:
    """:func:`_unlock_pool` for a cluster client: its own lock, its node manager's two (the
    client and the manager may share one: they keep sharing its replacement) and every node's
    pool. redis-py's per-node pools check their pid and reconnect in the child, as a plain
    client's do."""
    fresh: dict[int, Any] = {}
    manager = getattr(client, "nodes_manager", None)
    for owner, name in ((client, "_lock"), (manager, "_lock"), (manager, "_initialization_lock")):
        old = getattr(owner, name, None)
        if old is None or not hasattr(old, "acquire"):
            continue
        if id(old) not in fresh:
            fresh[id(old)] = (
                threading.RLock() if "RLock" in type(old).__name__ else threading.Lock()
            )
        setattr(owner, name, fresh[id(old)])
    for node in list(getattr(manager, "nodes_cache", {}).values()):
        if node.redis_connection is not None:
            _unlock_pool(node.redis_connection)


os.register_at_fork(after_in_child=_reset_after_fork)


# Buckets of a cluster store (see the module's docstring): enough that the records spread over
# a few dozen masters, few enough that a relay sweep reads every bucket's index at once.
_CLUSTER_BUCKETS = 64
_SLOTS = 16384


@functools.cache
def _bucket_tags(prefix: str) -> tuple[str, ...]:
    """The hash tag of each bucket: ``f"{prefix}/{n}"`` with the first ``n`` whose slot lies in
    the bucket's share of the slot range, so the buckets are spread evenly over the masters
    (``redis-cli --cluster create`` gives each master one contiguous range)."""
    from redis.crc import key_slot

    tags = []
    n = 0
    for bucket in range(_CLUSTER_BUCKETS):
        low, high = bucket * _SLOTS // _CLUSTER_BUCKETS, (bucket + 1) * _SLOTS // _CLUSTER_BUCKETS
        n = 0
        while not low <= key_slot(f"{prefix}/{n}".encode()) < high:
            n += 1
        tags.append(f"{prefix}/{n}")
    return tuple(tags)


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

    schemes = ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel")

    def __init__(
        self,
        url: str = _DEFAULT_URL,
        *,
        prefix: str | None = None,
        client: redis.Redis | None = None,
        socket_timeout: float = 5.0,
        min_replicas: int | None = None,
    ) -> None:
        url_prefix = url_replicas = None
        if client is None and isinstance(url, str):
            url, url_prefix, url_replicas = _take_own_options(url)
        prefix = own_value("RedisStore", "prefix", url_prefix, prefix, "taskonce")
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
        replicas = _replicas(url_replicas, min_replicas)
        self._prefix = prefix
        self._owns_client = client is None
        if client is None:
            self._url = _safe_url(url) if isinstance(url, str) else "<not a URL>"
            self._client = self._open(url, float(socket_timeout))
        else:
            self._url = self._describe_client(client)
            self._client = client
        self._claim = self._client.register_script(_CLAIM)
        self._complete = self._client.register_script(_COMPLETE)
        self._release = self._client.register_script(_RELEASE)
        self._renew = self._client.register_script(_RENEW)
        self._mark = self._client.register_script(_MARK)
        self._get = self._client.register_script(_GET)
        self._take_over = self._client.register_script(_TAKE_OVER)
        self._beat = self._client.register_script(_BEAT)
        self._seen = self._client.register_script(_SEEN)
        self._complete_sends = self._client.register_script(_COMPLETE_SENDS)
        self._mark_sends = self._client.register_script(_MARK_SENDS)
        self._take_sends = self._client.register_script(_TAKE_SENDS)
        self._dispatched_script = self._client.register_script(_HEAD + _DISPATCHED)
        self._pending = self._client.register_script(_PENDING)
        self._forget = self._client.register_script(_FORGET)
        self._cluster = isinstance(self._client, redis.cluster.RedisCluster)
        self._index = f"{prefix}!sends"
        self._tags: tuple[str, ...] = ()
        self._trips: _SharedTrips | _OneTrip
        if self._cluster:
            if "{" in prefix or "}" in prefix:
                raise ConfigError(
                    f"RedisStore prefix {prefix!r}: on Redis Cluster the store adds its own hash "
                    "tags to the prefix; give it without braces"
                )
            if replicas:
                raise ConfigError(
                    "RedisStore min_replicas is not available on Redis Cluster (a WAIT would "
                    "have to follow each write on its own node's connection)"
                )
            self._tags = _bucket_tags(prefix)
            self._trips = _OneTrip(self._client)
            _CLUSTER_CLIENTS.add(self._client)
        else:
            wait = (replicas, max(1, round(socket_timeout * 500))) if replicas else None
            reads = frozenset(script.sha for script in (self._get, self._seen, self._pending))
            # The line keeps one of the pool's connections: not where a pool of one or two
            # (``?max_connections=``) would leave the store's other commands none.
            own = (
                self._owns_client
                and getattr(self._client.connection_pool, "max_connections", 0) > 2
            )
            self._trips = _SharedTrips(self._client, wait, reads, own_connection=own)
        logger.debug("opened %s", self.describe())

    def _open(self, url: str, socket_timeout: float) -> redis.Redis:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(
                f"RedisStore url {self._url!r} is not a redis://, rediss://, unix://, "
                "redis+sentinel:// or redis+cluster:// URL"
            )
        scheme = url.split("://", 1)[0].lower()
        if scheme not in self.schemes:
            raise ConfigError(
                f"RedisStore url {self._url!r} has scheme {scheme!r}; expected one of "
                f"{', '.join(s + '://' for s in self.schemes)}"
            )
        try:
            if scheme == "redis+cluster":
                # RedisCluster has the same command methods the store calls (not a subclass).
                return cast(redis.Redis, self._open_cluster(url, socket_timeout))
            if scheme == "redis+sentinel":
                return self._open_sentinel(url, socket_timeout)
            return redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            # redis-py's messages can quote the URL's query string; name only the redacted URL.
            raise ConfigError(
                f"RedisStore url {self._url!r} is invalid ({type(exc).__name__})"
            ) from None

    def _open_cluster(self, url: str, socket_timeout: float) -> Any:
        """A :class:`redis.cluster.RedisCluster` for ``redis+cluster://[auth@]host:port,…``.

        redis-py retries a cluster command after a connection error *or a timeout* by default;
        a claim that timed out may have run, and running it again would make the key look taken
        (by the same delivery), so the client this store opens never retries: the call fails
        with StoreUnavailable and the message comes back (``fail_closed``). Redirections after
        a resharding (MOVED/ASK) are followed all the same."""
        auth, hosts, path, query = _split_multi_host(url, self._url)
        if path not in ("", "/", "/0"):
            raise ConfigError(
                f"RedisStore url {self._url!r}: a Redis Cluster has only database 0; "
                f"the URL names {path!r}"
            )
        kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
        }
        kwargs.update(_url_kwargs(auth, "0", query))  # the URL's own timeouts win, as from_url
        kwargs.pop("db", None)
        nodes = [
            redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
            for host, port in hosts
        ]
        try:
            return redis.cluster.RedisCluster(
                startup_nodes=nodes, retry=Retry(NoBackoff(), 0), **kwargs
            )
        except redis.exceptions.RedisClusterException as exc:
            # Opening a cluster client asks the nodes for the slot map: none answered.
            raise StoreUnavailable(
                f"Redis store {self._url} did not answer: none of the cluster nodes "
                f"{', '.join(f'{h}:{p}' for h, p in hosts)} could be reached ({exc})"
            ) from None
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(
                f"Redis store {self._url} did not answer: {type(exc).__name__}: {exc}"
            ) from None

    def _open_sentinel(self, url: str, socket_timeout: float) -> redis.Redis:
        """The master of ``redis+sentinel://[auth@]host:port,…/service_name[/db]`` through
        :class:`redis.sentinel.Sentinel`. The password (if any) is the master's and replicas';
        the sentinels are asked without one. Every new connection asks the sentinels where the
        master is, so after a failover the store reaches the promoted replica; a call in flight
        when the master died fails with StoreUnavailable (nothing is retried: it may have run)."""
        auth, hosts, path, query = _split_multi_host(url, self._url)
        parts = [part for part in path.split("/") if part]
        if not parts or len(parts) > 2:
            raise ConfigError(
                f"RedisStore url {self._url!r}: a Sentinel URL names the service after the "
                "hosts: redis+sentinel://host:port[,host:port…]/service_name[/db]"
            )
        service, db = parts[0], (parts[1] if len(parts) > 1 else "0")
        if not db.isdigit():
            raise ConfigError(
                f"RedisStore url {self._url!r}: the database after the service name must be "
                f"a number, got {db!r}"
            )
        timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
        kwargs: dict[str, Any] = {**timeouts, **_url_kwargs(auth, db, query)}
        sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            hosts, sentinel_kwargs=timeouts, **timeouts
        )
        client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
            service, retry=Retry(NoBackoff(), 0), **kwargs
        )
        return client

    @staticmethod
    def _describe_client(client: redis.Redis) -> str:
        """A URL-like name of a caller's client, built without its password."""
        try:
            kwargs = client.connection_pool.connection_kwargs
        except AttributeError:
            return f"<{type(client).__name__}>"
        db = kwargs.get("db", 0)
        if kwargs.get("path"):
            return f"unix://{kwargs['path']}?db={db}"
        tls = "SSL" in getattr(client.connection_pool, "connection_class", type).__name__
        host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
        return f"{'rediss' if tls else 'redis'}://{host}:{port}/{db}"

    # -- plumbing ------------------------------------------------------------------------------

    def _tag(self, key: str) -> str:
        return self._tags[zlib.crc32(key.encode("utf-8")) % _CLUSTER_BUCKETS]

    def _key(self, key: str) -> str:
        if self._cluster:
            return f"{{{self._tag(key)}}}:{key}"
        return f"{self._prefix}:{key}"

    def _index_of(self, key: str) -> str:
        """The sends index of ``key``'s record: in the same hash slot on a cluster."""
        if self._cluster:
            return f"{{{self._tag(key)}}}!sends"
        return self._index

    def _indexes(self) -> list[str]:
        if self._cluster:
            return [f"{{{tag}}}!sends" for tag in self._tags]
        return [self._index]

    def _pattern(self, key_prefix: str = "") -> str:
        """The SCAN pattern of this store's records whose key starts with ``key_prefix``."""
        escaped = _GLOB_SPECIAL.sub(r"\\\1", key_prefix)
        if self._cluster:
            return "{" + _GLOB_SPECIAL.sub(r"\\\1", self._prefix) + "/*}:" + escaped + "*"
        return _GLOB_SPECIAL.sub(r"\\\1", self._prefix) + ":" + escaped + "*"

    def _key_of(self, name: str) -> str:
        """The key of a record's Redis name (the inverse of :meth:`_key`)."""
        if self._cluster:
            return name.partition("}:")[2]
        return name[len(self._prefix) + 1 :]

    @staticmethod
    def _live_key(worker: str) -> str:
        # Under the same prefix (so removing a prefix's keys removes these too), in a
        # sub-namespace that the guard's keys ("queue:id") do not use.
        return f"~live:{worker}"

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
            if _cannot_answer(exc):
                self._unavailable(operation, key, exc)
            raise

    def _run(self, operation: str, script: Script, key: str, args: Sequence[Any]) -> Any:
        # EVALSHA straight on the client (redis-py's Script.__call__ costs a measurable share
        # of a round trip), shared with other threads' calls when they coincide.
        call = self._trips.run(script, self._key(key), args)
        exc = call.error
        if exc is None:
            return call.reply
        # A failed shared round trip hands the same exception to every caller: each raises its
        # own StoreUnavailable *from* it instead of re-raising the one object in many threads.
        if _cannot_answer(exc):
            self._unavailable(operation, key, exc)
        raise exc

    def _record(self, key: str, reply: Sequence[Any]) -> Record:
        """A Record from the scripts' ``{now, st, ow, fp, rs, ca, lu, ex[, wk[, sd]]}`` reply."""
        now = int(reply[0])
        st = _text(reply[1]) or ""
        status = _STATUS[st]
        sends = _text(reply[9]) if len(reply) > 9 else None
        lease_until = int(_text(reply[6]) or 0)
        remaining = 0.0
        if status is Status.IN_PROGRESS:
            remaining = max(0, lease_until - now) / 1000.0
        return Record(
            key=key,
            status=status,
            owner=_text(reply[2]),
            fingerprint=_text(reply[3]),
            result=_text(reply[4]),
            created_at=int(_text(reply[5]) or 0) / 1000.0,
            expires_at=int(_text(reply[7]) or 0) / 1000.0,
            lease_remaining=remaining,
            worker=_text(reply[8]) if len(reply) > 8 else None,
            marked=status is Status.COMPLETED and not lease_until,  # a completion keeps 'lu'
            sends_pending=st == "p",
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
        """Atomically take ``key`` for ``owner`` (see :meth:`Store.claim`).

        One EVALSHA; a fresh claim or a takeover answers with a single integer, only "exists"
        carries the record found.
        """
        args = (owner, _ms(lease), _ms(keep_for), *_optional(fingerprint), worker or "")
        reply = self._run("claim", self._claim, key, args)
        if isinstance(reply, list):
            return Claim(ClaimOutcome.EXISTS, self._record(key, reply))
        return Claim(ClaimOutcome.CLAIMED if int(reply) == 1 else ClaimOutcome.TAKEN_OVER)

    def take_over(
        self, key: str, old_owner: str, owner: str, lease: float, keep_for: float, worker: str
    ) -> bool:
        """Hand ``old_owner``'s live claim to ``owner`` (one EVALSHA, fenced by the old token)."""
        args = (old_owner, owner, _ms(lease), _ms(keep_for), worker)
        return bool(int(self._run("take_over", self._take_over, key, args)))

    def beat(self, worker: str, ttl: float) -> None:
        """Write ``worker``'s liveness record (one EVALSHA, judged by the Redis clock)."""
        args = (_ms(ttl), _ms(LIVENESS_RETENTION))
        self._run("beat", self._beat, self._live_key(worker), args)

    def seen(self, worker: str) -> Seen | None:
        """``worker``'s liveness record by the Redis clock, or None."""
        reply = self._run("seen", self._seen, self._live_key(worker), ())
        if reply is None:
            return None
        now, seen, until = (int(_text(item) or 0) for item in reply)
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
        args: tuple[Any, ...] = (owner, _ms(keep_for), *_optional(result))
        script = self._complete
        if sends:
            script = self._complete_sends
            args = (*args, self._index_of(key), json.dumps(list(sends)), key, _ms(dispatch_lease))
        if not int(self._run("complete", script, key, args)):
            raise LeaseLost(key, "complete")

    def release(self, key: str, owner: str | None) -> None:
        """Delete ``owner``'s claim (fenced), or with ``owner=None`` whatever is recorded."""
        if owner is None:  # its pending sends go with it
            self._run("release", self._forget, key, (self._index_of(key), key))
            return
        if not int(self._run("release", self._release, key, (owner,))):
            raise LeaseLost(key, "release")

    def renew(self, key: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s lease to ``lease`` seconds from now by the Redis clock, pushing the
        key's expiry out by as much; :class:`LeaseLost` if the claim is no longer ``owner``'s."""
        if not int(self._run("renew", self._renew, key, (owner, _ms(lease)))):
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
        args: tuple[Any, ...] = (_ms(keep_for), *_optional(fingerprint), *_optional(result))
        script = self._mark
        if sends:
            script = self._mark_sends
            args = (
                *args,
                self._index_of(key),
                json.dumps(list(sends)),
                key,
                token,
                _ms(dispatch_lease),
            )
        return bool(int(self._run("mark", script, key, args)))

    def take_sends(self, key: str, token: str, lease: float, older_than: float = 0.0) -> SendLease:
        """Take the dispatch lease of ``key``'s pending sends (one script, Redis clock)."""
        args = (token, _ms(lease), round(older_than * 1000), self._index_of(key), key)
        reply = self._run("take_sends", self._take_sends, key, args)
        if isinstance(reply, list):
            return SendLease(retry_after=int(reply[0]) / 1000.0)
        text = _text(reply) if not isinstance(reply, int) else None
        return SendLease(tuple(json.loads(text))) if text else SendLease()

    def dispatched(self, key: str, token: str) -> bool:
        """Clear ``key``'s pending sends if ``token`` still holds them (one script)."""
        return bool(
            int(
                self._run(
                    "dispatched", self._dispatched_script, key, (token, self._index_of(key), key)
                )
            )
        )

    def pending_sends(self, older_than: float = 0.0, limit: int = 100) -> list[str]:
        """Keys with sends pending for at least ``older_than`` s, from the index (one script)."""
        if self._cluster:
            return self._call(
                "pending_sends", None, lambda: self._pending_in_buckets(older_than, limit)
            )
        call = self._trips.run(self._pending, self._index, (round(older_than * 1000), limit))
        if call.error is not None:
            if _cannot_answer(call.error):
                self._unavailable("pending_sends", None, call.error)
            raise call.error
        return [_text(name) or "" for name in call.reply]

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
            found += [(float(score), _text(name) or "") for name, score in reply]
        return [name for _, name in sorted(found)[:limit]]

    def get(self, key: str) -> Record | None:
        """The live record of ``key`` with ``lease_remaining`` by the Redis clock, or None."""
        reply = self._run("get", self._get, key, ())
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
            text = _text(status)
            if text == "i":
                counts["in_progress"] += 1
            elif text in ("c", "p"):
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
        pattern = self._pattern() + _GLOB_SPECIAL.sub(r"\\\1", suffix)

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
            if isinstance(values, Exception) or _text(values[0]) not in _STATUS:
                continue  # gone meanwhile, or a foreign key under our prefix
            if isinstance(ttl, Exception) or int(ttl) < 0:
                continue  # expired meanwhile (-2), or not a record of this store (-1)
            key = self._key_of(_text(name) or "")
            if key.startswith(key_prefix):
                found.append(self._record(key, [now, *values, str(now + int(ttl))]))
        return found

    def close(self) -> None:
        """Disconnect the connection pool this store opened (a caller's ``client`` is left
        open: its owner closes it). A closed store reconnects if it is used again."""
        if self._owns_client:
            self._client.close()  # from_url: auto_close_connection_pool disconnects the pool
        logger.debug("closed %s", self.describe())

    @property
    def client(self) -> Any:
        """The store's redis client."""
        return self._client

    def describe(self) -> str:
        """``RedisStore <url without password> prefix=<prefix>``."""
        return f"RedisStore {self._url} prefix={self._prefix}"


# Connection parameters that take Python objects (callbacks, classes, retry policies, exception
# lists, socket constants), which a URL's text cannot give: redis-py would take the name and
# fail on the first connection, or misread the text (``retry_on_error`` becomes a list of
# letters).
_NOT_FROM_TEXT = frozenset(
    {
        "retry_on_error",
        "socket_type",
        "command_packer",
        "credential_provider",
        "driver_info",
        "event_dispatcher",
        "himport_registry",
        "maint_notifications_config",
        "maint_notifications_pool_handler",
        "maintenance_notification_hash",
        "maintenance_state",
        "orig_host_address",
        "orig_socket_connect_timeout",
        "orig_socket_timeout",
        "oss_cluster_maint_notifications_handler",
        "parser_class",
        "redis_connect_func",
        "retry",
        "socket_keepalive_options",
        "ssl_ocsp_context",
    }
)

_CONNECTION_CLASSES: dict[str, type[Any]] = {
    "redis": redis.connection.Connection,
    "rediss": redis.connection.SSLConnection,
    "unix": redis.connection.UnixDomainSocketConnection,
}


@functools.cache
def _driver_options(scheme: str) -> frozenset[str]:
    """The query options redis-py's ``from_url`` can hand to the connection of ``scheme``: the named
    parameters of its ``__init__`` and of the bases it passes ``**kwargs`` on to, plus the
    pool's ``max_connections``; the same set that decides whether redis-py raises TypeError."""
    names = {"max_connections"}
    for cls in _CONNECTION_CLASSES[scheme].__mro__:
        if "__init__" not in vars(cls):
            continue
        parameters = inspect.signature(vars(cls)["__init__"]).parameters.values()
        names.update(
            p.name
            for p in parameters
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        )
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return frozenset(names - _NOT_FROM_TEXT)


_PLAIN = _driver_options("redis")


def _split_multi_host(url: str, safe: str) -> tuple[str, list[tuple[str, int]], str, str]:
    """``scheme://[auth@]host:port[,host:port…]/path?query`` as (auth, hosts, path, query);
    ConfigError for a host without a port number or none at all."""
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    query = query.partition("#")[0]
    netloc, slash, path = rest.partition("/")
    auth, at, hostlist = netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"RedisStore url {safe!r}: {item.strip()!r} is not host:port (list the nodes "
                "as host:port,host:port…)"
            )
        hosts.append((host.strip("[]"), int(port)))
    return (auth if at else ""), hosts, slash + path, query


def _url_kwargs(auth: str, db: str, query: str) -> dict[str, Any]:
    """redis-py's connection keywords for a URL's user-info, database and query options,
    typed the way ``Redis.from_url`` types them (without host and port)."""
    text = f"redis://{auth + '@' if auth else ''}localhost/{db}{'?' + query if query else ''}"
    kwargs: dict[str, Any] = redis.connection.parse_url(text)  # type: ignore[no-untyped-call]
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    return kwargs


def _replicas(from_url: str | None, given: int | None) -> int:
    """The ``min_replicas`` option (URL or argument, not two different values), checked."""
    text = own_value(
        "RedisStore", "min_replicas", from_url, None if given is None else str(given), "0"
    )
    if isinstance(given, bool) or not text.isdigit():
        raise ConfigError(
            f"RedisStore min_replicas must be a whole number of replicas (0: off), got {text!r}"
        )
    return int(text)


def _take_own_options(url: str) -> tuple[str, str | None, str | None]:
    """``url`` without its ``prefix`` and ``min_replicas`` query options, and their values;
    ConfigError for a query option that neither taskonce nor redis-py takes. URLs of other
    schemes are returned unchanged (``RedisStore._open`` refuses them)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    head, mark, tail = url.partition("?")
    if scheme in ("redis+cluster", "redis+sentinel"):
        scheme = "redis"  # options of each node's plain connection
    if scheme not in _CONNECTION_CLASSES or not mark:
        return url, None, None
    query, hash_mark, fragment = tail.partition("#")
    safe = _safe_url(url)
    pairs = parse_qsl(query, keep_blank_values=True)
    values = single_values("RedisStore", safe, pairs)
    if scheme == "redis":
        tls = sorted(set(values) & (_driver_options("rediss") - _PLAIN))
        if tls:
            raise ConfigError(
                f"RedisStore url {safe!r}: query option {tls[0]!r} is a TLS option; "
                "TLS needs a rediss:// URL"
            )
    check_names(
        "RedisStore",
        safe,
        values,
        own=("prefix", "min_replicas"),
        driver=f"redis-py ({scheme}://)",
        accepted=_driver_options(scheme),
    )
    prefix = values.pop("prefix", None)
    replicas = values.pop("min_replicas", None)
    rest = f"?{urlencode(list(values.items()))}" if values else ""
    return f"{head}{rest}{hash_mark}{fragment}", prefix, replicas


__all__ = ["NotReplicated", "RedisStore"]
