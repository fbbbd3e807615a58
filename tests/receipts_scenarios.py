"""The receipts scenarios that tests/celery/test_receipts_workers.py and
tests/dramatiq/test_receipts_workers.py run through real workers, each on the Redis and the
PostgreSQL store, and their checks: a send the broker lost is published again and runs once;
one that arrived, or waits for its countdown or delay, is left alone; one whose receiver never
consumes gets three more copies, then ``send_unconfirmed`` once; a child that fails and
retries runs only its own tries.

Each module starts every scenario at once in one fixture (``world``), the slow ones first, and
each test then waits for its own outcome, so a module takes about as long as its slowest
scenario (the receiver that stays down: 15 s). The workers' relays sweep every
``RELAY_EVERY`` s; their guards' default ``confirm_within`` is ``WITHIN`` s, the fast
sender's (``*_1s``) ``FAST_WITHIN`` s. The outbox send (PostgreSQL store only) is made inside
``send_on_commit`` by a producer that is not a worker. A child that fails and awaits its
retry has no record of its key meanwhile; the guard's ``<key>\\x1freceived`` mark of the failed
run is its receipt.

A framework's module says how its workers start, how a child is published and lost, and where
its events, runs and queued messages are (its ``World``); what is checked, the waits with
their deadlines, and the reading of events and records are here, once, so that the two
frameworks are held to the same checks.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from taskonce import receipts
from taskonce.stores import Store
from tests.helpers import event_time, wait_for

#: the workers' relays sweep this often (s)
RELAY_EVERY = 1.0
#: the default policy's confirm_within (s); the fast sender's (``*_1s``) is FAST_WITHIN
WITHIN = 2.0
FAST_WITHIN = 1.0
#: the deferred child's countdown (Celery) or delay (Dramatiq) (s): longer than WITHIN
DEFERRED_BY = 5.0
#: how late a relay's action may come on a loaded machine, beyond its due time and one sweep
SLACK = 4.0
#: a look's lower bound: event timestamps are taken a few ms after the publish they follow
EARLY = 0.25


@dataclasses.dataclass
class Sent:
    """One child send of a scenario."""

    label: str  # what messages call the child: its label (Celery) or its actor (Dramatiq)
    sender_key: str  # the record that awaits its receipt (a task's key, or outbox:<uuid>)
    child_id: str
    queue: str  # the child's queue
    published_at: float = 0.0  # the sender's sends_dispatched event (just after the publish)
    deferred_at: float = 0.0  # its sends_deferred event (before the publish)
    lost_at: float = 0.0  # when the test removed it from the broker (lost sends)


class Watch(threading.Thread):
    """Samples, every 50 ms from the moment it starts, whether the record ``key`` awaits
    receipts, until it stops awaiting them: when it was first and last seen awaiting."""

    def __init__(self, store: Store, key: str) -> None:
        super().__init__(name=f"watch {key}", daemon=True)
        self.store = store
        self.key = key
        self.first_seen = self.last_seen = 0.0
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            record = self.store.get(self.key)
            entries = receipts.decode(record.receipts) if record and record.receipts else []
            if any(not e.unconfirmed for e in entries):
                self.last_seen = time.time()
                self.first_seen = self.first_seen or self.last_seen
            elif self.last_seen:
                return

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


@dataclasses.dataclass
class World:
    """A framework's workers with every scenario started: ``sent`` by scenario name, and the
    ``watches`` of the scenarios whose awaiting is sampled. A framework's subclass says where
    its events, runs and queued messages are, and how ``taskonce inspect`` finds its store."""

    store: Store
    prometheus: Path  # the workers' PROMETHEUS_MULTIPROC_DIR
    # keyword-only: a subclass's own fields (without defaults) come after these
    sent: dict[str, Sent] = dataclasses.field(default_factory=dict, kw_only=True)
    watches: dict[str, Watch] = dataclasses.field(default_factory=dict, kw_only=True)

    # -- the framework's ---------------------------------------------------------------------

    def all_events(self) -> list[dict[str, Any]]:
        """Every event the workers (and this process) wrote so far."""
        raise NotImplementedError

    def runs(self, sent: Sent) -> int:
        """How many times ``sent``'s child ran (rows in the module's runs table)."""
        raise NotImplementedError

    def queued(self, queue: str) -> int:
        """Messages waiting in ``queue`` on the broker."""
        raise NotImplementedError

    def store_options(self) -> list[str]:
        """``--store`` and ``--prefix`` or ``--table`` of ``taskonce inspect`` for the store."""
        raise NotImplementedError

    # -- reading -----------------------------------------------------------------------------

    def events(
        self, name: str, key: str | None = None, message_id: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            e
            for e in self.all_events()
            if e["event"] == name
            and (key is None or e.get("key") == key or e.get("message_id") == key)
            and (message_id is None or e.get("message_id") == message_id)
        ]

    def entries(self, key: str) -> list[receipts.Entry]:
        """The receipts the record ``key`` keeps (awaited and given up on)."""
        record = self.store.get(key)
        if record is None or not record.receipts:
            return []
        return receipts.decode(record.receipts)

    def awaiting(self, key: str) -> bool:
        return any(not e.unconfirmed for e in self.entries(key))

    def outbox_sender_key(self) -> str:
        """The key (``outbox:<uuid>``) of the one outbox send published so far."""
        found = [
            e
            for e in self.events("sends_dispatched")
            if str(e.get("message_id") or "").startswith("outbox:")
        ]
        assert len(found) == 1, found
        return str(found[0]["message_id"])

    # -- doing -------------------------------------------------------------------------------

    def watch(self, name: str, store: Store) -> None:
        """Sample, from now on (before its publish), whether ``sent[name]`` is awaited."""
        self.watches[name] = Watch(store, self.sent[name].sender_key)

    def stop_watches(self) -> None:
        for watch in self.watches.values():
            watch.stop()

    def published(self, sent: Sent) -> Sent:
        """Wait for the sender's sends_dispatched event; note its time."""
        found = wait_for(
            lambda: self.events("sends_dispatched", key=sent.sender_key),
            timeout=60,
            interval=0.05,
            what=f"{sent.sender_key} to publish its send",
        )
        sent.published_at = event_time(found[0])
        sent.deferred_at = event_time(self.events("sends_deferred", key=sent.sender_key)[0])
        return sent


def check_lost_in_time(world: World) -> None:
    """Each lost send was lost before the relay's first look, or the test is void."""
    for sent in world.sent.values():
        if sent.lost_at:
            assert sent.lost_at < sent.published_at + WITHIN, (
                f"{sent.label} was lost {sent.lost_at - sent.published_at:.2f}s after its "
                f"publish, after the relay's first look ({WITHIN}s): too slow to test"
            )


def check_lost_then_run_once(world: World, sent: Sent) -> None:
    """The lost send was published again once, ``WITHIN`` (plus at most a sweep and slack)
    after its first publish, under the same id; the child ran once, from that copy; the
    relay's next look found its receipt and nothing awaits any more."""
    wait_for(lambda: world.runs(sent) >= 1, timeout=60, interval=0.1, what=sent.label)
    wait_for(
        lambda: not world.awaiting(sent.sender_key),
        timeout=60,
        interval=0.1,
        what=f"{sent.sender_key}'s receipt to be found",
    )
    resent = world.events("sends_redispatched", key=sent.sender_key)
    assert [(e["reason"], e["count"]) for e in resent] == [("unconfirmed", 1)]
    after = event_time(resent[0]) - sent.published_at
    assert WITHIN - EARLY <= after <= WITHIN + RELAY_EVERY + SLACK, after
    claimed = world.events("claimed", message_id=sent.child_id)
    assert len(claimed) == 1, claimed
    assert event_time(claimed[0]) >= event_time(resent[0]) - EARLY  # the copy ran
    ran_after = event_time(claimed[0]) - sent.published_at
    assert ran_after <= WITHIN + RELAY_EVERY + SLACK, ran_after
    assert claimed[0]["queue"] == sent.queue
    assert world.runs(sent) == 1
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []
    assert world.events("send_unconfirmed", message_id=sent.child_id) == []
    assert world.entries(sent.sender_key) == []
    assert world.queued(sent.queue) == 0


def wait_until_settled(sent: Sent, watch: Watch) -> None:
    """Wait until ``watch`` saw ``sent`` awaited and then no longer: its receipt was found."""
    wait_for(
        lambda: not watch.is_alive(),
        timeout=60,
        interval=0.1,
        what=f"{sent.sender_key}'s receipt to be found",
    )
    assert watch.first_seen, "the send was never awaited"


def check_arrived_never_published_again(world: World, name: str) -> None:
    """The child ran at once; the relay's look found its record; nothing is published again,
    nothing skipped, for several confirm_within periods."""
    sent = world.sent[name]
    watch = world.watches[name]
    wait_for(lambda: world.runs(sent) >= 1, timeout=60, interval=0.1, what=sent.label)
    wait_until_settled(sent, watch)
    assert not world.awaiting(sent.sender_key)
    # Nothing can be due any more; watch a while anyway.
    end = sent.published_at + 4 * WITHIN + RELAY_EVERY
    while time.time() < end:
        assert world.events("sends_redispatched", key=sent.sender_key) == []
        time.sleep(0.2)
    assert world.events("sends_redispatched", key=sent.sender_key) == []
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []
    assert len(world.events("claimed", message_id=sent.child_id)) == 1
    assert world.runs(sent) == 1
    assert world.entries(sent.sender_key) == []


def check_deferred_not_sent_again_before_eta(world: World, name: str) -> None:
    """A child deferred (countdown, delay) by longer than confirm_within is awaited until its
    ETA plus confirm_within: it runs once, after its ETA, and is never published again."""
    sent = world.sent[name]
    watch = world.watches[name]
    wait_until_settled(sent, watch)
    # Still awaited until the look at ETA + confirm_within (not at confirm_within).
    awaited = watch.last_seen - sent.published_at
    assert awaited >= DEFERRED_BY + WITHIN - 1.0, awaited
    assert not world.awaiting(sent.sender_key)
    claimed = world.events("claimed", message_id=sent.child_id)
    assert len(claimed) == 1
    # The ETA is the publish's time (after sends_deferred) plus the countdown or delay.
    assert event_time(claimed[0]) - sent.deferred_at >= DEFERRED_BY - EARLY
    assert world.runs(sent) == 1
    assert world.events("sends_redispatched", key=sent.sender_key) == []
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []


def check_down_gets_three_copies_then_unconfirmed(
    world: World, sent: Sent, task: str, framework: str
) -> None:
    """No consumer at all: looks after 1, then 2, 4 and 8 s more; three copies, then
    ``send_unconfirmed`` once and nothing more; ``taskonce inspect`` and Prometheus show it
    (the child is ``framework``'s ``task``)."""
    gave_up = wait_for(
        lambda: world.events("send_unconfirmed", message_id=sent.child_id),
        timeout=90,
        interval=0.2,
        what=f"{sent.child_id} to be given up on",
    )
    # Two sweeps more: nothing else happens.
    end = time.time() + 2 * RELAY_EVERY + 0.5
    while time.time() < end:
        time.sleep(0.2)
    resent = world.events("sends_redispatched", key=sent.sender_key)
    assert [(e["reason"], e["count"]) for e in resent] == [("unconfirmed", 1)] * 3
    assert len(world.events("send_unconfirmed", message_id=sent.child_id)) == 1
    assert world.queued(sent.queue) == 1 + 3
    times = [sent.published_at, *(event_time(e) for e in resent), event_time(gave_up[0])]
    for n, (before, after) in enumerate(itertools.pairwise(times)):
        wait = FAST_WITHIN * 2**n
        assert wait - EARLY <= after - before <= wait + RELAY_EVERY + SLACK, (n, times)
    assert gave_up[0]["task"] == task and gave_up[0]["framework"] == framework
    entries = world.entries(sent.sender_key)
    assert [(e.key, e.tries, e.unconfirmed) for e in entries] == [
        (f"{sent.queue}:{sent.child_id}", 3, True)
    ]
    check_inspect_shows_unconfirmed(world, sent, task, framework)
    check_prometheus_counts_unconfirmed(world, sent, task, framework)


def check_inspect_shows_unconfirmed(world: World, sent: Sent, task: str, framework: str) -> None:
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "taskonce"), "inspect", sent.sender_key,
         *world.store_options()],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert (
        f"unconfirmed send {sent.child_id} {framework} {task} -> {sent.queue}:{sent.child_id} "
        "(re-sent 3 times)"
    ) in shown.stdout, shown.stdout


def check_prometheus_counts_unconfirmed(
    world: World, sent: Sent, task: str, framework: str
) -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(world.prometheus))
    labels = {"queue": sent.queue, "task": task, "framework": framework}
    assert (
        registry.get_sample_value("taskonce_sends_total", {"event": "unconfirmed", **labels}) == 1
    )
    assert (
        registry.get_sample_value("taskonce_events_total", {"event": "send_unconfirmed", **labels})
        == 1
    )


def check_retrying_runs_only_its_own_tries(world: World, sent: Sent) -> None:
    """The child fails every run and is retried at most twice, its retries further apart
    than its sender's confirm_within: three runs in all, none sent again, none reported as
    never received. The guard's ``<key>\\x1freceived`` mark of its failed run is its receipt; its
    key's own record is released."""
    wait_for(
        lambda: not world.awaiting(sent.sender_key),
        timeout=90,
        interval=0.2,
        what=f"{sent.sender_key} to stop awaiting",
    )
    wait_for(lambda: world.runs(sent) >= 3, timeout=60, interval=0.1, what=sent.label)
    # A copy sent again would start a retry chain of its own: watch for one a while longer
    # than a retry's countdown.
    end = time.time() + 3.0 + RELAY_EVERY + 1.0
    while time.time() < end:
        assert world.runs(sent) <= 3
        time.sleep(0.2)
    resent = world.events("sends_redispatched", key=sent.sender_key)
    unconfirmed = world.events("send_unconfirmed", message_id=sent.child_id)
    assert (world.runs(sent), len(resent), len(unconfirmed)) == (3, 0, 0)
    assert world.entries(sent.sender_key) == []
    child_key = f"{sent.queue}:{sent.child_id}"
    assert world.store.get(child_key) is None  # failed for good: released
    assert world.store.get(receipts.received_key(child_key)) is not None
