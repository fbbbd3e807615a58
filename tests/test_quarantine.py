"""Crash-loop quarantine, decided by the guard (in-process store, fake store clock): each
take-over of a key from a dead or expired owner is counted; past ``Policy.crash_limit`` the
delivery is not run, the key is quarantined (``quarantined``, the message refused as
``REJECT``) and later copies are skipped until an operator's release.

Real workers killing themselves on every run are in tests/celery/test_quarantine_workers.py
and tests/dramatiq/test_quarantine_workers.py; the store operations in
tests/test_store_quarantine.py and tests/test_store_properties.py.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from typing import Any

import pytest

from taskonce import ConfigError, Decision, Delivery, Guard, Policy, Quarantined
from taskonce.action import Do, before
from taskonce.keys import make_key
from taskonce.stores import MemoryStore, Status
from taskonce.worker import LIVENESS_WINDOW, Identity, identity
from tests.test_guard import Clock, Counter, Sink

KEY = make_key("m1", "q", "id+queue")
LEASE = 300.0
TASK = f"{Counter.__module__}.{Counter.__qualname__}"  # the task name guard.run gives it


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sink() -> Sink:
    return Sink()


def setup_guard(clock: Clock, sink: Sink, **policy: Any) -> tuple[Guard, MemoryStore]:
    store = MemoryStore(clock=clock)
    return Guard(store, default=Policy(lease=LEASE, **policy), events=[sink]), store


def crash(guard: Guard, clock: Clock) -> Decision:
    """One delivery of m1 whose handler's process dies: it begins (claims or takes over), runs
    nothing to its end, and its lease runs out by the store's clock."""
    ticket = guard.begin(Delivery("m1", "q", task=TASK), (1,), {})
    guard._stop_heartbeat(ticket)  # the dead process renews nothing
    clock.now += LEASE + 1
    return ticket.decision


def events(sink: Sink, name: str) -> list[dict[str, Any]]:
    return [e for e in sink.events if e["event"] == name]


@pytest.mark.parametrize("value", [-1, 1.5, True, "3", None])
def test_a_bad_crash_limit_is_a_config_error_naming_the_field(value: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        Policy(crash_limit=value)
    assert str(caught.value) == (
        f"Policy.crash_limit={value!r} must be a whole number, 0 or more (0 turns quarantine off)"
    )


def test_crash_limit_defaults_to_three_and_zero_is_allowed() -> None:
    assert Policy().crash_limit == 3
    assert Policy(crash_limit=0).crash_limit == 0


def test_a_crash_loop_runs_crash_limit_plus_one_times_then_is_quarantined(
    clock: Clock, sink: Sink
) -> None:
    guard, store = setup_guard(clock, sink, crash_limit=3)
    assert [crash(guard, clock) for _ in range(4)] == [Decision.RUN] * 4
    assert [e["reason"] for e in events(sink, "lease_taken_over")] == ["lease_expired"] * 3
    with pytest.raises(Quarantined) as raised:
        guard.begin(Delivery("m1", "q", task=TASK), (1,), {})
    assert (raised.value.key, raised.value.count) == (KEY, 4)
    assert str(raised.value) == (
        "key 'q:m1' quarantined: the process running it died 4 times (crash_limit); not run "
        "again until released: taskonce release 'q:m1' --store URL (in a Django project: "
        "python manage.py taskonce release 'q:m1')"
    )
    record = store.get(KEY)
    assert record is not None and record.status is Status.QUARANTINED and record.crashes == 4
    assert record.expires_at == pytest.approx(clock.now + guard.default.keep_for)
    [event] = events(sink, "quarantined")
    assert (event["key"], event["count"], event["reason"]) == (KEY, 4, "lease_expired")
    assert len(events(sink, "lease_taken_over")) == 3  # the fifth delivery took nothing over


def test_a_later_copy_is_skipped_until_an_operator_releases_the_key(
    clock: Clock, sink: Sink
) -> None:
    guard, store = setup_guard(clock, sink, crash_limit=1)
    crash(guard, clock), crash(guard, clock)
    with pytest.raises(Quarantined):
        guard.run("m1", "q", Counter(), 1)
    clock.now += 3600  # long after: still quarantined, no lease to run out
    handler = Counter()
    assert guard.run("m1", "q", handler, 1).status == "skipped"
    assert handler.calls == []
    skipped = events(sink, "duplicate_skipped")
    assert [e["reason"] for e in skipped] == ["quarantined"]
    store.release(KEY, None)  # taskonce release q:m1
    assert guard.run("m1", "q", handler, 1).status == "ran"
    assert handler.calls == [(1,)]


def test_a_lazy_queue_skips_a_quarantined_key_too(clock: Clock, sink: Sink) -> None:
    guard, store = setup_guard(clock, sink, crash_limit=1)
    crash(guard, clock), crash(guard, clock)
    with pytest.raises(Quarantined):
        guard.run("m1", "q", Counter(), 1)
    lazy = Guard(store, default=Policy(mode="lazy"), events=[sink])
    handler = Counter()
    assert lazy.run("m1", "q", handler, 1).status == "skipped" and handler.calls == []


def test_crash_limit_zero_never_quarantines(clock: Clock, sink: Sink) -> None:
    guard, _ = setup_guard(clock, sink, crash_limit=0)
    assert [crash(guard, clock) for _ in range(8)] == [Decision.RUN] * 8
    assert events(sink, "quarantined") == []


def test_a_dead_owners_take_over_counts_and_quarantines(clock: Clock, sink: Sink) -> None:
    guard, store = setup_guard(clock, sink, crash_limit=3)
    me = identity()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    dead = str(Identity(me.host, me.ns, gone.pid, "12345"))
    store.beat(dead, LIVENESS_WINDOW)
    store.claim(KEY, "t0", LEASE, 3600, None, dead)
    for n in range(1, 4):  # three owners of that identity died in turn, their leases alive
        assert store.take_over(KEY, f"t{n - 1}", f"t{n}", LEASE, 3600, dead) == n
    handler = Counter()
    action = before(guard, lambda: Delivery("m1", "q", task=TASK), (1,), {})
    assert action.do is Do.REJECT and isinstance(action.error, Quarantined)
    assert action.error.count == 4 and handler.calls == []
    [event] = events(sink, "quarantined")
    assert (event["reason"], event["count"]) == ("owner_dead", 4)
    assert store.get(KEY).status is Status.QUARANTINED  # type: ignore[union-attr]


def test_the_last_allowed_take_over_runs(clock: Clock, sink: Sink) -> None:
    guard, store = setup_guard(clock, sink, crash_limit=3)
    me = identity()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = str(Identity(me.host, me.ns, gone.pid, "12345"))
    store.claim(KEY, "t0", LEASE, 3600, None, dead)
    for n in range(1, 3):
        store.take_over(KEY, f"t{n - 1}", f"t{n}", LEASE, 3600, dead)
    handler = Counter()
    assert guard.run("m1", "q", handler, 1).status == "ran"
    assert handler.calls == [(1,)] and events(sink, "quarantined") == []


def test_the_error_crosses_processes_and_result_backends() -> None:
    error = Quarantined("q:m1", 4)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.key, copy.count, str(copy)) == ("q:m1", 4, str(error))
    # Celery's JSON result backend keeps an exception as its type and args, and calls
    # type(*args) to bring it back
    again = Quarantined(*json.loads(json.dumps(error.args)))
    assert str(again) == str(error)


def test_prometheus_counts_quarantines(clock: Clock, sink: Sink) -> None:
    from prometheus_client import CollectorRegistry

    from taskonce import PrometheusEvents

    registry = CollectorRegistry()
    store = MemoryStore(clock=clock)
    guard = Guard(store, Policy(lease=LEASE, crash_limit=1), events=[PrometheusEvents(registry)])
    crash(guard, clock), crash(guard, clock)
    with pytest.raises(Quarantined):
        guard.run("m1", "q", Counter(), 1)
    labels = {"queue": "q", "framework": "python"}
    assert registry.get_sample_value("taskonce_quarantined_total", {**labels, "task": ""}) is None
    names = {s.name: s for m in registry.collect() for s in m.samples}
    assert names["taskonce_quarantined_total"].value == 1
    assert names["taskonce_quarantined_total"].labels["queue"] == "q"
