"""``taskonce.send_on_commit`` end to end: a Flask app and a script (tests/outbox_app.py), each
in its own process, write an order on PostgreSQL and send to a real Celery worker and a real
Dramatiq worker through this module's own redis-server, which the tests stop and start by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.helpers import (
    POSTGRES_URL,
    RedisServer,
    free_port,
    require_service,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]


class Process:
    """A subprocess in its own process group, killed with its children at the end."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], tmp: Path) -> None:
        self.name = name
        self.ready = tmp / f"{name}.ready"
        self.log_path = tmp / f"{name}.log"
        self.ready.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**env, "OB_READY": str(self.ready)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> Process:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited:\n{self.log()}")
            return self.ready.exists()

        wait_for(ready, timeout=60, interval=0.1, what=f"{self.name} to be ready")
        return self

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


class Stack:
    def __init__(self, tmp: Path) -> None:
        require_service("postgresql")
        suffix = uuid.uuid4().hex[:8]
        self.tmp = tmp
        self.redis = RedisServer().start()
        self.env = {
            **os.environ,
            "OB_BROKER": f"redis://127.0.0.1:{self.redis.port}",
            "OB_QUEUE": f"ob{suffix}",
            "OB_ORDERS": f"ob_orders_{suffix}",
            "OB_RUNS": f"ob_runs_{suffix}",
            "OB_STORE_TABLE": f"ob_store_{suffix}",
            "OB_EVENTS": str(tmp / "events.jsonl"),
        }
        self.engine = sa.create_engine(POSTGRES_URL)
        self.suffix = suffix
        with self.engine.begin() as connection:
            connection.exec_driver_sql(f"CREATE TABLE ob_orders_{suffix} (id INTEGER PRIMARY KEY)")
            connection.exec_driver_sql(
                f"CREATE TABLE ob_runs_{suffix} (n SERIAL PRIMARY KEY, order_id INTEGER NOT NULL, "
                "framework VARCHAR(16) NOT NULL, saw_order BOOLEAN NOT NULL)"
            )
        self.processes: list[Process] = []
        queue = self.env["OB_QUEUE"]
        self.start(
            "celery",
            [sys.executable, "-m", "celery", "-A", "tests.outbox_app:celery_app", "worker",
             "-P", "prefork", "-c", "1", "-Q", queue, "-n", f"ob{suffix}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
        )  # fmt: skip
        self.start(
            "dramatiq",
            [sys.executable, "-m", "dramatiq", "tests.outbox_app:broker", "--processes", "1",
             "--threads", "1", "--queues", queue, "--path", str(ROOT)],
        )  # fmt: skip
        self.port = free_port()
        self.start("flask", [sys.executable, "-m", "tests.outbox_app", "serve", str(self.port)])
        for process in self.processes:
            process.wait_ready()

    def start(self, name: str, command: list[str]) -> Process:
        process = Process(name, command, self.env, self.tmp)
        self.processes.append(process)
        return process

    def request(self, order_id: int, fate: str = "commit") -> tuple[int, list[str]]:
        """The response's status and the two message ids the request sent."""
        url = f"http://127.0.0.1:{self.port}/orders/{order_id}?fate={fate}"
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, method="POST"), timeout=60
            ) as response:
                return int(response.status), response.read().decode().split()
        except urllib.error.HTTPError as exc:
            return int(exc.code), []

    def script(self, order_id: int, fate: str) -> tuple[int, list[str]]:
        """The script's exit status and the two message ids it sent."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.outbox_app", "order", str(order_id), fate],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            timeout=120,
        )
        if done.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(done.stderr.decode(errors="replace"))
        return done.returncode, done.stdout.decode().split()

    def events(self, message_id: str) -> list[str]:
        """The names of the guard's events for the delivery of ``message_id``."""
        try:
            lines = Path(self.env["OB_EVENTS"]).read_text().splitlines()
        except FileNotFoundError:
            return []
        found = [json.loads(line) for line in lines if line.strip()]
        return [e["event"] for e in found if e.get("message_id") == message_id]

    def relay(self) -> Process:
        return self.start(
            "relay",
            [str(Path(sys.executable).parent / "taskonce"), "relay", "--celery-app",
             "tests.outbox_app:celery_app", "--every", "0.5", "--older-than", "0"],
        )  # fmt: skip

    def runs(self, order_id: int) -> list[tuple[str, bool]]:
        with self.engine.connect() as connection:
            rows = connection.exec_driver_sql(
                f"SELECT framework, saw_order FROM ob_runs_{self.suffix} WHERE order_id = "
                f"{int(order_id)} ORDER BY framework"
            )
            return [(str(f), bool(s)) for f, s in rows]

    def ran_once(self, order_id: int) -> None:
        expected = [("celery", True), ("dramatiq", True)]
        wait_for(
            lambda: len(self.runs(order_id)) >= 2,
            timeout=60,
            interval=0.1,
            what=f"both tasks of order {order_id} to run\n{self.logs()}",
        )
        assert self.runs(order_id) == expected

    def pending(self) -> int:
        with self.engine.connect() as connection:
            return int(
                connection.exec_driver_sql(
                    f"SELECT count(*) FROM ob_store_{self.suffix} WHERE key LIKE 'outbox:%%' "
                    "AND status = 'sending'"
                ).scalar_one()
            )

    def order_exists(self, order_id: int) -> bool:
        with self.engine.connect() as connection:
            return (
                connection.exec_driver_sql(
                    f"SELECT 1 FROM ob_orders_{self.suffix} WHERE id = {int(order_id)}"
                ).first()
                is not None
            )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()[-3000:]}" for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            process.stop()
        self.redis.stop()
        with self.engine.begin() as connection:
            for table in ("ob_orders", "ob_runs", "ob_store", "ob_store_live"):
                connection.exec_driver_sql(f"DROP TABLE IF EXISTS {table}_{self.suffix}")
        self.engine.dispose()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("outbox"))
    try:
        yield s
    finally:
        s.close()


@pytest.mark.timeout(300)
def test_committed_and_rolled_back_requests_and_scripts(stack: Stack) -> None:
    status, sent = stack.request(1)
    assert status == 200 and len(sent) == 2
    code, scripted = stack.script(2, "commit")
    assert code == 0 and len(scripted) == 2
    assert stack.request(3, "rollback")[0] == 200
    assert stack.script(4, "rollback")[0] == 0
    stack.ran_once(1)
    stack.ran_once(2)
    # the ids the sends got inside the block are the ids that ran
    for message_id in sent + scripted:
        wait_for(lambda m=message_id: "completed" in stack.events(m), timeout=30, what=message_id)
    assert stack.request(5)[0] == 200  # sent after the rolled-back ones
    stack.ran_once(5)
    assert stack.runs(3) == [] and stack.runs(4) == []
    assert not stack.order_exists(3) and not stack.order_exists(4)
    assert stack.pending() == 0


def relayed(stack: Stack) -> Iterator[None]:
    relay = stack.relay()
    try:
        yield
    finally:
        relay.stop()
        stack.processes.remove(relay)


@pytest.mark.timeout(300)
def test_killed_after_commit_the_relay_sends_it_once(stack: Stack) -> None:
    code, sent = stack.script(10, "die")
    assert code == -signal.SIGKILL and len(sent) == 2
    assert stack.order_exists(10) and stack.pending() == 2  # committed, nothing published
    assert stack.runs(10) == []
    for _ in relayed(stack):
        stack.ran_once(10)
        wait_for(lambda: stack.pending() == 0, timeout=30, what="the outbox to be empty")
    assert stack.runs(10) == [("celery", True), ("dramatiq", True)]
    for message_id in sent:  # published by the relay under the ids fixed in the block
        assert stack.events(message_id).count("completed") == 1


@pytest.mark.timeout(300)
def test_killed_after_publishing_the_relay_copy_is_dropped_by_the_guard(stack: Stack) -> None:
    code, (celery_id, dramatiq_id) = stack.script(11, "die_after_publish")
    assert code == -signal.SIGKILL
    # The Celery send was published, then the process died before marking it sent (and
    # before publishing the Dramatiq one): both stay pending.
    wait_for(lambda: stack.runs(11) == [("celery", True)], timeout=60, what="the Celery task")
    assert stack.pending() == 2
    for _ in relayed(stack):
        stack.ran_once(11)
        wait_for(lambda: stack.pending() == 0, timeout=30, what="the outbox to be empty")
        wait_for(
            lambda: "duplicate_skipped" in stack.events(celery_id),
            timeout=30,
            what="the relay's copy of the Celery send to be skipped",
        )
    assert stack.runs(11) == [("celery", True), ("dramatiq", True)]
    assert stack.events(celery_id).count("completed") == 1
    assert stack.events(dramatiq_id).count("completed") == 1


@pytest.mark.timeout(300)
def test_broker_down_at_commit_the_sends_wait_and_go_out_when_it_is_back(stack: Stack) -> None:
    port = stack.redis.port
    stack.redis.stop()
    try:
        assert stack.request(20)[0] == 200  # no error reaches the request
        assert stack.script(21, "commit")[0] == 0
        assert stack.order_exists(20) and stack.order_exists(21)
        assert stack.pending() == 4
    finally:
        stack.redis.port = port
        stack.redis.start()
    for _ in relayed(stack):
        stack.ran_once(20)
        stack.ran_once(21)
        wait_for(lambda: stack.pending() == 0, timeout=30, what="the outbox to be empty")
