"""Real Dramatiq workers: ``taskonce.current_key()`` as an outside API's idempotency key across a
SIGKILL, and an unexpected error inside the store that loses nothing.

The workers run :mod:`tests.dramatiq.keys_app` (the test application plus ``charge_key``); the
fake payments API (:mod:`tests.payments_server`) runs in this process and deduplicates charges
by their ``Idempotency-Key``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.dramatiq.conftest import (
    RABBIT_REDIS,
    REDIS_REDIS,
    ROOT,
    Harness,
    Stack,
    Worker,
    harness_for,
)
from tests.dramatiq.keys_app import declare
from tests.helpers import wait_for
from tests.payments_server import PaymentsServer


class KeysWorker(Worker):
    """One ``python -m dramatiq tests.dramatiq.keys_app`` process group."""

    def start(self) -> Worker:
        env = {**os.environ, **self.config.to_env(), "PYTHONPATH": str(ROOT), **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "dramatiq", "tests.dramatiq.keys_app:broker",
                    "--processes", "1", "--threads", "2", "--path", str(ROOT),
                ],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        return self


def start_worker(h: Harness, env: dict[str, str] | None = None) -> Worker:
    worker = KeysWorker(h.config, h.tmp / f"keys-worker-{len(h.workers)}.log", env).start()
    h.workers.append(worker)
    h.wait_ready(worker)
    return worker


def notes(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killed_after_the_api_call_charges_once_with_the_same_key(
    pg_engine: sa.Engine, tmp_path: Path
) -> None:
    """RabbitMQ gives the message back when the killed worker's connection drops; the new
    worker takes the dead owner's claim over and runs the actor with the same key, and the API
    answers the first charge again."""
    with (
        PaymentsServer() as payments,
        harness_for(RABBIT_REDIS, tmp_path, pg_engine, "crash", start=False) as h,
    ):
        charge = declare(h.app)
        first = start_worker(h)
        keys_file = tmp_path / "keys.jsonl"
        message = charge.send(payments.url, "order-1", 4200, str(keys_file), True)
        wait_for(lambda: not first.alive, timeout=30, what="the killed worker to exit")
        first.kill()
        start_worker(h)
        h.wait(
            lambda: "completed" in h.event_names(message.message_id),
            timeout=40,
            what="the redelivered message to complete",
        )
        runs = notes(keys_file)
        assert len(runs) == 2 and runs[0]["pid"] != runs[1]["pid"]
        key = f"{h.config.queue('main')}:{message.message_id}"
        assert runs[0]["key"] == runs[1]["key"] == key
        assert len(payments.charges) == 1 and payments.charges[0]["key"] == key
        assert [status for _, status in payments.requests] == [201, 200]
        names = h.event_names(message.message_id)
        assert names.count("lease_taken_over") == 1 and names.count("completed") == 1


@pytest.mark.parametrize("stack", [REDIS_REDIS, RABBIT_REDIS], ids=lambda s: s.name)
def test_a_claim_raising_unexpectedly_once_runs_the_actor_once_later(
    stack: Stack, pg_engine: sa.Engine, tmp_path: Path
) -> None:
    """The store's first claim raises ``TypeError``: the actor does not run, the message is not
    failed or dead-lettered; a copy comes back after the backoff and runs once, with its key."""
    flag = tmp_path / "claim-broke"
    with harness_for(stack, tmp_path, pg_engine, "crash", start=False) as h:
        charge = declare(h.app)
        # the readiness pings are not guarded: the first guarded claim is the message's
        worker = start_worker(h, {"TO_BREAK_FIRST_CLAIM": str(flag)})
        keys_file = tmp_path / "keys.jsonl"
        message = charge.send("", "order-1", 4200, str(keys_file))
        h.wait(
            lambda: "completed" in h.event_names(message.message_id),
            timeout=30,
            what="the message to run after the backoff",
        )
        assert flag.exists()
        events = h.events(message.message_id)
        assert [e["event"] for e in events] == ["store_error", "claimed", "completed"]
        assert events[0]["reason"] == "internal_error"
        runs = notes(keys_file)
        assert [r["key"] for r in runs] == [f"{h.config.queue('main')}:{message.message_id}"]
        log = worker.output()
        assert "unexpected error before running charge_key" in log
        # the injected error's traceback once (a late readiness ping of an earlier test's
        # worker, for a table already dropped, may log a traceback of its own)
        assert log.count("in first_claim_fails") == 1
        assert "dead-letter" not in log
