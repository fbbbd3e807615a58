"""Receipts through a real Celery prefork worker on a Redis broker: the scenarios and checks
of tests/receipts_scenarios.py.

One worker per store (Redis, PostgreSQL), its relay sweeping every second, its guard's default
``confirm_within`` 2 s (``t.send_to_1s``: 1 s).

A message is lost by deleting, right after it was published, the Redis list that kombu keeps
for its queue (``{global_keyprefix}{queue}``): each lost child is routed to a queue of its own
that no worker consumes until then; the test then makes the worker consume it
(``control.add_consumer``). Runs are counted in a PostgreSQL table of the module, by label; the
events (JSONL) and the sender's record in the store tell what the relay did and when. The
outbox send's producer is a process of its own (``tests.celery.producer``).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chain

import taskonce
from taskonce.handoff import derive_id
from tests import receipts_scenarios
from tests.celery.conftest import ROOT, Stack, pg_connect, start_stack, stop_stack
from tests.helpers import wait_for
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


@dataclasses.dataclass
class World(receipts_scenarios.World):
    """The scenarios on one Celery stack: runs are counted by label, events are the stack's,
    queues are the Redis lists of its broker."""

    stack: Stack
    broker: redis.Redis
    table: str

    def all_events(self) -> list[dict[str, Any]]:
        return self.stack.events()

    def runs(self, sent: Sent) -> int:
        return self.runs_labelled(sent.label)

    def runs_labelled(self, label: str) -> int:
        with pg_connect() as conn:
            row = conn.execute(
                f"SELECT count(*) FROM {self.table} WHERE label = %s", (label,)
            ).fetchone()
        return int(row[0])

    def list_key(self, queue: str) -> str:
        """The Redis list kombu keeps ``queue``'s messages in (under the stack's key prefix)."""
        return f"{self.stack.prefix}:{queue}"

    def queued(self, queue: str) -> int:
        return int(self.broker.llen(self.list_key(queue)))

    def store_options(self) -> list[str]:
        stack = self.stack
        where = (
            ["--prefix", stack.store_ns] if stack.store == "redis" else ["--table", stack.store_ns]
        )
        return ["--store", stack.store_url, *where]

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
        sent.sender_key = self.world.outbox_sender_key()
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
        store=taskonce.open_store(stack.store_url, **options),
        prometheus=prometheus,
        stack=stack,
        broker=redis.Redis.from_url(str(stack.app.conf.broker_url)),
        table=table,
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
        world.sent["countdown"] = world.send_child("countdown", q("eager"), countdown=DEFERRED_BY)
        world.sent["arrived"] = world.send_child("arrived", q("eager"))
        for name in ("countdown", "arrived"):
            world.watch(name, watch_store)
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
        check_lost_in_time(world)
        yield world
    except BaseException:
        sys.stderr.write(f"--- worker log (tail) ---\n{stack.worker.log()[-8000:]}\n")
        raise
    finally:
        if producer is not None:
            producer.stop()
        world.stop_watches()
        try:
            stop_stack(stack)
        finally:
            world.close()
            watch_store.close()
            with pg_connect() as conn:
                conn.execute(f"DROP TABLE IF EXISTS {table}")


def test_a_lost_child_is_sent_again_and_runs_once(world: World) -> None:
    check_lost_then_run_once(world, world.sent["child"])


def test_a_lost_chain_step_is_sent_again_and_runs_once(world: World) -> None:
    sent = world.sent["step"]
    check_lost_then_run_once(world, sent)
    assert world.runs_labelled("lost-step-first") == 1


@pytest.mark.sql_store_only
def test_a_lost_outbox_send_is_sent_again_and_runs_once(world: World) -> None:
    sent = world.sent["outbox"]
    check_lost_then_run_once(world, sent)
    assert len(world.events("sends_dispatched", key=sent.sender_key)) == 1


def test_a_child_that_arrived_is_never_published_again(world: World) -> None:
    check_arrived_never_published_again(world, "arrived")


def test_a_countdown_child_is_not_sent_again_before_its_eta(world: World) -> None:
    """A child with a countdown longer than confirm_within is awaited until its ETA plus
    confirm_within: it runs once, after its ETA, and is never published again."""
    check_deferred_not_sent_again_before_eta(world, "countdown")


def test_a_receiver_that_stays_down_gets_three_copies_then_send_unconfirmed(world: World) -> None:
    check_down_gets_three_copies_then_unconfirmed(world, world.sent["down"], "t.record", "celery")


def test_a_child_that_fails_and_retries_runs_only_its_own_tries(world: World) -> None:
    """The child fails every run and retries 3 s later, at most twice (``t.retrying``): three
    runs in all. Its sender awaits it with confirm_within 1 s, shorter than the retry's
    countdown. Between its runs the child has no record of its key (the claim is released for
    the retry), but its failed run marked ``<key>\\x1freceived``: that is its receipt, so it is not
    sent again (each copy would start a retry chain of its own: 12 runs before the guard made
    that mark) nor reported as never received."""
    check_retrying_runs_only_its_own_tries(world, world.sent["retrying"])
