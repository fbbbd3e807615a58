"""Recovery from a dead claim owner, decided by the guard (in-process store, fake store clock):
worker identities, a dead or reused pid on this host, liveness records of other hosts.

Real worker processes killed mid-task are in tests/celery/test_recovery.py and
tests/dramatiq/test_recovery.py; the store operations are in tests/test_store_contract.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from taskonce import ConfigError, Decision, Delivery, Guard, Policy
from taskonce.errors import InProgressElsewhere, LeaseLost
from taskonce.guard import FIRST_RECHECK
from taskonce.keys import make_key
from taskonce.stores import ClaimOutcome, MemoryStore
from taskonce.worker import (
    ENV_VAR,
    LIVENESS_WINDOW,
    SILENCE_STREAK,
    Identity,
    identity,
    owner_gone,
    process_start,
)
from tests.test_guard import Clock, Counter, Sink

KEY = make_key("m1", "q", "id+queue")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process on this host that is not the test process."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def setup_guard(clock: Clock, sink: Sink) -> tuple[Guard, MemoryStore]:
    store = MemoryStore(clock=clock)
    return Guard(store, default=Policy(lease=300), events=[sink]), store


def foreign_claim(store: MemoryStore, worker: Identity | str, beat: bool = True) -> None:
    """A claim of ``KEY`` by another process ``worker`` that wrote its liveness record."""
    if beat:
        store.beat(str(worker), LIVENESS_WINDOW)
    claim = store.claim(KEY, "their-token", 300, 3600, None, str(worker))
    assert claim.outcome is ClaimOutcome.CLAIMED


def test_identity_names_host_namespace_pid_and_start_time() -> None:
    me = identity()
    assert me.pid == os.getpid()
    assert me.start == process_start(os.getpid())
    assert Identity.parse(str(me)) == me
    assert Identity.parse("an-old-owner-token") is None
    assert Identity.parse(None) is None
    assert owner_gone(me) is False


def test_identity_is_recomputed_in_a_forked_child() -> None:
    parent = str(identity())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its identity and leave without running pytest's teardown
        os.write(write, str(identity()).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 1000).decode()
    os.close(read)
    assert child != parent
    assert Identity.parse(child) == Identity(
        identity().host, identity().ns, pid, child.split("/")[3]
    )


def test_owner_tokens_differ_between_a_parent_and_its_forked_child() -> None:
    """A claim's owner token fences its writes: a forked child must never make one its parent
    made (the tokens' random half is drawn again in the child)."""
    store = MemoryStore()
    guard = Guard(store)
    made = [guard.begin(Delivery(f"p{i}", "q")).owner for i in range(3)]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its tokens and leave without running pytest's teardown
        tokens = [guard.begin(Delivery(f"c{i}", "q")).owner or "" for i in range(3)]
        os.write(write, ",".join(tokens).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 10_000).decode().split(",")
    os.close(read)
    made += [guard.begin(Delivery(f"p{i}", "q2")).owner for i in range(3)]
    assert all(isinstance(t, str) and len(t) == 32 for t in made + child)
    assert len(set(made + child)) == len(made) + len(child)
    assert {t[:16] for t in child}.isdisjoint({t[:16] for t in made if t})


def test_worker_id_from_the_environment_replaces_the_host_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "pod-7")
    monkeypatch.setattr("taskonce.worker._cached", None)
    assert identity().host == "pod-7"
    for bad in ("", "a/b", "has space", "x" * 101):
        monkeypatch.setenv(ENV_VAR, bad)
        monkeypatch.setattr("taskonce.worker._cached", None)
        with pytest.raises(ConfigError, match="TASKONCE_WORKER_ID=.* is not valid"):
            Guard(MemoryStore())


def test_dead_owner_on_this_host_is_taken_over_at_once(clock: Clock, sink: Sink) -> None:
    guard, store = setup_guard(clock, sink)
    me = identity()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    foreign_claim(store, Identity(me.host, me.ns, dead.pid, "12345"))
    clock.now += 2  # its last liveness write was 2 s ago; the lease has 298 s left
    handler = Counter()
    assert guard.run("m1", "q", handler, 1).status == "ran"
    assert handler.calls == [(1,)]
    taken = [e for e in sink.events if e["event"] == "lease_taken_over"]
    assert len(taken) == 1
    assert taken[0]["reason"] == "owner_dead"
    assert taken[0]["recovery_s"] == pytest.approx(2.0)
    with pytest.raises(LeaseLost):  # the dead owner's token is fenced out
        store.complete(KEY, "their-token", 3600, None)


def test_reused_pid_with_another_start_time_is_not_the_owner(
    clock: Clock, sink: Sink, sleeper: subprocess.Popen[bytes]
) -> None:
    """A live process holds the dead owner's pid, but it started at another time."""
    guard, store = setup_guard(clock, sink)
    me = identity()
    start = process_start(sleeper.pid)
    assert start is not None
    foreign_claim(store, Identity(me.host, me.ns, sleeper.pid, str(int(start) - 1)))
    assert guard.run("m1", "q", Counter()).status == "ran"
    assert [e["reason"] for e in sink.events if e["event"] == "lease_taken_over"] == ["owner_dead"]


def test_live_owner_with_the_right_start_time_keeps_its_claim(
    clock: Clock, sink: Sink, sleeper: subprocess.Popen[bytes]
) -> None:
    guard, store = setup_guard(clock, sink)
    me = identity()
    start = process_start(sleeper.pid)
    assert start is not None
    foreign_claim(store, Identity(me.host, me.ns, sleeper.pid, start))
    clock.now += 8
    with pytest.raises(InProgressElsewhere) as info:
        guard.run("m1", "q", Counter())
    # back just after its liveness would lapse, not after the 292 s left on the lease
    assert info.value.retry_after == pytest.approx(LIVENESS_WINDOW - 8 + 0.5)
    assert "lease_taken_over" not in sink.names()


def test_same_pid_namespace_is_required_to_judge_a_pid(clock: Clock, sink: Sink) -> None:
    """A host name shared by containers with separate pid namespaces: the pid means nothing
    here, so only the (fresh) liveness record counts."""
    guard, store = setup_guard(clock, sink)
    me = identity()
    foreign_claim(store, Identity(me.host, "4026500000", 999_999, "1"))
    with pytest.raises(InProgressElsewhere):
        guard.run("m1", "q", Counter())


def test_other_hosts_owner_is_taken_over_once_its_liveness_lapses(
    clock: Clock, sink: Sink, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard, store = setup_guard(clock, sink)
    foreign_claim(store, "other-host/4026531836/42/777")
    with pytest.raises(InProgressElsewhere) as info:
        guard.run("m1", "q", Counter())
    assert info.value.retry_after == pytest.approx(FIRST_RECHECK)  # the claim has just begun
    clock.now += 8
    with pytest.raises(InProgressElsewhere) as info:
        guard.run("m1", "q", Counter())
    assert info.value.retry_after == pytest.approx(LIVENESS_WINDOW - 8 + 0.5)
    clock.now += LIVENESS_WINDOW - 8 + 1  # by the store's clock the owner has been silent
    # this process has itself written without a gap long enough: the silence means death
    monkeypatch.setattr(guard._liveness, "_healthy_since", -1e9)
    store.beat(str(identity()), LIVENESS_WINDOW)
    assert guard.run("m1", "q", Counter()).status == "ran"
    taken = [e for e in sink.events if e["event"] == "lease_taken_over"]
    assert [e["reason"] for e in taken] == ["owner_silent"]
    assert taken[0]["recovery_s"] == pytest.approx(LIVENESS_WINDOW + 1)


def test_silence_is_not_judged_while_this_process_could_not_write_either(
    clock: Clock, sink: Sink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a store outage every owner looks silent: a process that has not itself written
    its record for a whole window since the outage defers instead of taking over."""
    guard, store = setup_guard(clock, sink)
    foreign_claim(store, "other-host/4026531836/42/777")
    clock.now += LIVENESS_WINDOW + 1
    guard._liveness.ensure()  # it wrote its record once…
    monkeypatch.setattr(guard._liveness, "_healthy_since", None)  # …then a write failed
    with pytest.raises(InProgressElsewhere) as info:
        guard.run("m1", "q", Counter())
    assert info.value.retry_after == pytest.approx(SILENCE_STREAK + 0.5)
    assert "lease_taken_over" not in sink.names()


def test_claim_without_a_worker_identity_waits_for_its_lease(clock: Clock, sink: Sink) -> None:
    """A claim written without an identity (an older version) is judged by its lease only."""
    guard, store = setup_guard(clock, sink)
    store.claim(KEY, "old-token", 300, 3600, None)
    clock.now += 200
    with pytest.raises(InProgressElsewhere) as info:
        guard.run("m1", "q", Counter())
    assert info.value.retry_after == pytest.approx(100)


def test_a_dead_owner_is_taken_over_even_with_on_in_progress_skip(clock: Clock, sink: Sink) -> None:
    """``skip`` acknowledges duplicates of a running message; a dead owner's message is not
    running, so it runs instead of being dropped."""
    store = MemoryStore(clock=clock)
    guard = Guard(store, default=Policy(on_in_progress="skip"), events=[sink])
    me = identity()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    foreign_claim(store, Identity(me.host, me.ns, dead.pid, "1"))
    assert guard.run("m1", "q", Counter()).status == "ran"


def test_the_takeover_race_has_one_winner(clock: Clock, sink: Sink) -> None:
    """Two deliveries judge the same dead owner: the fenced takeover lets one win; the other
    sees the winner's live claim and defers."""
    guard, store = setup_guard(clock, sink)
    me = identity()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    foreign_claim(store, Identity(me.host, me.ns, dead.pid, "1"))
    first = guard.begin(Delivery("m1", "q"))
    assert first.decision is Decision.RUN
    second = guard.begin(Delivery("m1", "q"))
    assert second.decision is Decision.DEFER  # the winner is this live process
    guard.finish(first)
    assert sink.names().count("lease_taken_over") == 1
