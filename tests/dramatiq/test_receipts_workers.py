"""Receipts through real ``dramatiq`` workers on RabbitMQ: the scenarios and checks of
tests/receipts_scenarios.py.

Per store (Redis, PostgreSQL) one worker consumes the main queues, its relay sweeping every
second, its guard's default ``confirm_within`` 2 s (``r_send_1s``: 1 s).

A message is lost by purging its queue right after it was published: each lost child goes to a
queue of its own (``rchild``, ``rstep``, ``routbox``) that no worker consumes until then; a
second worker consumes those three once they are purged (started early, its imports done, it
waits for a file before its consumers start: a cold start takes seconds on a loaded machine).
``rdown`` is never consumed.
Runs are counted in a PostgreSQL table of the module (one row per run, under the message id);
the events (JSONL) and the sender's record in the store tell what the relay did and when. The
outbox send is made in this process, with a guard of its own on the same store.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from taskonce.events import read_jsonl
from taskonce.handoff import derive_id
from tests import receipts_scenarios
from tests.dramatiq.conftest import RABBIT_PG, RABBIT_REDIS, Harness, Stack, harness_for, store_of
from tests.helpers import POSTGRES_URL, wait_for
from tests.receipts_scenarios import (
    DEFERRED_BY,
    RELAY_EVERY,
    WITHIN,
    Sent,
    check_arrived_never_published_again,
    check_deferred_not_sent_again_before_eta,
    check_down_gets_three_copies_then_unconfirmed,
    check_lost_in_time,
    check_lost_then_run_once,
    check_retrying_runs_only_its_own_tries,
)

#: what the first worker consumes (not the receipts' queues)
MAIN_QUEUES = ["main", "lazy", "open", "txn"]
#: what the second worker, started after the purges, consumes
LOST_QUEUES = ["rchild", "rstep", "routbox"]


@dataclasses.dataclass
class World(receipts_scenarios.World):
    """The scenarios on one harness: runs are counted by message id, events are its JSONL
    file, queues are RabbitMQ's."""

    h: Harness
    table: str

    def all_events(self) -> list[dict[str, Any]]:
        path = Path(self.h.config.events)
        if not path.exists():
            return []
        return read_jsonl(path)

    def runs(self, sent: Sent) -> int:
        return self.h.runs(self.table, sent.child_id)

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

    def store_options(self) -> list[str]:
        config = self.h.config
        where = (
            ["--prefix", str(config.store_prefix)]
            if config.store_prefix
            else ["--table", str(config.store_table)]
        )
        return ["--store", config.store, *where]

    def send_child(self, name: str, delay: float = 0.0, sender: str = "r_send") -> Sent:
        """``sender`` (a guarded actor on the main queue) sends actor ``name``'s message."""
        actor = self.h.app.actors[name]
        message = self.h.app.actors[sender].send(self.table, name, name, int(delay * 1000))
        key = f"{self.h.config.queue('main')}:{message.message_id}"
        return Sent(name, key, derive_id(key, 0), actor.queue_name)

    def lose(self, sent: Sent) -> Sent:
        """Wait until ``sent`` is in its queue (no consumer yet), then purge the queue."""
        wait_for(
            lambda: self.queued(sent.queue) >= 1,
            timeout=60,
            interval=0.02,
            what=f"{sent.label}'s message to be published to {sent.queue}",
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
    return Sent("r_rstep", key, step.message_id, step.queue_name)


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
    return Sent("r_routbox", world.outbox_sender_key(), message.message_id, message.queue_name)


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
        world = World(store=store_of(h.config), prometheus=prometheus, h=h, table=table)
        watch_store = store_of(h.config)
        try:
            sent = world.sent
            sent["down"] = world.send_child("r_rdown", sender="r_send_1s")
            sent["retrying"] = world.send_child("r_retrying", sender="r_send_1s")
            sent["delayed"] = world.send_child("child", delay=DEFERRED_BY)
            sent["arrived"] = world.send_child("child")
            for name in ("delayed", "arrived"):
                world.watch(name, watch_store)
            for name in ("down", "retrying", "delayed", "arrived"):
                world.published(sent[name])
            sent["child"] = world.published(world.lose(world.send_child("r_rchild")))
            sent["step"] = world.published(world.lose(_pipeline_step(world)))
            if stack.store == "postgresql":
                sent["outbox"] = world.published(world.lose(_outbox(world)))
            check_lost_in_time(world)
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
            world.stop_watches()
            world.store.close()
            watch_store.close()
            h.drop_table(table)


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
    check_arrived_never_published_again(world, "arrived")


def test_a_delayed_child_is_not_sent_again_before_its_eta(world: World) -> None:
    """A child with a delay longer than confirm_within is awaited until its ETA plus
    confirm_within: it runs once, after its ETA, and is never published again."""
    check_deferred_not_sent_again_before_eta(world, "delayed")


def test_a_receiver_that_stays_down_gets_three_copies_then_send_unconfirmed(world: World) -> None:
    check_down_gets_three_copies_then_unconfirmed(world, world.sent["down"], "r_rdown", "dramatiq")


def test_a_child_that_fails_and_retries_runs_only_its_own_tries(world: World) -> None:
    """The child fails every run and Dramatiq retries it 1.5 to 3 s later, at most twice
    (``r_retrying``): three runs in all. Its sender awaits it with confirm_within 1 s, shorter
    than the retry's backoff (Dramatiq's default backoff, 15 s x 2^n and up to twice that, can
    pass the default confirm_within of 300 s from the fifth of its 20 retries on). Between its
    runs the child has no record of its key (the claim is released for the retry), but its
    failed run marked ``<key>\\x1freceived``: that is its receipt, so it is not sent again (each
    copy would start a retry chain of its own: 12 runs before the guard made that mark) nor
    reported as never received."""
    check_retrying_runs_only_its_own_tries(world, world.sent["retrying"])
