"""Guarded Celery tasks on Amazon SQS (kombu's SQS transport) through a real prefork worker.

The SQS server is moto's (``moto[server]``, a dev dependency), started by this module on a free
loopback port and stopped by its pid: nothing reaches the internet. The queue's visibility
timeout is 4 s, so every case where SQS hands a message out again (a task that outlives the
timeout, a countdown longer than it, a requeue after a killed pool process) happens within a
test. The store is Redis; the run counts live in PostgreSQL, as in tests/celery/test_worker.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskonce.handoff import derive_id
from tests.celery.conftest import (
    Stack,
    Table,
    Worker,
    drop_store,
    new_prefix,
    publisher,
    store_url,
    worker_env,
)
from tests.helpers import free_port, require_service, wait_for

pytest.importorskip("boto3", reason="the sqs extra (kombu's SQS transport) is not installed")

VISIBILITY = 4
REGION = "us-east-1"
#: moto accepts any credentials; they only have to be there.
CREDENTIALS = "testing:testing"


class SqsServer:
    """moto's SQS server in a subprocess of its own process group on ``127.0.0.1:port``."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.log_file = directory / "moto.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SqsServer:
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

        def answers() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"moto exited: {self.log_file.read_text(errors='replace')}")
            try:
                self.client().list_queues()
            except Exception:
                return False
            return True

        wait_for(answers, timeout=60, interval=0.2, what="moto's SQS server to answer")
        return self

    def client(self) -> Any:
        import boto3

        key, secret = CREDENTIALS.split(":")
        return boto3.client(
            "sqs", endpoint_url=self.endpoint, region_name=REGION,
            aws_access_key_id=key, aws_secret_access_key=secret,
        )  # fmt: skip

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def sqs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqsServer]:
    server = SqsServer(tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stack(sqs: SqsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A worker consuming ``{prefix}.eager`` on SQS, visibility timeout 4 s, Redis store."""
    require_service("postgresql")
    require_service("redis")
    tmp = tmp_path_factory.mktemp("celery-sqs")
    prefix = new_prefix()
    broker = f"sqs://{CREDENTIALS}@127.0.0.1:{sqs.port}"
    surl, namespace = store_url("redis")
    events = tmp / "events.jsonl"
    # Receipts (the last test): a send unconfirmed 2 s after its publish is published again.
    extra = {"TO_VISIBILITY": str(VISIBILITY), "TO_CONFIRM_WITHIN": "2", "TO_RELAY_EVERY": "1"}
    env = worker_env(prefix, broker, surl, namespace, events, extra)
    # The worker creates the queue (with the visibility timeout); the publisher only sends.
    app = publisher(broker, prefix, region=REGION, is_secure=False, visibility_timeout=VISIBILITY)
    worker = Worker(tmp, env, [f"{prefix}.eager"]).start()
    try:
        yield Stack("sqs", "redis", prefix, events, worker, app, surl, namespace)
    finally:
        try:
            worker.stop()
        finally:
            app.close()
            drop_store(surl, namespace)


def new_id() -> str:
    return str(uuid.uuid4())


def drained(sqs: SqsServer, stack: Stack) -> None:
    """Wait until SQS holds no copy of anything on the eager queue: none visible, none in
    flight (received, not deleted), none delayed."""
    client = sqs.client()
    url = client.get_queue_url(QueueName=f"{stack.prefix}-eager")["QueueUrl"]
    names = [
        "ApproximateNumberOfMessages",
        "ApproximateNumberOfMessagesNotVisible",
        "ApproximateNumberOfMessagesDelayed",
    ]

    def empty() -> bool:
        attributes = client.get_queue_attributes(QueueUrl=url, AttributeNames=names)
        return all(attributes["Attributes"].get(name, "0") == "0" for name in names)

    wait_for(empty, timeout=60, interval=0.5, what="the SQS queue to hold no copy")


def test_duplicate_on_the_wire_runs_once(sqs: SqsServer, stack: Stack, runs: Table) -> None:
    """The same task id sent five times (five SQS messages): one run, four duplicate_skipped,
    and every message deleted."""
    task_id = new_id()
    for _ in range(5):
        stack.send("t.record", (runs.name, "dup5"), "eager", task_id=task_id)

    wait_for(
        lambda: stack.count(task_id, "duplicate_skipped") >= 4,
        timeout=40,
        what="four duplicate_skipped events",
    )
    drained(sqs, stack)
    assert runs.count("dup5") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "completed") == 1
    assert stack.count(task_id, "duplicate_skipped") == 4
    assert stack.app.AsyncResult(task_id).get(timeout=10) == "dup5"


def test_task_longer_than_the_visibility_timeout_runs_once(
    sqs: SqsServer, stack: Stack, runs: Table
) -> None:
    """A 10 s task on a 4 s visibility timeout: SQS hands the message out again while it
    runs (twice); each copy finds the live claim and is deferred, then skipped once the run
    completed. One run, and the queue drains."""
    task_id = new_id()
    stack.send("t.record", (runs.name, "slow"), "eager", task_id=task_id, kwargs={"sleep": 10})

    wait_for(
        lambda: stack.count(task_id, "in_progress_deferred") >= 1, timeout=20, what="a deferral"
    )
    assert stack.app.AsyncResult(task_id).get(timeout=40) == "slow"
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") >= 1, timeout=40, what="a skip")
    drained(sqs, stack)
    assert runs.count("slow") == 1
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "completed") == 1
    assert stack.count(task_id, "lease_taken_over") == 0


def test_countdown_longer_than_the_visibility_timeout_runs_once(
    sqs: SqsServer, stack: Stack, runs: Table
) -> None:
    """``countdown=9`` on a 4 s visibility timeout: the worker holds the message unacknowledged
    until its ETA, so SQS hands it out again (the worker then holds two or three copies, each
    for the same ETA). One runs, at its ETA; the others are skipped."""
    task_id = new_id()
    sent = time.time()
    stack.send("t.record", (runs.name, "eta"), "eager", task_id=task_id, countdown=9)

    wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=60, what="the run")
    wait_for(lambda: stack.count(task_id, "duplicate_skipped") >= 1, timeout=40, what="a skip")
    drained(sqs, stack)
    rows = runs.rows("eta")
    assert len(rows) == 1
    assert rows[0][5].timestamp() >= sent + 8.5  # not before its ETA
    assert stack.count(task_id, "claimed") == 1


def test_pool_process_killed_mid_body_runs_once_more(
    sqs: SqsServer, stack: Stack, runs: Table
) -> None:
    """acks_late + reject_on_worker_lost on SQS: SIGKILL the pool process running the task.
    Celery requeues the message (kombu sends a copy; the original comes back after the
    visibility timeout too); the first copy to arrive takes the dead child's claim over and
    runs, the other is skipped: two runs in all (the killed one and one more), one
    completion."""
    task_id = new_id()
    stack.send(
        "t.record", (runs.name, "crash"), "eager", task_id=task_id, kwargs={"hang_first": True}
    )
    first = wait_for(lambda: runs.rows("crash"), timeout=30, what="the first run to start")
    child = first[0][4]
    os.kill(child, signal.SIGKILL)

    wait_for(
        lambda: stack.count(task_id, "completed") == 1, timeout=40, what="the re-run to complete"
    )
    drained(sqs, stack)
    rows = runs.rows("crash")
    assert len(rows) == 2 and rows[1][4] != child
    assert stack.count(task_id, "claimed") == 1
    assert stack.count(task_id, "lease_taken_over") == 1
    assert stack.worker.alive()


def test_a_child_deleted_from_its_queue_is_sent_again_and_runs_once(
    sqs: SqsServer, stack: Stack, runs: Table, tmp_path: Path
) -> None:
    """A guarded parent sends a child to ``{prefix}.r-child``, a queue no worker consumes yet;
    the test receives the child from SQS and deletes it (a message lost). The parent's
    receipts find no trace of the child 2 s after its publish and publish it again under the
    same id; a worker started on that queue then runs it once."""
    queue = stack.q("r-child")
    parent_id = new_id()
    stack.send(
        "t.send_to", (runs.name, "lost-parent", queue, "lost-child"), "eager", task_id=parent_id
    )
    parent_key = f"{stack.q('eager')}:{parent_id}"
    child_id = derive_id(parent_key, 0)
    client = sqs.client()

    def queue_url() -> str | None:
        try:
            return str(client.get_queue_url(QueueName=f"{stack.prefix}-r-child")["QueueUrl"])
        except client.exceptions.QueueDoesNotExist:
            return None

    url = wait_for(queue_url, timeout=30, interval=0.1, what="the child's queue")
    received = wait_for(
        lambda: client.receive_message(QueueUrl=url, VisibilityTimeout=120).get("Messages"),
        timeout=30,
        interval=0.1,
        what="the child in its queue",
    )
    client.delete_message(QueueUrl=url, ReceiptHandle=received[0]["ReceiptHandle"])

    def resent() -> list[dict[str, Any]]:
        return [
            e
            for e in stack.events()
            if e["event"] == "sends_redispatched" and e.get("key") == parent_key
        ]

    wait_for(resent, timeout=30, interval=0.2, what="the receipts to publish the child again")
    worker = Worker(tmp_path, stack.worker.env, [queue]).start()
    try:
        wait_for(
            lambda: stack.count(child_id, "completed") == 1, timeout=40, what="the child's run"
        )
        assert [(e["reason"], e["count"]) for e in resent()] == [("unconfirmed", 1)]
        assert runs.count("lost-child") == 1
        assert runs.count("lost-parent") == 1
        assert stack.count(child_id, "claimed") == 1
    finally:
        worker.stop()
