"""Receipts through a real Celery prefork worker on a Redis broker: a send the broker lost is
published again and runs once; one that arrived, or waits for its countdown, is left alone; one
whose receiver never consumes gets three more copies, then ``send_unconfirmed`` once.

One worker per store (Redis, PostgreSQL), its relay sweeping every second, its guard's default
``confirm_within`` 2 s (``t.send_to_1s``: 1 s). The module starts every scenario at once in one
fixture (``world``), the slow ones first, and each test then waits for its own outcome, so the
module takes about as long as its slowest scenario (the receiver that stays down: 15 s).

A message is lost by deleting, right after it was published, the Redis list that kombu keeps
for its queue (``{global_keyprefix}{queue}``): each lost child is routed to a queue of its own
that no worker consumes until then; the test then makes the worker consume it
(``control.add_consumer``). Runs are counted in a PostgreSQL table of the module; the events
(JSONL) and the sender's record in the store tell what the relay did and when.

The outbox send (PostgreSQL store only) is made inside ``send_on_commit`` by a producer that is
not a worker. A child that fails and awaits its retry has no record of its key meanwhile; the guard's
``<key>~received`` mark of the failed run is its receipt.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain

import taskonce
from taskonce import receipts
from taskonce.handoff import derive_id
from taskonce.stores import Store
from tests.celery.conftest import ROOT, Stack, pg_connect, start_stack, stop_stack
from tests.helpers import event_time, wait_for

#: the worker's relay sweeps this often (s)
RELAY_EVERY = 1.0
#: the default policy's confirm_within (s); ``t.send_to_1s``'s is FAST_WITHIN
WITHIN = 2.0
FAST_WITHIN = 1.0
#: the countdown child's countdown (s): longer than WITHIN
COUNTDOWN = 5.0
#: how late a relay's action may come on a loaded machine, beyond its due time and one sweep
SLACK = 4.0
#: a look's lower bound: event timestamps are taken a few ms after the publish they follow
EARLY = 0.25


@dataclasses.dataclass
class Sent:
    """One child send of a scenario."""

    label: str  # the child's label in the runs table
    sender_key: str  # the record that awaits its receipt (a task's key, or outbox:<uuid>)
    child_id: str
    queue: str  # the child's queue
    published_at: float = 0.0  # the sender's sends_dispatched event (just after the publish)
    deferred_at: float = 0.0  # its sends_deferred event (before the publish)
    lost_at: float = 0.0  # when the test deleted it from the broker (lost sends)


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
    stack: Stack
    store: Store
    broker: redis.Redis
    table: str
    prometheus: Path
    sent: dict[str, Sent] = dataclasses.field(default_factory=dict)
    watches: dict[str, Watch] = dataclasses.field(default_factory=dict)

    # -- reading ---------------------------------------------------------------------------

    def events(self, name: str, key: str | None = None, message_id: str | None = None) -> list[
        dict[str, Any]
    ]:  # fmt: skip
        return [
            e
            for e in self.stack.events()
            if e["event"] == name
            and (key is None or e.get("key") == key or e.get("message_id") == key)
            and (message_id is None or e.get("message_id") == message_id)
        ]

    def runs(self, label: str) -> int:
        with pg_connect() as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {self.table} WHERE label = %s", (label,)
            ).fetchone()
        return int(row[0])

    def entries(self, key: str) -> list[receipts.Entry]:
        """The receipts the record ``key`` keeps (awaited and given up on)."""
        record = self.store.get(key)
        if record is None or not record.receipts:
            return []
        return receipts.decode(record.receipts)

    def awaiting(self, key: str) -> bool:
        return any(not e.unconfirmed for e in self.entries(key))

    def list_key(self, queue: str) -> str:
        """The Redis list kombu keeps ``queue``'s messages in (under the stack's key prefix)."""
        return f"{self.stack.prefix}:{queue}"

    def queued(self, queue: str) -> int:
        return int(self.broker.llen(self.list_key(queue)))

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

    def send_child(
        self,
        label: str,
        queue: str,
        task: str = "t.send_to",
        countdown: float = 0.0,
        child: str = "t.record",
    ) -> Sent:
        """``task`` (a guarded parent on the eager queue) sends ``child`` to ``queue``."""
        parent_id = str(uuid.uuid4())
        self.stack.send(
            task,
            (self.table, f"{label}-parent", queue, label, countdown, child),
            "eager",
            task_id=parent_id,
        )
        key = f"{self.stack.q('eager')}:{parent_id}"
        return Sent(label, key, derive_id(key, 0), queue)

    def lose(self, sent: Sent, publish: Any = None) -> Sent:
        """Wait until ``sent`` is in its queue's list (no consumer yet), delete the list, then
        let the worker consume the queue."""
        wait_for(
            lambda: self.queued(sent.queue) >= 1 or (publish is not None and publish()),
            timeout=60,
            interval=0.01,
            what=f"{sent.label} to be published to {sent.queue}",
        )
        assert self.queued(sent.queue) == 1, f"{sent.label}: expected one message in the list"
        assert self.broker.delete(self.list_key(sent.queue)) == 1
        sent.lost_at = time.time()
        replies = self.stack.app.control.add_consumer(sent.queue, reply=True, timeout=20, limit=1)
        assert replies and "ok" in next(iter(replies[0].values())), replies
        return sent

    def close(self) -> None:
        self.store.close()
        self.broker.close()


def _chain_step(world: World, label: str, queue: str) -> Sent:
    """A chain whose first step (guarded, eager queue) hands the next one (``t.step``) to
    ``queue``."""
    stack = world.stack
    first_id, step_id = str(uuid.uuid4()), str(uuid.uuid4())
    chain(
        stack.app.signature(
            "t.chain_a", args=(world.table, f"{label}-first"), task_id=first_id,
            queue=stack.q("eager"),
        ),
        stack.app.signature("t.step", args=(world.table, label), task_id=step_id, queue=queue),
    ).apply_async()  # fmt: skip
    return Sent(label, f"{stack.q('eager')}:{first_id}", step_id, queue)


class Producer:
    """``python -m tests.celery.producer``: a process of its own that sends ``t.record`` to a
    queue inside ``send_on_commit``, published right after the commit. Started early (its
    imports take seconds on a loaded machine); it sends when told to."""

    def __init__(self, world: World, label: str, queue: str) -> None:
        self.world = world
        self.sent = Sent(label, "", "", queue)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.celery.producer", world.table, label, queue],
            cwd=ROOT, env=world.stack.worker.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip

    def failed(self) -> bool:
        if self.process.poll() not in (None, 0):
            assert self.process.stderr is not None
            raise AssertionError(f"the producer failed:\n{self.process.stderr.read().decode()}")
        return False

    def send(self) -> Sent:
        """Send, and lose the message."""
        process, sent = self.process, self.sent
        assert process.stdout is not None and process.stdin is not None
        try:
            assert process.stdout.readline().strip() == b"ready", self.failed()
            process.stdin.write(b"go\n")
            process.stdin.flush()
            self.world.lose(sent, publish=self.failed)
            out, err = process.communicate(timeout=60)
        finally:
            self.stop()
        assert process.returncode == 0, err.decode()
        sent.child_id = out.decode().split()[-1]
        found = [
            e
            for e in self.world.events("sends_dispatched")
            if str(e.get("message_id") or "").startswith("outbox:")
        ]
        assert len(found) == 1, found
        sent.sender_key = found[0]["message_id"]
        return sent

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(
    scope="module",
    params=["redis", "postgresql"],
    ids=["redis-broker/redis-store", "redis-broker/pg-store"],
)
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    """The worker, and every scenario started: the receiver that stays down first (the
    longest), the countdown child, the child that arrives, then the three lost ones."""
    tmp = tmp_path_factory.mktemp(f"celery-receipts-{request.param}")
    prometheus = tmp / "prometheus"
    prometheus.mkdir()
    env = {
        "TO_RELAY_EVERY": str(RELAY_EVERY),
        "TO_CONFIRM_WITHIN": str(WITHIN),
        "TO_PROMETHEUS": "1",
        "PROMETHEUS_MULTIPROC_DIR": str(prometheus),
    }
    table = f"runs_{uuid.uuid4().hex[:12]}"
    with pg_connect() as conn:
        conn.execute(
            f"CREATE TABLE {table} (id serial PRIMARY KEY, label text NOT NULL, task_id text, "
            "retries int, pid int, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    stack = start_stack(tmp, "redis", request.param, extra_env=env)
    options = {"prefix": stack.store_ns} if request.param == "redis" else {"table": stack.store_ns}
    watch_store = taskonce.open_store(stack.store_url, **options)
    world = World(
        stack,
        taskonce.open_store(stack.store_url, **options),
        redis.Redis.from_url(str(stack.app.conf.broker_url)),
        table,
        prometheus,
    )
    producer = None
    try:
        q = stack.q
        if request.param == "postgresql":
            producer = Producer(world, "lost-outbox", q("r-outbox"))
        world.sent["down"] = world.send_child("down", q("r-down"), task="t.send_to_1s")
        world.sent["retrying"] = world.send_child(
            "retrying", q("eager"), task="t.send_to_1s", child="t.retrying"
        )
        world.sent["countdown"] = world.send_child("countdown", q("eager"), countdown=COUNTDOWN)
        world.sent["arrived"] = world.send_child("arrived", q("eager"))
        for name in ("countdown", "arrived"):
            world.watches[name] = Watch(watch_store, world.sent[name].sender_key)
        for name in ("down", "retrying", "countdown", "arrived"):
            world.published(world.sent[name])
        world.sent["child"] = world.published(
            world.lose(world.send_child("lost-child", q("r-child")))
        )
        world.sent["step"] = world.published(
            world.lose(_chain_step(world, "lost-step", q("r-step")))
        )
        if producer is not None:
            world.sent["outbox"] = world.published(producer.send())
        for sent in world.sent.values():
            if sent.lost_at:  # lost before the relay's first look, or the test is void
                assert sent.lost_at < sent.published_at + WITHIN, (
                    f"{sent.label} was deleted {sent.lost_at - sent.published_at:.2f}s after its "
                    f"publish, after the relay's first look ({WITHIN}s): too slow to test"
                )
        yield world
    except BaseException:
        sys.stderr.write(f"--- worker log (tail) ---\n{stack.worker.log()[-8000:]}\n")
        raise
    finally:
        if producer is not None:
            producer.stop()
        for watch in world.watches.values():
            watch.stop()
        try:
            stop_stack(stack)
        finally:
            world.close()
            watch_store.close()
            with pg_connect() as conn:
                conn.execute(f"DROP TABLE IF EXISTS {table}")


def check_lost_then_run_once(world: World, sent: Sent) -> None:
    """The lost send was published again once, ``WITHIN`` (plus at most a sweep and slack)
    after its first publish, under the same id; the child ran once; the relay's next look found
    its receipt and nothing awaits any more."""
    wait_for(lambda: world.runs(sent.label) >= 1, timeout=60, interval=0.1, what=sent.label)
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
    ran_after = event_time(claimed[0]) - sent.published_at
    assert ran_after <= WITHIN + RELAY_EVERY + SLACK, ran_after
    assert claimed[0]["queue"] == sent.queue
    assert world.runs(sent.label) == 1
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []
    assert world.events("send_unconfirmed", message_id=sent.child_id) == []
    assert world.entries(sent.sender_key) == []
    assert world.queued(sent.queue) == 0


def test_a_lost_child_is_sent_again_and_runs_once(world: World) -> None:
    check_lost_then_run_once(world, world.sent["child"])


def test_a_lost_chain_step_is_sent_again_and_runs_once(world: World) -> None:
    sent = world.sent["step"]
    check_lost_then_run_once(world, sent)
    assert world.runs("lost-step-first") == 1


@pytest.mark.sql_store_only
def test_a_lost_outbox_send_is_sent_again_and_runs_once(world: World) -> None:
    sent = world.sent["outbox"]
    check_lost_then_run_once(world, sent)
    assert len(world.events("sends_dispatched", key=sent.sender_key)) == 1


def test_a_child_that_arrived_is_never_published_again(world: World) -> None:
    """The child ran at once; the relay's look found its record; nothing is published again,
    nothing skipped, for several confirm_within periods."""
    sent = world.sent["arrived"]
    watch = world.watches["arrived"]
    wait_for(lambda: world.runs(sent.label) >= 1, timeout=60, interval=0.1, what=sent.label)
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
    assert world.runs(sent.label) == 1
    assert world.entries(sent.sender_key) == []


def test_a_countdown_child_is_not_sent_again_before_its_eta(world: World) -> None:
    """A child with a countdown longer than confirm_within is awaited until its ETA plus
    confirm_within: it runs once, after its ETA, and is never published again."""
    sent = world.sent["countdown"]
    watch = world.watches["countdown"]
    wait_for(
        lambda: not watch.is_alive(),
        timeout=60,
        interval=0.1,
        what=f"{sent.sender_key}'s receipt to be found",
    )
    assert watch.first_seen, "the send was never awaited"
    # Still awaited until the look at ETA + confirm_within (not at confirm_within).
    awaited = watch.last_seen - sent.published_at
    assert awaited >= COUNTDOWN + WITHIN - 1.0, awaited
    assert not world.awaiting(sent.sender_key)
    claimed = world.events("claimed", message_id=sent.child_id)
    assert len(claimed) == 1
    # The ETA is the publish's time (after sends_deferred) plus the countdown.
    assert event_time(claimed[0]) - sent.deferred_at >= COUNTDOWN - EARLY
    assert world.runs(sent.label) == 1
    assert world.events("sends_redispatched", key=sent.sender_key) == []
    assert world.events("duplicate_skipped", message_id=sent.child_id) == []


def test_a_receiver_that_stays_down_gets_three_copies_then_send_unconfirmed(world: World) -> None:
    """No consumer at all: looks after 1, then 2, 4 and 8 s more; three copies, then
    ``send_unconfirmed`` once and nothing more; ``taskonce inspect`` and Prometheus show it."""
    stack = world.stack
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
    assert gave_up[0]["task"] == "t.record" and gave_up[0]["framework"] == "celery"
    entries = world.entries(sent.sender_key)
    assert [(e.key, e.tries, e.unconfirmed) for e in entries] == [
        (f"{sent.queue}:{sent.child_id}", 3, True)
    ]

    where = ["--prefix", stack.store_ns] if stack.store == "redis" else ["--table", stack.store_ns]
    shown = subprocess.run(
        [str(Path(sys.executable).parent / "taskonce"), "inspect", sent.sender_key,
         "--store", stack.store_url, *where],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert (
        f"unconfirmed send {sent.child_id} celery t.record -> {sent.queue}:{sent.child_id} "
        "(re-sent 3 times)"
    ) in shown.stdout, shown.stdout

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(world.prometheus))
    labels = {"queue": sent.queue, "task": "t.record", "framework": "celery"}
    assert (
        registry.get_sample_value("taskonce_sends_total", {"event": "unconfirmed", **labels}) == 1
    )
    assert (
        registry.get_sample_value("taskonce_events_total", {"event": "send_unconfirmed", **labels})
        == 1
    )


def test_a_child_that_fails_and_retries_runs_only_its_own_tries(world: World) -> None:
    """The child fails every run and retries 3 s later, at most twice (``t.retrying``): three
    runs in all. Its sender awaits it with confirm_within 1 s, shorter than the retry's
    countdown. Between its runs the child has no record of its key (the claim is released for
    the retry), but its failed run marked ``<key>~received``: that is its receipt, so it is not
    sent again (each copy would start a retry chain of its own: 12 runs before the guard made
    that mark) nor reported as never received."""
    sent = world.sent["retrying"]
    wait_for(
        lambda: not world.awaiting(sent.sender_key),
        timeout=90,
        interval=0.2,
        what=f"{sent.sender_key} to stop awaiting",
    )
    wait_for(lambda: world.runs(sent.label) >= 3, timeout=60, interval=0.1, what=sent.label)
    # A copy sent again would start a retry chain of its own: watch for one a while longer
    # than a retry's countdown.
    end = time.time() + 3.0 + RELAY_EVERY + 1.0
    while time.time() < end:
        assert world.runs(sent.label) <= 3
        time.sleep(0.2)
    resent = world.events("sends_redispatched", key=sent.sender_key)
    unconfirmed = world.events("send_unconfirmed", message_id=sent.child_id)
    assert (world.runs(sent.label), len(resent), len(unconfirmed)) == (3, 0, 0)
    assert world.entries(sent.sender_key) == []
    child_key = f"{sent.queue}:{sent.child_id}"
    assert world.store.get(child_key) is None  # failed for good: released
    assert world.store.get(receipts.received_key(child_key)) is not None
