"""The Redis store's transport: how a script call reaches Redis.

:class:`SharedTrips` lets the threads of one process share round trips (group commit) on one
server or a Sentinel-managed master; :class:`OneTrip` sends every call on its own, for Redis
Cluster. Both answer with a :class:`Call` that holds the script's reply or its error. The
queue of callers that share a round trip is rebuilt in a forked child before any of its threads
runs (``os.register_at_fork``). The registered ``Script`` objects hold only the script text and
its SHA1, so they are fine across a fork.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.exceptions
from redis.commands.core import Script

try:  # the redis extra installs it (redis[hiredis]); redis-py works without it
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - depends on the installation
    _hiredis = None  # type: ignore[assignment]

from taskonce.stores.redis.compat import pool_connection
from taskonce.stores.redis.connecting import unlock_pool
from taskonce.stores.redis.wire import cannot_answer

_PACK_COMMAND: Callable[[tuple[Any, ...]], bytes] | None = getattr(_hiredis, "pack_command", None)


class Command:
    """A plain command the store sends the way it sends its scripts (``SET`` for a new claim
    or mark: cheaper on the server than any script): ``(name, key, *args)`` instead of
    ``EVALSHA``. Shaped like a registered ``Script`` where the transport looks (``sha``) so
    both share one queue; a plain command is never a read (a ``WAIT`` follows it) and is
    never reloaded."""

    __slots__ = ("name", "sha")

    def __init__(self, name: str) -> None:
        self.name = name
        self.sha = ""


def command_of(script: Script | Command, name: str, args: Sequence[Any]) -> tuple[Any, ...]:
    """What goes over the wire for one call."""
    if isinstance(script, Command):
        return (script.name, name, *args)
    return ("EVALSHA", script.sha, 1, name, *args)


class Call:
    """One caller's script (or plain command) and, once its round trip is back, its reply or
    error."""

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

    def __init__(self, script: Script | Command, name: str, args: Sequence[Any]) -> None:
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
        self.batch: list[Call] = []
        self.handed = False  # the sender's duty for ``batch`` is done
        self.successor: Call | None = None  # whom this sender gave the queue to

    def answer(self, reply: Any = None, error: BaseException | None = None) -> None:
        self.reply, self.error, self.answered = reply, error, True


class SharedTrips:
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
        self._queued: list[Call] = []
        self._busy = False
        self._conn: Any = None
        self._pack: Callable[[Any, tuple[Any, ...]], list[bytes]] = _redis_py_pack

    def run(self, script: Script | Command, name: str, args: Sequence[Any]) -> Call:
        """Run ``script`` on key ``name``; the returned call holds its reply or its error."""
        call = Call(script, name, args)
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

    def _send(self, batch: list[Call], loaded: bool = False) -> None:
        waits = self._wait is not None and any(c.script.sha not in self._reads for c in batch)
        if len(batch) == 1 and not waits:
            self._send_one(batch[0])
            return
        if self._own_connection and not waits:
            self._send_own_batch(batch)
            return
        pipe = self._pipeline(batch, waits)
        try:
            replies = pipe.execute(raise_on_error=False)
            acked = replies.pop() if waits else None
            if isinstance(acked, Exception):
                raise acked
        except (redis.exceptions.DataError, UnicodeError):
            # An argument redis-py cannot encode fails the pipeline before anything is sent:
            # send each call alone, so only the bad one fails.
            self._send_apart(batch, waits)
            return
        except Exception as exc:  # the whole round trip failed
            _answer_failed(batch, exc)
            return
        if acked is not None:
            self._answer_replicated(batch, replies, int(acked), loaded)
            return
        self._answer(batch, replies)

    def _pipeline(self, batch: list[Call], waits: bool) -> Any:
        """A round trip's pipeline (no MULTI): every call's command, then the WAIT if the
        round trip ``waits`` for replicas."""
        pipe = self._client.pipeline(transaction=False)
        for call in batch:
            pipe.execute_command(*command_of(call.script, call.name, call.args))  # type: ignore[no-untyped-call]
        if waits:
            assert self._wait is not None
            pipe.wait(*self._wait)
        return pipe

    def _send_apart(self, batch: list[Call], waits: bool) -> None:
        """Send each call of ``batch`` on a round trip of its own, with its WAIT if ``waits``;
        a batch of one needs none, its call is the one whose arguments cannot be encoded."""
        for call in batch:
            if waits and len(batch) > 1:
                self._send([call])
            else:
                self._send_one(call)

    def _answer(self, batch: list[Call], replies: list[Any]) -> None:
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
        self, batch: list[Call], replies: list[Any], acked: int, loaded: bool
    ) -> None:
        """Answer a batch sent with a WAIT: a write that fewer than ``min_replicas`` replicas
        acknowledged is :class:`NotReplicated` (its caller gets StoreUnavailable)."""
        assert self._wait is not None
        wanted, timeout_ms = self._wait
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError) and not loaded:
                assert isinstance(call.script, Script)
                self._client.script_load(call.script.script)  # after a restart or SCRIPT FLUSH
                self._send([call], loaded=True)
            elif isinstance(reply, BaseException):
                call.answer(error=reply)
            elif acked < wanted and call.script.sha not in self._reads:
                call.answer(error=NotReplicated(acked, wanted, timeout_ms))
            else:
                call.answer(reply)

    def _send_one(self, call: Call) -> None:
        if self._own_connection:
            self._send_own(call)
            return
        try:
            try:
                command = command_of(call.script, call.name, call.args)
                reply = self._client.execute_command(*command)  # type: ignore[no-untyped-call]
            except redis.exceptions.NoScriptError:
                assert isinstance(call.script, Script)
                reply = call.script(keys=[call.name], args=list(call.args))
        except Exception as exc:
            call.answer(error=exc)
        else:
            call.answer(reply)

    def _send_own(self, call: Call) -> None:
        """Send one EVALSHA down the connection this line keeps from the pool.

        Only the current sender of this line uses it, so it needs no pool checkout per call:
        redis-py's command path (pool checkout and return, each with a pid check, a lock, a
        poll of the socket and observability counters; the retry wrapper; the response
        callbacks) costs about as much client CPU as the round trip's own system calls
        (measured by ``bench/guard_cpu.py`` at 3e2c109, since removed; docs/performance.md).
        What it keeps: the connection's own retry policy (the store's client retries once
        after a connection error, never after a timeout), the script loaded again after a
        ``NoScriptError``, and a connection that failed in any other way goes back to the pool
        disconnected (a Sentinel pool then finds the current master for the next one). The
        EVALSHA reply has no response callback in redis-py, so the parser's reply is the
        reply."""
        conn = self._conn
        try:
            if conn is None:
                conn = self._conn = pool_connection(self._client.connection_pool)
                self._pack = _fast_packer(conn)
            packed = self._pack(conn, command_of(call.script, call.name, call.args))

            def attempt() -> Any:
                conn.send_packed_command(packed)
                return conn.read_response()

            reply = conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        except redis.exceptions.NoScriptError:
            try:  # Script.__call__ loads it (after a restart or SCRIPT FLUSH)
                assert isinstance(call.script, Script)
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

    def _send_own_batch(self, batch: list[Call]) -> None:
        """Send a shared round trip down the kept connection: every call's EVALSHA in one
        write, then their replies read in order (what redis-py's pipeline does, without its
        command path per call). A call whose arguments cannot be encoded fails alone; the
        round trip is retried as the connection's retry policy says, like a pipeline."""
        conn = self._conn
        sendable: list[Call] = []
        try:
            if conn is None:
                conn = self._conn = pool_connection(self._client.connection_pool)
                self._pack = _fast_packer(conn)
            packed: list[bytes] = []
            for call in batch:
                try:
                    packed += self._pack(conn, command_of(call.script, call.name, call.args))
                except (redis.exceptions.DataError, UnicodeError) as exc:
                    call.answer(error=exc)
                    continue
                sendable.append(call)
            if not sendable:
                return
            replies = _exchange(conn, packed, len(sendable))
        except BaseException as exc:
            self._drop_connection()
            if not isinstance(exc, Exception):
                raise  # an interruption: the sender's handler answers the calls
            _answer_failed(sendable, exc)
            return
        if any(cannot_answer(reply) for reply in replies if isinstance(reply, BaseException)):
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

    def _hand_over(self, sender: Call) -> None:
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

    def _abandon(self, call: Call) -> None:
        """``call``'s thread was interrupted: leave the queue, or finish the sender's duty."""
        with self._lock:
            if call in self._queued:
                self._queued.remove(call)
                return
            leads = call.leads
        if leads:
            self._hand_over(call)


def _exchange(conn: Any, packed: list[bytes], count: int) -> list[Any]:
    """One round trip down ``conn`` as its retry policy says: the packed commands in one write,
    then their ``count`` replies read in order; a call's own error (a ``ResponseError``) is its
    reply."""

    def attempt() -> list[Any]:
        conn.send_packed_command(packed)
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as exc:  # this call's own error
                replies.append(exc)
        return replies

    replies: list[Any] = conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
    return replies


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


class OneTrip:
    """What a cluster client uses instead of :class:`SharedTrips`: every call is its own
    EVALSHA. Sharing a round trip needs one connection that every queued script can go down;
    on a cluster the scripts of one batch belong to different nodes, and redis-py's cluster
    pipeline would split the batch per node and send the parts one node after another, with
    its own retry and redirection handling for a partly failed batch (a MOVED during a
    resharding re-sends commands, which for a claim could make it look taken by itself). The
    cost is the system-call time that sharing saves when several threads of one process call
    at the same moment: about a quarter of the throughput with 8 threads, nothing with one
    (measured by ``bench/cluster_trips.py`` at b2f2075, since removed; docs/performance.md)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def run(self, script: Script | Command, name: str, args: Sequence[Any]) -> Call:
        call = Call(script, name, args)
        try:
            try:
                reply = self._client.execute_command(*command_of(script, name, args))
            except redis.exceptions.NoScriptError:
                assert isinstance(script, Script)
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


def _release(call: Call) -> None:
    if not call.released:
        call.released = True
        call.ready.release()


def _interrupted() -> redis.exceptions.ConnectionError:
    return redis.exceptions.ConnectionError(
        "the thread sending this shared round trip was interrupted; the script may or may not "
        "have run"
    )


def _answer_failed(batch: list[Call], exc: Exception) -> None:
    """Answer every call of a round trip that failed as a whole with ``exc``: the first call
    gets ``exc`` itself and the others :func:`_shared` errors, except that an error saying
    Redis cannot answer goes to every caller as is (each turns it into StoreUnavailable)."""
    for call in batch:
        call.answer(error=exc if call is batch[0] or cannot_answer(exc) else _shared(exc))


def _shared(exc: Exception) -> Exception:
    """A caller's own error for a shared round trip that failed with ``exc`` (one exception
    object must not be raised in several threads)."""
    error = RuntimeError(f"the shared round trip failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


# Every live SharedTrips, emptied in a forked child before any of its threads runs: a queued
# call or a busy flag of the parent's threads must not survive there.
_FORKED: weakref.WeakSet[SharedTrips] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for trips in list(_FORKED):
        trips._reset()
        unlock_pool(trips._client)


os.register_at_fork(after_in_child=_reset_after_fork)


__all__ = ["Call", "Command", "NotReplicated", "OneTrip", "SharedTrips", "command_of"]
