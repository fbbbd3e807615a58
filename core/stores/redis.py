"""RedisStore: claims and marks in Redis, one Lua script (one round trip) per operation.

Each record is one Redis hash at ``f"{prefix}:{key}"`` with the fields

=========  ==================================================================================
``st``     status: ``"i"`` (in progress, a claim) or ``"c"`` (completed, a mark)
``ow``     owner token of a claim (absent on marks)
``fp``     payload fingerprint (absent when None)
``rs``     the handler's JSON result (absent when None)
``ca``     created at, milliseconds since the epoch by the Redis clock
``lu``     lease until, ms (claims only)
``ex``     expires at, ms; the key carries the same instant as its Redis expiry (``PEXPIREAT``)
=========  ==================================================================================

Every decision is taken inside a Lua script that reads the clock with ``redis.call('TIME')``,
so leases and retention are judged by the Redis server's clock, never by a worker's. Every
script touches exactly the one key it is given in ``KEYS``, so the store works unchanged on
Redis Cluster (each key hashes to its own slot) and with replicas (effects replication).
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

import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl, urlencode

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from taskonce.errors import ConfigError, LeaseLost, StoreUnavailable
from taskonce.stores import redact
from taskonce.stores.base import Claim, ClaimOutcome, Record, Status, Store

logger = logging.getLogger(__name__)

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

# Shared prologue of every script: Redis < 5 needs effects replication switched on before a
# script may write after the non-deterministic TIME; later versions always do it (no-op).
# ``now`` is the Redis server's clock in milliseconds.
_PROLOGUE = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function ms(x) return string.format('%.0f', x) end
"""

# KEYS[1] record; ARGV owner, lease_ms, keep_ms, has_fp ("1"/"0"), fp.
# Reply: 1 claimed, 2 taken over, or {now, st, ow, fp, rs, ca, lu, ex} for "exists".
_CLAIM = (
    _PROLOGUE
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'ex')
local outcome = 1
local created = now
if h[1] then
  if tonumber(h[7]) > now then
    local expired_claim = h[1] == 'i' and tonumber(h[6]) <= now
    local same_payload = (not h[3]) or ARGV[4] ~= '1' or h[3] == ARGV[5]
    if not (expired_claim and same_payload) then
      return {now, h[1], h[2], h[3], h[4], h[5], h[6], h[7]}
    end
    outcome = 2
    created = tonumber(h[5])
  end
  redis.call('DEL', KEYS[1])
end
local lease_until = now + tonumber(ARGV[2])
local expires = lease_until + tonumber(ARGV[3])
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'st', 'i', 'ow', ARGV[1], 'ca', ms(created),
             'lu', ms(lease_until), 'ex', ms(expires), 'fp', ARGV[5])
else
  redis.call('HSET', KEYS[1], 'st', 'i', 'ow', ARGV[1], 'ca', ms(created),
             'lu', ms(lease_until), 'ex', ms(expires))
end
redis.call('PEXPIREAT', KEYS[1], ms(expires))
return outcome
"""
)

# Fencing shared by complete, release and renew: the live record must be a claim of ARGV[1].
# (Like the memory store, a claim whose lease ran out but was not taken over is still owned.)
_OWNED = """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu', 'ex')
if not h[1] or tonumber(h[4]) <= now or h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
"""

# KEYS[1] record; ARGV owner, keep_ms, has_result ("1"/"0"), result. Reply 1 done, 0 not owner.
_COMPLETE = (
    _PROLOGUE
    + _OWNED
    + """
local expires = now + tonumber(ARGV[2])
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], 'ow', 'lu')
  redis.call('HSET', KEYS[1], 'st', 'c', 'ex', ms(expires), 'rs', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'ow', 'lu', 'rs')
  redis.call('HSET', KEYS[1], 'st', 'c', 'ex', ms(expires))
end
redis.call('PEXPIREAT', KEYS[1], ms(expires))
return 1
"""
)

# KEYS[1] record; ARGV owner. Reply 1 deleted, 0 not owner.
_RELEASE = (
    _PROLOGUE
    + _OWNED
    + """
redis.call('DEL', KEYS[1])
return 1
"""
)

# KEYS[1] record; ARGV owner, lease_ms. The expiry moves by as much as the lease end moves
# forward, so a renewed claim still outlives its lease by keep_for. Reply 1 renewed, 0 not owner.
_RENEW = (
    _PROLOGUE
    + _OWNED
    + """
local lease_until = now + tonumber(ARGV[2])
local expires = tonumber(h[4]) + math.max(0, lease_until - tonumber(h[3]))
redis.call('HSET', KEYS[1], 'lu', ms(lease_until), 'ex', ms(expires))
redis.call('PEXPIREAT', KEYS[1], ms(expires))
return 1
"""
)

# KEYS[1] record; ARGV keep_ms, has_fp, fp, has_result, result. Reply 1 written, 0 a live
# record exists (nothing changed).
_MARK = (
    _PROLOGUE
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'ex')
if h[1] and tonumber(h[2]) > now then return 0 end
local expires = now + tonumber(ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'st', 'c', 'ca', ms(now), 'ex', ms(expires))
if ARGV[2] == '1' then redis.call('HSET', KEYS[1], 'fp', ARGV[3]) end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'rs', ARGV[5]) end
redis.call('PEXPIREAT', KEYS[1], ms(expires))
return 1
"""
)

# KEYS[1] record. Reply: nil when absent or expired, else {now, st, ow, fp, rs, ca, lu, ex}.
_GET = (
    _PROLOGUE
    + """
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'ex')
if not h[1] or tonumber(h[7]) <= now then return false end
return {now, h[1], h[2], h[3], h[4], h[5], h[6], h[7]}
"""
)


def _cannot_answer(exc: BaseException) -> bool:
    """Whether ``exc`` means "Redis cannot answer right now" (a script that runs too long
    elsewhere blocks the server: ``BUSY Redis is busy …``)."""
    return isinstance(exc, _UNAVAILABLE) or (
        isinstance(exc, redis.exceptions.ResponseError)
        and str(exc).startswith(("BUSY", "LOADING", "MASTERDOWN"))
    )


_STATUS = {"i": Status.IN_PROGRESS, "c": Status.COMPLETED}
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

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._reset()
        _FORKED.add(self)

    def _reset(self) -> None:
        # After a fork the parent's threads do not exist in the child: no queue, no sender.
        self._lock = threading.Lock()
        self._queued: list[_Call] = []
        self._busy = False

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

    def _send(self, batch: list[_Call]) -> None:
        if len(batch) == 1:
            self._send_one(batch[0])
            return
        pipe = self._client.pipeline(transaction=False)
        for call in batch:
            pipe.evalsha(call.script.sha, 1, call.name, *call.args)
        try:
            replies = pipe.execute(raise_on_error=False)
        except (redis.exceptions.DataError, UnicodeError):
            # An argument redis-py cannot encode fails the pipeline before anything is sent:
            # send each call alone, so only the bad one fails.
            for call in batch:
                self._send_one(call)
            return
        except Exception as exc:  # the whole round trip failed
            for call in batch:
                call.answer(error=exc if call is batch[0] or _cannot_answer(exc) else _shared(exc))
            return
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                self._send_one(call)  # loads the script (after a restart or SCRIPT FLUSH)
            elif isinstance(reply, BaseException):
                call.answer(error=reply)
            else:
                call.answer(reply)

    def _send_one(self, call: _Call) -> None:
        try:
            try:
                reply = self._client.evalsha(call.script.sha, 1, call.name, *call.args)
            except redis.exceptions.NoScriptError:
                reply = call.script(keys=[call.name], args=list(call.args))
        except Exception as exc:
            call.answer(error=exc)
        else:
            call.answer(reply)

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

    def _abandon(self, call: _Call) -> None:
        """``call``'s thread was interrupted: leave the queue, or finish the sender's duty."""
        with self._lock:
            if call in self._queued:
                self._queued.remove(call)
                return
            leads = call.leads
        if leads:
            self._hand_over(call)


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


os.register_at_fork(after_in_child=_reset_after_fork)


class RedisStore(Store):
    """Claims and marks in Redis: standalone, or through ``client`` a Sentinel-managed primary.
    Every script touches only the one key it is given, so the key layout is cluster-safe.

    :param url: ``redis://[[user]:password@]host:port/db``, ``rediss://…`` (TLS) or
        ``unix:///path/to/redis.sock?db=0``; query-string options go to redis-py
        (:meth:`redis.Redis.from_url`). Ignored when ``client`` is given.
    :param prefix: namespace of this store's keys: a record lives at ``f"{prefix}:{key}"``.
        Non-empty, without whitespace. Default ``"taskonce"``.
    :param client: an existing :class:`redis.Redis` to use instead of opening one from ``url``
        (its own timeouts and retry policy apply; :meth:`close` leaves it open).
    :param socket_timeout: seconds to wait for a connection or a reply before the operation
        fails with :class:`~taskonce.errors.StoreUnavailable`. Default 5. A call queued behind
        another thread's round trip waits for that one first, so it can take up to about
        twice as long to fail.

    The client this store opens retries a command once, at once, after a connection error (a
    pooled connection that a Redis restart closed) but never after a timeout: a command that
    timed out may have run, and running a claim twice would make it look taken.
    """

    schemes = ("redis", "rediss", "unix")

    def __init__(
        self,
        url: str = _DEFAULT_URL,
        *,
        prefix: str = "taskonce",
        client: redis.Redis | None = None,
        socket_timeout: float = 5.0,
    ) -> None:
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
        self._trips = _SharedTrips(self._client)
        logger.debug("opened %s", self.describe())

    def _open(self, url: str, socket_timeout: float) -> redis.Redis:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(
                f"RedisStore url {self._url!r} is not a redis://, rediss:// or unix:// URL"
            )
        scheme = url.split("://", 1)[0].lower()
        if scheme not in self.schemes:
            raise ConfigError(
                f"RedisStore url {self._url!r} has scheme {scheme!r}; expected one of "
                f"{', '.join(s + '://' for s in self.schemes)}"
            )
        try:
            return redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
        except (ValueError, TypeError) as exc:
            # redis-py's messages can quote the URL's query string; name only the redacted URL.
            raise ConfigError(
                f"RedisStore url {self._url!r} is invalid ({type(exc).__name__})"
            ) from None

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

    def _key(self, key: str) -> str:
        return f"{self._prefix}:{key}"

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
        """A Record from the scripts' ``{now, st, ow, fp, rs, ca, lu, ex}`` reply."""
        now = int(reply[0])
        status = _STATUS[_text(reply[1]) or ""]
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
        )

    # -- the Store contract ----------------------------------------------------------------------

    def claim(
        self, key: str, owner: str, lease: float, keep_for: float, fingerprint: str | None
    ) -> Claim:
        """Atomically take ``key`` for ``owner`` (see :meth:`Store.claim`).

        One EVALSHA; a fresh claim or a takeover answers with a single integer, only "exists"
        carries the record found.
        """
        args = (owner, _ms(lease), _ms(keep_for), *_optional(fingerprint))
        reply = self._run("claim", self._claim, key, args)
        if isinstance(reply, list):
            return Claim(ClaimOutcome.EXISTS, self._record(key, reply))
        return Claim(ClaimOutcome.CLAIMED if int(reply) == 1 else ClaimOutcome.TAKEN_OVER)

    def complete(self, key: str, owner: str, keep_for: float, result: str | None) -> None:
        """Turn ``owner``'s claim into a mark kept ``keep_for`` seconds; :class:`LeaseLost` if
        the claim is no longer ``owner``'s."""
        args = (owner, _ms(keep_for), *_optional(result))
        if not int(self._run("complete", self._complete, key, args)):
            raise LeaseLost(key, "complete")

    def release(self, key: str, owner: str | None) -> None:
        """Delete ``owner``'s claim (fenced), or with ``owner=None`` whatever is recorded."""
        if owner is None:
            self._call("release", key, lambda: self._client.delete(self._key(key)))
            return
        if not int(self._run("release", self._release, key, (owner,))):
            raise LeaseLost(key, "release")

    def renew(self, key: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s lease to ``lease`` seconds from now by the Redis clock, pushing the
        key's expiry out by as much; :class:`LeaseLost` if the claim is no longer ``owner``'s."""
        if not int(self._run("renew", self._renew, key, (owner, _ms(lease)))):
            raise LeaseLost(key, "renew")

    def mark(self, key: str, keep_for: float, fingerprint: str | None, result: str | None) -> bool:
        """Record ``key`` as handled for ``keep_for`` seconds; False when a live record exists."""
        args = (_ms(keep_for), *_optional(fingerprint), *_optional(result))
        return bool(int(self._run("mark", self._mark, key, args)))

    def get(self, key: str) -> Record | None:
        """The live record of ``key`` with ``lease_remaining`` by the Redis clock, or None."""
        reply = self._run("get", self._get, key, ())
        return None if reply is None else self._record(key, reply)

    def purge(self, batch: int = 1000) -> int:
        """Always 0: every record carries a Redis expiry (``PEXPIREAT`` at its ``expires_at``),
        so Redis deletes expired records itself, and every script also treats a record whose
        ``expires_at`` has passed as absent. There is never anything left for a purge."""
        return 0

    def stats(self) -> Mapping[str, int]:
        """Counts of this prefix's records, by ``SCAN MATCH prefix:*`` (several round trips;
        for the CLI and monitoring, not hot paths). ``expired`` is always 0: Redis drops
        expired keys itself. On a cluster client only the nodes redis-py scans are counted."""
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self._prefix) + ":*"

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
            }

        return self._call("stats", None, count)

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
            elif text == "c":
                counts["completed"] += 1

    def close(self) -> None:
        """Disconnect the connection pool this store opened (a caller's ``client`` is left
        open: its owner closes it). A closed store reconnects if it is used again."""
        if self._owns_client:
            self._client.close()  # from_url: auto_close_connection_pool disconnects the pool
        logger.debug("closed %s", self.describe())

    def describe(self) -> str:
        """``RedisStore <url without password> prefix=<prefix>``."""
        return f"RedisStore {self._url} prefix={self._prefix}"


__all__ = ["RedisStore"]
