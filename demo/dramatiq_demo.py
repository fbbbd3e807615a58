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

import collections
import contextlib
import dataclasses
import shutil
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
    refusal = _check_arguments(broker, count)
    if refusal:
        out.write(refusal)
        return 2
    started = time.monotonic()
    deadline = started + DEADLINE
    plan = _plan(store, broker, count)
    embedded: _EmbeddedRedis | None = None
    workers: list[subprocess.Popen[bytes]] = []
    publisher: Any = None
    ok = False
    try:
        try:
            broker_url, broker_note, embedded = _choose_broker(broker, plan.workdir)
        except RuntimeError as exc:
            out.write(f"taskonce demo: {exc}\n")
            return 2
        plan = dataclasses.replace(plan, broker_url=broker_url)
        _write_banner(plan, broker_note, out)
        _demo.prepare_ledger(plan.store_url, plan.ledger, plan.ledger_table)
        out.write("  starting the workers … ")
        out.flush()
        _start_workers(plan, workers)
        if not _wait_ready(plan, workers, started, deadline, out):
            return 1
        from taskonce.demo.dramatiq_app import make_broker

        publisher = make_broker(plan.broker_url, plan.queue)
        _publish(publisher, plan, out)
        events = _demo.Events(plan.workdir / "events.jsonl")
        _watch(plan, workers, events, deadline, out)
        _stop_workers(plan, workers, out)
        counts = events.update()
        tally = _demo.tally(plan, counts)
        ok = tally.rows == count and tally.balance == tally.expected
        return _report(plan, tally, counts, ok=ok, started=started, out=out)
    except KeyboardInterrupt:
        out.write("\ninterrupted\n")
        return 130
    finally:
        _clean_up(plan, workers, publisher, embedded, temporary_store=store is None, ok=ok)


def _stop_workers(plan: _demo.Plan, workers: list[subprocess.Popen[bytes]], out: TextIO) -> None:
    """Stop the workers (emptying ``workers``), after showing their logs' tails if they had
    stopped on their own."""
    if not any(w.poll() is None for w in workers):
        out.write("  the workers stopped unexpectedly:\n")
        _tail_logs(plan, out)
    for worker in workers:
        _demo.stop(worker)
    workers.clear()


def _check_arguments(broker: str | None, count: int) -> str:
    """The refusal to print (exit code 2) when the arguments cannot make a demo, else ""."""
    if count < 1:
        return "taskonce demo: --count must be at least 1\n"
    if broker and not broker.startswith(("redis", "rediss", "unix", "amqp")):
        return "taskonce demo: Dramatiq's broker must be a redis://… or amqp://… URL\n"
    return ""


def _plan(store: str | None, broker: str | None, count: int) -> _demo.Plan:
    """A fresh temporary directory and tag; the store defaults to an SQLite file there. The
    broker URL is the one given, else "" until :func:`_choose_broker` has picked one. The queue
    is named like the namespace: a Redis broker's keys start with it, which is how
    :func:`_clean_broker` finds them."""
    workdir = Path(tempfile.mkdtemp(prefix="taskonce-demo-"))
    tag = uuid.uuid4().hex[:8]
    return _demo.new_plan(
        workdir,
        tag,
        store_url=store or f"sqlite:///{workdir / 'store.db'}",
        broker_url=broker or "",
        queue=f"taskonce_demo_{tag}",
        count=count,
        duplicate_every=DUPLICATE_EVERY,
    )


def _write_banner(plan: _demo.Plan, broker_note: str, out: TextIO) -> None:
    """What the demo runs on (passwords redacted; the embedded broker explained) and what it is
    about to do."""
    from taskonce.stores import redact

    out.write(f"taskonce demo — real Dramatiq workers ({WORKERS} processes, 2 threads each)\n")
    out.write(f"  broker  {redact(plan.broker_url)}\n")
    if broker_note:
        out.write(f"          {broker_note}\n")
    out.write(
        f"  store   {redact(plan.store_url)}"
        + (" (transactional: ledger row and mark commit together)\n" if plan.sql else "\n")
    )
    out.write(
        f"  {plan.count} charges, {len(plan.duplicates)} of them published twice with the same "
        "message id; one worker process is killed mid-charge\n\n"
    )
    out.flush()


def _start_workers(plan: _demo.Plan, workers: list[subprocess.Popen[bytes]]) -> None:
    """Start :data:`WORKERS` ``dramatiq`` workers (one process, two threads each), appended to
    ``workers`` one by one so that the caller stops those already started if a later one
    fails."""
    command = [
        sys.executable, "-m", "dramatiq", "taskonce.demo.dramatiq_app:broker",
        "--processes", "1", "--threads", "2",
    ]  # fmt: skip
    env = _demo.worker_env(plan, LEASE)
    for n in range(WORKERS):
        workers.append(_demo.spawn(command, plan, env, f"worker-{n}.log"))


def _wait_ready(
    plan: _demo.Plan,
    workers: list[subprocess.Popen[bytes]],
    started: float,
    deadline: float,
    out: TextIO,
) -> bool:
    """Wait for a ``ready-*`` file of every worker; False, with the end of their logs, when one
    exits or the deadline passes first."""
    while len(list(plan.workdir.glob("ready-*"))) < WORKERS:
        if any(w.poll() is not None for w in workers) or time.monotonic() > deadline:
            out.write("failed\n")
            _tail_logs(plan, out)
            return False
        time.sleep(0.05)
    out.write(
        f"ready (pids {', '.join(str(w.pid) for w in workers)}) after "
        f"{time.monotonic() - started:.1f}s\n"
    )
    return True


def _tail_logs(plan: _demo.Plan, out: TextIO) -> None:
    for n in range(WORKERS):
        _demo.tail(plan.workdir / f"worker-{n}.log", out)


def _publish(publisher: Any, plan: _demo.Plan, out: TextIO) -> None:
    """Enqueue every charge, the duplicates with their original's message id: half of them
    right after their original (they may meet it in flight), the other half after everything
    else (the original is long done). Only the victim's charge stalls."""
    from dramatiq import Message

    sending = time.monotonic()

    def message(index: int) -> Message[Any]:
        order, cents, message_id = plan.orders[index]
        return Message(
            queue_name=plan.queue,
            actor_name="charge",
            args=(order, cents),
            kwargs={"stall": index == plan.victim},
            options={},
            message_id=message_id,
        )

    late = plan.duplicates[1::2]
    for index in range(plan.count):
        again = index in plan.duplicates and index not in late
        for _ in range(2 if again else 1):
            publisher.enqueue(message(index))
    for index in late:
        publisher.enqueue(message(index))
    out.write(
        f"  sent {plan.count} charges + {len(plan.duplicates)} duplicates in "
        f"{time.monotonic() - sending:.1f}s\n"
    )
    out.flush()


def _watch(
    plan: _demo.Plan,
    workers: list[subprocess.Popen[bytes]],
    events: _demo.Events,
    deadline: float,
    out: TextIO,
) -> None:
    """Kill the victim's worker process once it is mid-charge, and draw the progress until every
    order is charged, every duplicate was skipped and the victim was killed — or the deadline
    passes, or no worker is left.

    Progress is the ledger itself (read every 0.3 s): a worker killed between its commit and
    its "completed" event leaves a charged order without that event."""
    progress = _demo.Progress(out, plan.count)
    killed = False
    charged, polled = 0, 0.0
    while True:
        counts = events.update()
        if time.monotonic() - polled > 0.3:
            charged, polled = (
                _demo.read_ledger(plan.store_url, plan.ledger, plan.ledger_table)[0],
                time.monotonic(),
            )
        if not killed:
            killed = _demo.kill_victim(
                plan, progress, out, "worker process", "; the other worker gets its messages back"
            )
        progress.draw(charged, counts)
        finished = (
            charged >= plan.count
            and counts[Event.DUPLICATE_SKIPPED.value] >= len(plan.duplicates)
            and killed
        )
        alive = [w for w in workers if w.poll() is None]
        if finished or time.monotonic() > deadline or not alive:
            break
        time.sleep(0.1)
    progress.end()


def _report(
    plan: _demo.Plan,
    tally: _demo.Tally,
    counts: collections.Counter[str],
    *,
    ok: bool,
    started: float,
    out: TextIO,
) -> int:
    """The result table in Dramatiq's words; the exit code (0 when ``ok``)."""
    count, duplicates = plan.count, len(plan.duplicates)
    out.write("\n")
    lines = [
        ("sent", str(count + duplicates),
         f"{count} charges + {duplicates} re-published with the same message ids"),
        ("delivered", str(tally.delivered),
         "deliveries a worker picked up: redeliveries and deferred copies included"),
        ("ran", str(tally.ran),
         f"{counts[Event.COMPLETED.value]} charges completed"
         + (f" + {tally.interrupted} killed mid-charge (its claim taken over and run again, or "
            "committed just before the kill)" if tally.interrupted else "")),
        ("duplicates skipped", str(counts[Event.DUPLICATE_SKIPPED.value]),
         "acknowledged without running"),
        ("deferred in flight", str(counts[Event.IN_PROGRESS_DEFERRED.value]),
         "arrived while the charge was running: enqueued again for later"),
    ]  # fmt: skip
    return _demo.report(
        out,
        lines,
        ledger_rows=tally.rows,
        orders=count,
        expected=tally.expected,
        balance=tally.balance,
        ok=ok,
        started=started,
        workdir=plan.workdir,
    )


def _clean_up(
    plan: _demo.Plan,
    workers: list[subprocess.Popen[bytes]],
    publisher: Any,
    embedded: _EmbeddedRedis | None,
    *,
    temporary_store: bool,
    ok: bool,
) -> None:
    """Stop the workers still running and the embedded Redis (which takes the demo's keys with
    it), else remove the demo's queues or keys from the broker; remove the demo's records from
    the store, and the temporary directory unless the run failed (its logs say why)."""
    for worker in workers:
        _demo.stop(worker)
    if publisher is not None:
        with contextlib.suppress(Exception):
            publisher.close()
    if embedded is not None:
        embedded.stop()
    elif plan.broker_url:
        with contextlib.suppress(Exception):
            _clean_broker(plan.broker_url, plan.queue)
    with contextlib.suppress(Exception):
        _demo.clean_store(plan.store_url, plan.namespace, plan.ledger_table, temporary_store)
    if ok:
        shutil.rmtree(plan.workdir, ignore_errors=True)


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
