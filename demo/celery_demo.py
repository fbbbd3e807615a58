"""``taskonce demo``: duplicate deliveries against a real Celery worker, and a balance that holds.

:func:`run_demo` starts ``celery worker`` (prefork, two pool processes) on
:mod:`taskonce.demo.celery_app`, sends ``count`` guarded "charge" tasks, re-publishes every
fifth one with the same task id (a producer that sent twice), SIGKILLs the pool process in
the middle of one charge (the broker gives that message back; it runs again once the dead
claim's lease is out), draws a progress bar, and prints what happened: sent, delivered, ran,
duplicates skipped, and the ledger's balance against the expected one.

Embedded default (nothing to install): an SQLite store and kombu's SQLAlchemy transport on
SQLite, both in a temporary directory. ``store`` / ``broker`` URLs run the same demo on Redis,
RabbitMQ or PostgreSQL; everything the demo creates there carries a random name and is removed
afterwards.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, TextIO

from taskonce.demo import common as _demo
from taskonce.events import Event

#: every n-th charge is published a second time with the same task id
DUPLICATE_EVERY = 5
#: the claim lease of the demo (the killed charge waits this long before it runs again)
LEASE = 4.0
#: the demo gives up (and reports what it saw) after this many seconds
DEADLINE = 55.0


def broker_options(broker: str, namespace: str) -> dict[str, Any]:
    """Transport options of the demo's broker (shared by the worker and the publisher)."""
    if broker.startswith("redis"):
        return {"global_keyprefix": f"{namespace}:"}
    if broker.startswith("sqla+sqlite"):
        return {"connect_args": {"timeout": 30}}
    return {}


def run_demo(*, store: str | None, broker: str | None, count: int, out: TextIO) -> int:
    """Run the demo; returns the exit code (0: every order charged exactly once).

    :param store: store URL, or None for an SQLite file in a temporary directory.
    :param broker: broker URL, or None for kombu's SQLAlchemy transport on SQLite.
    :param count: charge tasks to send (a fifth of them are sent twice).
    :param out: where the progress and the report are written.
    """
    refusal = _check_arguments(store, count)
    if refusal:
        out.write(refusal)
        return 2
    started = time.monotonic()
    deadline = started + DEADLINE
    plan = _plan(store, broker, count)
    _write_banner(plan, out)
    worker: subprocess.Popen[bytes] | None = None
    app: Any = None
    ok = False
    try:
        _demo.prepare_ledger(plan.store_url, plan.ledger, plan.ledger_table)
        out.write("  starting the worker … ")
        out.flush()
        worker = _start_worker(plan)
        if not _wait_ready(plan, worker, started, deadline, out):
            return 1
        app = _publisher(plan)
        _publish(app, plan, out)
        events = _demo.Events(plan.workdir / "events.jsonl")
        _watch(plan, worker, events, deadline, out)
        if worker.poll() is not None:
            out.write("  the worker stopped unexpectedly:\n")
            _demo.tail(plan.workdir / "worker.log", out)
        _demo.stop(worker)
        worker = None
        counts = events.update()
        tally = _demo.tally(plan, counts)
        ok = (
            tally.rows == count
            and tally.balance == tally.expected
            and counts[Event.COMPLETED.value] == count
        )
        return _report(plan, tally, counts, ok=ok, started=started, out=out)
    except KeyboardInterrupt:
        out.write("\ninterrupted\n")
        return 130
    finally:
        _clean_up(plan, worker, app, temporary_store=store is None, ok=ok)


def _check_arguments(store: str | None, count: int) -> str:
    """The refusal to print (exit code 2) when the arguments cannot make a demo, else ""."""
    if count < 1:
        return "taskonce demo: --count must be at least 1\n"
    if store is not None and store.startswith("memory"):
        return (
            "taskonce demo: the worker's processes must share the store; use sqlite:///…, "
            "redis://… or postgresql+psycopg://… (memory:// lives in one process)\n"
        )
    return ""


def _plan(store: str | None, broker: str | None, count: int) -> _demo.Plan:
    """A fresh temporary directory and tag; the store and broker default to SQLite files in
    that directory."""
    workdir = Path(tempfile.mkdtemp(prefix="taskonce-demo-"))
    tag = uuid.uuid4().hex[:8]
    return _demo.new_plan(
        workdir,
        tag,
        store_url=store or f"sqlite:///{workdir / 'store.db'}",
        broker_url=broker or f"sqla+sqlite:///{workdir / 'broker.db'}",
        queue=f"taskonce-demo-{tag}",
        count=count,
        duplicate_every=DUPLICATE_EVERY,
    )


def _write_banner(plan: _demo.Plan, out: TextIO) -> None:
    """What the demo runs on (passwords redacted) and what it is about to do."""
    from taskonce.stores import redact

    out.write("taskonce demo — a real Celery worker (prefork, 2 pool processes)\n")
    out.write(f"  broker  {redact(plan.broker_url)}\n")
    out.write(
        f"  store   {redact(plan.store_url)}"
        + (" (transactional: ledger row and mark commit together)\n" if plan.sql else "\n")
    )
    out.write(
        f"  {plan.count} charges, {len(plan.duplicates)} of them published twice with the same "
        "task id; one pool process is killed mid-charge\n\n"
    )
    out.flush()


def _start_worker(plan: _demo.Plan) -> subprocess.Popen[bytes]:
    """``celery worker`` on the demo's app: prefork with two pool processes (one of them gets
    killed), on the run's queue only, without the cluster chatter a lone worker does not need."""
    command = [
        sys.executable, "-m", "celery", "-A", "taskonce.demo.celery_app", "worker",
        "-P", "prefork", "-c", "2", "-Q", plan.queue, "-n", f"demo-{plan.tag}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", os.environ.get("TASKONCE_DEMO_LOGLEVEL", "WARNING"),
    ]  # fmt: skip
    return _demo.spawn(command, plan, _demo.worker_env(plan, LEASE), "worker.log")


def _wait_ready(
    plan: _demo.Plan,
    worker: subprocess.Popen[bytes],
    started: float,
    deadline: float,
    out: TextIO,
) -> bool:
    """Wait for the worker's ``ready`` file (written once it consumes); False, with the end of
    its log, when it exits or the deadline passes first."""
    while not (plan.workdir / "ready").exists():
        if worker.poll() is not None or time.monotonic() > deadline:
            out.write("failed\n")
            _demo.tail(plan.workdir / "worker.log", out)
            return False
        time.sleep(0.05)
    out.write(f"ready (pid {worker.pid}) after {time.monotonic() - started:.1f}s\n")
    return True


def _publisher(plan: _demo.Plan) -> Any:
    """A Celery app of the demo's own that only sends (results ignored)."""
    from celery import Celery

    app = Celery(
        f"taskonce-demo-publisher-{plan.tag}", broker=plan.broker_url, set_as_current=False
    )
    app.conf.update(
        broker_transport_options=broker_options(plan.broker_url, plan.namespace),
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
    )
    return app


def _publish(app: Any, plan: _demo.Plan, out: TextIO) -> None:
    """Send every charge, the duplicates with their original's task id: half of them right
    after their original (they may meet it in flight), the other half after everything else
    (the original is long done). Only the victim's charge stalls."""
    sending = time.monotonic()
    with warnings.catch_warnings(), app.producer_or_acquire() as producer:
        # kombu's SQLAlchemy transport uses an ORM option SQLAlchemy 2.1 deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        late = plan.duplicates[1::2]
        for index, (order, cents, task_id) in enumerate(plan.orders):
            again = index in plan.duplicates and index not in late
            for _ in range(2 if again else 1):
                app.send_task(
                    "taskonce_demo.charge",
                    args=(order, cents),
                    kwargs={"stall": index == plan.victim},
                    task_id=task_id,
                    queue=plan.queue,
                    producer=producer,
                )
        for index in late:
            order, cents, task_id = plan.orders[index]
            app.send_task(
                "taskonce_demo.charge",
                args=(order, cents),
                kwargs={"stall": False},
                task_id=task_id,
                queue=plan.queue,
                producer=producer,
            )
    out.write(
        f"  sent {plan.count} charges + {len(plan.duplicates)} duplicates in "
        f"{time.monotonic() - sending:.1f}s\n"
    )
    out.flush()


def _watch(
    plan: _demo.Plan,
    worker: subprocess.Popen[bytes],
    events: _demo.Events,
    deadline: float,
    out: TextIO,
) -> None:
    """Kill the victim's pool process once it is mid-charge, and draw the progress until every
    charge completed, every duplicate was skipped and the victim was killed — or the deadline
    passes, or the worker exits."""
    progress = _demo.Progress(out, plan.count)
    killed = False
    while True:
        counts = events.update()
        if not killed:
            killed = _demo.kill_victim(plan, progress, out, "pool process")
        progress.draw(counts[Event.COMPLETED.value], counts)
        finished = (
            counts[Event.COMPLETED.value] >= plan.count
            and counts[Event.DUPLICATE_SKIPPED.value] >= len(plan.duplicates)
            and killed
        )
        if finished or time.monotonic() > deadline or worker.poll() is not None:
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
    """The result table in Celery's words; the exit code (0 when ``ok``)."""
    count, duplicates = plan.count, len(plan.duplicates)
    out.write("\n")
    lines = [
        ("sent", str(count + duplicates),
         f"{count} charges + {duplicates} re-published with the same task ids"),
        ("delivered", str(tally.delivered),
         "messages a pool process picked up, redeliveries included"),
        ("ran", str(tally.ran),
         f"{counts[Event.COMPLETED.value]} charges completed"
         + (f" + {tally.interrupted} killed mid-charge, its claim taken over, run again"
            if tally.interrupted else "")),
        ("duplicates skipped", str(counts[Event.DUPLICATE_SKIPPED.value]),
         "acknowledged without running"),
        ("deferred in flight", str(counts[Event.IN_PROGRESS_DEFERRED.value]),
         "arrived while the charge was running: delivered again later"),
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
    worker: subprocess.Popen[bytes] | None,
    app: Any,
    *,
    temporary_store: bool,
    ok: bool,
) -> None:
    """Stop the worker if it still runs, remove what the run created on the broker and in the
    store, and the temporary directory — kept when the run failed (its logs say why) or
    ``TASKONCE_DEMO_KEEP`` is set."""
    if worker is not None:
        _demo.stop(worker)
    if app is not None:
        with contextlib.suppress(Exception):
            _clean_broker(app, plan.broker_url, plan.queue, plan.namespace)
        app.close()
    with contextlib.suppress(Exception):
        _demo.clean_store(plan.store_url, plan.namespace, plan.ledger_table, temporary_store)
    if ok and not os.environ.get("TASKONCE_DEMO_KEEP"):
        shutil.rmtree(plan.workdir, ignore_errors=True)


def _clean_broker(app: Any, broker_url: str, queue: str, namespace: str) -> None:
    if broker_url.startswith("redis"):
        _demo.delete_redis_keys(broker_url, f"{namespace}:*")
    elif broker_url.startswith(("amqp", "pyamqp")):
        import importlib

        entity: Any = importlib.import_module("kombu.entity")  # kombu's typing is partial
        with app.connection_for_write() as conn:
            channel = conn.channel()
            entity.Queue(queue, channel=channel).delete()
            entity.Exchange(queue, channel=channel).delete()
