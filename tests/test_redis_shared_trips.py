"""RedisStore shares round trips between threads: each caller still gets its own answer.

Threads that call the store while a round trip is in flight are sent together as one
pipeline (``taskonce.stores.redis.trips.SharedTrips``). These tests force such a shared round trip
deterministically — the first caller's send is held until the others have queued behind it —
and check that replies, errors, a Redis that went away, a flushed script cache and a fork all
reach the right caller. All against a real Redis server.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import taskonce
from taskonce import LeaseLost, StoreUnavailable
from taskonce.stores import ClaimOutcome
from taskonce.stores.redis import RedisStore
from tests.helpers import REDIS_URL, RedisServer, drop_store, require_service, wait_for


@pytest.fixture
def store() -> Iterator[RedisStore]:
    require_service("redis")
    store = taskonce.open_store(REDIS_URL, prefix=f"shared{random.getrandbits(40):x}")
    assert isinstance(store, RedisStore)
    try:
        yield store
    finally:
        drop_store(store)


class Sends:
    """Records the size of every round trip; can hold the first one until ``followers``
    callers have queued behind it, then run ``meanwhile`` before letting it go."""

    def __init__(
        self,
        store: RedisStore,
        followers: int = 0,
        meanwhile: Callable[[], object] | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        self.trips = store._trips
        self.sizes: list[int] = []
        self.held = threading.Event()
        self._first = True
        self._followers = followers
        self._meanwhile = meanwhile
        self._hold = hold
        self._send = self.trips._send
        self.trips._send = self.send  # type: ignore[method-assign]

    def send(self, batch: list[Any]) -> None:
        self.sizes.append(len(batch))
        if self._first:
            self._first = False
            self.held.set()
            if self._followers:
                wait_for(
                    lambda: len(self.trips._queued) >= self._followers,
                    what=f"{self._followers} callers queued behind the first",
                )
            if self._hold is not None:
                assert self._hold.wait(20), "the held send was never let go"
            if self._meanwhile is not None:
                self._meanwhile()
        self._send(batch)


def start(fn: Callable[[], Any], results: dict[Any, Any], slot: Any) -> threading.Thread:
    """Run ``fn`` in a daemon thread; ``results[slot]`` gets its value or its exception."""

    def run() -> None:
        try:
            results[slot] = fn()
        except BaseException as exc:  # the test inspects it
            results[slot] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def in_threads(
    store: RedisStore, calls: list[Callable[[], Any]], first: Callable[[], Any]
) -> list[Any]:
    """Run ``first`` in a thread, then each of ``calls`` in its own thread once the first is
    sending; returns every call's result or exception, ``first``'s last."""
    results: dict[int, Any] = {}
    threads = [start(first, results, len(calls))]
    wait_for(lambda: store._trips._busy, what="the first call sending")
    threads += [start(fn, results, i) for i, fn in enumerate(calls)]
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "a caller never got its answer"
    return [results[i] for i in range(len(calls) + 1)]


def test_racing_threads_share_round_trips_and_every_key_is_claimed_once(
    store: RedisStore,
) -> None:
    keys = [f"k{i}" for i in range(150)]
    sends = Sends(store, followers=3)
    outcomes: dict[str, list[ClaimOutcome]] = {key: [] for key in keys}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        order = list(keys)
        random.Random(seed).shuffle(order)
        for key in order:
            outcome = store.claim(key, f"owner-{seed}", 300, 600, None).outcome
            with lock:
                outcomes[key].append(outcome)

    threads = [threading.Thread(target=worker, args=(seed,), daemon=True) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    for key, seen in outcomes.items():
        assert sorted(o.value for o in seen) == sorted(
            [ClaimOutcome.CLAIMED.value] + [ClaimOutcome.EXISTS.value] * 7
        ), key
    # Each key: the winner's plain SET, and each of the 7 others' SET then ``claim`` script.
    assert sum(sends.sizes) == (1 + 7 * 2) * len(keys)
    assert max(sends.sizes) >= 3, f"no round trip was shared: {sends.sizes[:20]}"
    assert len(sends.sizes) < (1 + 7 * 2) * len(keys)


def test_a_shared_round_trip_hands_each_caller_its_own_reply_or_error(store: RedisStore) -> None:
    store.claim("held", "me", 300, 600, "fp-1")
    store._client.hset(store._key("not-a-hash"), "x", "1")  # a foreign key under the prefix
    sends = Sends(store, followers=4)
    results = in_threads(
        store,
        [
            lambda: store.claim("fresh", "me", 300, 600, None).outcome,
            lambda: store.complete("held", "someone-else", 600, None),  # fenced: refused
            lambda: store.get("held"),
            lambda: store.claim("not-a-hash", "me", 300, 600, None),  # WRONGTYPE in Lua
        ],
        first=lambda: store.claim("first", "me", 300, 600, None).outcome,
    )
    assert sends.sizes[:2] == [1, 4], sends.sizes  # the held first call, then the rest shared
    fresh, fenced, got, wrong, first = results
    assert first is ClaimOutcome.CLAIMED and fresh is ClaimOutcome.CLAIMED
    assert isinstance(fenced, LeaseLost) and "held" in str(fenced)
    assert got is not None and got.owner == "me" and got.fingerprint == "fp-1"
    assert isinstance(wrong, redis.exceptions.ResponseError) and "WRONGTYPE" in str(wrong)
    # The refused complete changed nothing: the claim is still "me"'s and can complete.
    store.complete("held", "me", 600, '"ok"')
    record = store.get("held")
    assert record is not None and record.result == '"ok"'


def test_redis_gone_during_a_shared_round_trip_is_store_unavailable_for_each_caller() -> None:
    server = RedisServer().start()
    try:
        store = taskonce.open_store(server.url, socket_timeout=1.0)
        assert isinstance(store, RedisStore)
        store.claim("warm", "me", 300, 600, None)  # the pool holds an open connection
        Sends(store, followers=3, meanwhile=server.stop)
        results = in_threads(
            store,
            [lambda k=k: store.claim(k, "me", 300, 600, None) for k in ("a", "b", "c")],
            first=lambda: store.claim("first", "me", 300, 600, None),
        )
        assert all(isinstance(r, StoreUnavailable) for r in results), results
        assert len({id(r) for r in results}) == len(results), "one exception shared by callers"
        for key, exc in zip(("a", "b", "c", "first"), results, strict=True):
            assert f"did not answer claim of key {key!r}" in str(exc)
        # Nothing was lost: with Redis back, every key can still be claimed.
        server.start()
        for key in ("a", "b", "c", "first"):
            assert store.claim(key, "me", 300, 600, None).outcome is ClaimOutcome.CLAIMED
        store.close()
    finally:
        server.stop()


def test_a_flushed_script_cache_inside_a_shared_round_trip_is_reloaded(store: RedisStore) -> None:
    store.claim("done", "me", 300, 600, None)
    store.complete("done", "me", 600, None)
    # The first caller (a claim) reloads its own script; the queued gets then find theirs gone.
    Sends(store, followers=3, meanwhile=lambda: store._client.script_flush())
    results = in_threads(
        store,
        [lambda: store.get("done"), lambda: store.get("absent"), lambda: store.get("done")],
        first=lambda: store.claim("first", "me", 300, 600, None).outcome,
    )
    done1, absent, done2, first = results
    assert first is ClaimOutcome.CLAIMED
    assert absent is None
    for record in (done1, done2):
        assert record is not None and record.status is taskonce.Status.COMPLETED


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_wait_for_its_parents_round_trip(store: RedisStore) -> None:
    let_go = threading.Event()
    sends = Sends(store, hold=let_go)
    lead = threading.Thread(target=lambda: store.claim("parent", "me", 300, 600, None), daemon=True)
    lead.start()
    assert sends.held.wait(10)  # the parent's round trip is in flight: the queue is busy
    pid = os.fork()
    if pid == 0:  # the child: its own queue, its own connection
        code = 1
        try:
            if store.claim("child", "kid", 300, 600, None).outcome is ClaimOutcome.CLAIMED:
                code = 0
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "the child waited on its parent's round trip"
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if not done:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        let_go.set()
        lead.join(10)
    record = store.get("child")
    assert record is not None and record.owner == "kid"
    assert store.get("parent") is not None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("lock", ["_lock", "_fork_lock"])
def test_a_forked_child_is_not_stuck_on_a_pool_lock_its_parent_held(
    store: RedisStore, lock: str
) -> None:
    """A parent's thread (the liveness writer, say) holds redis-py's pool lock at the fork: the
    child's copy of that lock would never be released."""
    store.get("warm")  # the pool has been used: the child must reset it
    held, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with getattr(store._client.connection_pool, lock):
            held.set()
            let_go.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if store.claim("child", "kid", 300, 600, None).outcome is ClaimOutcome.CLAIMED:
                code = 0
        finally:
            os._exit(code)
    done = False
    try:
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, f"the child is stuck on the pool's {lock}"
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        if not done:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        let_go.set()
        holder.join(10)


class Interrupted(BaseException):
    """What Dramatiq's TimeLimit and Shutdown throw into a worker thread (BaseException)."""


def throw_into(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in ``thread`` as Dramatiq's TimeLimit does (it fires once the thread
    runs Python code again)."""
    assert thread.ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type)
    )
    assert done == 1


def claim_in_thread(store: RedisStore, key: str, results: dict[str, Any]) -> threading.Thread:
    return start(lambda: store.claim(key, "me", 300, 600, None).outcome, results, key)


def test_the_next_sender_interrupted_answers_its_batch_and_nothing_waits_forever(
    store: RedisStore,
) -> None:
    let_go = threading.Event()
    Sends(store, followers=2, hold=let_go)
    results: dict[str, Any] = {}
    first = claim_in_thread(store, "first", results)
    wait_for(lambda: store._trips._busy, what="the first call sending")
    next_sender = claim_in_thread(store, "next", results)
    wait_for(lambda: len(store._trips._queued) == 1, what="one call queued")
    other = claim_in_thread(store, "other", results)
    wait_for(lambda: len(store._trips._queued) == 2, what="two calls queued")
    throw_into(next_sender, Interrupted)  # fires when it wakes up to send the queue
    let_go.set()
    for thread in (first, next_sender, other):
        thread.join(20)
        assert not thread.is_alive(), "a caller waits for a thread that was interrupted"
    assert results["first"] is ClaimOutcome.CLAIMED
    assert isinstance(results["next"], Interrupted)
    assert isinstance(results["other"], StoreUnavailable)
    assert "interrupted" in str(results["other"])
    # The line is free again: a new call is sent at once, and "other" (never sent) is free.
    assert not store._trips._busy and not store._trips._queued
    assert store.claim("other", "me", 300, 600, None).outcome is ClaimOutcome.CLAIMED


def test_a_sender_interrupted_mid_send_keeps_its_interruption_to_itself(
    store: RedisStore,
) -> None:
    sends = Sends(store)
    send = sends._send

    def interrupted_send(batch: list[Any]) -> None:
        if len(batch) > 1:
            raise Interrupted  # a time limit hits the thread that sends the shared trip
        send(batch)

    sends._send = interrupted_send  # the held first call, then the shared trip is interrupted
    let_go = threading.Event()
    sends._hold = let_go
    results: dict[str, Any] = {}
    threads = [claim_in_thread(store, "first", results)]
    wait_for(lambda: store._trips._busy, what="the first call sending")
    for key in ("a", "b", "c"):
        threads.append(claim_in_thread(store, key, results))
        wait_for(lambda k=key: k in [c.name.rsplit(":", 1)[1] for c in store._trips._queued])
    let_go.set()
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive()
    assert results["first"] is ClaimOutcome.CLAIMED
    assert isinstance(results["a"], Interrupted)  # the sender of the shared trip
    for key in ("b", "c"):
        assert isinstance(results[key], StoreUnavailable), results[key]
    assert not store._trips._busy
    assert store.claim("b", "me", 300, 600, None).outcome is ClaimOutcome.CLAIMED


def test_a_queued_caller_interrupted_by_a_signal_leaves_the_queue(store: RedisStore) -> None:
    let_go = threading.Event()
    Sends(store, hold=let_go)
    results: dict[str, Any] = {}
    first = claim_in_thread(store, "first", results)
    wait_for(lambda: store._trips._busy, what="the first call sending")

    def on_alarm(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            store.claim("main", "me", 300, 600, None)  # queued in the main thread, then a signal
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert store._trips._queued == []
    let_go.set()
    first.join(20)
    assert results["first"] is ClaimOutcome.CLAIMED
    assert store.get("main") is None  # never sent
    assert store.claim("main", "me", 300, 600, None).outcome is ClaimOutcome.CLAIMED


def test_an_argument_redis_cannot_encode_fails_only_its_own_call(store: RedisStore) -> None:
    Sends(store, followers=3)
    results = in_threads(
        store,
        [
            lambda: store.claim("fine-1", "me", 300, 600, None).outcome,
            lambda: store.claim("bad-\ud800", "me", 300, 600, None),  # not encodable as UTF-8
            lambda: store.claim("fine-2", "me", 300, 600, None).outcome,
        ],
        first=lambda: store.claim("first", "me", 300, 600, None).outcome,
    )
    fine1, bad, fine2, first = results
    assert fine1 is fine2 is first is ClaimOutcome.CLAIMED
    assert isinstance(bad, UnicodeError)
