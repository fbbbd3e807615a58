"""``taskonce demo --framework dramatiq``: duplicate deliveries against real Dramatiq workers.

:func:`run_demo` starts two ``dramatiq`` workers (one process, two threads each) on
:mod:`taskonce.demo.dramatiq_app`, sends ``count`` guarded "charge" messages, re-publishes
every fifth one with the same message id (a producer that sent twice), SIGKILLs the worker
process in the middle of one charge (the broker gives that message — and whatever else the
dead process had fetched — back to the other worker; the charge runs again once the dead
claim's lease is out), draws a progress bar, and prints what happened: sent, delivered, ran,
duplicates skipped, and the ledger's balance against the expected one.

The store defaults to an SQLite file in a temporary directory (transactional: each ledger row
commits with its mark). Dramatiq has no SQL broker, so the embedded broker is Redis:

1. a private ``redis-server`` the demo starts on a free port in its temporary directory (no
   persistence) and stops afterwards, when the ``redis-server`` binary is on ``PATH``;
2. otherwise the Redis at ``redis://127.0.0.1:6379/0``, when it answers, under a random key
   namespace that is deleted afterwards (the output says so);
3. otherwise the demo stops and says how to give it a broker.

``--broker redis://…`` or ``--broker amqp://…`` uses a real broker; everything the demo
creates there carries a random name and is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from taskonce.demo import common as _demo
from taskonce.events import Event

#: every n-th charge is published a second time with the same message id
DUPLICATE_EVERY = 5
#: the claim lease of the demo (the killed charge waits this long before it runs again)
LEASE = 4.0
#: the demo gives up (and reports what it saw) after this many seconds
DEADLINE = 90.0
#: the Redis the demo falls back to when it cannot start its own
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
WORKERS = 2
_DECISIONS = (
    Event.CLAIMED.value,
    Event.LEASE_TAKEN_OVER.value,
    Event.DUPLICATE_SKIPPED.value,
    Event.IN_PROGRESS_DEFERRED.value,
)


class _EmbeddedRedis:
    """A ``redis-server`` of the demo's own, on a free port, without persistence."""

    def __init__(self, binary: str, workdir: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def wait_ready(self, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if _redis_answers(self.url):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


def _choose_broker(broker: str | None, workdir: Path) -> tuple[str, str, _EmbeddedRedis | None]:
    """The broker URL, a sentence saying what it is, and the embedded server if started."""
    if broker:
        return broker, "", None
    binary = shutil.which("redis-server")
    if binary:
        server = _EmbeddedRedis(binary, workdir)
        if server.wait_ready():
            return (
                server.url,
                f"a private redis-server started by the demo on port {server.port} "
                "(Dramatiq has no SQL broker; stopped and deleted afterwards)",
                server,
            )
        server.stop()
    if _redis_answers(LOCAL_REDIS):
        return (
            LOCAL_REDIS,
            "the local Redis (no redis-server binary to start a private one; Dramatiq has no "
            "SQL broker) — the demo's keys carry a random namespace and are deleted afterwards",
            None,
        )
    raise RuntimeError(
        "Dramatiq needs a Redis or RabbitMQ broker and none is at hand: install redis-server "
        "(the demo then starts a private one), start Redis on 127.0.0.1:6379, or pass "
        "--broker redis://…|amqp://…"
    )


def run_demo(*, store: str | None, broker: str | None, count: int, out: TextIO) -> int:
    """Run the demo; returns the exit code (0: every order charged exactly once).

    :param store: store URL, or None for an SQLite file in a temporary directory.
    :param broker: broker URL (``redis://…`` or ``amqp://…``), or None for an embedded Redis.
    :param count: charge messages to send (a fifth of them are sent twice).
    :param out: where the progress and the report are written.
    """
    if count < 1:
        out.write("taskonce demo: --count must be at least 1\n")
        return 2
    if broker and not broker.startswith(("redis", "rediss", "unix", "amqp")):
        out.write("taskonce demo: Dramatiq's broker must be a redis://… or amqp://… URL\n")
        return 2
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="taskonce-demo-"))
    tag = uuid.uuid4().hex[:8]
    namespace = f"taskonce_demo_{tag}"
    queue = namespace
    store_url = store or f"sqlite:///{workdir / 'store.db'}"
    sql = _demo.is_sql(store_url)
    ledger_table = f"taskonce_demo_ledger_{tag}"
    ledger = f"sql:{ledger_table}" if sql else f"sqlite:{workdir / 'ledger.db'}"

    rng = random.Random(20261122)
    orders = [(f"order-{i:04d}", rng.randint(100, 9999), str(uuid.uuid4())) for i in range(count)]
    duplicates = [i for i in range(count) if i % DUPLICATE_EVERY == 2]
    victim = count // 3
    while victim in duplicates and victim + 1 < count:
        victim += 1

    from taskonce.stores import redact

    embedded: _EmbeddedRedis | None = None
    workers: list[subprocess.Popen[bytes]] = []
    publisher: Any = None
    broker_url = broker or ""
    ok = False
    try:
        try:
            broker_url, broker_note, embedded = _choose_broker(broker, workdir)
        except RuntimeError as exc:
            out.write(f"taskonce demo: {exc}\n")
            return 2
        out.write(f"taskonce demo — real Dramatiq workers ({WORKERS} processes, 2 threads each)\n")
        out.write(f"  broker  {redact(broker_url)}\n")
        if broker_note:
            out.write(f"          {broker_note}\n")
        out.write(
            f"  store   {redact(store_url)}"
            + (" (transactional: ledger row and mark commit together)\n" if sql else "\n")
        )
        out.write(
            f"  {count} charges, {len(duplicates)} of them published twice with the same "
            "message id; one worker process is killed mid-charge\n\n"
        )
        out.flush()

        _demo.prepare_ledger(store_url, ledger, ledger_table)
        env = {
            **os.environ,
            "TASKONCE_DEMO_BROKER": broker_url,
            "TASKONCE_DEMO_QUEUE": queue,
            "TASKONCE_DEMO_STORE": store_url,
            "TASKONCE_DEMO_NS": namespace,
            "TASKONCE_DEMO_LEDGER": ledger,
            "TASKONCE_DEMO_DIR": str(workdir),
            "TASKONCE_DEMO_LEASE": str(LEASE),
        }
        command = [
            sys.executable, "-m", "dramatiq", "taskonce.demo.dramatiq_app:broker",
            "--processes", "1", "--threads", "2",
        ]  # fmt: skip
        out.write("  starting the workers … ")
        out.flush()
        for n in range(WORKERS):
            with open(workdir / f"worker-{n}.log", "ab") as log:
                workers.append(
                    subprocess.Popen(
                        command,
                        cwd=workdir,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = started + DEADLINE
        while len(list(workdir.glob("ready-*"))) < WORKERS:
            if any(w.poll() is not None for w in workers) or time.monotonic() > deadline:
                out.write("failed\n")
                for n in range(WORKERS):
                    _demo.tail(workdir / f"worker-{n}.log", out)
                return 1
            time.sleep(0.05)
        out.write(
            f"ready (pids {', '.join(str(w.pid) for w in workers)}) after "
            f"{time.monotonic() - started:.1f}s\n"
        )

        from dramatiq import Message

        from taskonce.demo.dramatiq_app import make_broker

        publisher = make_broker(broker_url, queue)
        sending = time.monotonic()

        def message(index: int) -> Message[Any]:
            order, cents, message_id = orders[index]
            return Message(
                queue_name=queue,
                actor_name="charge",
                args=(order, cents),
                kwargs={"stall": index == victim},
                options={},
                message_id=message_id,
            )

        # Half the duplicates follow their original at once (they may meet it in flight), the
        # other half come after everything else (the original is long done).
        late = duplicates[1::2]
        for index in range(count):
            again = index in duplicates and index not in late
            for _ in range(2 if again else 1):
                publisher.enqueue(message(index))
        for index in late:
            publisher.enqueue(message(index))
        out.write(
            f"  sent {count} charges + {len(duplicates)} duplicates in "
            f"{time.monotonic() - sending:.1f}s\n"
        )
        out.flush()

        events = _demo.Events(workdir / "events.jsonl")
        progress = _demo.Progress(out, count)
        killed: str | None = None
        victim_file = workdir / "victim.pid"
        # Progress is the ledger itself: a worker killed between its commit and its
        # "completed" event leaves a charged order without that event.
        charged, polled = 0, 0.0
        while True:
            counts = events.update()
            if time.monotonic() - polled > 0.3:
                charged, polled = (
                    _demo.read_ledger(store_url, ledger, ledger_table)[0],
                    time.monotonic(),
                )
            if killed is None and victim_file.exists():
                with contextlib.suppress(ValueError, ProcessLookupError):
                    pid = int(victim_file.read_text().strip() or 0)
                    os.kill(pid, signal.SIGKILL)
                    killed = f"  killed worker process {pid} in the middle of {orders[victim][0]}"
                    progress.clear()
                    out.write(f"{killed} (SIGKILL); the other worker gets its messages back\n")
            progress.draw(charged, counts)
            finished = (
                charged >= count
                and counts[Event.DUPLICATE_SKIPPED.value] >= len(duplicates)
                and killed is not None
            )
            alive = [w for w in workers if w.poll() is None]
            if finished or time.monotonic() > deadline or not alive:
                break
            time.sleep(0.1)
        progress.end()
        if not any(w.poll() is None for w in workers):
            out.write("  the workers stopped unexpectedly:\n")
            for n in range(WORKERS):
                _demo.tail(workdir / f"worker-{n}.log", out)
        for worker in workers:
            _demo.stop(worker)
        workers = []
        counts = events.update()

        rows, balance = _demo.read_ledger(store_url, ledger, ledger_table)
        expected = sum(cents for _, cents, _ in orders)
        delivered = sum(counts[name] for name in _DECISIONS)
        ran = counts[Event.CLAIMED.value] + counts[Event.LEASE_TAKEN_OVER.value]
        interrupted = ran - counts[Event.COMPLETED.value]
        ok = rows == count and balance == expected
        out.write("\n")
        lines = [
            ("sent", str(count + len(duplicates)),
             f"{count} charges + {len(duplicates)} re-published with the same message ids"),
            ("delivered", str(delivered),
             "deliveries a worker picked up: redeliveries and deferred copies included"),
            ("ran", str(ran),
             f"{counts['completed']} charges completed"
             + (f" + {interrupted} killed mid-charge (its claim taken over and run again, or "
                "committed just before the kill)" if interrupted else "")),
            ("duplicates skipped", str(counts[Event.DUPLICATE_SKIPPED.value]),
             "acknowledged without running"),
            ("deferred in flight", str(counts[Event.IN_PROGRESS_DEFERRED.value]),
             "arrived while the charge was running: enqueued again for later"),
        ]  # fmt: skip
        return _demo.report(
            out,
            lines,
            ledger_rows=rows,
            orders=count,
            expected=expected,
            balance=balance,
            ok=ok,
            started=started,
            workdir=workdir,
        )
    except KeyboardInterrupt:
        out.write("\ninterrupted\n")
        return 130
    finally:
        for worker in workers:
            _demo.stop(worker)
        if publisher is not None:
            with contextlib.suppress(Exception):
                publisher.close()
        if embedded is not None:
            embedded.stop()
        elif broker_url:
            with contextlib.suppress(Exception):
                _clean_broker(broker_url, queue)
        with contextlib.suppress(Exception):
            _demo.clean_store(store_url, namespace, ledger_table, temporary=store is None)
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)


def _clean_broker(broker_url: str, queue: str) -> None:
    """Delete the demo's queues (RabbitMQ) or keys (Redis, namespace = the queue name)."""
    if broker_url.startswith("amqp"):
        import pika

        connection = pika.BlockingConnection(pika.URLParameters(broker_url))
        try:
            channel = connection.channel()
            for suffix in ("", ".DQ", ".XQ"):
                channel.queue_delete(queue=queue + suffix)
        finally:
            connection.close()
        return
    _demo.delete_redis_keys(broker_url, f"{queue}:*")
