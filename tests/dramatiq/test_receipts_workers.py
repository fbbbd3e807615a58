"""Receipts through real ``dramatiq`` workers on RabbitMQ: a send the broker lost is published
again and runs once; one that arrived, or waits for its delay, is left alone; one whose receiver
never consumes gets three more copies, then ``send_unconfirmed`` once.

Per store (Redis, PostgreSQL) one worker consumes the main queues, its relay sweeping every
second, its guard's default ``confirm_within`` 2 s (``r_send_1s``: 1 s). The module starts every
scenario at once in one fixture (``world``), the slow ones first, and each test then waits for
its own outcome, so the module takes about as long as its slowest scenario (the receiver that
stays down: 15 s).

A message is lost by purging its queue right after it was published: each lost child goes to a
queue of its own (``rchild``, ``rstep``, ``routbox``) that no worker consumes until then; a
second worker consumes those three once they are purged (started early, its imports done, it
waits for a file before its consumers start: a cold start takes seconds on a loaded machine).
``rdown`` is never consumed.
Runs are counted in a PostgreSQL table of the module (one row per run, under the message id);
the events (JSONL) and the sender's record in the store tell what the relay did and when.

The outbox send (PostgreSQL store only) is made inside ``send_on_commit`` by a producer that is
not a worker. A child that fails and awaits its retry has no record of its key meanwhile; the guard's
``<key>~received`` mark of the failed run is its receipt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import sqlalchemy as sa
from dramatiq import pipeline
from sqlalchemy.orm import Session

import taskonce
from taskonce import receipts
from taskonce.events import read_jsonl
from taskonce.handoff import derive_id
from taskonce.stores import Store
from tests.dramatiq.conftest import RABBIT_PG, RABBIT_REDIS, Harness, Stack, harness_for, store_of
from tests.helpers import POSTGRES_URL, event_time, wait_for

#: the workers' relays sweep this often (s)
RELAY_EVERY = 1.0
#: the default policy's confirm_within (s); ``r_send_1s``'s is FAST_WITHIN
WITHIN = 2.0
FAST_WITHIN = 1.0
#: the delayed child's delay (s): longer than WITHIN
DELAY = 5.0
#: how late a relay's action may come on a loaded machine, beyond its due time and one sweep
SLACK = 4.0
#: a look's lower bound: event timestamps are taken a few ms after the publish they follow
EARLY = 0.25
#: what the first worker consumes (not the receipts' queues)
MAIN_QUEUES = ["main", "lazy", "open", "txn"]
#: what the second worker, started after the purges, consumes
LOST_QUEUES = ["rchild", "rstep", "routbox"]


@dataclasses.dataclass
class Sent:
    """One child send of a scenario."""

    sender_key: str  # the record that awaits its receipt (an actor's key, or outbox:<uuid>)
    child_id: str
    queue: str  # the child's queue
    actor: str  # the child's actor
    published_at: float = 0.0  # the sender's sends_dispatched event (just after the publish)
    deferred_at: float = 0.0  # its sends_deferred event (before the publish)
    lost_at: float = 0.0  # when the test purged it from its queue (lost sends)


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
    h: Harness
    store: Store
    table: str
    prometheus: Path
    sent: dict[str, Sent] = dataclasses.field(default_factory=dict)
    watches: dict[str, Watch] = dataclasses.field(default_factory=dict)

    # -- reading ---------------------------------------------------------------------------

    def events(
        self, name: str, key: str | None = None, message_id: str | None = None
    ) -> list[dict[str, Any]]:
        path = Path(self.h.config.events)
        if not path.exists():
            return []
        return [
            e
            for e in read_jsonl(path)
            if e["event"] == name
            and (key is None or e.get("key") == key or e.get("message_id") == key)
            and (message_id is None or e.get("message_id") == message_id)
        ]

    def runs(self, message_id: str) -> int:
        return self.h.runs(self.table, message_id)

    def entries(self, key: str) -> list[receipts.Entry]:
        """The receipts the record ``key`` keeps (awaited and given up on)."""
        record = self.store.get(key)
        if record is None or not record.receipts:
            return []
        return receipts.decode(record.receipts)

    def awaiting(self, key: str) -> bool:
        return any(not e.unconfirmed for e in self.entries(key))

    def rabbit(self, action: Callable[[Any], Any]) -> Any:
        connection = pika.BlockingConnection(pika.URLParameters(self.h.config.broker))
        try:
            return action(connection.channel())
        finally:
            with contextlib.suppress(Exception):
                connection.close()

    def counts(self, queue: str) -> tuple[int, int]:
        """Messages ready in ``queue`` and its consumers ((0, 0) before anything declared it)."""

        def count(channel: Any) -> tuple[int, int]:
            try:
                method = channel.queue_declare(queue=queue, passive=True).method
            except pika.exceptions.ChannelClosedByBroker:
                return 0, 0  # not declared yet
            return int(method.message_count), int(method.consumer_count)

        counts: tuple[int, int] = self.rabbit(count)
        return counts

    def queued(self, queue: str) -> int:
        return self.counts(queue)[0]

    # -- doing -----------------------------------------------------------------------------

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

    def send_child(self, name: str, delay: float = 0.0, sender: str = "r_send") -> Sent:
        """``sender`` (a guarded actor on the main queue) sends actor ``name``'s message."""
        actor = self.h.app.actors[name]
        message = self.h.app.actors[sender].send(self.table, name, name, int(delay * 1000))
        key = f"{self.h.config.queue('main')}:{message.message_id}"
        return Sent(key, derive_id(key, 0), actor.queue_name, name)

    def lose(self, sent: Sent) -> Sent:
        """Wait until ``sent`` is in its queue (no consumer yet), then purge the queue."""
        wait_for(
            lambda: self.queued(sent.queue) >= 1,
            timeout=60,
            interval=0.02,
            what=f"{sent.actor}'s message to be published to {sent.queue}",
        )
        assert self.counts(sent.queue) == (1, 0)  # published, and no consumer
        purged = self.rabbit(lambda channel: channel.queue_purge(queue=sent.queue))
        assert purged.method.message_count == 1
        sent.lost_at = time.time()
        return sent


def _pipeline_step(world: World) -> Sent:
    """A pipeline whose first step (guarded, main queue) hands the next one to ``rstep``."""
    actors = world.h.app.actors
    first = actors["pipe_step"].message(world.table, 0)
    step = actors["r_rstep"].message(world.table, "lost-step")
    pipeline([first, step], broker=world.h.app.broker).run()
    key = f"{world.h.config.queue('main')}:{first.message_id}"
    return Sent(key, step.message_id, step.queue_name, "r_rstep")


def _outbox(world: World) -> Sent:
    """``r_routbox`` sent inside ``send_on_commit`` (this process, its own guard on the same
    store), published right after the commit."""
    engine = sa.create_engine(POSTGRES_URL)
    try:
        with Session(engine) as session:
            with taskonce.send_on_commit(session, guard=world.h.app.guard):
                message = world.h.app.actors["r_routbox"].send(world.table, "outbox")
            session.commit()
    finally:
        engine.dispose()
    found = [
        e
        for e in world.events("sends_dispatched")
        if str(e.get("message_id") or "").startswith("outbox:")
    ]
    assert len(found) == 1, found
    return Sent(found[0]["message_id"], message.message_id, message.queue_name, "r_routbox")


@pytest.fixture(scope="module", params=[RABBIT_REDIS, RABBIT_PG], ids=lambda s: s.name)
def world(
    request: pytest.FixtureRequest, pg_engine: sa.Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """The worker, and every scenario started: the receiver that stays down first (the
    longest), the delayed child, the child that arrives, then the three lost ones and the
    worker that consumes their queues."""
    stack: Stack = request.param
    tmp = tmp_path_factory.mktemp(f"dramatiq-receipts-{stack.name.replace('/', '-')}")
    prometheus = tmp / "prometheus"
    prometheus.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(prometheus)}
    go = tmp / "go"
    with harness_for(
        stack, tmp, pg_engine, "shared", start=False,
        relay_every=RELAY_EVERY, confirm_within=WITHIN, prometheus=True,
    ) as h:  # fmt: skip
        # The second worker: it starts now and consumes the lost queues once told to.
        second = h.start_worker(
            ready=False, env={**env, "TASKONCE_DQ_GO": str(go)}, queues=LOST_QUEUES
        )
        h.start_worker(env=env, queues=MAIN_QUEUES)

        def waiting() -> bool:
            if not second.alive:
                raise AssertionError(f"the second worker exited:\n{second.output()[-4000:]}")
            return Path(f"{go}.waiting").exists()

        wait_for(waiting, timeout=90, interval=0.1, what="the second worker to wait for its go")
        table = h.new_runs_table()
        world = World(h, store_of(h.config), table, prometheus)
        watch_store = store_of(h.config)
        try:
            sent = world.sent
            sent["down"] = world.send_child("r_rdown", sender="r_send_1s")
            sent["retrying"] = world.send_child("r_retrying", sender="r_send_1s")
            sent["delayed"] = world.send_child("child", delay=DELAY)
            sent["arrived"] = world.send_child("child")
            for name in ("delayed", "arrived"):
                world.watches[name] = Watch(watch_store, sent[name].sender_key)
            for name in ("down", "retrying", "delayed", "arrived"):
                world.published(sent[name])
            sent["child"] = world.published(world.lose(world.send_child("r_rchild")))
            sent["step"] = world.published(world.lose(_pipeline_step(world)))
            if stack.store == "postgresql":
                sent["outbox"] = world.published(world.lose(_outbox(world)))
            for lost in sent.values():
                if lost.lost_at:  # lost before the relay's first look, or the test is void
                    assert lost.lost_at < lost.published_at + WITHIN, (
                        f"{lost.actor} was purged {lost.lost_at - lost.published_at:.2f}s after "
                        f"its publish, after the relay's first look ({WITHIN}s): too slow to test"
                    )
            go.touch()
            lost_queues = [lost.queue for lost in sent.values() if lost.lost_at]
            wait_for(
                lambda: all(world.counts(queue)[1] >= 1 for queue in lost_queues),
                timeout=60,
                interval=0.05,
                what=f"the second worker to consume {lost_queues}",
            )
            yield world
        finally:
            for watch in world.watches.values():
                watch.stop()
            world.store.close()
            watch_store.close()
            h.drop_table(table)


def check_lost_then_run_once(world: World, sent: Sent) -> None:
    """The lost send was published again once, ``WITHIN`` (plus at most a sweep and slack)
    after its first publish, under the same id; the child ran once, from that copy; the
    relay's next look found its receipt and nothing awaits any more."""
    wait_for(lambda: world.runs(sent.child_id) >= 1, timeout=60, interval=0.1, what=sent.actor)
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
    assert world.runs(sent.child_id) == 1
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []
    assert world.events("send_unconfirmed", message_id=sent.child_id) == []
    assert world.entries(sent.sender_key) == []
    assert world.queued(sent.queue) == 0


def test_a_lost_child_is_sent_again_and_runs_once(world: World) -> None:
    check_lost_then_run_once(world, world.sent["child"])


def test_a_lost_pipeline_step_is_sent_again_and_runs_once(world: World) -> None:
    sent = world.sent["step"]
    check_lost_then_run_once(world, sent)
    assert world.h.runs(world.table, sent.sender_key.rsplit(":", 1)[1]) == 1


def test_a_lost_outbox_send_is_sent_again_and_runs_once(world: World) -> None:
    if "outbox" not in world.sent:
        pytest.skip("the producer outbox needs an SQL store")
    sent = world.sent["outbox"]
    check_lost_then_run_once(world, sent)
    assert len(world.events("sends_dispatched", key=sent.sender_key)) == 1


def test_a_child_that_arrived_is_never_published_again(world: World) -> None:
    """The child ran at once; the relay's look found its record; nothing is published again,
    nothing skipped, for several confirm_within periods."""
    sent = world.sent["arrived"]
    watch = world.watches["arrived"]
    wait_for(lambda: world.runs(sent.child_id) >= 1, timeout=60, interval=0.1, what=sent.actor)
    wait_for(
        lambda: not watch.is_alive(),
        timeout=60,
        interval=0.1,
        what=f"{sent.sender_key}'s receipt to be found",
    )
    assert watch.first_seen, "the send was never awaited"
    assert not world.awaiting(sent.sender_key)
    # Nothing can be due any more; watch a while anyway.
    end = sent.published_at + 4 * WITHIN + RELAY_EVERY
    while time.time() < end:
        assert world.events("sends_redispatched", key=sent.sender_key) == []
        time.sleep(0.2)
    assert world.events("sends_redispatched", key=sent.sender_key) == []
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []
    assert len(world.events("claimed", message_id=sent.child_id)) == 1
    assert world.runs(sent.child_id) == 1
    assert world.entries(sent.sender_key) == []


def test_a_delayed_child_is_not_sent_again_before_its_eta(world: World) -> None:
    """A child with a delay longer than confirm_within is awaited until its ETA plus
    confirm_within: it runs once, after its ETA, and is never published again."""
    sent = world.sent["delayed"]
    watch = world.watches["delayed"]
    wait_for(
        lambda: not watch.is_alive(),
        timeout=60,
        interval=0.1,
        what=f"{sent.sender_key}'s receipt to be found",
    )
    assert watch.first_seen, "the send was never awaited"
    # Still awaited until the look at ETA + confirm_within (not at confirm_within).
    awaited = watch.last_seen - sent.published_at
    assert awaited >= DELAY + WITHIN - 1.0, awaited
    assert not world.awaiting(sent.sender_key)
    claimed = world.events("claimed", message_id=sent.child_id)
    assert len(claimed) == 1
    # The ETA is the publish's time (after sends_deferred) plus the delay.
    assert event_time(claimed[0]) - sent.deferred_at >= DELAY - EARLY
    assert world.runs(sent.child_id) == 1
    assert world.events("sends_redispatched", key=sent.sender_key) == []
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []


def test_a_receiver_that_stays_down_gets_three_copies_then_send_unconfirmed(world: World) -> None:
    """No consumer at all: looks after 1, then 2, 4 and 8 s more; three copies, then
    ``send_unconfirmed`` once and nothing more; ``taskonce inspect`` and Prometheus show it."""
    config = world.h.config
    sent = world.sent["down"]
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
    assert gave_up[0]["task"] == "r_rdown" and gave_up[0]["framework"] == "dramatiq"
    entries = world.entries(sent.sender_key)
    assert [(e.key, e.tries, e.unconfirmed) for e in entries] == [
        (f"{sent.queue}:{sent.child_id}", 3, True)
    ]

    where = (
        ["--prefix", str(config.store_prefix)]
        if config.store_prefix
        else ["--table", str(config.store_table)]
    )
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "taskonce"), "inspect", sent.sender_key,
         "--store", config.store, *where],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert (
        f"unconfirmed send {sent.child_id} dramatiq r_rdown -> {sent.queue}:{sent.child_id} "
        "(re-sent 3 times)"
    ) in shown.stdout, shown.stdout

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(world.prometheus))
    labels = {"queue": sent.queue, "task": "r_rdown", "framework": "dramatiq"}
    assert (
        registry.get_sample_value("taskonce_sends_total", {"event": "unconfirmed", **labels}) == 1
    )
    assert (
        registry.get_sample_value("taskonce_events_total", {"event": "send_unconfirmed", **labels})
        == 1
    )


def test_a_child_that_fails_and_retries_runs_only_its_own_tries(world: World) -> None:
    """The child fails every run and Dramatiq retries it 1.5 to 3 s later, at most twice
    (``r_retrying``): three runs in all. Its sender awaits it with confirm_within 1 s, shorter
    than the retry's backoff (Dramatiq's default backoff, 15 s x 2^n and up to twice that, can
    pass the default confirm_within of 300 s from the fifth of its 20 retries on). Between its
    runs the child has no record of its key (the claim is released for the retry), but its
    failed run marked ``<key>~received``: that is its receipt, so it is not sent again (each
    copy would start a retry chain of its own: 12 runs before the guard made that mark) nor
    reported as never received."""
    sent = world.sent["retrying"]
    wait_for(
        lambda: not world.awaiting(sent.sender_key),
        timeout=90,
        interval=0.2,
        what=f"{sent.sender_key} to stop awaiting",
    )
    wait_for(lambda: world.runs(sent.child_id) >= 3, timeout=60, interval=0.1, what=sent.actor)
    # A copy sent again would start a retry chain of its own: watch for one a while longer
    # than a retry's countdown.
    end = time.time() + 3.0 + RELAY_EVERY + 1.0
    while time.time() < end:
        assert world.runs(sent.child_id) <= 3
        time.sleep(0.2)
    resent = world.events("sends_redispatched", key=sent.sender_key)
    unconfirmed = world.events("send_unconfirmed", message_id=sent.child_id)
    assert (world.runs(sent.child_id), len(resent), len(unconfirmed)) == (3, 0, 0)
    assert world.entries(sent.sender_key) == []
    child_key = f"{sent.queue}:{sent.child_id}"
    assert world.store.get(child_key) is None  # failed for good: released
    assert world.store.get(receipts.received_key(child_key)) is not None
