"""Real Celery workers (prefork) on real brokers: ``taskonce.current_key()`` as an outside API's
idempotency key across a SIGKILL, and an unexpected error inside the store that loses nothing.

Each test runs its own worker of :mod:`tests.celery.keys_app` (the app under test plus
``t.charge``), a Redis store, and — for the payments — a fake payments API in this process
(:mod:`tests.payments_server`) that deduplicates charges by their ``Idempotency-Key``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.celery.conftest import (
    QUEUE_NAMES,
    ROOT,
    Stack,
    Table,
    Worker,
    broker_url,
    clean_broker,
    drop_store,
    publisher,
    stop_stack,
    store_url,
    worker_env,
)
from tests.helpers import require_service, wait_for
from tests.payments_server import PaymentsServer

BROKERS = [pytest.param("redis", id="redis-broker"), pytest.param("rabbitmq", id="rabbitmq-broker")]
#: Redis broker database of these tests (the other Celery tests use 1-4).
KEYS_DB = 9


class KeysWorker(Worker):
    """A ``celery worker`` of :mod:`tests.celery.keys_app`."""

    def launch(self) -> Worker:
        self.ready_file.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery.keys_app", "worker",
            "-P", "prefork", "-c", str(self.concurrency), "-Q", ",".join(self.queues),
            "-n", f"{self.env.get('TO_PREFIX', 'tc')}-{uuid.uuid4().hex[:4]}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ]  # fmt: skip
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        return self


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    started: list[Stack] = []
    yield started
    for stack in started:
        stop_stack(stack)


def start(stacks: list[Stack], tmp: Path, broker: str, env: dict[str, str] | None = None) -> Stack:
    """A worker of :mod:`tests.celery.keys_app` on ``broker`` with a Redis store."""
    require_service("postgresql")
    require_service("redis")
    prefix = f"tk{uuid.uuid4().hex[:10]}"
    burl = broker_url(broker, KEYS_DB)
    surl, namespace = store_url("redis")
    events = tmp / "events.jsonl"
    queues = [f"{prefix}.{name}" for name in QUEUE_NAMES]
    app = publisher(burl, prefix)
    worker = KeysWorker(tmp, worker_env(prefix, burl, surl, namespace, events, env), queues)
    try:
        worker.start()
    except BaseException:
        clean_broker(app, burl, prefix, queues)
        drop_store(surl, namespace)
        app.close()
        raise
    stack = Stack(broker, "redis", prefix, events, worker, app, surl, namespace)
    stacks.append(stack)
    return stack


@pytest.fixture
def payments() -> Iterator[PaymentsServer]:
    with PaymentsServer() as server:
        yield server


def notes(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("broker", BROKERS)
def test_killed_after_the_api_call_charges_once_with_the_same_key(
    stacks: list[Stack], tmp_path: Path, payments: PaymentsServer, broker: str
) -> None:
    """The pool process is SIGKILLed after the payments API charged, before the task returned.
    Celery redelivers the message, the guard takes the dead owner's claim over, the task runs
    again with the same ``current_key()``, and the API answers the first charge again."""
    stack = start(stacks, tmp_path, broker)
    keys_file = tmp_path / "keys.jsonl"
    task_id = str(uuid.uuid4())
    stack.send(
        "t.charge", (payments.url, "order-1", 4200, str(keys_file)), "eager",
        task_id=task_id, kwargs={"die_after_call": True},
    )  # fmt: skip
    result = stack.app.AsyncResult(task_id).get(timeout=60)

    runs = notes(keys_file)
    assert len(runs) == 2, runs  # killed once, run again
    assert runs[0]["pid"] != runs[1]["pid"]  # the first process died
    assert runs[0]["key"] == runs[1]["key"] == f"{stack.q('eager')}:{task_id}"
    assert len(payments.charges) == 1  # charged once
    assert payments.charges[0]["key"] == runs[0]["key"]
    assert [status for _, status in payments.requests] == [201, 200]
    assert result == payments.charges[0]["id"]  # the re-run got the first charge back
    names = [e["event"] for e in stack.events(task_id)]
    assert names.count("claimed") == 1 and names.count("lease_taken_over") == 1
    assert names.count("completed") == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_claim_raising_unexpectedly_once_runs_the_task_once_later(
    stacks: list[Stack], tmp_path: Path, runs: Table, broker: str
) -> None:
    """The store's first claim raises ``TypeError`` (an incompatible driver): the task is not
    run and not failed; the message comes back after the store retry delay and runs once."""
    flag = tmp_path / "claim-broke"
    stack = start(stacks, tmp_path, broker, {"TO_BREAK_FIRST_CLAIM": str(flag)})
    task_id = str(uuid.uuid4())
    stack.send("t.record", (runs.name, "once"), "eager", task_id=task_id)
    assert stack.app.AsyncResult(task_id).get(timeout=60) == "once"

    assert flag.exists()  # the injected error happened
    assert runs.count("once") == 1
    events = stack.events(task_id)
    names = [e["event"] for e in events]
    assert names[:3] == ["store_error", "claimed", "completed"], names
    assert events[0]["reason"] == "internal_error"
    log = stack.worker.log()
    assert "unexpected error before running t.record" in log
    assert log.count("Traceback") == 1  # logged once, with its traceback
    assert "FAILURE" not in log and "raised unexpected" not in log
    wait_for(lambda: stack.count(task_id, "completed") == 1, timeout=5, what="one completion")
